"""Reading JSON that a checkpoint's writer may not have been: finite numbers only, bounded
nesting, and typed fields, each refused as a `CorruptCheckpointError` (by its caller) that names
what was expected, never a TypeError, OverflowError or RecursionError from deeper down.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "FieldError",
    "check_depth",
    "field_dict",
    "field_int",
    "field_list",
    "field_name",
    "field_str",
    "loads",
]

MAX_DEPTH = 64
"""How deeply a checkpoint's JSON may nest (a manifest's JSON values included)."""


class FieldError(ValueError):
    """A JSON document or field is not what the format says; the caller adds where."""


def _no_constant(name: str) -> Any:
    raise FieldError(f"the number {name} is not allowed (JSON numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FieldError(f"the number {text[:40]} is out of range (JSON numbers must be finite)")
    return value


def loads(data: bytes | str) -> Any:
    """``json.loads`` that refuses NaN, Infinity, numbers that overflow a float and documents
    nested deeper than `MAX_DEPTH` (`FieldError`)."""
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise FieldError(f"the JSON nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise FieldError(f"not UTF-8 ({e})") from None
    except ValueError as e:
        if isinstance(e, FieldError):
            raise
        raise FieldError(f"not valid JSON ({e})") from None
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise `FieldError` when ``value`` nests deeper than ``limit`` (walked without recursion;
    a container's scalars are told apart by their types' set, not one by one)."""
    if not isinstance(value, (dict, list)):
        return
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise FieldError(f"the JSON nests deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node
        if any(issubclass(k, (dict, list)) for k in set(map(type, children))):
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def field_int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (bools and floats are not ints here)."""
    if type(value) is not int:
        raise FieldError(f"{what} is {value!r:.60}, not an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise FieldError(f"{what} is {value}, outside {bound}")
    return value


def field_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{what} is {value!r:.60}, not a string")
    return value


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def field_name(value: Any, what: str) -> str:
    """A name (of a tensor, a mesh dim, a file): a non-empty string without control characters."""
    name = field_str(value, what)
    if not name or _CONTROL.search(name):
        raise FieldError(f"{what} {name!r:.80} is empty or holds control characters")
    return name


def field_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise FieldError(f"{what} is {type(value).__name__}, not a list")
    return value


def field_dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise FieldError(f"{what} is {type(value).__name__}, not an object")
    return value
