"""Shared worker threads for I/O: started once per process, not once per save or load."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["cpu_share", "io_pool"]

_LOCK = threading.Lock()
_POOLS: dict[int, tuple[int, ThreadPoolExecutor]] = {}


def io_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` workers (re-created after a fork)."""
    with _LOCK:
        pid = os.getpid()
        hit = _POOLS.get(threads)
        if hit is None or hit[0] != pid:
            hit = (pid, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="anyshard-io"))
            _POOLS[threads] = hit
        return hit[1]


def cpu_share() -> int:
    """This process's share of the CPUs it may run on: the CPUs of its affinity mask divided
    among the job's processes on this host (``LOCAL_WORLD_SIZE``, which torchrun and torch's
    elastic agent set; 1 when unset), at least 1.

    Reads of local files that hit the page cache are memory copies and checksums: bound by the
    CPU, so that more reading threads than the process's share of the CPUs only add context
    switches. Remote reads wait on the network and keep their thread count.

    >>> cpu_share() >= 1
    True
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cpus = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    return max(1, cpus // max(local, 1))
