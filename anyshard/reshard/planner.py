"""Read planning: from what a target needs and what is stored, to coalesced byte-range reads.

Pure: shapes, mappings and file headers in; plans out. No I/O, no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping as MappingType, Sequence
from dataclasses import dataclass, field

from anyshard.errors import CorruptCheckpointError
from anyshard.reshard.boxes import Piece, box_numel, box_shape, intersect
from anyshard.ucl.compile import enumerate_shards
from anyshard.ucl.mapping import Mapping

__all__ = [
    "ReadPlan",
    "Request",
    "Segment",
    "ShardCheck",
    "StoredShardInfo",
    "Transfer",
    "match_shards",
    "plan_reads",
]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``src`` (a piece of the stored shard of ``fqn`` in ``rank``'s file) to ``dst``
    (a piece of target tensor number ``target``); both hold the same logical box."""

    fqn: str
    target: int
    rank: int
    src: Piece
    dst: Piece

    @property
    def numel(self) -> int:
        return box_numel(self.src.array_box)


@dataclass(frozen=True, slots=True)
class StoredShardInfo:
    """A stored shard's bytes in its file, as the file's header gives them."""

    start: int
    stop: int
    itemsize: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous byte run of a transfer: file bytes ``[offset, offset + length)`` go to
    bytes ``[pos, pos + length)`` of the transfer's buffer (its C-order box)."""

    transfer: int
    offset: int
    length: int
    pos: int


@dataclass(frozen=True, slots=True)
class ShardCheck:
    """Bytes ``[start, stop)`` of a request are part ``part`` of stored shard ``shard``."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Request:
    """One read of ``length`` bytes at ``offset`` of ``rank``'s file."""

    rank: int
    offset: int
    length: int
    segments: tuple[Segment, ...]
    checks: tuple[ShardCheck, ...] = ()


@dataclass(slots=True)
class ReadPlan:
    transfers: list[Transfer]
    direct: list[bool]  # transfer i reads straight into the target's memory
    batches: list[list[Request]]  # executed one after another; bounded staging memory each
    shards: list[tuple[int, str, int, int, int]] = field(default_factory=list)  # rank, fqn, start, stop, crc

    @property
    def requests(self) -> list[Request]:
        return [r for b in self.batches for r in b]

    @property
    def bytes_read(self) -> int:
        return sum(r.length for r in self.requests)

    @property
    def bytes_needed(self) -> int:
        return sum(s.length for r in self.requests for s in r.segments)


def match_shards(
    fqn: str,
    target: int,
    target_pieces: Sequence[Piece],
    mapping: Mapping,
    shape: Sequence[int],
    sizes: MappingType[str, int],
    rank_of: Callable[[MappingType[str, int]], int],
    shard_shapes: dict[tuple[int, str], tuple[int, ...]] | None = None,
) -> list[Transfer]:
    """Transfers that fill ``target_pieces`` from the stored shards described by ``mapping``.

    Raises `CorruptCheckpointError` when the stored shards do not cover the target exactly once.
    ``shard_shapes``, when given, receives the shape of every stored shard used, by (rank, fqn).
    """
    out: list[Transfer] = []
    for tp in target_pieces:
        if box_numel(tp.logical_box) == 0:
            continue
        got = 0
        for coords, shard in enumerate_shards(mapping, shape, sizes, needed=tp.logical_box):
            rank = rank_of(coords)
            if shard_shapes is not None:
                shard_shapes[(rank, fqn)] = shard.shape
            for sp in shard.pieces:
                x = intersect(sp.logical_box, tp.logical_box)
                if x is None:
                    continue
                out.append(Transfer(fqn, target, rank, sp.restrict(x), tp.restrict(x)))
                got += box_numel(x)
        need = box_numel(tp.logical_box)
        if got != need:
            raise CorruptCheckpointError(
                f"{fqn}: the stored shards hold {got} of the {need} elements of region "
                f"{list(tp.logical_box)}; the manifest's mapping {str(mapping)!r} does not cover the tensor exactly once"
            )
    return out


