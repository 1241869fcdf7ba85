"""Task functions: incremental saves of FSDP2 x TP training state on 4 gloo ranks."""

from __future__ import annotations

import torch
from _layouts import _flat, _write_truth, full, train_state
from torch.distributed.tensor import DTensor

import anyshard


def incremental_save_task(layout: str, base: str, ckpt: str, truth_dir: str, seed: int) -> dict:
    """Save a trained state as ``base`` (hashed), change the optimizer state and one weight,
    save it as ``ckpt`` on top of ``base``; rank 0 keeps torch's full tensors of the second
    state as the oracle. Returns what this rank's shards became: written or referenced."""
    state = train_state(layout, seed)
    anyshard.save(base, state, content_hash=True)
    for name, v in _flat(state):
        if isinstance(v, torch.Tensor) and (name.startswith("optim.") or name == "model.up.weight"):
            local = v.to_local() if isinstance(v, DTensor) else v
            if local.is_floating_point():
                local.add_(1.0)
    anyshard.save(ckpt, state, base=base)
    tensors = {k: full(v).contiguous() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
    _write_truth(tensors, state, truth_dir)
    manifest = anyshard.open(ckpt).manifest
    rank = torch.distributed.get_rank()
    return {"referenced": sorted(manifest.refs.get(rank, {})), "world": manifest.world_size}
