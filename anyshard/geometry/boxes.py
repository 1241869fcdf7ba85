"""Box algebra: the pure arithmetic under every plan.

A *box* is a tuple of half-open ``(lo, hi)`` intervals, one per tensor dim. A *piece*
says that a box of a stored (or target) shard holds a box of the logical tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]

__all__ = [
    "Box",
    "Piece",
    "box_numel",
    "box_shape",
    "full_box",
    "intersect",
    "flat_range_to_boxes",
    "box_runs",
    "is_empty",
]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def is_empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when they do not meet."""
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))
    if any(hi <= lo for lo, hi in out):
        return None
    return out


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the flat (C-order) index range ``[start, stop)`` of ``shape`` into boxes.

    Each box covers consecutive flat indices, the boxes come in flat order, and there are
    at most ``2 * ndim - 1`` of them.
    """
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    start, stop = max(0, start), min(stop, total)
    if start >= stop:
        return []
    if not shape:
        return [()]
    return list(_flat_boxes(shape, start, stop))


def _unravel(shape: Sequence[int], index: int) -> list[int]:
    out = []
    for s in _strides(shape):
        out.append(index // s)
        index %= s
    return out


def _flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[Box]:
    # Recursive on the leading dim: a partial leading slab, whole slabs, a partial slab.
    if len(shape) == 1:
        yield ((start, stop),)
        return
    inner = math.prod(shape[1:])
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    if first == last:
        for sub in _flat_boxes(shape[1:], first_off, last_off):
            yield ((first, first + 1),) + sub
        return
    if first_off:
        for sub in _flat_boxes(shape[1:], first_off, inner):
            yield ((first, first + 1),) + sub
        first += 1
    if last > first:
        yield ((first, last),) + tuple((0, n) for n in shape[1:])
    if last_off:
        for sub in _flat_boxes(shape[1:], 0, last_off):
            yield ((last, last + 1),) + sub


def box_runs(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """Contiguous element runs ``(flat_start, length)`` of ``box`` inside a C-order ``shape``.

    Runs come in C order of the box and adjacent runs are merged.
    """
    if not shape:
        return [(0, 1)]
    if is_empty(box):
        return []
    strides = _strides(shape)
    # Find the innermost dims that the box covers whole: they fold into one run.
    d = len(shape) - 1
    run = 1
    while d >= 0 and box[d] == (0, shape[d]):
        run *= shape[d]
        d -= 1
    if d < 0:
        return [(0, run)]
    run *= box[d][1] - box[d][0]
    base_dims = box[:d]
    out: list[tuple[int, int]] = []
    for idx in _iter_index(base_dims):
        off = sum(i * s for i, s in zip(idx, strides, strict=False)) + box[d][0] * strides[d]
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((off, run))
    return out


def _iter_index(box: Box) -> Iterator[tuple[int, ...]]:
    if not box:
        yield ()
        return
    (lo, hi), rest = box[0], box[1:]
    for i in range(lo, hi):
        for tail in _iter_index(rest):
            yield (i,) + tail


@dataclass(frozen=True, slots=True)
class Piece:
    """``array_box`` of a C-order array of ``array_shape`` that starts ``base`` elements into a
    shard's flat data holds ``logical_box`` of the logical tensor (same shape as ``array_box``).

    A plain sub-block has ``base=0`` and ``array_shape`` equal to the shard's shape; a piece of
    a flattened fragment has ``array_shape`` equal to the shape of its logical box.
    """

    base: int
    array_shape: tuple[int, ...]
    array_box: Box
    logical_box: Box

    def __post_init__(self) -> None:
        assert box_shape(self.array_box) == box_shape(self.logical_box), self

    def restrict(self, logical: Box) -> Piece | None:
        """The part of this piece that holds ``logical`` (a box of the logical tensor)."""
        inter = intersect(self.logical_box, logical)
        if inter is None:
            return None
        array_box = tuple(
            (alo + lo - llo, alo + hi - llo)
            for (alo, _), (llo, _), (lo, hi) in zip(
                self.array_box, self.logical_box, inter, strict=True
            )
        )
        return Piece(
            base=self.base, array_shape=self.array_shape, array_box=array_box, logical_box=inter
        )

    def runs(self) -> list[tuple[int, int]]:
        """Element runs ``(flat_start, length)`` of this piece within the shard's flat data."""
        return [(self.base + off, n) for off, n in box_runs(self.array_shape, self.array_box)]
