"""Reading the trainer's configuration: the TOML file, command-line overrides and the
ANYSHARD_FAULT / ANYSHARD_SLOW environment variables, each value checked against its field's
type with a message naming the key; and writing it back out as TOML.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from anyshard.format import storage
from anyshard.trainer_integration.gpt.config.checks import validate
from anyshard.trainer_integration.gpt.config.schema import (
    FAULT_ENV,
    FAULT_MODES,
    SLOW_ENV,
    SLOW_MODES,
    Config,
    ConfigError,
)

_SECTIONS = ("model", "parallel", "train", "checkpoint", "fault", "ft")


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(tp: Any) -> tuple[type, bool]:
    """The scalar type of a field and whether it is optional (``X | None``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0], True) if args else (tp, False)


def _type_name(tp: Any) -> str:
    scalar, optional = _scalar(tp)
    name = {bool: "bool (true or false)"}.get(scalar, scalar.__name__)
    return f"{name} or none" if optional else name


def _parse_text(text: str, tp: Any) -> Any:
    """A command-line value as the field's type; raises ValueError if it is not one."""
    scalar, optional = _scalar(tp)
    word = text.strip().lower()
    if optional and word in ("none", "null"):
        return None
    if scalar is bool:
        if word in ("true", "1", "yes"):
            return True
        if word in ("false", "0", "no"):
            return False
        raise ValueError(text)
    return scalar(text)


def _check_toml(value: Any, tp: Any) -> Any:
    """A TOML value as the field's type (an int is a float too); raises ValueError if not."""
    scalar, _ = _scalar(tp)
    if scalar is float and type(value) in (int, float):
        return float(value)
    if scalar is str and type(value) is bool:  # `auto = true` (validation checks the word)
        return "true" if value else "false"
    if type(value) is not scalar:
        raise ValueError(value)
    return value


def _unknown(where: str, what: str, name: str, valid: Sequence[str], among: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return ConfigError(f"{where}: unknown {what}{hint} {among}: {', '.join(valid)}")


def _field_type(section: str | None, key: str, where: str) -> Any:
    """The type of ``section.key`` (``key`` alone for a top-level key); ConfigError if unknown."""
    cls = Config if section is None else _types(Config)[section]
    types = {k: v for k, v in _types(cls).items() if section is not None or k not in _SECTIONS}
    if key not in types:
        if section is None:
            valid = [*_SECTIONS, *types]
            raise _unknown(
                where, f"section or key {key!r}", key, valid, "valid sections and top-level keys"
            )
        raise _unknown(
            where, f"key {key!r} in [{section}]", key, list(types), f"valid keys of [{section}]"
        )
    return types[key]


def _set(values: dict, section: str | None, key: str, value: Any) -> None:
    (values if section is None else values.setdefault(section, {}))[key] = value


def _apply_toml(values: dict, doc: Mapping[str, Any], source: str) -> None:
    for name, table in doc.items():
        if name not in _SECTIONS:
            _field_type(None, name, source)
            _set(
                values, None, name, _converted(_check_toml, table, None, name, f"{source}: {name}")
            )
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name} must be a table ([{name}]), got {table!r}")
        for key, value in table.items():
            _field_type(name, key, f"{source}: [{name}]")
            where = f"{source}: [{name}] {key}"
            _set(values, name, key, _converted(_check_toml, value, name, key, where))


def _converted(convert, value: Any, section: str | None, key: str, where: str) -> Any:
    tp = _field_type(section, key, where)
    try:
        return convert(value, tp)
    except ValueError:
        default = getattr(Config() if section is None else getattr(Config(), section), key)
        raise ConfigError(
            f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"for example the default, {_toml_value(default) if default is not None else 'none'}"
        ) from None


def _split_overrides(overrides: Sequence[str]) -> list[tuple[str, str | None]]:
    """``--a.b value`` and ``--a.b=value`` as (name, value) pairs; value None when absent."""
    args, pairs, i = list(overrides), [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"expected an override like --train.steps 10 or --train.steps=10, got {arg!r}"
            )
        name, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((name, value))
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((name, args[i + 1]))
            i += 2
        else:
            pairs.append((name, None))
            i += 1
    return pairs


def _apply_overrides(values: dict, overrides: Sequence[str]) -> None:
    for name, text in _split_overrides(overrides):
        section, _, key = name.partition(".") if "." in name else ("", "", name)
        where = f"--{name}"
        if section and section not in _SECTIONS:
            raise _unknown(where, f"section {section!r}", section, _SECTIONS, "valid sections")
        tp = _field_type(section or None, key, where)
        if text is None:  # a bare flag: true for a bool, an error otherwise
            if _scalar(tp)[0] is not bool:
                raise ConfigError(f"{where}: missing value; expected {_type_name(tp)}")
            text = "true"
        value = _converted(_parse_text, text, section or None, key, f"{where} {text}")
        _set(values, section or None, key, value)


def parse_fault_env(text: str) -> dict[str, Any]:
    """The `FaultConfig` fields that ANYSHARD_FAULT="rank:step[:mode]" sets; {} when empty.

    Without a mode the configured one stays.

    >>> parse_fault_env("1:7:sigkill")
    {'kill_rank': 1, 'kill_step': 7, 'mode': 'sigkill'}
    >>> parse_fault_env("0:3")
    {'kill_rank': 0, 'kill_step': 3}
    """
    text = text.strip()
    if not text:
        return {}
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in FAULT_MODES):
            raise ValueError(text)
        fault: dict[str, Any] = {"kill_rank": int(parts[0]), "kill_step": int(parts[1])}
    except ValueError:
        raise ConfigError(
            f"{FAULT_ENV}={text!r}: expected rank:step[:mode] with mode one of "
            f"{', '.join(FAULT_MODES)}, e.g. {FAULT_ENV}=1:7:sigkill"
        ) from None
    return fault | ({"mode": parts[2]} if len(parts) == 3 else {})


