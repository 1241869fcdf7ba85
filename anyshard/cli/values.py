"""Values the command line reads and prints: the usage error (exit code 2), ``--layout``
NAME=INT lists, spec names, seconds, and byte counts for people."""

from __future__ import annotations

import argparse


class Usage(Exception):
    """Bad command-line input: one line on stderr, exit code 2."""


def layout_arg(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        try:
            if not eq or not key.strip():
                raise ValueError
            out[key.strip()] = int(value)
        except ValueError:
            raise Usage(
                f"--layout: {item!r} is not NAME=INT; write e.g. --layout tp=2,pp=2,hidden=64"
            ) from None
    return out


def load_spec_arg(name: str):
    from pathlib import Path

    from anyshard.ucl.library import SPEC_DIR, parse, shipped_specs

    p = Path(name)
    if p.is_file():
        return parse(p.read_text()), str(p)
    if name in shipped_specs():
        return parse((SPEC_DIR / f"{name}.ucl").read_text()), f"{name} (shipped)"
    raise Usage(
        f"{name}: no such file, and not a shipped spec (shipped: {', '.join(shipped_specs())})"
    )


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be 0 or more")
    return value


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
