"""Lowering a mapping to pieces: which box of a shard holds which box of the logical tensor.

Pure functions: shapes, mesh sizes and coordinates in, `Shard` descriptions out. The spec
evaluator builds on the same steps (`ShardState`, `narrow_block`, `narrow_flat`, ...).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingType
from dataclasses import dataclass

from anyshard.errors import MappingError
from anyshard.geometry.boxes import Box, Piece, box_shape, flat_range_to_boxes, full_box, intersect
from anyshard.geometry.shards import Shard, chunk_bounds
from anyshard.ucl.mapping import (
    Chunk,
    Flatten,
    Mapping,
    On,
    Op,
    Pad,
    Range,
    Replicate,
    Slice,
    Split,
)

__all__ = [
    "ShardState",
    "initial_state",
    "compile_mapping",
    "compile_mapping_cached",
    "enumerate_shards",
    "flatten_pieces",
    "narrow_block",
    "narrow_flat",
    "translate_box",
]


@dataclass(slots=True)
class ShardState:
    shape: tuple[int, ...]
    pieces: list[Piece]
    flat: bool


def initial_state(logical_shape: Sequence[int]) -> ShardState:
    shape = tuple(int(n) for n in logical_shape)
    box = full_box(shape)
    return ShardState(shape, [Piece(0, shape, box, box)], flat=False)


def narrow_block(st: ShardState, dim: int, start: int, stop: int) -> None:
    shape = st.shape[:dim] + (stop - start,) + st.shape[dim + 1 :]
    window = tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(st.shape))
    pieces = []
    for p in st.pieces:
        inter = intersect(p.array_box, window)
        if inter is None:
            continue
        logical = translate_box(inter, p.array_box, p.logical_box)
        array_box = tuple(
            (lo - start, hi - start) if d == dim else (lo, hi) for d, (lo, hi) in enumerate(inter)
        )
        pieces.append(Piece(0, shape, array_box, logical))
    st.shape, st.pieces = shape, pieces


def narrow_flat(st: ShardState, start: int, stop: int) -> None:
    pieces = []
    for p in st.pieces:
        n = math.prod(p.array_shape)
        u, v = max(p.base, start), min(p.base + n, stop)
        if u >= v:
            continue
        for sub in flat_range_to_boxes(p.array_shape, u - p.base, v - p.base):
            logical = translate_box(sub, p.array_box, p.logical_box)
            pieces.append(_rebased(p.base - start, p.array_shape, sub, logical))
    st.shape, st.pieces = (stop - start,), pieces


def _rebased(base: int, array_shape: tuple[int, ...], sub: Box, logical: Box) -> Piece:
    """A piece for ``sub`` (a flat-contiguous box of a C-order array of ``array_shape`` that
    starts ``base`` elements into the shard), holding the logical box ``logical``."""
    strides = [math.prod(array_shape[d + 1 :]) for d in range(len(array_shape))]
    offset = sum(lo * s for (lo, _), s in zip(sub, strides, strict=True))
    shape = box_shape(sub)
    return Piece(base + offset, shape, full_box(shape), logical)


def translate_box(box: Box, src: Box, dst: Box) -> Box:
    """``box`` (inside the space of ``src``) moved by the offset that takes ``src`` onto ``dst``."""
    return tuple(
        (lo - slo + dlo, hi - slo + dlo)
        for (lo, hi), (slo, _), (dlo, _) in zip(box, src, dst, strict=True)
    )


def _contiguous_parts(shape: tuple[int, ...], box: Box) -> Iterator[Box]:
    """Split ``box`` into sub-boxes that are each contiguous in C order within ``shape``."""
    d = len(shape) - 1
    while d >= 0 and box[d] == (0, shape[d]):
        d -= 1
    outer = [i for i in range(d) if box[i][1] - box[i][0] > 1]
    if d < 0 or not outer:
        yield box
        return
    first = outer[-1]
    for i in range(*box[first]):
        yield from _contiguous_parts(shape, box[:first] + ((i, i + 1),) + box[first + 1 :])


def flatten_pieces(st: ShardState) -> None:
    pieces = []
    for p in st.pieces:
        for sub in _contiguous_parts(p.array_shape, p.array_box):
            logical = translate_box(sub, p.array_box, p.logical_box)
            pieces.append(_rebased(p.base, p.array_shape, sub, logical))
    st.shape, st.pieces, st.flat = (math.prod(st.shape),), pieces, True


def _apply(st: ShardState, op: Op, coord: int | None, size: int | None) -> None:
    if isinstance(op, (Chunk, Split, Slice, Range)):
        dim = 0 if isinstance(op, Range) else op.dim
        _check_dim(st, op, dim)
        if isinstance(op, Range) and len(st.shape) != 1:
            # Without this, range() would take rows of dim 0, not elements.
            raise MappingError(
                f"{op}: range() takes elements of a flat shard, but the shard has shape {list(st.shape)}; "
                "put flatten() before it"
            )
        extent = st.shape[dim]
        if isinstance(op, Chunk):
            parts, index = (size, coord) if op.axis is not None else (op.parts, op.index)
            start, stop = chunk_bounds(extent, parts, index)
        elif isinstance(op, Split):
            if len(op.sizes) != size or sum(op.sizes) != extent:
                raise MappingError(
                    f"{op}: needs {size} sizes (the size of {op.axis}) summing to {extent}; got {list(op.sizes)}"
                )
            start = sum(op.sizes[:coord])
            stop = start + op.sizes[coord]
        else:
            start, stop = op.start, op.stop
            if stop > extent:
                raise MappingError(f"{op}: stop {stop} is beyond the extent {extent} of dim {dim}")
        if st.flat:
            narrow_flat(st, start, stop)
        else:
            narrow_block(st, dim, start, stop)
    elif isinstance(op, Pad):
        _check_dim(st, op, op.dim)
        if op.size < st.shape[op.dim]:
            raise MappingError(f"{op}: dim {op.dim} already has {st.shape[op.dim]} elements")
        shape = st.shape[: op.dim] + (op.size,) + st.shape[op.dim + 1 :]
        if not st.flat:
            st.pieces = [Piece(0, shape, p.array_box, p.logical_box) for p in st.pieces]
        st.shape = shape
    elif isinstance(op, Flatten):
        if not st.flat:
            flatten_pieces(st)


def _check_dim(st: ShardState, op: Op, dim: int) -> None:
    if dim >= len(st.shape) or (st.flat and dim != 0):
        raise MappingError(f"{op}: the shard has {len(st.shape)} dim(s) here {list(st.shape)}")


def _axis_size(op: Op, sizes: MappingType[str, int]) -> int | None:
    axis = op.axis_name
    if axis is None:
        return None
    if axis not in sizes:
        raise MappingError(f"{op}: mesh dim {axis!r} is not in the mesh {dict(sizes)}")
    return sizes[axis]


def compile_mapping(
    mapping: Mapping,
    logical_shape: Sequence[int],
    sizes: MappingType[str, int],
    coords: MappingType[str, int],
) -> Shard | None:
    """The shard held at mesh ``coords``; None where an ``on()`` excludes these coordinates."""
    st = initial_state(logical_shape)
    for op in mapping.ops:
        size = _axis_size(op, sizes)
        coord = coords.get(op.axis_name) if op.axis_name is not None else None
        if op.axis_name is not None and coord is None:
            raise MappingError(f"{op}: no coordinate given for mesh dim {op.axis_name!r}")
        if isinstance(op, On):
            if op.index >= size:
                raise MappingError(f"{op}: index is outside mesh dim {op.axis} of size {size}")
            if coord != op.index:
                return None
            continue
        _apply(st, op, coord, size)
    return Shard(st.shape, tuple(st.pieces))


def compile_mapping_cached(
    mapping: Mapping,
    logical_shape: Sequence[int],
    sizes: MappingType[str, int],
    coords: MappingType[str, int],
) -> Shard | None:
    """`compile_mapping`, remembered: a state dict holds hundreds of tensors of a few shapes
    under a few mappings (shards are immutable, so callers may share them)."""
    return _compile_cached(
        mapping, tuple(logical_shape), tuple(sizes.items()), tuple(sorted(coords.items()))
    )


@functools.lru_cache(maxsize=8192)
def _compile_cached(mapping: Mapping, shape: tuple, sizes: tuple, coords: tuple) -> Shard | None:
    return compile_mapping(mapping, shape, dict(sizes), dict(coords))


def enumerate_shards(
    mapping: Mapping,
    logical_shape: Sequence[int],
    sizes: MappingType[str, int],
    needed: Box | None = None,
) -> Iterator[tuple[dict[str, int], Shard]]:
    """Every distinct shard the mapping describes over the mesh, with the coordinates that hold it.

    Mesh dims the mapping does not name are left out of the coordinates (the shard is the same
    along them); a `replicate` dim yields coordinate 0. With ``needed``, only shards holding
    part of that logical box are produced, and whole subtrees of coordinates are pruned as soon
    as a narrowing leaves nothing of it.
    """
    ops = mapping.ops
    st = initial_state(logical_shape)

    def prune(state: ShardState) -> bool:
        return needed is not None and all(
            intersect(p.logical_box, needed) is None for p in state.pieces
        )

    def walk(
        i: int, state: ShardState, coords: dict[str, int]
    ) -> Iterator[tuple[dict[str, int], Shard]]:
        if prune(state):
            return
        if i == len(ops):
            yield dict(coords), Shard(state.shape, tuple(state.pieces))
            return
        op = ops[i]
        size = _axis_size(op, sizes)
        axis = op.axis_name
        if axis is None:
            nxt = ShardState(state.shape, list(state.pieces), state.flat)
            _apply(nxt, op, None, None)
            yield from walk(i + 1, nxt, coords)
            return
        named_before = axis in coords  # by an earlier op, whose frame owns the entry
        if named_before:
            choices = [coords[axis]]
        elif isinstance(op, On):
            choices = [op.index]
        elif isinstance(op, Replicate):
            choices = [0]
        else:
            choices = _candidate_coords(op, state, size, needed)
        for c in choices:
            if isinstance(op, On) and c != op.index:
                continue
            nxt = ShardState(state.shape, list(state.pieces), state.flat)
            if not isinstance(op, (On, Replicate)):
                _apply(nxt, op, c, size)
            coords[axis] = c
            yield from walk(i + 1, nxt, coords)
            if not named_before:
                del coords[axis]

    yield from walk(0, st, {})


def _candidate_coords(op: Op, state: ShardState, size: int, needed: Box | None) -> range:
    """Coordinates worth trying for a narrowing op; all of them unless a cheap bound exists."""
    if needed is None or state.flat or not isinstance(op, Chunk) or len(state.pieces) != 1:
        return range(size)
    p = state.pieces[0]
    if p.array_box != full_box(p.array_shape):
        return range(size)
    # A single block piece covering the shard: local index = logical index - offset.
    lo = needed[op.dim][0] - p.logical_box[op.dim][0]
    hi = needed[op.dim][1] - p.logical_box[op.dim][0]
    extent = state.shape[op.dim]
    step = -(-extent // size) if size else 0
    if step == 0:
        return range(size)
    first = max(0, lo // step)
    last = min(size, -(-hi // step))
    return range(first, max(first, last))
