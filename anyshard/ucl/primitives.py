"""The spec's mapping primitives, one function each: what ``chunk``, ``slice``, ``pad``, ...
do to the pieces of the local tensor being built, and to its flags.

The flags of a part say what is not a box correspondence: whether this rank's copy is the one a
checkpoint keeps (``replicate``, ``average``, ``on``), the mesh dims to average over before saving
(``average``), a ``transpose`` and a ``cast``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from anyshard.errors import MappingError, UCLSemanticError
from anyshard.geometry.boxes import Piece
from anyshard.geometry.shards import chunk_bounds
from anyshard.ucl.arithmetic import Evaluator
from anyshard.ucl.check import DTYPES, USAGE
from anyshard.ucl.lowering import (
    ShardState,
    flatten_pieces,
    initial_state,
    narrow_block,
    narrow_flat,
)
from anyshard.ucl.syntax import KwArg, OpCall, Part

__all__ = ["apply", "new_flags", "part_state"]


def new_flags() -> dict:
    """The flags of a part before any primitive: a primary copy, nothing else."""
    return {"primary": True, "average": [], "transpose": None, "dtype": None}


def part_state(
    ev: Evaluator, part: Part, env, flags: dict
) -> tuple[str, tuple[int, ...], ShardState]:
    """The logical name and shape of ``part``, and its pieces once its primitives applied."""
    logical = ev.name(part.name, env)
    shape = tuple(ev.expr(d, env) for d in part.shape)
    if any(n < 0 for n in shape):
        raise ev.error(part, f"{logical}: negative size in shape {list(shape)}", "sizes >= 0")
    st = initial_state(shape)
    for op in part.ops:
        apply(ev, st, op, env, flags)
    return logical, shape, st


def apply(ev: Evaluator, st: ShardState, op: OpCall, env, flags: dict) -> None:
    """Apply the primitive ``op`` to ``st`` (its pieces) and ``flags``."""
    pos = [a for a in op.args if not isinstance(a, KwArg)]
    kw = {a.name: ev.expr(a.value, env) for a in op.args if isinstance(a, KwArg)}
    primitive = _PRIMITIVES.get(op.name)
    assert primitive is not None, op.name  # check_spec: every primitive is known
    try:
        primitive(_Op(ev, st, op, pos, kw, env, flags))
    except MappingError as e:
        raise ev.error(op, str(e), USAGE[op.name]) from None


@dataclass(slots=True)
class _Op:
    """One primitive call being applied: its arguments and what it changes."""

    ev: Evaluator
    st: ShardState
    op: OpCall
    pos: list
    kw: dict[str, int]
    env: Mapping[str, int]
    flags: dict

    def num(self, i: int) -> int:
        """The value of positional argument ``i``."""
        return self.ev.expr(self.pos[i], self.env)

    def fail(self, message: str, expected: str) -> UCLSemanticError:
        return self.ev.error(self.op, message, expected)

    def dim(self, d: int) -> int:
        ndim = len(self.st.shape)
        if not 0 <= d < ndim or (self.st.flat and d != 0):
            raise self.fail(
                f"{self.op}: dim {d} does not exist; the tensor here has shape {list(self.st.shape)}",
                f"a dim in 0..{ndim - 1}",
            )
        return d

    def narrow(self, dim: int, start: int, stop: int) -> None:
        if self.st.flat:
            narrow_flat(self.st, start, stop)
        else:
            narrow_block(self.st, dim, start, stop)


def _replicate(o: _Op) -> None:
    o.flags["primary"] &= o.ev.coords.get(o.pos[0].name, 0) == 0


def _average(o: _Op) -> None:
    _replicate(o)
    o.flags["average"].append(o.pos[0].name)


def _on(o: _Op) -> None:
    axis = o.pos[0].name
    index, size = o.num(1), o.ev.env[axis]
    if not 0 <= index < size:
        raise o.fail(
            f"{o.op}: index {index} is outside mesh dim {axis} of size {size}",
            f"an index in 0..{size - 1}",
        )
    o.flags["primary"] &= o.ev.coords.get(axis, 0) == index


def _transpose(o: _Op) -> None:
    a, b = o.num(0), o.num(1)
    if o.st.flat or a == b:
        raise o.fail(f"{o.op}: needs two distinct dims of a block tensor", USAGE[o.op.name])
    o.dim(a)
    o.dim(b)
    o.flags["transpose"] = (a, b)


def _cast(o: _Op) -> None:
    o.flags["dtype"] = DTYPES[o.pos[0].name]


def _flatten(o: _Op) -> None:
    if not o.st.flat:
        flatten_pieces(o.st)


def _range(o: _Op) -> None:
    start, stop = o.num(0), o.num(1)
    st = o.st
    if len(st.shape) != 1:
        raise o.fail(
            f"{o.op} takes elements of a flat tensor, but this one has shape {list(st.shape)}",
            "flatten() before range()",
        )
    if not 0 <= start <= stop <= st.shape[0]:
        raise o.fail(f"{o.op}: outside 0..{st.shape[0]}", f"0 <= start <= stop <= {st.shape[0]}")
    o.narrow(0, start, stop)


def _pad(o: _Op) -> None:
    st = o.st
    dim = o.dim(o.num(0))
    extent = st.shape[dim]
    size = o.num(1) if len(o.pos) > 1 else None
    if size is None:
        m = o.kw["multiple"]
        if m <= 0:
            raise o.fail(f"{o.op}: multiple {m}", "a positive multiple")
        size = -(-extent // m) * m
    if size < extent:
        raise o.fail(f"{o.op}: dim {dim} already has {extent} elements", f"a size >= {extent}")
    shape = st.shape[:dim] + (size,) + st.shape[dim + 1 :]
    if not st.flat:
        st.pieces = [Piece(0, shape, p.array_box, p.logical_box) for p in st.pieces]
    st.shape = shape


def _slice(o: _Op) -> None:
    dim = o.dim(o.num(0))
    extent = o.st.shape[dim]
    start, stop = o.num(1), o.num(2)
    if not 0 <= start <= stop <= extent:
        raise o.fail(f"{o.op}: outside 0..{extent} of dim {dim}", f"0 <= start <= stop <= {extent}")
    o.narrow(dim, start, stop)


def _split(o: _Op) -> None:
    dim = o.dim(o.num(0))
    extent = o.st.shape[dim]
    axis = o.pos[1].name
    sizes = [o.ev.expr(x, o.env) for x in o.pos[2].items]
    n = o.ev.env[axis]
    if len(sizes) != n or sum(sizes) != extent or any(s < 0 for s in sizes):
        raise o.fail(
            f"{o.op}: sizes {sizes} do not cut {extent} elements into {n} parts",
            f"{n} non-negative sizes (the size of {axis}) summing to {extent}",
        )
    c = o.ev.coords.get(axis, 0)
    start = sum(sizes[:c])
    o.narrow(dim, start, start + sizes[c])


def _chunk(o: _Op) -> None:
    dim = o.dim(o.num(0))
    extent = o.st.shape[dim]
    if len(o.pos) == 3:
        parts, index = o.num(1), o.num(2)
        if not 0 <= index < parts:
            raise o.fail(f"{o.op}: index {index} is outside 0..{parts - 1}", USAGE[o.op.name])
    else:
        parts, index = o.ev.env[o.pos[1].name], o.ev.coords.get(o.pos[1].name, 0)
    unit = o.kw.get("unit", 1)
    if unit <= 0 or extent % unit:
        raise o.fail(
            f"{o.op}: dim {dim} has {extent} elements, not a multiple of the unit {unit}",
            "a unit that divides the dim",
        )
    start, stop = chunk_bounds(extent // unit, parts, index)
    o.narrow(dim, start * unit, stop * unit)


_PRIMITIVES: dict[str, Callable[[_Op], None]] = {
    "replicate": _replicate,
    "average": _average,
    "on": _on,
    "transpose": _transpose,
    "cast": _cast,
    "flatten": _flatten,
    "range": _range,
    "pad": _pad,
    "slice": _slice,
    "split": _split,
    "chunk": _chunk,
}
