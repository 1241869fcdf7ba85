"""N simulated ranks, no processes: a Llama-shaped model (`benchkit.llama`) saved under one
layout (pp x dp_shard x tp, FSDP2 over TP, layers split over pipeline stages) and loaded under
another, through the library's own planning code. The save derives every tensor's mapping as
``anyshard.save`` does (``hold_mapping``, ``stored_mapping``) into the real manifest; a loading
rank plans as ``anyshard.load`` does (``match_shards``, ``plan_reads``) against data-file headers
laid out as the saving ranks write them.
"""

from __future__ import annotations

import math
import time
from collections import namedtuple

from anyshard.api.tensor_layout import hold_mapping, stored_mapping
from anyshard.format.datafile import block_size
from anyshard.format.manifest import Manifest, TensorEntry
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import box_numel
from anyshard.geometry.runs import piece_offsets, unit_length_dim
from anyshard.reshard.planner import match_shards, plan_reads
from anyshard.reshard.read_plan import StoredShardInfo
from anyshard.ucl.lowering import compile_mapping

from .llama import Tensor, placements

ITEMSIZE = 2  # bf16
DIMS = ("pp", "dp_shard", "tp")
RankStats = namedtuple(
    "RankStats", "headers plan_s runs reads bytes_read bytes_needed target_bytes"
)


def num_layers(model: list[Tensor]) -> int:
    return 1 + max(t.layer for t in model if t.layer is not None)


def stage_of(t: Tensor, pp: int, layers: int) -> int:
    if t.layer is None:
        return pp - 1 if t.last else 0
    return t.layer * pp // layers


class Layout:
    """A (pp, dp_shard, tp) layout: its mesh, a rank's coordinates, a tensor's mapping."""

    def __init__(self, pp: int, dp: int, tp: int):
        self.sizes, self.world = (pp, dp, tp), pp * dp * tp
        self.axis_sizes = dict(zip(DIMS, self.sizes, strict=True))
        self.mesh = MeshEntry(dims=DIMS, sizes=self.sizes, offset=0, strides=(dp * tp, tp, 1))

    def coords(self, rank: int) -> dict[str, int]:
        _, dp, tp = self.sizes
        return {"pp": rank // (dp * tp), "dp_shard": rank // tp % dp, "tp": rank % tp}

    def hold(self, t: Tensor, stage: int):
        _, dp, tp = self.sizes
        pl = placements(t.kind, DIMS[1:], fsdp_over_tp=tp)
        return hold_mapping(t.name, pl, DIMS[1:], (dp, tp), DIMS, {"pp": stage})


def build_manifest(model: list[Tensor], lay: Layout) -> tuple[Manifest, float]:
    """The manifest of a save under ``lay``, and the per-rank save planning time (one rank's
    tensors through hold_mapping + stored_mapping + compile)."""
    layers, tensors, t0 = num_layers(model), {}, time.perf_counter()
    for t in model:
        stage = stage_of(t, lay.sizes[0], layers)
        hold, at = lay.hold(t, stage), {"pp": stage, "dp_shard": 0, "tp": 0}
        nbytes = math.prod(compile_mapping(hold, t.shape, lay.axis_sizes, at).shape) * ITEMSIZE
        stored = stored_mapping(t.name, hold, lay.axis_sizes, nbytes, len(t.shape))
        tensors[t.name] = TensorEntry(dtype="BF16", shape=t.shape, mesh=0, mapping=str(stored))
    per_rank = (time.perf_counter() - t0) / lay.sizes[0]  # a rank plans only its stage's tensors
    files = {r: f"data/rank-{r:05d}.safetensors" for r in range(lay.world)}
    kw = {"world_size": lay.world, "meshes": (lay.mesh,), "files": files, "tensors": tensors}
    return Manifest(**kw, library="sim"), per_rank


def file_layout(manifest: Manifest, model: list[Tensor], lay: Layout, rank: int) -> dict:
    """Where each stored shard of ``rank``'s data file lies (`StoredShardInfo`), as the save
    writes them (model order)."""
    offset, out = 4096, {}
    for t in model:
        entry = manifest.tensors[t.name].parsed
        if (shard := compile_mapping(entry, t.shape, lay.axis_sizes, lay.coords(rank))) is None:
            continue
        n = math.prod(shard.shape) * ITEMSIZE
        block = block_size(tuple(shard.shape), ITEMSIZE)  # the checksum blocks a save writes
        crcs = (0,) * max(1, -(-n // block))
        out[t.name] = StoredShardInfo(offset, offset + n, ITEMSIZE, block=block, crcs=crcs)
        offset += n
    return out


def plan_rank(manifest: Manifest, model, save: Layout, load: Layout, rank: int, layers: int):
    coords = load.coords(rank)
    mine = [t for t in model if stage_of(t, load.sizes[0], layers) == coords["pp"]]
    t0, transfers, target_bytes = time.perf_counter(), [], 0
    for i, t in enumerate(mine):
        target = compile_mapping(load.hold(t, coords["pp"]), t.shape, load.axis_sizes, coords)
        target_bytes += sum(box_numel(p.logical_box) for p in target.pieces) * ITEMSIZE
        entry, sizes = manifest.tensors[t.name].parsed, save.axis_sizes
        transfers += match_shards(t.name, i, target.pieces, entry, t.shape, sizes, save.mesh.rank)
    match_s, files = time.perf_counter() - t0, sorted({tr.rank for tr in transfers})
    # stands for reading these files' headers: not planning time
    info = {(r, k): s for r in files for k, s in file_layout(manifest, model, save, r).items()}
    t1 = time.perf_counter()
    plan = plan_reads(transfers, info, [True] * len(mine))
    plan_s, reads = match_s + time.perf_counter() - t1, sum(r.count for r in plan.requests)
    # before coalescing: one read per stretch contiguous in both the file and the destination
    runs = sum(len(piece_offsets(tr.src, unit_length_dim(tr.src, tr.dst))) for tr in transfers)
    needed = (plan.bytes_read, plan.bytes_needed, target_bytes)
    return RankStats(len(files), plan_s, runs, reads, *needed)
