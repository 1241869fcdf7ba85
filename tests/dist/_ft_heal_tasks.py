"""Processes for tests/dist/test_ft_heal.py: two replica groups, each its own torch.distributed
world (its own store and default process group), healed across by `AnyshardTransport`."""

from __future__ import annotations

import os
import pickle
import sys
import traceback
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


def group_main(role: str, layout: str, rank: int, port: int, src_port: int, out_path: str):
    """One rank of a replica group: ``role`` "source" serves its state, "healer" receives."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        from anyshard.trainer_integration.ft import AnyshardTransport

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("w/", store), rank=rank, world_size=2
        )
        for name in ("loads", "load", "dumps", "dump"):
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
            with open(f"{out_path}.meta{rank}", "w") as f:
                f.write(meta)
            payload = {"user": state, "torchft": {"step": 12, "batches_committed": 24}}
            transport.send_checkpoint([1], 12, payload, timedelta(seconds=60))
            result = {"sent": transport.last["sent_bytes"]}
        else:
            import time

            path = f"{out_path}.meta{rank}".replace("healer", "source")
            while not os.path.exists(path):
                time.sleep(0.05)
            time.sleep(0.1)
            meta = open(path).read()
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
        dist.destroy_process_group()
        with open(f"{out_path}.{rank}.ok", "w") as f:
            f.write(repr(result))
    except BaseException:
        with open(f"{out_path}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
