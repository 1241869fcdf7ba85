"""Run as a script: 2 gloo ranks (non-daemonic processes: DCP's background process needs them as
its parents) run `_dcp_backend_tasks.dcp_async_save_task` with DCP's process-based async save:
tensor-parallel training state saved through AnyshardWriter in DCP's background process while it
changes under the save, then loaded back bit-exact. Prints "rank R ok N" (tensors checked).

Usage: python tests/dist/_dcp_process_async.py CKPT PORT
"""

from __future__ import annotations

import os
import sys

import torch.multiprocessing as mp


def _rank(rank: int, ckpt: str, port: int) -> None:
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _dcp_backend_tasks import dcp_async_save_task

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        n = dcp_async_save_task("tp2", ckpt, 4, "process", "tp2")
        sys.stdout.write(f"rank {rank} ok {n}\n")  # one write: the ranks share the pipe
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(_rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, start_method="spawn")
