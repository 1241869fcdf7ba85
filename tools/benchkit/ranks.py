"""Processes for a benchmark: gloo ranks that join one group (`run_ranks`), a function in a fresh
interpreter (`in_fresh_process`), and `measure_ranks`, every rank's counters from a common
barrier.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .measure import measure


def _child(conn: Any, fn: Callable[..., Any], args: tuple, where: tuple) -> None:
    (rank, world, store, threads, environ), ok = where, True
    if environ is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    try:
        if store is None:
            value = fn(*args)
        else:
            import torch
            import torch.distributed as dist

            os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it
            torch.set_num_threads(threads)
            files = dist.FileStore(store, world)
            dist.init_process_group("gloo", store=files, rank=rank, world_size=world)
            value = fn(rank, world, *args)
    except BaseException as e:  # the parent raises it, naming the rank
        import traceback

        ok, value = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    conn.send((ok, value))
    if store is not None and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # gloo's threads can abort a finalizing interpreter (pytorch#179291)


def _spawn(
    fn: Callable[..., Any], args: tuple, world: int, store: str | None, threads: int
) -> list:
    """Gloo ranks (``store`` given) fork from a server that imported torch once: each rank
    starts in milliseconds and with the same modules, where a spawned rank imports torch for
    seconds; a fresh process (no ``store``) is spawned."""
    if store is None:
        ctx, environ = mp.get_context("spawn"), None
    else:
        ctx, environ = mp.get_context("forkserver"), dict(os.environ)
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = []
    for rank, (_, send) in enumerate(pipes):
        where = (rank, world, store, threads, environ)
        procs.append(ctx.Process(target=_child, args=(send, fn, args, where)))
        procs[-1].start()
        send.close()
    results, errors, waiting = [None] * world, [], {recv: r for r, (recv, _) in enumerate(pipes)}
    while waiting:  # a failed rank ends the others, which would wait for it forever
        for conn in mp.connection.wait(list(waiting)):
            rank = waiting.pop(conn)
            try:
                ok, results[rank] = conn.recv()
            except EOFError:
                ok, results[rank] = False, "the process died without a result"
            if not ok:
                errors.append(f"rank {rank} of {fn.__name__}: {results[rank]}")
                waiting.clear()
                for p in procs:
                    p.terminate()
                break
    for rank, p in enumerate(procs):
        p.join()
        if p.exitcode and not errors:
            errors.append(f"rank {rank} of {fn.__name__} exited {p.exitcode}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1) -> list[Any]:
    """Start ``world`` processes that join one gloo group (a FileStore; ``LOCAL_WORLD_SIZE``
    set as torchrun sets it; ``threads`` torch threads each) and call ``fn(rank, world,
    *args)``; the ranks' return values, in rank order. A failed rank raises, naming it."""
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as d:
        return _spawn(fn, args, world, os.path.join(d, "store"), threads)


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a freshly spawned process (nothing this process imported in it)."""
    return _spawn(fn, args, 1, None, 1)[0]


def measure_ranks(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> list[dict]:
    """Inside a rank: `measure` ``fn`` on every rank, timed from a common barrier (``before``
    runs on rank 0 between two barriers, e.g. `drop_cache`); every rank's record, rank order."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    if before is not None and dist.get_rank() == 0:
        before()
    dist.barrier()
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, measure(fn))
    return out
