"""Helper of tests/unit/test_crash_safety.py: saving process groups to kill, and their state.

``python tests/crash_worker.py`` runs a zygote: it imports torch and anyshard once, prints
``ready``, then reads JSON commands on stdin, one a line, and answers each with one JSON line:

- ``{"cmd": "spawn", "root": ROOT, "store": FILE, "log": PREFIX, "mode": M, "local": DIR}``
  forks a process group of
  `WORLD` ranks (one POSIX process group, led by rank 0, so ``os.killpg`` kills them all). Each
  rank joins a gloo group through a FileStore at ``FILE`` (a fresh name per spawn), restores the
  newest committed step under ``ROOT`` with `Checkpointer.restore_latest`, checks it bit-exact
  against `expected_state`, and then saves steps restored+1, restored+2, ... with a
  ``Checkpointer(ROOT, every_steps=1, keep_last=KEEP_LAST)`` until it is killed (a job under
  ``torchrun --max-restarts``). ``mode`` "async" saves with ``async_=True``; "tiered" saves
  to ``DIR`` (the node's local disk) first and uploads to ``ROOT`` in the background;
  "incremental" saves with ``incremental=True`` a state that also holds a tensor ``f`` that
  never changes, so that every step references the first step's copy of it. Output goes to ``PREFIX-rank<r>.log``. Answer: ``{"pids": [...]}``.
- ``{"cmd": "reap"}`` waits for the ranks of the last spawn; answer ``{"status": [...]}``
  (``os.waitpid`` statuses).
- ``{"cmd": "quit"}``.

Forking from the zygote saves the 3 s import of torch at every restart. The ranks write nothing
the test relies on besides the checkpoints: the test reads only what is on disk.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

WORLD = 2
KEEP_LAST = 2
W_SHAPE = (1024, 640)  # float32, 2.5 MiB, a DTensor sharded on dim 0 over the 2 ranks
B_SHAPE = (512, 1024)  # bfloat16, 1 MiB, a plain (replicated) tensor
MAX_STEPS = 100_000


F_SHAPE = (512, 512)  # float32, 1 MiB, a plain tensor the same at every step (incremental)


def expected_state(step: int, fixed: bool = False) -> dict:
    """The full (unsharded) state saved at ``step``: derived from the step number only (and,
    with ``fixed``, a tensor ``f`` that is the same at every step)."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    w = torch.randn(W_SHAPE, generator=g)
    bits = torch.randint(-(2**15), 2**15, B_SHAPE, dtype=torch.int16, generator=g)
    b = bits.view(torch.bfloat16)  # arbitrary bit patterns, NaNs included: compared as bits
    state = {
        "model": {"w": w, "b": b},
        "extra": {"step": step, "tag": f"step-{step}", "sizes": [step % 7, step % 11]},
    }
    if fixed:
        state["model"]["f"] = torch.randn(F_SHAPE, generator=torch.Generator().manual_seed(5))
    return state


def template(fixed: bool = False) -> dict:
    """A state to restore into, as plain tensors (the layout a single process loads under)."""
    state = {
        "model": {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_SHAPE, dtype=torch.bfloat16)},
        "extra": {"step": -1, "tag": "", "sizes": []},
    }
    if fixed:
        state["model"]["f"] = torch.zeros(F_SHAPE)
    return state


def bit_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _sharded_state(step: int, mesh, fixed: bool = False) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    full = expected_state(step, fixed)
    rank = mesh.get_local_rank()
    local = full["model"]["w"].chunk(WORLD, dim=0)[rank].contiguous()
    full["model"]["w"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return full


def _check_restored(state: dict, step: int, rank: int) -> None:
    want = expected_state(step, "f" in state["model"])
    if "f" in state["model"] and not bit_exact(state["model"]["f"], want["model"]["f"]):
        raise AssertionError(f"rank {rank}: restored step {step}: f is not bit-exact")
    w = state["model"]["w"].to_local()
    if not bit_exact(w, want["model"]["w"].chunk(WORLD, dim=0)[rank]):
        raise AssertionError(f"rank {rank}: restored step {step}: w is not bit-exact")
    if not bit_exact(state["model"]["b"], want["model"]["b"]):
        raise AssertionError(f"rank {rank}: restored step {step}: b is not bit-exact")
    if state["extra"] != want["extra"]:
        raise AssertionError(f"rank {rank}: restored step {step}: extra {state['extra']}")


def rank_main(
    rank: int, root: str, store_path: str, mode: str = "sync", local: str | None = None
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from anyshard.trainer_integration import Checkpointer

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    ckpt = Checkpointer(
        root,
        every_steps=1,
        keep_last=KEEP_LAST,
        async_=mode == "async",
        local_dir=local if mode == "tiered" else None,
        incremental=mode == "incremental",
    )
    fixed = mode == "incremental"
    state = _sharded_state(0, mesh, fixed)  # a template under this run's layout
    restored = ckpt.restore_latest(state) or 0
    print(f"rank {rank}: restored step {restored}", flush=True)
    if restored:
        _check_restored(state, restored, rank)
    for step in range(restored + 1, MAX_STEPS):
        ckpt.save(step, _sharded_state(step, mesh, fixed))
    ckpt.wait()


def _fork_rank(rank: int, pgid: int, msg: dict) -> int:
    pid = os.fork()
    if pid == 0:  # the rank: never returns
        code = 1
        try:
            os.setpgid(0, pgid)
            log = os.open(f"{msg['log']}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            rank_main(rank, msg["root"], msg["store"], msg.get("mode", "sync"), msg.get("local"))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        os.setpgid(pid, pgid or pid)  # as the child does, whichever runs first
    except OSError:
        pass
    return pid


def zygote() -> None:
    import torch.distributed  # noqa: F401  (imported once, here, for every fork)
    import torch.distributed.tensor  # noqa: F401

    import anyshard.trainer_integration  # noqa: F401

    torch.set_num_threads(1)
    pids: list[int] = []
    print("ready", flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "spawn":
            pids = []
            for rank in range(WORLD):
                pids.append(_fork_rank(rank, pids[0] if pids else 0, msg))
            answer: dict = {"pids": pids}
        elif msg["cmd"] == "reap":
            answer = {"status": [os.waitpid(p, 0)[1] for p in pids]}
            pids = []
        else:
            break
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    zygote()
