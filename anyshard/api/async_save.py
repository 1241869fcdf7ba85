"""Asynchronous saves: stage shards in host memory, write and commit in the background.

The background thread talks to the other ranks over its own gloo process group, so that its
collectives never interleave with the training loop's on the caller's group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

__all__ = ["SaveHandle", "background_group", "stage", "submit", "wait_for_previous"]

_LOCK = threading.Lock()
_STAGING: dict[str, torch.Tensor] = {}  # fqn -> host buffer, reused by the next save
_GROUPS: dict[object, object] = {}
_EXECUTOR: list[ThreadPoolExecutor] = []
_IN_FLIGHT: list[SaveHandle] = []


class SaveHandle:
    """The pending outcome of ``anyshard.save(..., async_=True)``."""

    def __init__(self, future: Future):
        self._future = future
        self._observed = False

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the commit; raises the save's error (`SaveError` or the rank's own)."""
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise  # not finished: its outcome is still to be seen
        except BaseException:
            self._observed = True
            raise
        self._observed = True


def wait_for_previous() -> None:
    """Wait for the async save in flight, if any; raise its error (once)."""
    with _LOCK:
        pending = list(_IN_FLIGHT)
        _IN_FLIGHT.clear()
    for handle in pending:
        if handle._observed:
            handle._future.exception()  # waited for; its error was already raised to the caller
        else:
            handle.result()


def _buffer(fqn: str, t: torch.Tensor) -> torch.Tensor:
    buf = _STAGING.get(fqn)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        pin = t.device.type == "cuda" and torch.cuda.is_available()
        buf = _STAGING[fqn] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    return buf


def stage(writes: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of the shards to write in host buffers kept for the next save, so that the caller
    may change its tensors as soon as this returns."""
    staged = []
    cuda = False
    for fqn, t in writes:
        buf = _buffer(fqn, t)
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        cuda |= t.device.type == "cuda"
        staged.append((fqn, buf))
    if cuda:
        torch.cuda.synchronize()
    live = {fqn for fqn, _ in writes}
    for fqn in [k for k in _STAGING if k not in live]:
        del _STAGING[fqn]  # tensors that left the state dict
    return staged


def background_group(group):
    """A gloo group with the ranks of ``group``, for the background thread (created once;
    creating it is collective, so every rank reaches it at the same save)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = group if group is not None else "default"
    g = _GROUPS.get(key)
    if g is None:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        g = _GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return g


def submit(fn: Callable[[], None]) -> SaveHandle:
    with _LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="anyshard-save"))
        handle = SaveHandle(_EXECUTOR[0].submit(fn))
        _IN_FLIGHT.append(handle)
    return handle
