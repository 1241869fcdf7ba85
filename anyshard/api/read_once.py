"""Reading each stored region once per job, for loads whose targets are plain local tensors (a
spec load, the DCP reader): the ranks that need the same region of a logical tensor agree on one
of them to read it; that rank reads it (verified, as any read) and sends it to the others.

The agreement is deterministic from what every rank needs (`assign`): each region goes to the
rank needing it that has been given the fewest bytes so far, so the reading is spread over the
ranks that share it. Regions are shared when they are the same box of the same logical tensor;
regions that only overlap are read by each rank that needs them.

What a reader forwards is checked on arrival (`anyshard.format.transit`): the reader sends the
crc32c of each region it forwards (computed on the host copy it read, before any copy to a
device) in a side tensor, one per receiver, and each receiver checks the regions before it
places them; the ranks then agree, and a region damaged in transit is a `ChecksumError` on
every rank, naming the tensor, the reader and the receiver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from anyshard.api import collectives as coll
from anyshard.api.transfer import agree_on_transit
from anyshard.format import transit
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import Manifest
from anyshard.geometry.boxes import Box, Piece, box_shape, full_box, intersect
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.reshard.stored import stored_shards

__all__ = [
    "Region",
    "assign",
    "fill_once",
    "fill_shared",
    "needs_of",
    "place",
    "reads_column_slice",
]

Region = tuple[str, Box]  # a logical tensor's name and a box of it


@dataclass(frozen=True, slots=True)
class Assignment:
    """Who reads ``region`` and who receives it from that rank."""

    region: Region
    reader: int
    receivers: tuple[int, ...]


def needs_of(fills: Sequence[Fill]) -> list[Region]:
    """The distinct regions ``fills`` need, sorted."""
    return sorted({(f.fqn, p.logical_box) for f in fills for p in f.pieces})


def reads_column_slice(manifest: Manifest, fill: Fill) -> bool:
    """Whether ``fill`` reads a column slice of a stored shard of two or more dims: a part of
    its rows narrower than the stored rows (reads widen it to whole rows or tiles)."""
    for p in fill.pieces:
        if len(p.logical_box) < 2:
            continue
        for s in stored_shards(manifest, fill.fqn, p.logical_box):
            for sp in s.shard.pieces:
                common = intersect(sp.logical_box, p.logical_box)
                if common is not None and common[-1] != sp.logical_box[-1]:
                    return True
    return False


def assign(needs: Sequence[Sequence[Region]], manifest: Manifest) -> list[Assignment]:
    """Who reads each region that rank ``r`` needs (``needs[r]``): a region one rank needs is
    its own. The regions read from the same stored shards go together (their reads coalesce,
    and a checksum block they share is read once, even by column splits of row blocks) to the
    one of the ranks needing them given the fewest bytes so far (then the lowest rank), largest
    groups first; it sends each region to the others that need it. The same on every rank that
    computes it."""
    holders: dict[Region, tuple[int, ...]] = {}
    for r, regions in enumerate(needs):
        for region in regions:
            holders[region] = (*holders.get(region, ()), r)

    def nbytes(region: Region) -> int:
        fqn, box = region
        return math.prod(box_shape(box)) * ST_TO_DTYPE[manifest.tensors[fqn].dtype].itemsize

    groups: dict[tuple, list[Region]] = {}
    for region in holders:
        fqn, box = region
        # the stored shards it is read from (a fused local tensor holds several logical ones)
        sources = tuple(sorted({(s.rank, s.key) for s in stored_shards(manifest, fqn, box)}))
        groups.setdefault(sources, []).append(region)
    size = {g: sum(map(nbytes, regions)) for g, regions in groups.items()}
    load = [0] * len(needs)
    out = []
    for g in sorted(groups, key=lambda g: (-size[g], g)):
        ranks = sorted({r for region in groups[g] for r in holders[region]})
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += size[g]
        out += [
            Assignment(region, reader, tuple(r for r in holders[region] if r != reader))
            for region in groups[g]
        ]
    return sorted(out, key=lambda a: a.region)


def _tiled_by(boxes: Sequence[Box]) -> Box | None:
    """The box that ``boxes`` (two or more, disjoint) cover exactly, if they do: read as one, the
    column slices of the same rows make one request of whole rows instead of one run a slice
    and a row, interleaved."""
    if not 1 < len(boxes) <= 64:
        return None
    whole = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes))
                  for d in range(len(boxes[0])))  # fmt: skip
    if sum(math.prod(box_shape(b)) for b in boxes) != math.prod(box_shape(whole)):
        return None
    for i, a in enumerate(boxes):  # equal volumes and no overlap: they tile it
        if any(intersect(a, b) is not None for b in boxes[i + 1 :]):
            return None
    return whole


def place(dest: torch.Tensor, piece: Piece, src: torch.Tensor) -> None:
    """Copy ``src`` (the whole of ``piece.logical_box``) into where ``piece`` lies in ``dest``."""
    index = tuple(slice(lo, hi) for lo, hi in piece.array_box)
    if piece.base == 0 and tuple(dest.shape) == piece.array_shape:
        dest[index].copy_(src)
        return
    n = math.prod(piece.array_shape)
    flat = dest.view(-1)[piece.base : piece.base + n].view(piece.array_shape)
    flat[index].copy_(src)


def _buffers(
    manifest: Manifest, plan: Sequence[Assignment], me: int
) -> tuple[dict[Region, torch.Tensor], list[Fill]]:
    """Where rank ``me`` reads the regions ``plan`` gives it: a buffer each region (a view of
    one flat buffer a tensor), and the fills that read them."""
    by_fqn: dict[str, list[Box]] = {}
    for a in plan:
        if a.reader == me:
            by_fqn.setdefault(a.region[0], []).append(a.region[1])
    got: dict[Region, torch.Tensor] = {}
    reads: list[Fill] = []
    for fqn, boxes in by_fqn.items():  # one flat buffer a tensor: its reads plan together
        dtype = ST_TO_DTYPE[manifest.tensors[fqn].dtype]
        whole = _tiled_by(boxes)
        if whole is not None:  # read as one box (neighbouring column slices: whole rows)
            shape = box_shape(whole)
            buf = torch.empty(shape, dtype=dtype)
            for box in boxes:
                got[(fqn, box)] = buf[tuple(slice(a - w, b - w) for (a, b), (w, _) in
                                            zip(box, whole, strict=True))]  # fmt: skip
            reads.append(Fill(fqn, buf, (Piece(0, shape, full_box(shape), whole),)))
            continue
        sizes = [math.prod(box_shape(box)) for box in boxes]
        flat = torch.empty(sum(sizes), dtype=dtype)
        pieces, at = [], 0
        for box, n in zip(boxes, sizes, strict=True):
            shape = box_shape(box)
            pieces.append(Piece(at, shape, full_box(shape), box))
            got[(fqn, box)] = flat[at : at + n].view(shape)
            at += n
        reads.append(Fill(fqn, flat, tuple(pieces)))
    return got, reads


def fill_once(
    path: str,
    manifest: Manifest,
    fills: Sequence[Fill],
    plan: Sequence[Assignment],
    me: int,
    peers: Sequence[int],
    *,
    group=None,
    threads: int = 8,
    verify: bool = True,
    headers: dict | None = None,
    error: BaseException | None = None,
) -> int:
    """Fill ``fills`` (this rank's, rank ``me`` of ``plan``) reading only the regions ``plan``
    gives this rank and receiving the others from their readers; ``peers[r]`` is rank ``r``'s
    global rank (for point-to-point messages). Collective over the ranks of ``plan``: a read
    error on any of them is raised on all (over ``group``) before anything is sent, as is
    ``error``, one this rank met before (it then reads nothing). A region damaged on its way
    from its reader is a `ChecksumError` on all of them, raised before anything received is
    placed (`anyshard.format.transit`; ``ANYSHARD_CHECK_TRANSIT=0`` skips computing and
    checking the checksums, and the agreement stays). Returns the bytes this rank read."""
    got, reads = _buffers(manifest, plan, me)
    bytes_read = 0
    try:
        if reads and error is None:
            done = fill_regions(
                path, manifest, reads, threads=threads, verify=verify, headers=headers
            )
            bytes_read = done.bytes_read
    except Exception as e:
        error = e
    coll.raise_together(error, group, f"load of {path}")
    device = coll.device(group)
    checked = transit.enabled()
    ops = []
    crcs: dict[int, list[int]] = {}  # receiver -> the crc32c of each region sent to it
    arriving: dict[int, list[Region]] = {}  # reader -> the regions received from it
    for a in plan:  # the same order on every rank
        fqn, box = a.region
        if a.reader == me and a.receivers:
            host = got[a.region].contiguous()
            crc = transit.crc_of(host) if checked else transit.UNCHECKED
            sent = host.to(device)
            ops += [dist.P2POp(dist.isend, sent, peers[r]) for r in a.receivers]
            for r in a.receivers:
                crcs.setdefault(r, []).append(crc)
        elif me in a.receivers:
            buf = torch.empty(box_shape(box), dtype=ST_TO_DTYPE[manifest.tensors[fqn].dtype])
            got[a.region] = buf = buf.to(device)
            ops.append(dist.P2POp(dist.irecv, buf, peers[a.reader]))
            arriving.setdefault(a.reader, []).append(a.region)
    # after the regions, one side tensor between each reader and receiver: their crc32c
    ops += [
        dist.P2POp(dist.isend, transit.crcs_tensor(values, device), peers[r])
        for r, values in sorted(crcs.items())
    ]
    sides = {
        r: torch.empty(len(regions), dtype=torch.int64, device=device)
        for r, regions in sorted(arriving.items())
    }
    ops += [dist.P2POp(dist.irecv, side, peers[r]) for r, side in sides.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    failed: list[transit.Mismatch] = []
    for r, regions in arriving.items():
        for region, crc in zip(regions, sides[r].tolist(), strict=True):
            bad = transit.check(crc, got[region], region[0], region[1], r, me)
            if bad is not None:
                failed.append(bad)
    if coll.world_size(group) > 1:  # every rank, those with nothing to send or receive too
        agree_on_transit(failed, group, f"load of {path}")
    for f in fills:
        for p in f.pieces:
            place(f.dest, p, got[(f.fqn, p.logical_box)].to(f.dest.device))
    return bytes_read


def fill_shared(
    path: str,
    manifest: Manifest,
    fills: Sequence[Fill],
    group,
    *,
    threads: int = 8,
    verify: bool = True,
) -> tuple[int, list[Assignment]]:
    """Fill ``fills`` reading each stored region once per job: the ranks of ``group`` exchange
    what they need (`needs_of`), agree who reads what (`assign`), read and send (`fill_once`).
    Collective; the bytes this rank read and the agreement."""
    wanted = [[fqn, [list(r) for r in box]] for fqn, box in needs_of(fills)]
    everyone = [
        [(fqn, tuple((lo, hi) for lo, hi in box)) for fqn, box in needs]
        for needs in coll.all_gather_json(wanted, group)
    ]
    peers = [
        dist.get_global_rank(group, r) if group is not None else r
        for r in range(coll.world_size(group))
    ]
    plan = assign(everyone, manifest)
    nbytes = fill_once(
        path,
        manifest,
        fills,
        plan,
        coll.rank(group),
        peers,
        group=group,
        threads=threads,
        verify=verify,
    )
    return nbytes, plan
