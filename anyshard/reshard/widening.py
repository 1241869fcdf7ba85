"""Reads widened so that every byte read is covered by a checksum the executor checks.

A transfer that needs part of a checksum block reads the whole blocks it touches (staged, the
needed piece a `Transfer.window` of them); one that needs some columns of a shard with checksum
tiles reads only the rows of the tiles it touches, each tile checked (`Transfer.tiles`). A shard
of 3 or more dims is tiled as the 2-d array of its rows (every dim but the last flattened): a
transfer of it is cut into parts whose rows are consecutive there, each read as a 2-d one.
Pure, as the planner is: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from anyshard.errors import CorruptCheckpointError
from anyshard.geometry.boxes import Piece, box_numel, box_shape
from anyshard.geometry.runs import piece_offsets, unit_length_dim
from anyshard.reshard.read_plan import STAGING, TARGET, Request, StoredShardInfo, Transfer

__all__ = [
    "fully_read",
    "tile_rows",
    "tiled_parts",
    "tiled_shards",
    "whole_blocks",
    "widened_budget",
    "widened_to_blocks",
    "widened_to_tiles",
]


def _flat_range(p: Piece) -> tuple[int, int]:
    """Elements ``[first, last + 1)`` of the shard's flat data that piece ``p`` spans."""
    strides = [1] * len(p.array_shape)
    for d in range(len(p.array_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * p.array_shape[d + 1]
    if box_numel(p.array_box) == 0:
        return p.base, p.base
    first = sum(lo * s for (lo, _), s in zip(p.array_box, strides, strict=True))
    last = sum((hi - 1) * s for (_, hi), s in zip(p.array_box, strides, strict=True))
    return p.base + first, p.base + last + 1


def _contiguous(p: Piece) -> bool:
    """Whether ``p``'s box is one run of the flat data: the dims after the first partial one
    (counting from the innermost) are whole, and those before it have extent one."""
    shape, box = p.array_shape, p.array_box
    partial = [d for d, ((lo, hi), n) in enumerate(zip(box, shape, strict=True)) if hi - lo != n]
    if not partial:
        return True
    last = partial[-1]
    return all(hi - lo <= 1 for lo, hi in box[:last])


def whole_blocks(p: Piece, info: StoredShardInfo) -> bool:
    """Whether piece ``p`` of a stored shard is whole checksum blocks, read as they are."""
    if not _contiguous(p):
        return False
    a, b = _flat_range(p)
    start, stop = a * info.itemsize, b * info.itemsize
    size = info.stop - info.start
    return start % info.block_bytes == 0 and (stop % info.block_bytes == 0 or stop == size)


# a transfer of a shard of 3 or more dims is read by tiles only where it cuts into at most this
# many parts (`_row_runs`); past it, by whole blocks
MAX_ROW_RUNS = 4096


def _rows_of(shape: Sequence[int], box) -> tuple[int, int] | None:
    """Rows ``[f0, f1)`` of the 2-d array of rows of ``shape`` (every dim but the last
    flattened) that ``box`` covers, when they are consecutive there; else None."""
    lead, ext = shape[:-1], [hi - lo for lo, hi in box[:-1]]
    partial = [d for d, n in enumerate(lead) if ext[d] != n]
    if 0 in ext or (partial and any(e > 1 for e in ext[: partial[-1]])):
        return None
    first, last = _row_span(shape, box)
    return first, last


def _row_span(shape: Sequence[int], box) -> tuple[int, int]:
    """Rows ``[first, last + 1)`` of the 2-d array of rows of ``shape`` from the first row
    ``box`` touches to its last (``box`` not empty)."""
    first = last = 0
    stride = 1
    for d in range(len(shape) - 2, -1, -1):
        first += box[d][0] * stride
        last += (box[d][1] - 1) * stride
        stride *= shape[d]
    return first, last + 1


def _outer_dim(box) -> int:
    """The first dim but the last where ``box`` has an extent over one (0 when none has)."""
    return next((d for d, (lo, hi) in enumerate(box[:-1]) if hi - lo > 1), 0)


def _cuts_along(shape: Sequence[int], box, band: int) -> bool:
    """Whether a box of rows not consecutive is cut along `_outer_dim`, one index a part: where
    an index of it spans whole bands, so that the parts read no band twice; else it is read as
    one span of the bands from its first row to its last (its runs of rows under a band apart,
    so that no band in between goes unused)."""
    return _rows_of(shape, box) is None and math.prod(shape[_outer_dim(box) + 1 : -1]) % band == 0


def _runs_needed(shape: Sequence[int], box, band: int) -> int:
    """The parts `_row_runs` cuts a transfer of ``box`` into."""
    if not _cuts_along(shape, box, band):
        return 1
    d = _outer_dim(box)
    one = tuple((x[0], x[0] + 1) if k == d else x for k, x in enumerate(box))
    return (box[d][1] - box[d][0]) * _runs_needed(shape, one, band)


def _row_runs(t: Transfer, band: int) -> list[Transfer]:
    """``t`` cut along its outer dims (`_cuts_along`) into parts that each read a span of whole
    bands of the stored shard's 2-d array of rows, no band read by two parts."""
    shape, box = t.src.array_shape, t.src.array_box
    if not _cuts_along(shape, box, band):
        return [t]
    d = _outer_dim(box)
    shift = t.src.logical_box[d][0] - box[d][0]
    out = []
    for i in range(*box[d]):
        cut = tuple(
            (i + shift, i + shift + 1) if k == d else lb for k, lb in enumerate(t.src.logical_box)
        )
        src, dst = t.src.restrict(cut), t.dst.restrict(cut)
        assert src is not None and dst is not None
        out += _row_runs(Transfer(t.fqn, t.target, t.rank, src, dst), band)
    return out


def _band(t: Transfer, info: StoredShardInfo) -> int:
    """Rows of the 2-d array of rows of ``t``'s stored shard in a checksum block."""
    return info.block_bytes // (t.src.array_shape[-1] * info.itemsize)


def _tile_span(t: Transfer, info: StoredShardInfo) -> tuple[int, int, int, int, int, int]:
    """The whole tiles that ``t`` (a box of a stored shard, its rows those of the 2-d array of
    rows, every dim but the last flattened) touches: rows ``[r0, r1)`` in whole checksum
    blocks, from its first row to its last, columns ``[c0, c1)`` in whole column blocks; and
    the rows of a block and the columns of a column block."""
    shape = t.src.array_shape
    rows_total, cols = math.prod(shape[:-1]), shape[-1]
    band = _band(t, info)
    width = cols // info.tiles
    (lo, hi), (clo, chi) = _row_span(shape, t.src.array_box), t.src.array_box[-1]
    r0, r1 = lo // band * band, min(rows_total, -(-hi // band) * band)
    c0, c1 = clo // width * width, -(-chi // width) * width
    return r0, r1, c0, c1, band, width


def tiled_shards(
    transfers: Sequence[Transfer], shard_info, fully, skip: int
) -> set[tuple[int, str]]:
    """Stored shards to read by tiles: tiled, not read whole, and read only by boxes whose
    tiles leave out some columns, at least ``skip`` bytes, of each row (of a shard of 3 or more
    dims, by boxes that cut into at most `MAX_ROW_RUNS` runs of consecutive rows)."""
    by_key: dict[tuple[int, str], list[Transfer]] = {}
    for t in transfers:
        by_key.setdefault((t.rank, t.fqn), []).append(t)
    out = set()
    for key, ts in by_key.items():
        info = shard_info[key]
        if key in fully or info.tiles < 2 or len(info.tile_crcs) == 0:
            continue
        if any(
            t.src.base != 0
            or len(t.src.array_shape) < 2
            or _runs_needed(t.src.array_shape, t.src.array_box, _band(t, info)) > MAX_ROW_RUNS
            for t in ts
        ):
            continue
        cols = ts[0].src.array_shape[-1]
        width = cols // info.tiles
        took = max(
            -(-chi // width) * width - clo // width * width
            for clo, chi in (t.src.array_box[-1] for t in ts)
        )
        if took < cols and (cols - took) * info.itemsize >= skip:
            out.add(key)
    return out


def tile_rows(i: int, t: Transfer, shard_info) -> Request:
    """The read of tiled transfer ``i``: its rows, one read each, into its staging buffer (or,
    without a window, straight into its target)."""
    info = shard_info[(t.rank, t.fqn)]
    (r0, r1), (c0, c1) = t.src.array_box
    row = t.src.array_shape[1] * info.itemsize
    n = (c1 - c0) * info.itemsize
    offset = info.start + r0 * row + c0 * info.itemsize
    if offset + (r1 - r0 - 1) * row + n > info.stop:
        raise CorruptCheckpointError(
            f"{t.fqn}: stored shard in rank {t.rank}'s file is shorter than its mapping says"
        )
    if t.window is None:
        into = _target_rows(t, info.itemsize)
        assert into is not None  # `widened_to_tiles` checked it
        first, stride = into
        return Request(t.rank, offset, n, ((TARGET, i, first, n),), (), (r1 - r0, row, stride))
    return Request(t.rank, offset, n, ((STAGING, i, 0, n),), (), (r1 - r0, row, n), None, True)


def tiled_parts(t: Transfer, info: StoredShardInfo, max_staging: int) -> list[Transfer]:
    """``t`` cut along its rows so that each part, widened to whole tiles, stages about
    ``max_staging`` bytes; the cuts fall on band edges, so that no tile is read twice. A
    transfer of a shard of 3 or more dims is first cut where its outer dims span whole bands
    (`_row_runs`), each part then cut along its outer dim where a band begins."""
    out = []
    for run in _row_runs(t, _band(t, info)):
        out += _band_parts(run, info, max_staging)
    return out


def _band_parts(t: Transfer, info: StoredShardInfo, max_staging: int) -> list[Transfer]:
    """`tiled_parts` of a part of `_row_runs`: cut along its outer dim (`_outer_dim`; dim 0 of
    a 2-d shard) at indices whose first row begins a band."""
    r0, r1, c0, c1, band, _ = _tile_span(t, info)
    step = max(1, max_staging // max((c1 - c0) * info.itemsize * band, 1)) * band
    shape, box = t.src.array_shape, t.src.array_box
    d = _outer_dim(box)
    inner = math.prod(shape[d + 1 : -1])  # rows an index of dim d spans
    first = _row_span(shape, box)[0] - box[d][0] * inner  # the first row under index 0
    period = math.lcm(inner, band) // inner  # indices from one that begins a band to the next
    i0 = next((i for i in range(period) if (first + i * inner) % band == 0), None)
    lo, hi = box[d]
    if i0 is None:
        return [t]
    q = max(1, step // (period * inner)) * period
    cuts = [lo, *range(i0 + ((lo - i0) // q + 1) * q, hi, q), hi]
    shift = t.src.logical_box[d][0] - lo  # logical index of array index 0 along dim d
    out = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        cut = tuple(
            (a + shift, b + shift) if k == d else lb for k, lb in enumerate(t.src.logical_box)
        )
        out.append(Transfer(t.fqn, t.target, t.rank, t.src.restrict(cut), t.dst.restrict(cut)))
    return out


def widened_to_tiles(t: Transfer, info: StoredShardInfo, direct: bool) -> Transfer:
    """``t`` reading the whole tiles its source touches (staged, their rows in C order), the
    needed piece taken from them (`Transfer.window`), each tile checked (`Transfer.tiles`); or,
    where it needs whole tiles and may read into its target (``direct``) in rows at a fixed
    stride, straight into the target (no window), its tiles checked there."""
    r0, r1, c0, c1, band, width = _tile_span(t, info)
    shape = t.src.array_shape
    rows_total, cols = math.prod(shape[:-1]), shape[-1]
    box = ((r0, r1), (c0, c1))
    src = Piece(base=0, array_shape=(rows_total, cols), array_box=box, logical_box=box)
    (lo, hi), (clo, chi) = _row_span(shape, t.src.array_box), t.src.array_box[-1]
    if len(shape) == 2:
        window = Piece(
            base=0,
            array_shape=(r1 - r0, c1 - c0),
            array_box=((lo - r0, hi - r0), (clo - c0, chi - c0)),
            logical_box=t.src.logical_box,
        )
    else:  # the needed box in the staged rows: the stored shard's dims, its rows from r0 on
        window = Piece(
            base=-r0 * (c1 - c0),  # where row 0 would be; the box's first row is at or after r0
            array_shape=(*shape[:-1], c1 - c0),
            array_box=(*t.src.array_box[:-1], (clo - c0, chi - c0)),
            logical_box=t.src.logical_box,
        )
    per_band = info.tiles
    crcs = tuple(
        info.tile_crcs[(r // band) * per_band + c // width]
        for r in range(r0, r1, band)
        for c in range(c0, c1, width)
    )
    checks = (band, width, crcs)
    rows = _rows_of(shape, t.src.array_box)
    flat = t if len(shape) == 2 else _as_rows(t, rows) if rows is not None else None
    if (
        direct
        and flat is not None
        and box == tuple(flat.src.array_box)
        and _target_rows(flat, info.itemsize) is not None
    ):
        return Transfer(t.fqn, t.target, t.rank, flat.src, flat.dst, None, checks)
    return Transfer(t.fqn, t.target, t.rank, src, t.dst, window, checks)


def _as_rows(t: Transfer, rows: tuple[int, int]) -> Transfer | None:
    """``t`` (of a shard of 3 or more dims, its rows ``rows`` of the stored shard's 2-d array
    of rows) as a transfer between the 2-d arrays of rows of the stored shard and of its target
    (a logical box made up to match: rows ``rows``), when its target's rows are consecutive
    too; else None."""
    d = t.dst
    got = _rows_of(d.array_shape, d.array_box)
    if got is None or len(d.array_shape) < 2:
        return None
    lc = t.src.logical_box[-1]
    logical = (rows, lc)
    cols = t.src.array_shape[-1]
    src = Piece(0, (math.prod(t.src.array_shape[:-1]), cols), (rows, t.src.array_box[-1]), logical)
    dst = Piece(
        d.base,
        (math.prod(d.array_shape[:-1]), d.array_shape[-1]),
        (got, d.array_box[-1]),
        logical,
    )
    return Transfer(t.fqn, t.target, t.rank, src, dst)


def _target_rows(t: Transfer, itemsize: int) -> tuple[int, int] | None:
    """Where the rows of ``t`` (a box of a 2-d stored shard) go in its target, when they go to
    one byte offset after another at a fixed stride: ``(first, stride)``; else None."""
    n = box_shape(t.src.array_box)
    if len(n) != 2 or unit_length_dim(t.src, t.dst) != 1 or n[0] == 0:
        return None
    at = piece_offsets(t.dst, 1) * itemsize
    if at.size != n[0]:
        return None
    stride = int(at[1] - at[0]) if at.size > 1 else n[1] * itemsize
    if at.size > 1 and (stride < n[1] * itemsize or not bool((np.diff(at) == stride).all())):
        return None
    return int(at[0]), stride


def widened_budget(t: Transfer, info: StoredShardInfo, max_staging: int) -> int:
    """Elements of ``t`` per part, so that each part, widened to whole rows and blocks, stages
    about ``max_staging`` bytes (a shard that is one block, as in version-1 files, is staged
    whole: cutting it would read it once per part)."""
    if info.block_bytes >= info.stop - info.start:
        return max(1, t.numel)
    shape = box_shape(t.src.array_box)
    full_row = math.prod(t.src.array_shape[1:]) * info.itemsize if shape else info.itemsize
    needed_row = math.prod(shape[1:]) if shape else 1
    return max(1, max_staging // max(full_row, 1)) * max(needed_row, 1)


def widened_to_blocks(t: Transfer, info: StoredShardInfo) -> Transfer:
    """``t`` reading the whole checksum blocks its source touches (staged), the needed piece
    taken from them (`Transfer.window`)."""
    a, b = _flat_range(t.src)
    block, item = info.block_bytes, info.itemsize
    size = info.stop - info.start
    lo = (a * item) // block * block
    hi = min(size, -(-(b * item) // block) * block)
    first, n = lo // item, (hi - lo) // item
    run = ((0, n),)
    src = Piece(base=first, array_shape=(n,), array_box=run, logical_box=run)
    window = Piece(
        base=t.src.base - first,
        array_shape=t.src.array_shape,
        array_box=t.src.array_box,
        logical_box=t.src.logical_box,
    )
    return Transfer(t.fqn, t.target, t.rank, src, t.dst, window)


def fully_read(transfers: Sequence[Transfer], shard_info) -> set[tuple[int, str]]:
    """Stored shards whose every byte some transfer needs: their checksums can be verified."""
    needed: dict[tuple[int, str], int] = {}
    for t in transfers:
        key = (t.rank, t.fqn)
        needed[key] = needed.get(key, 0) + t.numel * shard_info[key].itemsize
    return {k for k, n in needed.items() if n == shard_info[k].stop - shard_info[k].start}
