"""Shards: a local tensor's shape and the pieces of the logical tensor it holds.

A shard is what a rank holds of one logical tensor; its pieces say which box of the shard's own
index space holds which box of the logical tensor. `chunk_bounds` is the split torch.chunk (and
so DTensor's ``Shard``) makes of one dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from anyshard.geometry.boxes import Piece

__all__ = ["Shard", "chunk_bounds"]


@dataclass(frozen=True, slots=True)
class Shard:
    """A shard of ``shape`` whose ``pieces`` hold regions of the logical tensor."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def chunk_bounds(extent: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``torch.chunk(extent, parts)`` (as DTensor's Shard).

    torch.chunk uses parts of ceil(extent / parts); trailing parts may be short or empty.
    """
    size = -(-extent // parts) if parts else 0
    start = min(index * size, extent)
    return start, min(start + size, extent)
