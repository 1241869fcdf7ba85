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

from anyshard.api import collectives as coll

__all__ = [
    "SaveHandle",
    "background_group",
    "current_stream_event",
    "reserve",
    "stage",
    "start",
    "submit",
    "wait_for_previous",
]

_LOCK = threading.Lock()
_STAGING: dict[str, torch.Tensor] = {}  # fqn -> host bytes, reused by the next save
_GROUPS: dict[object, object] = {}
_EXECUTOR: list[ThreadPoolExecutor] = []
_IN_FLIGHT: list[SaveHandle] = []


class SaveHandle:
    """The pending outcome of ``anyshard.save(..., async_=True)``."""

    def __init__(self, future: Future, staged: threading.Event | None = None):
        self._future = future
        self._observed = False
        self._staged = staged

    def staged(self) -> bool:
        """Whether the shards are in the staging buffers (the saved tensors may change)."""
        return self._staged is None or self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the shards are copied into the staging buffers, after which the saved
        tensors may be modified (immediate unless the save deferred its staging). Returns
        whether they are (False only on timeout); a failed staging surfaces at `result`."""
        return self._staged is None or self._staged.wait(timeout)

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
    """A host buffer shaped like ``t``: a view of the bytes kept for ``fqn`` (reallocated only
    when they are too few), pinned when ``t`` is on a GPU."""
    nbytes = t.numel() * t.element_size()
    pin = t.device.type == "cuda" and torch.cuda.is_available()
    buf = _STAGING.get(fqn)
    if buf is None or buf.numel() < nbytes or (pin and not buf.is_pinned()):
        buf = _STAGING[fqn] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return buf[:nbytes].view(t.dtype).view(t.shape)


def reserve(tensors: dict[str, torch.Tensor]) -> int:
    """Allocate (pinned for GPU tensors) and touch the staging buffers of ``tensors`` (fqn ->
    this rank's local tensor) now, so that the first async save neither allocates nor faults
    pages in. Returns the bytes reserved."""
    total = 0
    for fqn, t in tensors.items():
        _buffer(fqn, t).view(-1).view(torch.uint8).fill_(0)
        total += t.numel() * t.element_size()
    return total


def current_stream_event():
    """An event recorded on the current CUDA stream (None without CUDA): a copy that waits
    for it sees every kernel queued so far, an optimizer step included."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def stage(writes: Sequence[tuple[str, torch.Tensor]], after=None) -> list[tuple[str, torch.Tensor]]:
    """Copies of the shards to write in host buffers kept for the next save, so that the caller
    may change its tensors as soon as this returns. Device tensors are copied on a side stream
    that first waits for ``after`` (`current_stream_event`), then synchronised."""
    staged = []
    cuda = any(t.device.type == "cuda" for _, t in writes)
    stream = torch.cuda.Stream() if cuda else None
    if stream is not None and after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        for fqn, t in writes:
            buf = _buffer(fqn, t)
            buf.copy_(t, non_blocking=t.device.type == "cuda")
            staged.append((fqn, buf))
    if stream is not None:
        stream.synchronize()
    live = {fqn for fqn, _ in writes}
    for fqn in [k for k in _STAGING if k not in live]:
        del _STAGING[fqn]  # tensors that left the state dict
    return staged


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def background_group(group):
    """A gloo group with the ranks of ``group``, for the background thread (created once;
    creating it is collective, so every rank reaches it at the same save)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = group if group is not None else "default"
    g = _GROUPS.get(key)
    if g is None or not coll.alive(g):
        # destroyed since (with the group it serves, or by a re-initialised default group):
        # every rank finds it so at the same save, and creates it anew
        for k, v in list(_GROUPS.items()):
            if not coll.alive(v):
                del _GROUPS[k]
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        g = _GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return g


def _executor() -> ThreadPoolExecutor:
    with _LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="anyshard-save"))
        return _EXECUTOR[0]


def start(group) -> None:
    """Start the save thread and create its gloo group for ``group`` now (collective over
    ``group``, like the first async save), so that the first save does neither while the
    training loop waits."""
    background_group(group)
    _executor().submit(lambda: None).result()


def submit(fn: Callable[[], object], staged: threading.Event | None = None) -> SaveHandle:
    executor = _executor()
    with _LOCK:
        handle = SaveHandle(executor.submit(fn), staged)
        _IN_FLIGHT.append(handle)
    return handle