def parse_slow_env(text: str) -> dict[str, Any]:
    """The `FaultConfig` fields that
    ANYSHARD_SLOW="rank:factor[:from_step[:until_step]][:mode]" sets; {} when empty. The mode
    (one of `schema.SLOW_MODES`, "sleep" when left out) may follow any of the numbers.

    >>> parse_slow_env("1:2.5:40")
    {'slow_rank': 1, 'slow_factor': 2.5, 'slow_from': 40}
    >>> parse_slow_env("0:2")
    {'slow_rank': 0, 'slow_factor': 2.0}
    >>> parse_slow_env("1:2:15:40:neighbour")
    {'slow_rank': 1, 'slow_factor': 2.0, 'slow_from': 15, 'slow_until': 40, 'slow_mode': 'neighbour'}
    >>> parse_slow_env("1:3:compute")
    {'slow_rank': 1, 'slow_factor': 3.0, 'slow_mode': 'compute'}
    """
    text = text.strip()
    if not text:
        return {}
    parts = text.split(":")
    mode = parts.pop() if parts and parts[-1] in SLOW_MODES else None
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError(text)
        slow: dict[str, Any] = {"slow_rank": int(parts[0]), "slow_factor": float(parts[1])}
        if len(parts) >= 3:
            slow["slow_from"] = int(parts[2])
        if len(parts) == 4:
            slow["slow_until"] = int(parts[3])
    except ValueError:
        raise ConfigError(
            f"{SLOW_ENV}={text!r}: expected rank:factor[:from_step[:until_step]][:mode] (a "
            f"global rank, a factor >= 1, the first slow step, the first step no longer slow, "
            f"mode one of {', '.join(SLOW_MODES)}), e.g. {SLOW_ENV}=1:2:50 or "
            f"{SLOW_ENV}=1:2:15:40:neighbour"
        ) from None
    return slow | ({"slow_mode": mode} if mode is not None else {})


def _build(values: dict) -> Config:
    sections = {name: _types(Config)[name](**values.pop(name, {})) for name in _SECTIONS}
    return Config(**sections, **values)


def loads_config(
    text: str,
    overrides: Sequence[str] = (),
    *,
    source: str = "<string>",
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Like `load_config`, from TOML text; ``source`` names it in error messages.

    >>> loads_config("[train]\\nsteps = 10\\n", ["--parallel.tp=2"], environ={}).train.steps
    10
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    values: dict[str, Any] = {}
    _apply_toml(values, doc, source)
    _apply_overrides(values, overrides)
    environ = os.environ if environ is None else environ
    values.setdefault("fault", {}).update(parse_fault_env(environ.get(FAULT_ENV, "")))
    values["fault"].update(parse_slow_env(environ.get(SLOW_ENV, "")))
    cfg = _build(values)
    validate(cfg)
    return cfg


TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiny.toml")
"""A shipped configuration a tenth of the default's size (a step in about 0.1 s on 2 CPU
cores), for tests and quick checks: ``load_config(TINY_CONFIG, overrides)``."""


def trainer_config(argv: Sequence[str]) -> tuple[Config, int | None]:
    """The config of the trainer's command line (`train.main`) and its ``--stop-at`` step:
    ``--config FILE``, ``--stop-at N`` and ``--relayout-at STEP:LAYOUT`` (the config's
    ``parallel.relayout_at``) taken out, the other words overrides (`load_config`)."""
    argv, path, stop_at = list(argv), None, None
    for flag in ("--config", "--stop-at", "--relayout-at"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 == len(argv):
                raise ConfigError(f"{flag} needs a value")
            value, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
            if flag == "--config":
                path = value
            elif flag == "--stop-at":
                try:
                    stop_at = int(value)
                except ValueError:
                    raise ConfigError(f"--stop-at {value!r}: expected a step number") from None
            else:
                argv += ["--parallel.relayout_at", value]
    return load_config(path, argv), stop_at


def load_config(
    path: str | None = None,
    overrides: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The defaults, then the TOML file at ``path``, then ``overrides``, then ANYSHARD_FAULT.

    ``overrides`` are command-line words: ``["--parallel.tp", "2", "--train.steps=10"]``;
    ``environ`` defaults to ``os.environ``. Raises `ConfigError` (a ValueError) on an unknown
    key, a value of the wrong type, or values that conflict (see `checks.validate`).

    >>> cfg = load_config(None, ["--parallel.dp_shard", "2", "--checkpoint.async_=yes"], environ={})
    >>> cfg.parallel.world_size, cfg.checkpoint.async_
    (2, True)
    """
    text = "" if path is None else storage.read_bytes(path).decode("utf-8")
    return loads_config(text, overrides, source=path or "<defaults>", environ=environ)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested dicts of JSON values, one per section, plus ``run_dir``."""
    return dataclasses.asdict(cfg)


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # the shortest text that reads back as the same float
    chars = (
        _ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value
    )
    return '"' + "".join(chars) + '"'


def dump_toml(cfg: Config) -> str:
    """The config as TOML that `load_config` reads back equal; None values are left out.

    >>> from anyshard.trainer_integration.gpt.config import TrainConfig
    >>> cfg = Config(train=TrainConfig(steps=10))
    >>> loads_config(dump_toml(cfg), environ={}) == cfg
    True
    >>> print(dump_toml(cfg).splitlines()[0])
    run_dir = "runs/demo"
    """
    values = config_to_dict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in _SECTIONS]
    for name in _SECTIONS:
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in values[name].items() if v is not None]
    return "\n".join(lines) + "\n"
