"""Save under one parallel layout, load under others: the anyshard round trip in one script.

    python examples/reshard_demo.py [--dir DIR]

Starts 4 CPU processes (gloo), forked from a server process that imports torch and anyshard
once for all of them. They build a small model's state as DTensors under
FSDP2 x TP (dp_shard=2 x tp=2) and save it with anyshard.save. Then 4 processes load it under
tp=4, 2 processes under dp_shard=2, and this process loads it as plain tensors; every load is
compared bit for bit with the original full tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import anyshard

SHAPES = {
    "embed.weight": (50, 16),
    "attn.wq.weight": (24, 16),
    "attn.wo.weight": (16, 24),
    "norm.weight": (16,),
}


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def placements_for(name: str, layout: str):
    from torch.distributed.tensor import Replicate, Shard

    if layout == "fsdp2xtp2":
        tp = {"attn.wq.weight": Shard(0), "attn.wo.weight": Shard(1)}.get(name, Replicate())
        return (Shard(0), tp)
    if layout == "tp4":
        return ({"attn.wq.weight": Shard(0), "attn.wo.weight": Shard(1)}.get(name, Replicate()),)
    return (Shard(0),)  # dp_shard


def sharded_state(layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dims = {
        "fsdp2xtp2": ((2, 2), ("dp_shard", "tp")),
        "tp4": ((4,), ("tp",)),
        "dp2": ((2,), ("dp_shard",)),
    }
    sizes, names = dims[layout]
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    return {
        k: distribute_tensor(v, mesh, placements_for(k, layout)) for k, v in full_state().items()
    }


def worker(rank: int, world: int, init: str, path: str, layout: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if mode == "save":
            state = sharded_state(layout)
            anyshard.save(path, {"model": state, "step": 100})
            if rank == 0:
                local = {k: tuple(v.to_local().shape) for k, v in state.items()}
                print(f"  saved under {layout} on {world} ranks; rank 0 holds {local}")
        else:
            state = {
                "model": {k: torch.zeros_like(v) for k, v in sharded_state(layout).items()},
                "step": 0,
            }
            anyshard.load(path, state)
            for k, v in state["model"].items():
                assert torch.equal(v.full_tensor(), full_state()[k]), f"{k} differs"
            if rank == 0:
                print(
                    f"  loaded under {layout} on {world} ranks: all {len(SHAPES)} tensors bit-exact, step={state['step']}"
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker threads can abort the process
    # there after a clean run ("terminate called without an active exception", pytorch#179291).
    sys.stdout.flush()
    os._exit(0)


def run(world: int, path: str, layout: str, mode: str, tmp: str) -> None:
    init = "file://" + os.path.join(tmp, f"rdzv-{mode}-{layout}")
    mp.start_processes(
        worker, args=(world, init, path, layout, mode), nprocs=world, start_method="forkserver"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        help="where to write the checkpoint, kept afterwards (default: a temporary directory, "
        "removed at the end)",
    )
    args = parser.parse_args(argv)
    mp.set_forkserver_preload(["torch", "torch.distributed", "anyshard"])
    with tempfile.TemporaryDirectory(prefix="anyshard-demo-") as tmp:
        return _demo(os.path.join(args.dir or tmp, "step-000100"), tmp)


def _demo(path: str, tmp: str) -> int:
    print(f"anyshard {anyshard.__version__}: checkpoint at {path}")
    run(4, path, "fsdp2xtp2", "save", tmp)
    with anyshard.open(path) as ckpt:
        for name in ckpt.keys():
            meta = ckpt.metadata(name)
            print(
                f"  {name:16s} {str(list(meta.shape)):9s} {meta.num_shards} stored shard(s), mapping {meta.mapping!r}"
            )
    run(4, path, "tp4", "load", tmp)
    run(2, path, "dp2", "load", tmp)
    state = {"model": {k: torch.empty(s) for k, s in SHAPES.items()}, "step": 0}
    anyshard.load(path, state)
    assert all(torch.equal(state["model"][k], v) for k, v in full_state().items())
    print(
        f"  loaded in 1 process as plain tensors: bit-exact; a slice reads only its bytes: "
        f"model.embed.weight[3, :4] = {[round(x, 4) for x in anyshard.open(path).get_slice('model.embed.weight')[3, :4].tolist()]}"
    )
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
