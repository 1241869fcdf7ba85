"""Mapping expressions: the part of UCL that says how one shard derives from its logical tensor.

A mapping is a pipeline of operations applied left to right to the logical tensor::

    chunk(0, dp_shard) | chunk(1, tp)          # FSDP over dim 0, then TP over dim 1
    chunk(0, tp) | chunk(0, dp_shard)          # FSDP2 over TP on the same dim (_StridedShard)
    chunk(0, 4, 1)                             # the second of 4 torch.chunk parts
    split(0, tp, [4, 3, 3])                    # uneven parts given explicitly
    slice(1, 0, 128) | pad(1, 256)             # a region, padded to a size
    flatten() | range(100, 200)                # a fragment of the flattened tensor
    replicate(dp_replicate)                    # the same on every rank of that mesh dim
    on(dp_replicate, 1)                        # held (written) only at that coordinate

Operations that name a mesh dim (an *axis*) are parameterised by the rank's coordinate along
it, so one expression describes the shard of every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lark

from anyshard.errors import MappingError, MappingSyntaxError

__all__ = [
    "Chunk",
    "Flatten",
    "Mapping",
    "On",
    "Op",
    "Pad",
    "Range",
    "Replicate",
    "Slice",
    "Split",
    "parse_mapping",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    line: int = field(default=0, compare=False, repr=False)
    column: int = field(default=0, compare=False, repr=False)

    @property
    def axis_name(self) -> str | None:
        return getattr(self, "axis", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk(Op):
    """torch.chunk along ``dim``: into the size of ``axis`` parts taking the rank's coordinate,
    or into ``parts`` parts taking ``index``."""

    dim: int
    axis: str | None = None
    parts: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        if self.axis is not None:
            return f"chunk({self.dim}, {self.axis})"
        return f"chunk({self.dim}, {self.parts}, {self.index})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Split(Op):
    """Consecutive parts of the given sizes along ``dim``; the rank takes its coordinate's part."""

    dim: int
    axis: str
    sizes: tuple[int, ...]

    def __str__(self) -> str:
        return f"split({self.dim}, {self.axis}, [{', '.join(map(str, self.sizes))}])"


@dataclass(frozen=True, slots=True, kw_only=True)
class Slice(Op):
    dim: int
    start: int
    stop: int

    def __str__(self) -> str:
        return f"slice({self.dim}, {self.start}, {self.stop})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Pad(Op):
    """Pad ``dim`` at its end to ``size`` elements; padding holds no logical data."""

    dim: int
    size: int

    def __str__(self) -> str:
        return f"pad({self.dim}, {self.size})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Flatten(Op):
    def __str__(self) -> str:
        return "flatten()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Range(Op):
    """Elements ``[start, stop)`` of a flattened shard."""

    start: int
    stop: int

    def __str__(self) -> str:
        return f"range({self.start}, {self.stop})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate(Op):
    axis: str

    def __str__(self) -> str:
        return f"replicate({self.axis})"


@dataclass(frozen=True, slots=True, kw_only=True)
class On(Op):
    """The shard exists only at coordinate ``index`` of ``axis``."""

    axis: str
    index: int

    def __str__(self) -> str:
        return f"on({self.axis}, {self.index})"


