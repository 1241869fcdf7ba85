"""How the ranks' C allocator returns freed memory, so that a memory budget holds.

glibc's malloc raises its mmap threshold each time a large block mapped on its own is freed
(up to 32 MiB): after the first steps, tensors of up to that size come from the heap, and what
they leave behind when they are freed stays resident. Under FSDP, which gathers every block's
parameters and makes its gradients afresh each step, a rank's RSS then runs 20-30% above the
tensors it holds at once (`tools/bench_autolayout.py --memory-gib`), so that a layout counted
within the budget can exceed it.

The ``lean`` mode fixes the threshold at 1 MiB: every allocation of 1 MiB or more is mapped on
its own and unmapped when freed, so that RSS follows the tensors. Mapping afresh costs page
faults; the launcher (`launch.launch`) also starts the ranks with transparent huge pages for
malloc's mappings (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc 2.35 or later), which makes
that cheaper. The trainer uses ``lean`` where a memory budget is set on a job that runs on the host
(``train.malloc = auto`` and ``parallel.auto_memory_gib``), or where ``train.malloc = lean``.

Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes

__all__ = ["HUGETLB_TUNABLE", "LEAN_MMAP_THRESHOLD", "hugepage_env", "set_lean", "wanted"]

LEAN_MMAP_THRESHOLD = 1 << 20  # bytes: allocations this large or larger are mapped on their own
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def wanted(mode: str, budget_gib: float | None, *, on_accelerator: bool = False) -> bool:
    """Whether the ranks run ``lean``: ``mode`` is ``train.malloc``; ``auto`` is lean where a
    memory budget is set and the job runs on the host (on an accelerator the budget counts
    the accelerator's memory, which the host's allocator does not hold)."""
    return mode == "lean" or (mode == "auto" and budget_gib is not None and not on_accelerator)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc alone has it)
    except (OSError, AttributeError):
        return None
    return libc


def set_lean() -> bool:
    """Fix this process's mmap threshold at `LEAN_MMAP_THRESHOLD`; whether it was set (False
    where the C library is not glibc). It holds for the rest of the process."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD) == 1)


def hugepage_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with huge pages for malloc's mappings added to ``GLIBC_TUNABLES``, for
    processes started afresh (glibc reads it only at a process's start); a value the user set
    is kept. Huge pages alone leave the dynamic threshold as it is: the threshold is set in
    the rank (`set_lean`), so that a process started with this environment is lean only where
    the trainer asks."""
    out = dict(env)
    tunables = [x for x in out.get("GLIBC_TUNABLES", "").split(":") if x]
    if not any(x.startswith("glibc.malloc.hugetlb=") for x in tunables):
        out["GLIBC_TUNABLES"] = ":".join([*tunables, HUGETLB_TUNABLE])
    return out
