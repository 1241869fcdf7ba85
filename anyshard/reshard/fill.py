"""Filling target regions from a checkpoint: find the stored shards, read their headers, plan
the reads, execute them. The one path by which `load`, `open` and the exporters read bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anyshard.errors import CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.datafile import DataFileHeader, data_path, read_headers
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import Manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard.executor import execute_plan
from anyshard.reshard.planner import ReadPlan, StoredShardInfo, Transfer, match_sources, plan_reads
from anyshard.reshard.stored import describe_spec, stored_shards

__all__ = ["Fill", "fill_regions"]


@dataclass(frozen=True, slots=True)
class Fill:
    """Fill ``pieces`` of ``dest`` (each holding a region of logical tensor ``fqn``)."""

    fqn: str
    dest: torch.Tensor
    pieces: tuple[Piece, ...]


def fill_regions(
    path: str,
    manifest: Manifest,
    fills: Sequence[Fill],
    *,
    headers: dict[int, DataFileHeader] | None = None,
    threads: int = 8,
) -> ReadPlan:
    """Read what ``fills`` need, only that, and write it into their tensors."""
    transfers: list[Transfer] = []
    shapes: dict[tuple[int, str], tuple[int, ...]] = {}  # stored shards used: (rank, key)
    stored_dtype: dict[tuple[int, str], str] = {}
    for i, f in enumerate(fills):
        entry = manifest.tensors[f.fqn]
        used: dict[tuple[int, str], tuple[int, ...]] = {}
        transfers += match_sources(
            f.fqn,
            i,
            f.pieces,
            lambda needed, fqn=f.fqn: (
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
    missing = {r for r, _ in shapes} - set(headers)
    headers.update(read_headers(path, manifest, missing))
    info: dict[tuple[int, str], StoredShardInfo] = {}
    dtypes: dict[tuple[int, str], torch.dtype] = {}
    for (rank, key), shape in shapes.items():
        header = headers[rank]
        stored = header.shards.get(key)
        want = stored_dtype[(rank, key)]
        if stored is None or stored.shape != tuple(shape) or stored.dtype != want:
            found = "nothing" if stored is None else f"{stored.dtype} {list(stored.shape)}"
            raise CorruptCheckpointError(
                f"{header.path}: expected the stored tensor {key!r} as {want} {list(shape)}, found {found}; "
                "the data file does not belong to this manifest"
            )
        dtype = ST_TO_DTYPE[stored.dtype]
        info[(rank, key)] = StoredShardInfo(
            stored.start, stored.stop, dtype.itemsize, stored.crc32c
        )
        dtypes[(rank, key)] = dtype
    direct_ok = [
        f.dest.device.type == "cpu"
        and f.dest.is_contiguous()
        and f.dest.dtype == ST_TO_DTYPE[manifest.tensors[f.fqn].dtype]
        for f in fills
    ]
    # Object stores: fewer, longer reads (each a GET streamed into the targets); locally,
    # 64 MiB parts that threads read in parallel.
    remote = {"max_part": 128 << 20, "max_request": 128 << 20} if storage.is_url(path) else {}
    plan = plan_reads(transfers, info, direct_ok, **remote)
    paths = {r: data_path(path, manifest, r) for r in {t.rank for t in plan.transfers}}
    execute_plan(plan, [f.dest for f in fills], dtypes, paths, threads=threads)
    return plan
