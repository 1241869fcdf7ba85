"""Filling target regions from a checkpoint: find the stored shards, read their headers, plan
the reads, execute them. The one path by which `load`, `open` and the exporters read bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from anyshard.format import storage
from anyshard.format.datafile import DataFileHeader, data_path, read_headers
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import Manifest
from anyshard.format.ranged_reads import MAX_GAP
from anyshard.geometry.boxes import Piece
from anyshard.reshard import planner
from anyshard.reshard.executor import execute_plan
from anyshard.reshard.planner import match_sources, plan_reads
from anyshard.reshard.read_plan import ReadPlan, StoredShardInfo, Transfer
from anyshard.reshard.stored import describe_spec, stored_shards
from anyshard.reshard.verify import check_stored

__all__ = [
    "Fill",
    "MatchedFills",
    "execute_fills",
    "fill_regions",
    "match_fills",
]


@dataclass(frozen=True, slots=True)
class Fill:
    """Fill ``pieces`` of ``dest`` (each holding a region of logical tensor ``fqn``)."""

    fqn: str
    dest: torch.Tensor
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class MatchedFills:
    """The transfers that fill some regions, and the stored shards they read, checked against
    the data files' headers: nothing is allocated or read yet."""

    path: str
    manifest: Manifest
    fqns: tuple[str, ...]
    transfers: list[Transfer]
    info: dict[tuple[int, str], StoredShardInfo]
    dtypes: dict[tuple[int, str], torch.dtype]


def match_fills(
    path: str,
    manifest: Manifest,
    needs: Sequence[tuple[str, tuple[Piece, ...]]],
    *,
    headers: dict[int, DataFileHeader] | None = None,
) -> MatchedFills:
    """Where the regions ``needs`` (logical tensor, target pieces) are stored, checked against
    the data files' headers (read once into ``headers``): `CorruptCheckpointError` when the
    stored shards do not cover them exactly once or do not match the headers."""
    transfers: list[Transfer] = []
    shapes: dict[tuple[int, str], tuple[int, ...]] = {}  # stored shards used: (rank, key)
    stored_dtype: dict[tuple[int, str], str] = {}
    for i, (fqn, pieces) in enumerate(needs):
        entry = manifest.tensors[fqn]
        used: dict[tuple[int, str], tuple[int, ...]] = {}
        transfers += match_sources(
            fqn,
            i,
            pieces,
            lambda needed, fqn=fqn: (
                (s.rank, s.key, s.shard) for s in stored_shards(manifest, fqn, needed)
            ),
            used,
            f"the manifest's mapping {entry.mapping!r}"
            if entry.mapping is not None
            else f"the spec it was saved with ({describe_spec(manifest)})",
        )
        shapes.update(used)
        stored_dtype.update(dict.fromkeys(used, entry.dtype))
    headers = headers if headers is not None else {}
    # where each stored shard is read: its rank's data file, or a referenced one (a number
    # past the world size)
    source = {k: manifest.source_of(*k) for k in shapes}
    missing = set(source.values()) - set(headers)
    headers.update(read_headers(path, manifest, missing))
    info: dict[tuple[int, str], StoredShardInfo] = {}
    dtypes: dict[tuple[int, str], torch.dtype] = {}
    for (rank, key), shape in shapes.items():
        src = source[(rank, key)]
        stored = check_stored(
            path, manifest, rank, key, headers[src], stored_dtype[(rank, key)], shape
        )
        dtype = ST_TO_DTYPE[stored.dtype]
        info[(src, key)] = StoredShardInfo(
            stored.start,
            stored.stop,
            dtype.itemsize,
            block=stored.block,
            crcs=stored.crcs,
            tiles=stored.tiles,
            tile_crcs=stored.tile_crcs,
        )
        dtypes[(src, key)] = dtype
    if manifest.refs:
        transfers = [
            t if source[(t.rank, t.fqn)] == t.rank else replace(t, rank=source[(t.rank, t.fqn)])
            for t in transfers
        ]
    fqns = tuple(fqn for fqn, _ in needs)
    return MatchedFills(path, manifest, fqns, transfers, info, dtypes)


def execute_fills(
    matched: MatchedFills,
    dests: Sequence[torch.Tensor],
    *,
    threads: int = 8,
    verify: bool = True,
) -> ReadPlan:
    """Read what ``matched`` needs into ``dests`` (one per need, in order); with ``verify``,
    every byte read is in a checksum block that is read whole and checked (`plan_reads`)."""
    path, manifest = matched.path, matched.manifest
    direct_ok = [
        d.device.type == "cpu"
        and d.is_contiguous()
        and d.dtype == ST_TO_DTYPE[manifest.tensors[fqn].dtype]
        for fqn, d in zip(matched.fqns, dests, strict=True)
    ]
    # Object stores: fewer, longer reads (each a GET streamed into the targets); locally,
    # 64 MiB parts that threads read in parallel.
    remote = (
        # ranges closer than MAX_GAP share one GET, gap included: tiles skip nothing nearer
        {"max_part": 128 << 20, "max_request": 128 << 20, "tile_skip": MAX_GAP + 1}
        if storage.is_url(path)
        else {"tile_skip": planner.TILE_SKIP_LOCAL}
    )
    plan = plan_reads(matched.transfers, matched.info, direct_ok, verify=verify, **remote)
    paths = {r: data_path(path, manifest, r) for r in {t.rank for t in plan.transfers}}
    execute_plan(plan, list(dests), matched.dtypes, paths, threads=threads)
    return plan


def fill_regions(
    path: str,
    manifest: Manifest,
    fills: Sequence[Fill],
    *,
    headers: dict[int, DataFileHeader] | None = None,
    threads: int = 8,
    verify: bool = True,
) -> ReadPlan:
    """Read what ``fills`` need and write it into their tensors, verified (see `execute_fills`)."""
    matched = match_fills(path, manifest, [(f.fqn, f.pieces) for f in fills], headers=headers)
    return execute_fills(matched, [f.dest for f in fills], threads=threads, verify=verify)
