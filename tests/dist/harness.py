"""A small multi-process harness: a pool of gloo ranks that runs test functions on every rank.

Workers are spawned once per pool and join one process group through a FileStore (tests/conftest.py
shares one pool of each size between the test modules of a session); each task runs a top-level
function of a test module on every rank, with a timeout, and leaves the workers' environment
variables and process groups as it found them: the groups a task's meshes created are destroyed
when it returns (each gloo group keeps threads that poll; a session's worth of them in every
worker cost the machine a core). After a task failed or timed out, the next module that asks for a
pool gets a fresh one. ``init=False`` spawns bare workers that join no process group
(each task sets up its own), for tests of several torch.distributed worlds.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any

from anyshard._compat import clear_dtensor_sharding_cache, process_groups
from anyshard.trainer_integration.gpt.launch import PRELOAD

# Workers fork from one server process that imported torch, its distributed packages and
# anyshard once (the warm launcher's list, `launch.PRELOAD`): a pool of 8 ranks starts in about
# a second, where 8 interpreters importing torch each took 30 s on 2 cores. A forked worker
# gets the server's environment, not the test's: tasks set what they need themselves.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["anyshard", "anyshard._compat", *PRELOAD])


def _import(path: str):
    name = "_dist_task_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _release_groups_since(before: set) -> None:
    """Destroy the process groups created since ``before`` (the default group stays), and free
    them: a destroyed gloo group's threads end when its last reference goes."""
    import gc

    import torch.distributed as dist

    new = [g for g in process_groups() - before if g is not dist.GroupMember.WORLD]
    for group in new:
        dist.destroy_process_group(group)
    new = group = None  # no reference left here
    # also where the task destroyed its groups itself (the trainer does): DTensor's caches and
    # reference cycles may still hold their meshes, and the meshes the groups
    clear_dtensor_sharding_cache()
    gc.collect()


def _worker(rank: int, world: int, store_path: str | None, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    if store_path is not None:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        path, fn, args = task
        env = dict(os.environ)
        groups = process_groups()
        try:
            out = getattr(_import(path), fn)(*args)
            results.put((rank, True, out))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
        finally:  # a task's AWS_* or LOCAL_RANK do not reach the next module's tasks
            os.environ.clear()
            os.environ.update(env)
            _release_groups_since(groups)
    if store_path is not None:
        dist.destroy_process_group()


class DistPool:
    def __init__(self, world: int, tmpdir: str, *, init: bool = True):
        self.world = world
        self._tasks = [_CTX.Queue() for _ in range(world)]
        self._results = _CTX.Queue()
        self.failed = False
        store = os.path.join(tmpdir, f"store-{world}") if init else None
        self._procs = [
            _CTX.Process(
                target=_worker, args=(r, world, store, self._tasks[r], self._results), daemon=True
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def healthy(self) -> bool:
        """Whether every worker still runs and no task failed (a failed task may leave the
        ranks' collectives out of step; a timed-out one kills the workers)."""
        return not self.failed and all(p.is_alive() for p in self._procs)

    def run(self, path: str, fn: str, *args: Any, timeout: float = 240) -> list[Any]:
        """Run ``fn(*args)`` from the module file ``path`` on every rank; results by rank."""
        return self.run_ranks(path, fn, [args] * self.world, timeout=timeout)

    def run_ranks(
        self, path: str, fn: str, args: list[tuple], *, timeout: float = 240
    ) -> list[Any]:
        """Run ``fn(*args[r])`` from the module file ``path`` on each rank r; results by rank."""
        assert len(args) == self.world, (len(args), self.world)
        for q, a in zip(self._tasks, args, strict=True):
            q.put((path, fn, tuple(a)))
        out: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + timeout
        for _ in range(self.world):
            while True:
                try:
                    rank, ok, value = self._results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close(kill=True)
                        why = f"rank(s) {dead} died" if dead else f"not done within {timeout}s"
                        raise TimeoutError(f"{fn}: {why}") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            # the ranks that failed may have left the others' collectives out of step
            self.failed = True
            raise AssertionError(f"{fn} failed:\n" + "\n".join(sorted(errors)))
        return [out[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 20)
            if p.is_alive():
                p.kill()
