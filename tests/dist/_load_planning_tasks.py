"""Task functions run on every rank by the harness: read-once loads of a local checkpoint, counting
how often the load plans (reads the manifest and checks the state dict against it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import anyshard
import anyshard.api.load


def planned_loads_task(path: str, planner: str) -> dict[str, int]:
    """Save ``w`` (rows split over the ranks) to ``path``, then load it read-once as a replicated
    DTensor (a replica split) and split by columns (read once by stored shards); check both;
    how many times each load called ``anyshard.api.load.<planner>``."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    full = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    anyshard.save(path, {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 4})
    original = getattr(anyshard.api.load, planner)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    counts = {}
    setattr(anyshard.api.load, planner, counted)
    try:
        for route, placement in (("replica split", Replicate()), ("stored shards", Shard(1))):
            calls[0] = 0
            state = {"w": distribute_tensor(torch.zeros_like(full), mesh, [placement]), "step": 0}
            anyshard.load(path, state, read_once=True)
            assert torch.equal(state["w"].full_tensor(), full) and state["step"] == 4, route
            counts[route] = calls[0]
    finally:
        setattr(anyshard.api.load, planner, original)
    return counts
