"""Read planning: from what a target needs and what is stored, to coalesced byte-range reads.

Pure: shapes, mappings and file headers in; plans out. No I/O, no torch.distributed. The plan's
parts are in `anyshard.reshard.read_plan`; reads widened to whole checksum blocks and tiles in
`anyshard.reshard.widening`; the merging of runs into requests in `anyshard.reshard.coalesce`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Mapping as MappingType

from anyshard.errors import CorruptCheckpointError
from anyshard.geometry.boxes import Box, Piece, box_numel, box_shape, intersect
from anyshard.geometry.shards import Shard
from anyshard.reshard.coalesce import ShardIds, coalesce, transfer_units
from anyshard.reshard.read_plan import ReadPlan, StoredShardInfo, Transfer
from anyshard.reshard.widening import (
    fully_read,
    tile_rows,
    tiled_parts,
    tiled_shards,
    whole_blocks,
    widened_budget,
    widened_to_blocks,
    widened_to_tiles,
)
from anyshard.ucl.lowering import enumerate_shards
from anyshard.ucl.mapping import Mapping

__all__ = ["TILE_SKIP_LOCAL", "match_shards", "match_sources", "plan_reads"]


MiB = 1 << 20
# A column slice of a local file reads its tiles row by row only where that skips at least a
# page of each row: a file is read from its device by pages, so skipping less saves no device
# read, while the read call a row costs about as much as copying and checksumming 2-4 KiB.
TILE_SKIP_LOCAL = 4 << 10


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
    carries the checks of the blocks it reads. A transfer that needs some columns of a shard
    (of two or more dims) with checksum tiles reads, instead, only the rows of the tiles it touches (one read a
    row, `Transfer.tiles`), where that skips at least ``tile_skip`` bytes of each row
    (`TILE_SKIP_LOCAL` for a local file; on object storage, where closer ranges share one GET,
    more than the gap a GET reads through).
    """
    final, direct = _final_transfers(
        transfers, shard_info, direct_ok, max_staging, max_widened, verify, tile_skip
    )
    plan = ReadPlan(transfers=final, direct=direct, batches=[])
    # Checksum blocks get an id when a request reads part of them; the executor verifies each
    # from the parts the requests read. Without verification, single-unit reads may become
    # repeated requests that carry no checks.
    shard_ids = ShardIds(plan, shard_info, verify)
    limits = (max_part, max_gap, slack, max_request, max_spans)
    for batch in _batches(final, direct, shard_info, batch_bytes):
        rows = [i for i in batch if final[i].tiles is not None]
        units = [transfer_units(i, final[i], direct[i], shard_info, max_part) for i in batch]
        units = [u for u in units if final[u[0]].tiles is None]
        out = coalesce(units, final, direct, shard_info, shard_ids, limits)
        plan.batches.append(out + [tile_rows(i, final[i], shard_info) for i in rows])
    return plan


def _final_transfers(
    transfers: Sequence[Transfer],
    shard_info: MappingType[tuple[int, str], StoredShardInfo],
    direct_ok: Sequence[bool],
    max_staging: int,
    max_widened: int,
    verify: bool,
    tile_skip: int,
) -> tuple[list[Transfer], list[bool]]:
    """The transfers as they are read (widened to whole tiles or checksum blocks, or cut to
    fit staging), and for each whether it reads straight into its target's memory."""
    final: list[Transfer] = []
    direct: list[bool] = []
    fully = fully_read(transfers, shard_info)
    widened = min(max_staging, max_widened)
    tiled = tiled_shards(transfers, shard_info, fully, tile_skip) if verify else set()
    for t in transfers:
        info = shard_info[(t.rank, t.fqn)]
        per = max(1, max_staging // info.itemsize)
        if (t.rank, t.fqn) in tiled:
            parts = [
                widened_to_tiles(p, info, direct_ok[t.target])
                for p in tiled_parts(t, info, widened)
            ]
            final.extend(parts)
            direct.extend([p.window is None for p in parts])  # read into the target itself
        elif verify and (t.rank, t.fqn) not in fully and not whole_blocks(t.src, info):
            budget = widened_budget(t, info, widened)
            parts = [widened_to_blocks(p, info) for p in _split_transfer(t, budget)]
            final.extend(parts)
            direct.extend([False] * len(parts))
        elif direct_ok[t.target]:
            final.append(t)
            direct.append(True)
        else:
            parts = _split_transfer(t, per)
            final.extend(parts)
            direct.extend([False] * len(parts))
    return final, direct


def _batches(final: list[Transfer], direct: list[bool], shard_info, batch_bytes: int):
    """Transfer numbers in batches, each staging at most ``batch_bytes`` (or one transfer)."""
    batches: list[list[int]] = [[]]
    staged = 0
    for i, t in enumerate(final):
        nbytes = 0 if direct[i] else t.numel * shard_info[(t.rank, t.fqn)].itemsize
        if batches[-1] and staged + nbytes > batch_bytes:
            batches.append([])
            staged = 0
        batches[-1].append(i)
        staged += nbytes
    return batches
