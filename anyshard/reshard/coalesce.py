"""Coalescing: the byte runs that a plan's transfers read, merged into requests.

Runs of one file that follow one another, or lie close inside one stored shard, become one
request (the gaps read through and dropped), within limits on a request's bytes and spans; each
request carries the parts of checksum blocks it reads (`ShardCheck`), numbered by `ShardIds`.
Pure, as the planner is: no I/O.
"""

from __future__ import annotations

import math

import numpy as np

from anyshard.errors import CorruptCheckpointError
from anyshard.geometry.boxes import box_shape
from anyshard.geometry.runs import contiguous_from, piece_offsets, unit_length_dim
from anyshard.reshard.read_plan import (
    GAP,
    STAGING,
    TARGET,
    ReadPlan,
    Request,
    ShardCheck,
    Transfer,
)

__all__ = ["ShardIds", "coalesce", "transfer_units"]


class ShardIds:
    """Numbers checksum blocks in the order requests first read them, listing them in the plan
    as ``(rank, stored key, start, stop, crc32c)``."""

    def __init__(self, plan: ReadPlan, shard_info, verify: bool):
        self._plan, self._info = plan, shard_info
        self._ids: dict[tuple[int, str], dict[int, int]] = {}  # stored shard -> block -> id
        self.verify = verify

    def ids(self, key: tuple[int, str], k0: int, k1: int) -> list[int]:
        """The ids of blocks ``k0 .. k1 - 1`` of stored shard ``key``."""
        known = self._ids.get(key)
        if known is None:
            known = self._ids[key] = {}
        out = [known.get(k) for k in range(k0, k1)]
        if None in out:
            info, shards = self._info[key], self._plan.shards
            for j, n in enumerate(out):
                if n is None:
                    k = k0 + j
                    a = info.start + k * info.block_bytes
                    b = min(a + info.block_bytes, info.stop)
                    n = out[j] = known[k] = len(shards)
                    shards.append((key[0], key[1], a, b, info.block_crcs[k]))
        return out


