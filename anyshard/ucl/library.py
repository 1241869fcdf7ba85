"""Where a checked `Spec` comes from: spec text, a ``.ucl`` file, or a spec shipped with anyshard.

`parse` chains the parser (`anyshard.ucl.parser`) and the static checks (`anyshard.ucl.check`);
`load_spec` takes whatever names a spec and gives it parsed and checked. The shipped specs live
in ``anyshard/ucl/specs/*.ucl``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from anyshard.errors import AnyshardError
from anyshard.ucl import mapping, parser
from anyshard.ucl.check import check_spec
from anyshard.ucl.parser import parse_syntax
from anyshard.ucl.syntax import Spec

__all__ = ["SPEC_DIR", "load_spec", "parse", "preload", "shipped_specs"]

SPEC_DIR = Path(__file__).parent / "specs"


def parse(text: str) -> Spec:
    """Parse and statically check a spec; raises `UCLSyntaxError` or `UCLSemanticError` (and
    nothing else, whatever the text) with the line and column of the first wrong place.
    A text parsed before gives the same (immutable) `Spec` again."""
    return _parse(text)


@lru_cache(maxsize=64)
def _parse(text: str) -> Spec:
    spec = parse_syntax(text)
    check_spec(spec, text)
    return spec


def shipped_specs() -> list[str]:
    """Names of the specs shipped with anyshard (``anyshard/ucl/specs/*.ucl``)."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.ucl"))


def load_spec(spec: Spec | str | Path) -> Spec:
    """A `Spec` from a parsed spec, a spec's text, a path to a ``.ucl`` file, or the name of a
    shipped spec (``"megatron_gpt"``)."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Path):
        return parse(spec.read_text())
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a Spec, a text, a path or a name, not {type(spec).__name__}")
    if "\n" in spec or ";" in spec:
        return parse(spec)
    if spec in shipped_specs():
        return parse((SPEC_DIR / f"{spec}.ucl").read_text())
    p = Path(spec)
    if p.is_file():
        return parse(p.read_text())
    raise AnyshardError(
        f"spec {spec!r} is neither a file nor a shipped spec ({', '.join(shipped_specs())}) "
        "nor spec text"
    )


def preload() -> None:
    """Build the parsers of mapping expressions and of specs now. Each is built once per
    process, on first use; a process that forks workers calls this first, so that no worker
    builds them again."""
    mapping._parser()
    parser._parser()
