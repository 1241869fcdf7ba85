"""Units of a transfer: the stretches that are contiguous both in the file and in the destination.

A transfer copies one box between two C-order arrays (a stored shard's, a target's). Walking
the box in C order, both sides are contiguous over the innermost dims that each array covers in
full; a *unit* spans the innermost dims over which *both* are, so a transfer is ``count`` units
of ``length`` elements, unit ``k`` at box position ``k * length``. Offsets are computed with numpy:
no Python object per row.
"""

from __future__ import annotations

import math

import numpy as np

from anyshard.geometry.boxes import Piece, box_shape

__all__ = ["contiguous_from", "piece_offsets", "unit_length_dim"]


def contiguous_from(p: Piece) -> int:
    """The first dim from which ``p.array_box`` is contiguous in ``p.array_shape``: every later
    dim is covered in full."""
    d = len(p.array_shape) - 1
    while d > 0 and p.array_box[d] == (0, p.array_shape[d]):
        d -= 1
    return max(d, 0)


def unit_length_dim(*pieces: Piece) -> int:
    """The dim where units start for a box shared by ``pieces`` (the latest of their
    contiguity dims)."""
    return max(contiguous_from(p) for p in pieces)


def piece_offsets(p: Piece, u: int) -> np.ndarray:
    """Element offsets (in the shard's flat data) of every unit of ``p`` whose units start at dim
    ``u``, in C order of the box."""
    shape = p.array_shape
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    const = p.base + sum(lo * s for (lo, _), s in zip(p.array_box[u:], strides[u:], strict=True))
    offsets = np.array([const], dtype=np.int64)
    ext = box_shape(p.array_box)
    for d in range(u):
        if ext[d] == 1:
            offsets = offsets + p.array_box[d][0] * strides[d]
            continue
        steps = np.arange(p.array_box[d][0], p.array_box[d][1], dtype=np.int64) * strides[d]
        offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
    return offsets