def transfer_units(i: int, t: Transfer, direct: bool, shard_info, max_part: int):
    """``(file offsets, destination offsets, unit bytes)`` of transfer ``i``."""
    info = shard_info[(t.rank, t.fqn)]
    if direct:
        u = unit_length_dim(t.src, t.dst)
        dst = piece_offsets(t.dst, u) * info.itemsize
    else:
        u = contiguous_from(t.src)
    src = piece_offsets(t.src, u)
    length = math.prod(box_shape(t.src.array_box)[u:]) * info.itemsize
    src = info.start + src * info.itemsize
    if src.size and int(src.max()) + length > info.stop:
        raise CorruptCheckpointError(
            f"{t.fqn}: stored shard in rank {t.rank}'s file is shorter than its mapping says"
        )
    if not direct:
        dst = np.arange(src.size, dtype=np.int64) * length
    if length > max_part:  # cut huge runs so that several threads can read one shard
        cuts = np.arange(0, length, max_part, dtype=np.int64)
        src = (src[:, None] + cuts[None, :]).reshape(-1)
        dst = (dst[:, None] + cuts[None, :]).reshape(-1)
        sizes = np.minimum(max_part, length - cuts)
        sizes = np.tile(sizes, src.size // sizes.size)
    else:
        sizes = np.full(src.size, length, dtype=np.int64)
    return i, src, dst, sizes


def coalesce(units, transfers, direct, shard_info, shard_ids, limits) -> list[Request]:
    max_part, max_gap, slack, max_request, max_spans = limits
    if not units:
        return []
    ids = np.concatenate([np.full(src.size, i, dtype=np.int64) for i, src, _, _ in units])
    src = np.concatenate([u[1] for u in units])
    dst = np.concatenate([u[2] for u in units])
    size = np.concatenate([u[3] for u in units])
    ranks = np.array([transfers[i].rank for i in range(len(transfers))], dtype=np.int64)
    keys = {(t.rank, t.fqn) for t in transfers}
    key_index = {k: n for n, k in enumerate(sorted(keys))}
    shard_of = np.array([key_index[(t.rank, t.fqn)] for t in transfers], dtype=np.int64)
    order = np.lexsort((src, ranks[ids]))
    ids, src, dst, size = ids[order], src[order], dst[order], size[order]
    rank_col, shard_col = ranks[ids], shard_of[ids]
    gap = np.empty_like(src)
    gap[0] = -1
    gap[1:] = src[1:] - (src[:-1] + size[:-1])
    # A unit continues the request before it when it follows in the same file, with no gap or a
    # small one inside the same stored shard.
    joins = (gap == 0) | (
        (gap > 0)
        & (gap <= np.minimum(max_gap, slack * np.roll(size, 1)))
        & (shard_col == np.roll(shard_col, 1))
    )
    joins &= rank_col == np.roll(rank_col, 1)
    joins[0] = False
    starts = _group_starts(joins, src, size, gap, max_request, max_spans)
    gapless, staged, uniform = _group_kinds(starts, ids, dst, size, gap, transfers, direct)
    return _requests(
        starts,
        gapless,
        staged,
        uniform,
        ids.tolist(),
        src.tolist(),
        dst.tolist(),
        size.tolist(),
        gap.tolist(),
        transfers,
        direct,
        shard_info,
        shard_ids,
    )


def _group_starts(joins, src, size, gap, max_request: int, max_spans: int) -> list[int]:
    """Indices of the units that start a request: where a unit does not join the one before,
    and wherever a run of joined units outgrows ``max_request`` bytes or ``max_spans`` spans."""
    starts = np.flatnonzero(~joins)
    last = np.append(starts[1:], len(src)) - 1
    spans_before = np.cumsum(1 + ((gap > 0) & joins))
    too_long = ((src[last] + size[last] - src[starts]) > max_request) | (
        spans_before[last] - spans_before[starts] >= max_spans
    )
    if not too_long.any():
        return starts.tolist()
    out: list[int] = []
    long_groups = set(np.flatnonzero(too_long).tolist())
    for g, (a, z) in enumerate(zip(starts.tolist(), last.tolist(), strict=True)):
        out.append(a)
        if g not in long_groups:
            continue
        first, count = a, 1
        for k in range(a + 1, z + 1):  # a long run: cut it where the limits say
            count += 2 if gap[k] > 0 else 1
            if src[k] + size[k] - src[first] > max_request or count > max_spans:
                out.append(k)
                first, count = k, 1
    return out


def _group_kinds(starts, ids, dst, size, gap, transfers, direct) -> tuple[list, list, list]:
    """For each group of units (``starts``): whether no gap lies between its units, whether it
    stages any unit, and whether its units are equal rows into one target at a fixed stride,
    with no gap between them (`Request.rows`)."""
    first = np.asarray(starts, dtype=np.int64)
    inner_gap = gap != 0
    inner_gap[first] = False  # a gap before a group's first unit is not inside it
    gapless = ~np.logical_or.reduceat(inner_gap, first)
    direct_of = np.asarray(direct, dtype=bool)[ids]
    staged = np.logical_or.reduceat(~direct_of, first)
    target_of = np.array([t.target for t in transfers], dtype=np.int64)[ids]
    step = np.zeros_like(dst)
    step[1:] = dst[1:] - dst[:-1]
    # unit k breaks its group's rows if it differs from unit k - 1 (k not a group's first)
    breaks = np.zeros(len(ids), dtype=bool)
    breaks[1:] = (
        inner_gap[1:]
        | (size[1:] != size[:-1])
        | (target_of[1:] != target_of[:-1])
        | ~direct_of[1:]
        | ~direct_of[:-1]
        | (step[1:] < size[1:])
    )
    breaks[first] = ~direct_of[first]
    # ... or if its stride differs from the one before (k not a group's first two)
    strides = np.zeros(len(ids), dtype=bool)
    strides[1:] = step[1:] != step[:-1]
    strides[first] = False
    second = first + 1
    strides[second[second < len(ids)]] = False
    uniform = ~np.logical_or.reduceat(breaks | strides, first)
    return gapless.tolist(), staged.tolist(), uniform.tolist()


def _requests(
    starts,
    gapless,
    staged,
    uniform,
    ids,
    src,
    dst,
    size,
    gap,
    transfers,
    direct,
    shard_info,
    shard_ids,
) -> list[Request]:
    """The requests of the units grouped by ``starts`` (``gapless``, ``staged`` and
    ``uniform``: `_group_kinds`)."""
    kinds = [TARGET if d else STAGING for d in direct]
    unit_kinds = [kinds[i] for i in ids]
    out: list[Request] = []
    repeats = _Repeats(transfers, kinds, out)
    bounds = starts + [len(ids)]
    for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        i = ids[a]
        if b - a == 1 and not shard_ids.verify:
            repeats.add(i, size[a], src[a], dst[a])
            continue
        repeats.flush()
        if gapless[g]:  # the units are the spans
            spans = tuple(zip(unit_kinds[a:b], ids[a:b], dst[a:b], size[a:b], strict=True))
        else:
            spans = _gapped_spans(unit_kinds, ids, dst, size, gap, a, b)
        start, end = src[a], src[b - 1] + size[b - 1]
        rows = None
        if uniform[g] and b - a > 1:
            rows = (transfers[i].target, dst[a], dst[a + 1] - dst[a], size[a])
        checks = _checks(transfers, ids[a:b], start, end, shard_info, shard_ids)
        out.append(
            Request(transfers[i].rank, start, end - start, spans, checks, None, rows, staged[g])
        )
    repeats.flush()
    return out


def _gapped_spans(unit_kinds, ids, dst, size, gap, a: int, b: int) -> tuple:
    """The spans of units ``a .. b - 1``, the gaps between them read through and dropped."""
    spans = []
    for k in range(a, b):
        if k > a and gap[k]:
            spans.append((GAP, -1, 0, gap[k]))
        spans.append((unit_kinds[k], ids[k], dst[k], size[k]))
    return tuple(spans)


class _Repeats:
    """Reads of one unit that carry no checks, merged while they follow one another at a fixed
    stride in the file and in the destination: one request that repeats (`Request.repeat`)."""

    def __init__(self, transfers, kinds, out: list[Request]) -> None:
        self._transfers, self._kinds, self._out = transfers, kinds, out
        self._run: list = []  # [transfer, size, src, dst, count, src stride, dst stride]

    def add(self, i: int, n: int, src: int, dst: int) -> None:
        """A read of ``n`` bytes at ``src`` of the file into ``dst`` of transfer ``i``."""
        run = self._run
        if run and run[0] == i and run[1] == n:
            ds, dd = src - run[2] - run[4] * run[5], dst - run[3] - run[4] * run[6]
            if run[4] == 1 and ds > 0:
                run[5], run[6], run[4] = ds, dd, 2
                return
            if ds == 0 and dd == 0:
                run[4] += 1
                return
        self.flush()
        run[:] = [i, n, src, dst, 1, 0, 0]

    def flush(self) -> None:
        """The pending run of reads, as one request."""
        if self._run:
            i, n, s0, d0, count, ds, dd = self._run
            repeat = (count, ds, dd) if count > 1 else None
            kind = self._kinds[i]
            self._out.append(
                Request(
                    self._transfers[i].rank,
                    s0,
                    n,
                    ((kind, i, d0, n),),
                    (),
                    repeat,
                    None,
                    kind == STAGING,
                )
            )
            self._run.clear()


def _checks(transfers, unit_ids, start, end, shard_info, shard_ids) -> tuple[ShardCheck, ...]:
    """The parts of checksum blocks that a request (reading the units of transfers
    ``unit_ids``) reads, in file order, to verify them."""
    if not shard_ids.verify:
        return ()
    checks = []
    keys = dict.fromkeys((transfers[i].rank, transfers[i].fqn) for i in dict.fromkeys(unit_ids))
    for key in keys:
        info = shard_info[key]
        a, b = max(start, info.start), min(end, info.stop)
        if a >= b:
            continue
        block, base = info.block_bytes, info.start
        k0, k1 = (a - base) // block, (b - 1 - base) // block + 1
        at = base + k0 * block - start  # where block k0 begins, relative to the request
        for n in shard_ids.ids(key, k0, k1):
            checks.append(ShardCheck(n, max(at, a - start), min(at + block, b - start)))
            at += block
    if len(keys) > 1:
        checks.sort(key=lambda c: c.start)
    return tuple(checks)
