"""Task functions: a state of FSDP2-over-TP DTensors saved by torch.distributed.checkpoint."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(10, 12, generator=g),
        "model.emb": torch.randn(13, 8, generator=g).to(torch.bfloat16),
        "model.norm": torch.randn(7, generator=g),
    }


PLACEMENTS = {
    "model.w": (Shard(0), Shard(1)),
    "model.emb": (Shard(0), Shard(0)),  # FSDP over TP on one dim: strided, uneven
    "model.norm": (Replicate(), Replicate()),
}


def dcp_save_task(path: str, seed: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    state = {k: distribute_tensor(t, mesh, PLACEMENTS[k]) for k, t in full(seed).items()}
    state["step"] = 17
    dcp.save(state, checkpoint_id=path)


def dcp_load_task(path: str, seed: int) -> None:
    """Load ``path`` with torch.distributed.checkpoint into FSDP2-over-TP DTensors; every rank
    checks its shards against the full tensors."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    truth = full(seed)
    state = {
        k: distribute_tensor(torch.zeros_like(t), mesh, PLACEMENTS[k]) for k, t in truth.items()
    }
    state["step"] = 0
    dcp.load(state, checkpoint_id=path)
    for k, t in truth.items():
        want = distribute_tensor(t, mesh, PLACEMENTS[k]).to_local()
        got = state[k].to_local()
        if got.dtype != want.dtype or not torch.equal(got, want):
            raise AssertionError(f"{k}: DCP loaded other values than were converted")
    if state["step"] != 17:
        raise AssertionError(f"step: {state['step']}")
