"""Task functions run on every rank by the harness: tools/scale_sim.py's toy model, saved and loaded
for real on 8 gloo ranks, with the load's planning recorded for comparison with the simulator."""

from __future__ import annotations

import os
import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import anyshard
import anyshard.format.datafile
import anyshard.reshard.fill
from anyshard._compat import compute_local_shape_and_global_offset

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "tools"))  # after harness.py
from benchkit import llama, simulated_ranks  # noqa: E402

DIMS = ("pp", "dp_shard", "tp")
SAVE, LOAD = (2, 2, 2), (1, 4, 2)
# Uneven on purpose: 10, 22, 6 and 30 rows split 4 and 8 ways leave short and empty chunks.
# (Sizes of 8k + 1 rows are avoided: torch's compute_local_shape_and_global_offset gives
# overlapping shards for an uneven _StridedShard there, e.g. 41 rows on a (4, 2) mesh.)
SIZES = {"h": 10, "f": 22, "kv": 6, "vocab": 30, "layers": 4}


def model() -> list[llama.Tensor]:
    return llama.dense_70b(**SIZES)


def full_tensor_of(t: llama.Tensor) -> torch.Tensor:
    """The same values on every rank, from the tensor's name alone."""
    g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
    return torch.randn(t.shape, generator=g).to(torch.bfloat16)


def expected_local(full: torch.Tensor, kind: str, dp: int, tp: int, coords) -> torch.Tensor:
    """What a rank at ``(dp_shard, tp) = coords`` holds under FSDP2 over TP, in plain torch:
    TP's torch.chunk first, then FSDP2's torch.chunk of that along dim 0."""

    def part(x: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
        chunks = x.chunk(n, dim)
        return chunks[i] if i < len(chunks) else x.narrow(dim, 0, 0)

    d, t = coords
    if kind == "col":
        return part(part(full, 0, tp, t), 0, dp, d)
    if kind == "row":
        return part(part(full, 0, dp, d), 1, tp, t)
    assert kind == "norm", kind
    return part(full, 0, dp, d)


def _dtensor(t: llama.Tensor, values: torch.Tensor, submesh, tp: int) -> DTensor:
    placements = llama.placements(t.kind, ("dp_shard", "tp"), fsdp_over_tp=tp)
    shape, offset = compute_local_shape_and_global_offset(values.shape, submesh, placements)
    local = values[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    # distribute_tensor refuses uneven _StridedShard, so build the local shard ourselves
    return DTensor.from_local(
        local.contiguous(),
        submesh,
        placements,
        shape=values.shape,
        stride=values.stride(),
        run_check=False,
    )


def _stage_state(sizes: tuple[int, int, int], fill) -> tuple[dict, object]:
    """This rank's stage of the model as DTensors on ``mesh["dp_shard", "tp"]``, in model order
    (the order the data files are written in, as the simulator assumes)."""
    pp, _, tp = sizes
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=DIMS)
    submesh = mesh["dp_shard", "tp"]
    stage = mesh.get_coordinate()[0]
    specs = model()
    layers = simulated_ranks.num_layers(specs)
    state = {}
    for t in specs:
        if simulated_ranks.stage_of(t, pp, layers) == stage:
            state[t.name] = _dtensor(t, fill(t), submesh, tp)
    return state, submesh


def save_task(ckpt: str) -> int:
    state, submesh = _stage_state(SAVE, full_tensor_of)
    coords = tuple(submesh.get_coordinate())
    for name, v in state.items():  # the DTensors hold what FSDP2 over TP would hold
        t = next(t for t in model() if t.name == name)
        want = expected_local(full_tensor_of(t), t.kind, SAVE[1], SAVE[2], coords)
        assert torch.equal(v.to_local(), want), f"{name}: built the wrong local shard"
    anyshard.save(ckpt, state)
    return len(state)


def _file_rank(path: str) -> int:
    return int(os.path.basename(path).removeprefix("rank-").removesuffix(".safetensors"))


def load_task(ckpt: str) -> dict:
    """Load under the LOAD layout, check every value, and report what planning read and chose."""
    state, submesh = _stage_state(LOAD, lambda t: torch.zeros(t.shape, dtype=torch.bfloat16))
    plans, headers = [], []
    plan_reads, read_header = anyshard.reshard.fill.plan_reads, anyshard.format.datafile.read_header

    def recording_plan_reads(*args, **kwargs):
        plans.append(plan_reads(*args, **kwargs))
        return plans[-1]

    def recording_read_header(path):
        headers.append(_file_rank(path))
        return read_header(path)

    anyshard.reshard.fill.plan_reads = recording_plan_reads
    anyshard.format.datafile.read_header = recording_read_header
    try:
        anyshard.load(ckpt, state)
    finally:
        anyshard.reshard.fill.plan_reads = plan_reads
        anyshard.format.datafile.read_header = read_header
    coords = tuple(submesh.get_coordinate())
    for t in model():
        full, got = full_tensor_of(t), state[t.name]
        want = expected_local(full, t.kind, LOAD[1], LOAD[2], coords)
        assert torch.equal(got.to_local(), want), f"{t.name}: wrong local shard after load"
        assert torch.equal(got.full_tensor(), full), f"{t.name}: wrong full tensor after load"
    (plan,) = plans
    return {
        "rank": dist.get_rank(),
        "headers": sorted(headers),
        "reads": sum(r.count for r in plan.requests),
        "bytes_read": plan.bytes_read,
        "bytes_needed": plan.bytes_needed,
        "transfer_files": sorted({tr.rank for tr in plan.transfers}),
    }
