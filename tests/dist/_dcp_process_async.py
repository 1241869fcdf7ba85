"""Run as a script: 2 gloo ranks (non-daemonic processes: DCP's background process needs them as
its parents) save a tensor-parallel model's state with dcp.async_save through AnyshardWriter in
DCP's background process, changing the state under the save; the checkpoint must hold the state
of the call, read back bit-exact. Prints "rank R ok N" (tensors checked) for each rank.

Usage: python tests/dist/_dcp_process_async.py CKPT PORT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp


def _rank(rank: int, ckpt: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import anyshard
    from anyshard.dcp import AnyshardWriter

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _layouts import _flat, full, train_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        state = train_state("tp2", 4)
        before = {k: full(v).clone() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
        future = dcp.async_save(
            state,
            storage_writer=AnyshardWriter(ckpt),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        for _, v in _flat(state):  # the caller may modify its tensors once async_save returns
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                (v.to_local() if hasattr(v, "to_local") else v).add_(1000.0)
        future.result()
        dist.barrier()
        with anyshard.open(ckpt) as view:
            for k, t in before.items():
                assert torch.equal(view.get_tensor(k), t), f"{k}: not the state at the call"
        print(f"rank {rank} ok {len(before)}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(_rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, start_method="spawn")
