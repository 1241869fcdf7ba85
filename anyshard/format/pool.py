"""Shared worker threads for I/O: started once per process, not once per save or load."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["io_pool"]

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