@dataclass(frozen=True, slots=True)
class Mapping:
    """A parsed mapping: a pipeline of operations. ``str()`` gives text that parses back."""

    ops: tuple[Op, ...] = ()

    def __str__(self) -> str:
        return " | ".join(str(op) for op in self.ops)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh dims the mapping names, in order of first use."""
        seen: dict[str, None] = {}
        for op in self.ops:
            if op.axis_name is not None:
                seen.setdefault(op.axis_name)
        return tuple(seen)

    def then(self, *ops: Op) -> Mapping:
        return Mapping(self.ops + tuple(ops))


def _grammar() -> str:
    return (Path(__file__).parent / "mapping.lark").read_text()


@functools.cache
def _parser() -> lark.Lark:
    # strict=False: lark's strict mode proves that no two terminals match the same text, which
    # costs 0.1-0.5 s per process (every load's first mapping) and cannot change once the
    # grammar is fixed; a unit test builds the grammar in strict mode instead.
    return lark.Lark(_grammar(), parser="lalr", propagate_positions=True, strict=False)


# name -> (argument kinds, constructor); kinds: i = int, a = axis name, l = list of ints
_SIGNATURES: dict[str, list[tuple[str, Callable[..., Op]]]] = {
    "chunk": [
        ("ia", lambda d, a: Chunk(dim=d, axis=a)),
        ("iii", lambda d, n, i: Chunk(dim=d, parts=n, index=i)),
    ],
    "split": [("ial", lambda d, a, s: Split(dim=d, axis=a, sizes=tuple(s)))],
    "slice": [("iii", lambda d, a, b: Slice(dim=d, start=a, stop=b))],
    "pad": [("ii", lambda d, n: Pad(dim=d, size=n))],
    "flatten": [("", lambda: Flatten())],
    "range": [("ii", lambda a, b: Range(start=a, stop=b))],
    "replicate": [("a", lambda a: Replicate(axis=a))],
    "on": [("ai", lambda a, i: On(axis=a, index=i))],
}
_USAGE = {
    "chunk": "chunk(dim, axis) or chunk(dim, parts, index)",
    "split": "split(dim, axis, [size, ...])",
    "slice": "slice(dim, start, stop)",
    "pad": "pad(dim, size)",
    "flatten": "flatten()",
    "range": "range(start, stop)",
    "replicate": "replicate(axis)",
    "on": "on(axis, index)",
}


def _kind(node: lark.Tree) -> str:
    return {"int_arg": "i", "name_arg": "a", "list_arg": "l"}[node.data]


def _value(node: lark.Tree) -> int | str | list[int]:
    tokens = [c for c in node.children if isinstance(c, lark.Token)]
    if node.data == "int_arg":
        return int(tokens[0])
    if node.data == "name_arg":
        return str(tokens[0])
    return [int(c) for c in tokens]


def _build_op(tree: lark.Tree, text: str) -> Op:
    name_tok = tree.children[0]
    assert isinstance(name_tok, lark.Token)  # the grammar: an operation starts with its name
    args = [a for a in tree.children[1:] if isinstance(a, lark.Tree)]
    name = str(name_tok)
    line, column = name_tok.line or 1, name_tok.column or 1
    if name not in _SIGNATURES:
        raise MappingSyntaxError(
            f"unknown mapping operation {name!r}",
            text=text,
            line=line,
            column=column,
            expected="one of " + ", ".join(sorted(_SIGNATURES)),
        )
    kinds = "".join(_kind(a) for a in args)
    for sig, make in _SIGNATURES[name]:
        if sig == kinds:
            op = make(*(_value(a) for a in args))
            return _with_position(op, line, column)
    raise MappingSyntaxError(
        f"wrong arguments to {name}", text=text, line=line, column=column, expected=_USAGE[name]
    )


def _with_position(op: Op, line: int, column: int) -> Op:
    object.__setattr__(op, "line", line)
    object.__setattr__(op, "column", column)
    return op


def _check(op: Op, text: str) -> None:
    def bad(why: str) -> MappingError:
        return MappingSyntaxError(
            why,
            text=text,
            line=op.line,
            column=op.column,
            expected=_USAGE[type(op).__name__.lower()],
        )

    if getattr(op, "dim", 0) < 0:
        raise bad("dim must be >= 0")
    if isinstance(op, Chunk) and op.axis is None:
        assert op.parts is not None and op.index is not None  # chunk(dim, parts, index)
        if not (op.parts > 0 and 0 <= op.index < op.parts):
            raise bad(f"chunk index {op.index} is outside 0..{op.parts - 1}")
    if isinstance(op, Split) and any(s < 0 for s in op.sizes):
        raise bad("split sizes must be >= 0")
    if isinstance(op, (Slice, Range)) and not 0 <= op.start <= op.stop:
        raise bad("need 0 <= start <= stop")
    if isinstance(op, Pad) and op.size < 0:
        raise bad("pad size must be >= 0")
    if isinstance(op, On) and op.index < 0:
        raise bad("on() index must be >= 0")


_TERMINAL_WORDS = {
    "NAME": "a name",
    "SIGNED_INT": "an integer",
    "$END": "the end of the expression",
}


def _describe(terminals) -> str:
    """Lark's terminal names (``RPAR``) as the text a user would type (``')'``)."""
    literals = {
        t.name: t.pattern.value
        for t in _parser().terminals
        if isinstance(t.pattern, lark.lexer.PatternStr)
    }
    words = [
        _TERMINAL_WORDS.get(n) or (repr(literals[n]) if n in literals else n) for n in terminals
    ]
    return ", ".join(sorted(words))


@functools.lru_cache(maxsize=4096)
def parse_mapping(text: str) -> Mapping:
    """Parse a mapping expression; raises `MappingSyntaxError` with line and column."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        expected = getattr(e, "expected", None) or getattr(e, "allowed", None) or []
        line, column, what = e.line, e.column, "malformed mapping expression"
        token = getattr(e, "token", None)
        if token is not None and token.type == "$END":
            # lark places the end of input at the last token; the error is just after it.
            line, column = token.end_line or line, token.end_column or column
            what = "unexpected end of mapping expression"
        raise MappingSyntaxError(
            what,
            text=text,
            line=line if line > 0 else 1,
            column=column if column > 0 else 1,
            expected=_describe(expected) or "an operation such as chunk(0, tp)",
        ) from None
    ops = tuple(_build_op(t, text) for t in tree.children if isinstance(t, lark.Tree))
    for op in ops:
        _check(op, text)
    return Mapping(ops)
