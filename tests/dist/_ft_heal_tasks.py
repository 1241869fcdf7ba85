"""Processes for tests/dist/test_ft_heal.py: two replica groups, each its own torch.distributed
world (its own store and default process group), healed across by `AnyshardTransport`."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

SHAPES = {"w": (6, 4), "b": (5,), "emb": (7, 3)}


def logical(name: str, salt: float) -> torch.Tensor:
    n = 1
    for s in SHAPES[name]:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(SHAPES[name]) * (1 + salt) + salt


def _state(layout: str, fill: bool):
    """``{"default": state}`` in ``layout`` (dp2: rows sharded; tp2: columns; repl2: replicated
    DTensors), filled with the logical values (the source) or zeros (the healer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(layout[:-1],))
    place = {"dp2": [Shard(0)], "tp2": [Shard(-1)], "repl2": [Replicate()]}[layout]
    model = {}
    optim = {}
    for name in SHAPES:
        full = logical(name, 0.0) if fill else torch.zeros(SHAPES[name])
        model[name] = distribute_tensor(full, mesh, place)
        moment = logical(name, 0.5) if fill else torch.zeros(SHAPES[name])
        optim[f"state.{name}.exp_avg"] = distribute_tensor(moment, mesh, place)
    state = {
        "model": model,
        "optim": optim,
        "rng": torch.arange(16, dtype=torch.uint8) if fill else torch.zeros(16, dtype=torch.uint8),
        "data": {"samples_consumed": 96 if fill else 0},
        "step": 12 if fill else 0,
    }
    return {"default": state}


def _refuse(*args, **kwargs):
    raise AssertionError("the heal must not pickle or unpickle")


def _write_atomic(path: str, text: str) -> None:
    """``path`` appears whole or not at all: a reader that polls for it never reads a part."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def group_main(role: str, layout: str, rank: int, port: int, src_port: int, out_path: str):
    """One rank of a replica group, in a process of its own that is in no process group yet:
    ``role`` "source" serves its state, "healer" receives it. Returns what it sent or checked;
    the process's default process group is destroyed again, and pickle restored, on return."""
    import time

    from anyshard.trainer_integration.heal import AnyshardTransport

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("w/", store), rank=rank, world_size=2)
    saved = {name: getattr(pickle, name) for name in ("loads", "load", "dumps", "dump")}
    try:
        for name in saved:
            setattr(pickle, name, _refuse)
        state = _state(layout, role == "source")
        transport = AnyshardTransport(
            state=lambda: _state(layout, False),
            replica_id=f"{role}-group",
            group_rank=rank,
            group_world_size=2,
            store_addr="127.0.0.1",
            store_port=port,
            timeout=timedelta(seconds=60),
        )
        meta = transport.metadata()
        if role == "source":
            _write_atomic(f"{out_path}.meta{rank}", meta)
            payload = {"user": state, "torchft": {"step": 12, "batches_committed": 24}}
            transport.send_checkpoint([1], 12, payload, timedelta(seconds=60))
            result = {"sent": transport.last["sent_bytes"]}
        else:
            path = f"{out_path}.meta{rank}".replace("healer", "source")
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                assert time.monotonic() < deadline, f"{path} did not appear"
                time.sleep(0.05)
            with open(path) as f:
                meta = f.read()
            got = transport.recv_checkpoint(0, meta, 12, timedelta(seconds=60))
            sd = got["user"]["default"]
            checked = 0
            for name in SHAPES:
                assert torch.equal(sd["model"][name].full_tensor(), logical(name, 0.0)), name
                exp = sd["optim"][f"state.{name}.exp_avg"].full_tensor()
                assert torch.equal(exp, logical(name, 0.5)), name
                checked += 2
            assert torch.equal(sd["rng"], torch.arange(16, dtype=torch.uint8))
            assert sd["data"] == {"samples_consumed": 96} and sd["step"] == 12, sd
            assert got["torchft"] == {"step": 12, "batches_committed": 24}, got["torchft"]
            result = {"checked": checked, "received": transport.last["received_bytes"]}
        dist.barrier()
    finally:
        for name, fn in saved.items():
            setattr(pickle, name, fn)
        dist.destroy_process_group()
    return result
