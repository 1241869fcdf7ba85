"""Read planning: from what a target needs and what is stored, to coalesced byte-range reads.

Pure: shapes, mappings and file headers in; plans out. No I/O, no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from anyshard.errors import CorruptCheckpointError
from anyshard.geometry.boxes import Box, Piece, box_numel, box_shape, intersect
from anyshard.geometry.runs import contiguous_from, piece_offsets, unit_length_dim
from anyshard.geometry.shards import Shard
from anyshard.ucl.lowering import enumerate_shards
from anyshard.ucl.mapping import Mapping

__all__ = [
    "ReadPlan",
    "Request",
    "GAP",
    "STAGING",
    "TARGET",
    "ShardCheck",
    "StoredShardInfo",
    "Transfer",
    "match_shards",
    "match_sources",
    "plan_reads",
]

MiB = 1 << 20
# A column slice of a local file reads its tiles row by row only where that skips at least a
# page of each row: a file is read from its device by pages, so skipping less saves no device
# read, while the read call a row costs about as much as copying and checksumming 2-4 KiB.
TILE_SKIP_LOCAL = 4 << 10


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``src`` (a piece of the stored tensor ``fqn`` in ``rank``'s file) to ``dst``
    (a piece of target tensor number ``target``); both hold the same logical box.

    ``fqn`` is the key the shard is stored under: the logical name, or under a spec the local
    name of the tensor that rank saved."""

    fqn: str
    target: int
    rank: int
    src: Piece
    dst: Piece
    # Set when the read was widened to whole checksum blocks: ``src`` is then the run of whole
    # blocks read (a flat piece), staged, and ``window`` the needed piece within that run. Or,
    # widened to whole tiles of a 2-d shard: ``src`` is the box of tiles read (staged in C
    # order) and ``tiles`` = ``(band, width, crcs)``: the box cut into tiles of ``band`` rows
    # (the last band possibly shorter) by ``width`` columns, the crc32c of each, row-major.
    window: Piece | None = None
    tiles: tuple[int, int, tuple[int, ...]] | None = None

    @property
    def numel(self) -> int:
        return box_numel(self.src.array_box)


@dataclass(frozen=True, slots=True)
class StoredShardInfo:
    """A stored shard's bytes in its file and the crc32c of each of its checksum blocks of
    ``block`` bytes (the last one possibly shorter), as the file's header gives them; without
    ``block``, the whole shard is one block whose crc32c is ``crc32c``."""

    start: int
    stop: int
    itemsize: int
    crc32c: int = 0
    block: int | None = None
    crcs: tuple[int, ...] | None = None
    # tiles: the last dim in ``tiles`` column blocks, the crc32c of each (block, column block)
    tiles: int = 1
    tile_crcs: tuple[int, ...] = ()

    @property
    def block_bytes(self) -> int:
        return self.block if self.block is not None else max(self.stop - self.start, 1)

    @property
    def block_crcs(self) -> tuple[int, ...]:
        return self.crcs if self.crcs is not None else (self.crc32c,)


class ShardCheck(NamedTuple):
    """Bytes ``[start, stop)`` of a request are part of stored shard number ``shard``."""

    shard: int
    start: int
    stop: int


GAP, TARGET, STAGING = 0, 1, 2


class Request(NamedTuple):
    """One read of ``length`` bytes at ``offset`` of ``rank``'s file.

    ``spans`` place the bytes, in file order, as ``(kind, transfer, offset, n)``: ``TARGET``
    straight into the memory of the transfer's target tensor at byte ``offset``; ``STAGING`` into
    the transfer's staging buffer (its box in C order) at byte ``offset``; ``GAP`` bytes read
    through and dropped (coalescing; ``transfer`` is -1).

    ``repeat = (count, file_stride, dest_stride)`` makes a request stand for ``count`` reads of a
    single span, the k-th at ``offset + k * file_stride`` into ``offset + k * dest_stride`` of the
    span's destination: the rows of a strided region, planned and run without an object each.

    ``rows = (target, first, stride, n)`` says what the planner found of the spans: they are
    all ``TARGET`` spans of ``n`` bytes into target tensor number ``target``, the k-th at byte
    ``first + k * stride`` (``stride >= n``), with no gap between them; ``staged`` says whether a
    span is ``STAGING``. The executor reads them instead of walking the spans.
    """

    rank: int
    offset: int
    length: int
    spans: tuple[tuple[int, int, int, int], ...]
    checks: tuple[ShardCheck, ...] = ()
    repeat: tuple[int, int, int] | None = None
    rows: tuple[int, int, int, int] | None = None
    staged: bool = True

    @property
    def count(self) -> int:
        return 1 if self.repeat is None else self.repeat[0]


