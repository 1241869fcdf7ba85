"""Task functions: incremental saves of FSDP2 x TP training state on 4 gloo ranks."""

from __future__ import annotations

import torch
from _layouts import _flat, _write_truth, full, train_state
from torch.distributed.tensor import DTensor

import anyshard
from anyshard.api.load import load_reporting


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


def read_once_load_task(layout: str, ckpt: str, truth_dir: str, seed: int, read_once: bool) -> dict:
    """Load ``ckpt`` into ``layout`` with or without read-once forwarding; check every tensor
    against torch's full tensors; return the bytes this rank fetched from storage."""
    import json
    import os

    from safetensors.torch import load_file

    state = train_state(layout, seed)
    report = load_reporting(ckpt, state, read_once=read_once)
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    with open(os.path.join(truth_dir, "values.json")) as f:
        values = json.load(f)
    for k, v in _flat(state):
        if isinstance(v, torch.Tensor):
            assert torch.equal(full(v), truth[k]), f"{k} differs after a read-once load"
        else:
            assert json.loads(json.dumps(v)) == values[k], k
    return {"read": report.bytes_read, "forwarded": report.forwarded}
