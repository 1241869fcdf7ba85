"""Shared worker threads for I/O: started once per process, not once per save or load."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["cpu_share", "io_pool", "lower_thread_priority", "thread_nice"]

_LOCK = threading.Lock()
_POOLS: dict[tuple[int, int], tuple[int, ThreadPoolExecutor]] = {}


def thread_nice() -> int:
    """The calling thread's nice value where threads have their own (Linux), else 0."""
    if sys.platform != "linux":
        return 0
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return 0


def lower_thread_priority(nice: int) -> int:
    """Raise the calling thread's nice value to ``nice`` (Linux only, where each thread has its
    own; elsewhere the call would reach the whole process, and does nothing). A value below the
    current one needs privileges: without them the thread keeps its value. Returns the value the
    thread has afterwards.

    Threads that this thread starts inherit its value: `io_pool` therefore keeps one pool per
    value, so that work submitted from a low-priority thread never starts workers that later
    serve normal-priority callers."""
    current = thread_nice()
    if sys.platform != "linux" or nice == current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:  # lowering the value back needs CAP_SYS_NICE or RLIMIT_NICE
        pass
    return thread_nice()


def io_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` workers (re-created after a fork), one per nice value
    of the calling thread: its workers start from the threads that submit to it, and inherit
    their priority (`lower_thread_priority`)."""
    key = (threads, thread_nice())
    with _LOCK:
        pid = os.getpid()
        hit = _POOLS.get(key)
        if hit is None or hit[0] != pid:
            hit = (pid, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="anyshard-io"))
            _POOLS[key] = hit
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