@dataclass(slots=True)
class ReadPlan:
    transfers: list[Transfer]
    direct: list[bool]  # transfer i reads straight into the target's memory
    batches: list[list[Request]]  # executed one after another; bounded staging memory each
    shards: list[tuple[int, str, int, int, int]] = field(
        default_factory=list
    )  # rank, fqn, start, stop, crc

    @property
    def requests(self) -> list[Request]:
        return [r for b in self.batches for r in b]

    @property
    def bytes_read(self) -> int:
        return sum(r.length * r.count for r in self.requests)

    @property
    def bytes_needed(self) -> int:
        return sum(n * r.count for r in self.requests for kind, _, _, n in r.spans if kind != GAP)


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

    def sources(needed: Box):
        for coords, shard in enumerate_shards(mapping, shape, sizes, needed=needed):
            yield rank_of(coords), fqn, shard

    return match_sources(
        fqn,
        target,
        target_pieces,
        sources,
        shard_shapes,
        f"the manifest's mapping {str(mapping)!r}",
    )


def match_sources(
    fqn: str,
    target: int,
    target_pieces: Sequence[Piece],
    sources: Callable[[Box], Iterable[tuple[int, str, Shard]]],
    shard_shapes: dict[tuple[int, str], tuple[int, ...]] | None = None,
    described_by: str = "the manifest",
) -> list[Transfer]:
    """Transfers that fill ``target_pieces`` (regions of logical tensor ``fqn``) from the stored
    shards ``sources(needed_box)`` gives as ``(rank, stored key, shard)``.

    Raises `CorruptCheckpointError` when they do not cover the target exactly once.
    ``shard_shapes``, when given, receives the shape of every stored shard used, by (rank, key).
    """
    out: list[Transfer] = []
    for tp in target_pieces:
        if box_numel(tp.logical_box) == 0:
            continue
        got = 0
        for rank, key, shard in sources(tp.logical_box):
            if shard_shapes is not None:
                shard_shapes[(rank, key)] = shard.shape
            for sp in shard.pieces:
                x = intersect(sp.logical_box, tp.logical_box)
                if x is None:
                    continue
                out.append(Transfer(key, target, rank, sp.restrict(x), tp.restrict(x)))
                got += box_numel(x)
        need = box_numel(tp.logical_box)
        if got != need:
            raise CorruptCheckpointError(
                f"{fqn}: the stored shards hold {got} of the {need} elements of region "
                f"{list(tp.logical_box)}; {described_by} does not cover the tensor exactly once"
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
    max_widened: int = 4 * MiB,
    batch_bytes: int = 256 * MiB,
    max_part: int = 64 * MiB,
    max_gap: int = 1 * MiB,
    slack: float = 0.05,
    max_request: int = 64 * MiB,
    max_spans: int = 1024,
    verify: bool = True,
    tile_skip: int = TILE_SKIP_LOCAL,
) -> ReadPlan:
    """Coalesced reads for ``transfers``.

    ``direct_ok[target]`` says a target tensor is contiguous host memory of the stored dtype:
    its transfers read straight into it, scattering each file run over the destination's runs
    (one ``preadv`` per request). Other transfers go through a staging buffer of at most
    ``max_staging`` bytes, and a batch holds at most ``batch_bytes`` of staging. Neighbouring
    runs of one stored shard are read together when the gap between them is at most ``slack``
    times the run before it (and at most ``max_gap``): at most ``slack`` more bytes are read
    than needed, and never bytes outside the needed shards.

    With ``verify``, every byte read is covered by a checksum that the executor checks: a
    transfer that needs part of a checksum block reads the whole blocks it touches into staging
    (`Transfer.window`), in parts of about ``max_widened`` bytes (at most ``max_staging``; small
    enough to pass through a reading thread's reused buffer while in cache), and every request
    carries the checks of the blocks it reads. A transfer that needs some columns of a 2-d
    shard with checksum tiles reads, instead, only the rows of the tiles it touches (one read a
    row, `Transfer.tiles`), where that skips at least ``tile_skip`` bytes of each row
    (`TILE_SKIP_LOCAL` for a local file; on object storage, where closer ranges share one GET,
    more than the gap a GET reads through).
    """
    final: list[Transfer] = []
    direct: list[bool] = []
    fully = _fully_read(transfers, shard_info)
    widened = min(max_staging, max_widened)
    tiled = _tiled_shards(transfers, shard_info, fully, tile_skip) if verify else set()
    for t in transfers:
        info = shard_info[(t.rank, t.fqn)]
        per = max(1, max_staging // info.itemsize)
        if (t.rank, t.fqn) in tiled:
            parts = [_tiled(p, info, direct_ok[t.target]) for p in _tiled_parts(t, info, widened)]
            final.extend(parts)
            direct.extend([p.window is None for p in parts])  # read into the target itself
        elif verify and (t.rank, t.fqn) not in fully and not _whole_blocks(t.src, info):
            parts = [
                _widened(p, info) for p in _split_transfer(t, _widened_budget(t, info, widened))
            ]
            final.extend(parts)
            direct.extend([False] * len(parts))
        elif direct_ok[t.target]:
            final.append(t)
            direct.append(True)
        else:
            parts = _split_transfer(t, per)
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
    plan = ReadPlan(transfers=final, direct=direct, batches=[])
    # Checksum blocks get an id when a request reads part of them; the executor verifies each
    # from the parts the requests read. Without verification, single-unit reads may become
    # repeated requests that carry no checks.
    shard_ids = _ShardIds(plan, shard_info, verify)
    limits = (max_part, max_gap, slack, max_request, max_spans)
    for batch in batches:
        rows = [i for i in batch if final[i].tiles is not None]
        units = [_units(i, final[i], direct[i], shard_info, max_part) for i in batch]
        units = [u for u in units if final[u[0]].tiles is None]
        out = _coalesce(units, final, direct, shard_info, shard_ids, limits)
        plan.batches.append(out + [_tile_rows(i, final[i], shard_info) for i in rows])
    return plan


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


def _whole_blocks(p: Piece, info: StoredShardInfo) -> bool:
    """Whether piece ``p`` of a stored shard is whole checksum blocks, read as they are."""
    if not _contiguous(p):
        return False
    a, b = _flat_range(p)
    start, stop = a * info.itemsize, b * info.itemsize
    size = info.stop - info.start
    return start % info.block_bytes == 0 and (stop % info.block_bytes == 0 or stop == size)


def _tile_span(t: Transfer, info: StoredShardInfo) -> tuple[int, int, int, int, int, int]:
    """The whole tiles that ``t`` (a box of a 2-d stored shard) touches: rows ``[r0, r1)`` in
    whole checksum blocks, columns ``[c0, c1)`` in whole column blocks; and the rows of a block
    and the columns of a column block."""
    rows_total, cols = t.src.array_shape
    band = info.block_bytes // (cols * info.itemsize)
    width = cols // info.tiles
    (lo, hi), (clo, chi) = t.src.array_box
    r0, r1 = lo // band * band, min(rows_total, -(-hi // band) * band)
    c0, c1 = clo // width * width, -(-chi // width) * width
    return r0, r1, c0, c1, band, width


def _tiled_shards(
    transfers: Sequence[Transfer], shard_info, fully, skip: int
) -> set[tuple[int, str]]:
    """Stored shards to read by tiles: 2-d, tiled, not read whole, and read only by boxes whose
    tiles leave out some columns, at least ``skip`` bytes, of each row."""
    by_key: dict[tuple[int, str], list[Transfer]] = {}
    for t in transfers:
        by_key.setdefault((t.rank, t.fqn), []).append(t)
    out = set()
    for key, ts in by_key.items():
        info = shard_info[key]
        if key in fully or info.tiles < 2 or len(info.tile_crcs) == 0:
            continue
        if any(t.src.base != 0 or len(t.src.array_shape) != 2 for t in ts):
            continue
        cols = ts[0].src.array_shape[1]
        took = max(sp[3] - sp[2] for sp in (_tile_span(t, info) for t in ts))
        if took < cols and (cols - took) * info.itemsize >= skip:
            out.add(key)
    return out


def _tile_rows(i: int, t: Transfer, shard_info) -> Request:
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
        assert into is not None  # `_tiled` checked it
        first, stride = into
        return Request(t.rank, offset, n, ((TARGET, i, first, n),), (), (r1 - r0, row, stride))
    return Request(t.rank, offset, n, ((STAGING, i, 0, n),), (), (r1 - r0, row, n), None, True)


def _tiled_parts(t: Transfer, info: StoredShardInfo, max_staging: int) -> list[Transfer]:
    """``t`` cut along its rows so that each part, widened to whole tiles, stages about
    ``max_staging`` bytes; the cuts fall on band edges, so that no tile is read twice."""
    r0, r1, c0, c1, band, _ = _tile_span(t, info)
    step = max(1, max_staging // max((c1 - c0) * info.itemsize * band, 1)) * band
    (lo, hi), cols = t.src.array_box[0], t.src.logical_box[1:]
    shift = t.src.logical_box[0][0] - lo  # logical row of array row 0
    cuts = [lo, *range((lo // step + 1) * step, hi, step), hi]
    out = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        box = ((a + shift, b + shift), *cols)
        out.append(Transfer(t.fqn, t.target, t.rank, t.src.restrict(box), t.dst.restrict(box)))
    return out


def _tiled(t: Transfer, info: StoredShardInfo, direct: bool) -> Transfer:
    """``t`` reading the whole tiles its source touches (staged, their rows in C order), the
    needed piece taken from them (`Transfer.window`), each tile checked (`Transfer.tiles`); or,
    where it needs whole tiles and may read into its target (``direct``) in rows at a fixed
    stride, straight into the target (no window), its tiles checked there."""
    r0, r1, c0, c1, band, width = _tile_span(t, info)
    rows_total, cols = t.src.array_shape
    box = ((r0, r1), (c0, c1))
    src = Piece(base=0, array_shape=(rows_total, cols), array_box=box, logical_box=box)
    (lo, hi), (clo, chi) = t.src.array_box
    window = Piece(
        base=0,
        array_shape=(r1 - r0, c1 - c0),
        array_box=((lo - r0, hi - r0), (clo - c0, chi - c0)),
        logical_box=t.src.logical_box,
    )
    per_band = info.tiles
    crcs = tuple(
        info.tile_crcs[(r // band) * per_band + c // width]
        for r in range(r0, r1, band)
        for c in range(c0, c1, width)
    )
    checks = (band, width, crcs)
    if direct and box == tuple(t.src.array_box) and _target_rows(t, info.itemsize) is not None:
        return Transfer(t.fqn, t.target, t.rank, t.src, t.dst, None, checks)
    return Transfer(t.fqn, t.target, t.rank, src, t.dst, window, checks)


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


def _widened_budget(t: Transfer, info: StoredShardInfo, max_staging: int) -> int:
    """Elements of ``t`` per part, so that each part, widened to whole rows and blocks, stages
    about ``max_staging`` bytes (a shard that is one block, as in version-1 files, is staged
    whole: cutting it would read it once per part)."""
    if info.block_bytes >= info.stop - info.start:
        return max(1, t.numel)
    shape = box_shape(t.src.array_box)
    full_row = math.prod(t.src.array_shape[1:]) * info.itemsize if shape else info.itemsize
    needed_row = math.prod(shape[1:]) if shape else 1
    return max(1, max_staging // max(full_row, 1)) * max(needed_row, 1)


def _widened(t: Transfer, info: StoredShardInfo) -> Transfer:
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


class _ShardIds:
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


def _fully_read(transfers: Sequence[Transfer], shard_info) -> set[tuple[int, str]]:
    """Stored shards whose every byte some transfer needs: their checksums can be verified."""
    needed: dict[tuple[int, str], int] = {}
    for t in transfers:
        key = (t.rank, t.fqn)
        needed[key] = needed.get(key, 0) + t.numel * shard_info[key].itemsize
    return {k for k, n in needed.items() if n == shard_info[k].stop - shard_info[k].start}


def _units(i: int, t: Transfer, direct: bool, shard_info, max_part: int):
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


def _coalesce(units, transfers, direct, shard_info, shard_ids, limits) -> list[Request]:
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
    checked = [shard_ids.verify] * len(transfers)
    out: list[Request] = []
    run: list = []  # a pending repeated read: [transfer, size, src, dst, count, src stride, dst stride]

    def flush() -> None:
        if run:
            i, n, s0, d0, count, ds, dd = run
            repeat = (count, ds, dd) if count > 1 else None
            staged_i = kinds[i] == STAGING
            out.append(
                Request(
                    transfers[i].rank, s0, n, ((kinds[i], i, d0, n),), (), repeat, None, staged_i
                )
            )
            run.clear()

    bounds = starts + [len(ids)]
    for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        i = ids[a]
        if b - a == 1 and not checked[i]:
            if run and run[0] == i and run[1] == size[a]:
                ds, dd = src[a] - run[2] - run[4] * run[5], dst[a] - run[3] - run[4] * run[6]
                if run[4] == 1 and ds > 0:
                    run[5], run[6], run[4] = ds, dd, 2
                    continue
                if ds == 0 and dd == 0:
                    run[4] += 1
                    continue
            flush()
            run[:] = [i, size[a], src[a], dst[a], 1, 0, 0]
            continue
        flush()
        if gapless[g]:  # the units are the spans
            spans = tuple(zip(unit_kinds[a:b], ids[a:b], dst[a:b], size[a:b], strict=True))
        else:
            spans = []
            for k in range(a, b):
                if k > a and gap[k]:
                    spans.append((GAP, -1, 0, gap[k]))
                spans.append((unit_kinds[k], ids[k], dst[k], size[k]))
            spans = tuple(spans)
        start, end = src[a], src[b - 1] + size[b - 1]
        rows = None
        if uniform[g] and b - a > 1:
            rows = (transfers[i].target, dst[a], dst[a + 1] - dst[a], size[a])
        out.append(
            Request(
                transfers[i].rank,
                start,
                end - start,
                spans,
                _checks(transfers, ids[a:b], start, end, shard_info, shard_ids),
                None,
                rows,
                staged[g],
            )
        )
    flush()
    return out


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