def _split_transfer(t: Transfer, max_numel: int) -> list[Transfer]:
    """Cut a transfer into parts of at most ``max_numel`` elements along its outermost dims."""
    shape = box_shape(t.src.logical_box)
    if math.prod(shape) <= max_numel:
        return [t]
    d = next(i for i, n in enumerate(shape) if n > 1)
    rows = max(1, max_numel // math.prod(shape[d + 1 :]))
    lo, hi = t.src.logical_box[d]
    out = []
    for start in range(lo, hi, rows):
        box = t.src.logical_box[:d] + ((start, min(start + rows, hi)),) + t.src.logical_box[d + 1 :]
        part = Transfer(t.fqn, t.target, t.rank, t.src.restrict(box), t.dst.restrict(box))
        out.extend(_split_transfer(part, max_numel))
    return out


def plan_reads(
    transfers: Sequence[Transfer],
    shard_info: MappingType[tuple[int, str], StoredShardInfo],
    direct_ok: Sequence[bool],
    *,
    max_staging: int = 32 * MiB,
    batch_bytes: int = 256 * MiB,
    max_part: int = 64 * MiB,
    max_gap: int = 1 * MiB,
    slack: float = 0.05,
    max_request: int = 16 * MiB,
) -> ReadPlan:
    """Coalesced reads for ``transfers``.

    ``direct_ok[target]`` says a target tensor is contiguous host memory of the stored dtype, so
    a transfer whose source and destination are both one contiguous run reads straight into
    it. Other transfers go through a staging buffer of at most ``max_staging`` bytes, and a
    batch holds at most ``batch_bytes`` of staging. Neighbouring runs of one file are read
    together when the gap between them is at most ``slack`` times the run before it (and at
    most ``max_gap``): at most ``slack`` more bytes read than needed.
    """
    final: list[Transfer] = []
    direct: list[bool] = []
    for t in transfers:
        info = shard_info[(t.rank, t.fqn)]
        one_run = len(t.src.runs()) == 1 and len(t.dst.runs()) == 1
        if direct_ok[t.target] and one_run:
            final.append(t)
            direct.append(True)
        else:
            parts = _split_transfer(t, max(1, max_staging // info.itemsize))
            final.extend(parts)
            direct.extend([False] * len(parts))
    batches: list[list[int]] = [[]]
    staged = 0
    for i, t in enumerate(final):
        nbytes = 0 if direct[i] else t.numel * shard_info[(t.rank, t.fqn)].itemsize
        if batches[-1] and staged + nbytes > batch_bytes:
            batches.append([])
            staged = 0
        batches[-1].append(i)
        staged += nbytes
    shard_ids: dict[tuple[int, str], int] = {}
    plan = ReadPlan(transfers=final, direct=direct, batches=[])
    for batch in batches:
        segments = [s for i in batch for s in _segments(i, final[i], shard_info, max_part)]
        plan.batches.append(_coalesce(segments, final, shard_info, shard_ids, plan, max_gap, slack, max_request))
    return plan


def _segments(i: int, t: Transfer, shard_info, max_part: int) -> list[Segment]:
    info = shard_info[(t.rank, t.fqn)]
    out, pos = [], 0
    for start, n in t.src.runs():
        offset, length = info.start + start * info.itemsize, n * info.itemsize
        if offset + length > info.stop:
            raise CorruptCheckpointError(f"{t.fqn}: stored shard in rank {t.rank}'s file is shorter than its mapping says")
        for cut in range(0, length, max_part):
            part = min(max_part, length - cut)
            out.append(Segment(i, offset + cut, part, pos + cut))
        pos += length
    return out


def _coalesce(segments, transfers, shard_info, shard_ids, plan, max_gap, slack, max_request) -> list[Request]:
    segments.sort(key=lambda s: (transfers[s.transfer].rank, s.offset))
    groups: list[list[Segment]] = []
    for s in segments:
        if groups:
            prev = groups[-1]
            last = prev[-1]
            same_file = transfers[last.transfer].rank == transfers[s.transfer].rank
            gap = s.offset - (last.offset + last.length)
            span = s.offset + s.length - prev[0].offset
            if (
                same_file
                and 0 <= gap <= min(max_gap, slack * last.length)
                and span <= max_request
                and _in_shards(last.offset + last.length, s.offset, (last, s), transfers, shard_info)
            ):
                prev.append(s)
                continue
        groups.append([s])
    requests = []
    for g in groups:
        rank = transfers[g[0].transfer].rank
        start, stop = g[0].offset, g[-1].offset + g[-1].length
        requests.append(Request(rank, start, stop - start, tuple(g), _checks(g, transfers, shard_info, shard_ids, plan)))
    return requests


def _in_shards(lo: int, hi: int, segments, transfers, shard_info) -> bool:
    """Whether file bytes ``[lo, hi)`` (a gap read through) lie in the segments' stored shards.

    Other bytes of the file (another tensor's shard, padding, the header) are never read.
    """
    infos = (shard_info[(transfers[s.transfer].rank, transfers[s.transfer].fqn)] for s in segments)
    for start, stop in sorted((i.start, i.stop) for i in infos):
        if start <= lo < stop:
            lo = stop
    return lo >= hi


def _checks(group, transfers, shard_info, shard_ids, plan) -> tuple[ShardCheck, ...]:
    """The parts of stored shards a request reads, to verify shards that get read in full."""
    start, stop = group[0].offset, group[-1].offset + group[-1].length
    out = []
    for key in dict.fromkeys((transfers[s.transfer].rank, transfers[s.transfer].fqn) for s in group):
        info = shard_info[key]
        a, b = max(start, info.start), min(stop, info.stop)
        if a >= b:
            continue
        if key not in shard_ids:
            shard_ids[key] = len(plan.shards)
            plan.shards.append((key[0], key[1], info.start, info.stop, info.crc32c))
        out.append(ShardCheck(shard_ids[key], a - start, b - start))
    return tuple(out)
