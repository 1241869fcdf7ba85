"""Each rank's own work per step: what it spends on its own part of the step, as opposed to
waiting in collectives for the others, measured alike whatever makes a rank slow (a slower
device, a core shared with a noisy neighbour, more work, a slow data phase).

On the host (gloo) a rank blocks in a collective where it waits for its result:
``Work.wait`` (every c10d collective, sync ones included, and the pipeline's sends and
receives) and the functional collectives' ``wait_tensor`` (DTensor: tensor parallelism, FSDP2's
redistributions). `WaitClock` times those waits on the training thread; a rank's own work is
its step's wall time less them (`WaitClock.own`). The rank that arrives last at a collective
waits least: its own work is the longest.

On an accelerator a wait does not block the host (the stream waits), so the host's clocks do not
see it; there `BlockTimer` records device events around each transformer block's forward and
backward instead, and a rank's own work is their device time plus what the host spent outside
the model before it (its data loading).

    >>> clock = WaitClock()
    >>> with clock:
    ...     clock.begin()
    ...     clock.blocked_s
    0.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from anyshard._compat import functional_collectives

__all__ = ["BlockTimer", "WaitClock", "blocked_in", "hook_blocks"]

_lock = threading.Lock()
_local = threading.local()
_clocks: list[WaitClock] = []  # the installed clocks
_originals: dict[str, Any] = {}
_now = time.perf_counter  # the clock the waits are timed with


def _work_class() -> Any:
    import torch.distributed as dist

    return dist.Work


def _timed(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``wait``, its blocking time added to the clocks of the thread that calls it (a wait
    inside another, as ``wait_tensor`` waits its ``Work``, counts once)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "inside", False) or not _clocks:
            return wait(*args, **kwargs)
        _local.inside = True
        began = _now()
        try:
            return wait(*args, **kwargs)
        finally:
            blocked_in(_now() - began)
            _local.inside = False

    timed.__wrapped__ = wait  # type: ignore[attr-defined]
    timed.__doc__ = wait.__doc__
    return timed


def blocked_in(seconds: float) -> None:
    """Book ``seconds`` of waiting for the others to the clocks of the calling thread (the
    collectives' waits call it; a test injects waits with it)."""
    me = threading.get_ident()
    with _lock:
        for clock in _clocks:
            if clock.thread == me:
                clock.blocked_s += seconds


def _install() -> None:
    funcol = functional_collectives()
    work = _work_class()
    _originals["work_wait"] = work.wait
    _originals["wait_tensor"] = funcol.wait_tensor
    work.wait = _timed(work.wait)
    funcol.wait_tensor = _timed(funcol.wait_tensor)


def _uninstall() -> None:
    funcol = functional_collectives()
    _work_class().wait = _originals.pop("work_wait")
    funcol.wait_tensor = _originals.pop("wait_tensor")


def hook_blocks(model: Any, kind: type, before: Callable, after: Callable) -> None:
    """``before`` and ``after`` as the forward pre-hook and hook of each ``kind`` block of
    ``model`` (the straggler's and the accelerator's block timers)."""
    blocks: list[Any] = [m for m in model.modules() if isinstance(m, kind)]
    for block in blocks:
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)


class WaitClock:
    """The time the thread that entered it spends blocked in collectives, from `begin` on.

    A context manager: entering it wraps ``torch.distributed.Work.wait`` and
    ``_functional_collectives.wait_tensor`` (once for all clocks; the last to leave restores
    them). Waits on other threads (a background save's) are not this thread's."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.blocked_s = 0.0

    def __enter__(self) -> WaitClock:
        with _lock:
            if not _clocks:
                _install()
            self.thread = threading.get_ident()
            _clocks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _clocks.remove(self)
            if not _clocks:
                _uninstall()

    def begin(self) -> None:
        """A step starts: its blocked time starts from zero."""
        with _lock:
            self.blocked_s = 0.0

    def own(self, wall_s: float) -> float:
        """A step of ``wall_s`` seconds (since `begin`): this rank's own work in it, the wall
        time less the waits."""
        with _lock:
            return max(0.0, wall_s - self.blocked_s)


class BlockTimer:
    """On an accelerator: the device time of each transformer block's forward and backward on
    this rank, from events recorded on the current stream as each starts and ends (after the
    block's parameters arrived, so waits for the others' all-gathers fall outside). Its hooks
    go after the straggler's (`straggler.Straggler`), so an injected slowdown falls inside."""

    def __init__(self) -> None:
        self.model: Any = None
        self.pairs: list[tuple[Any, Any]] = []

    def arm(self, model: Any) -> None:
        """Before a step of ``model``: forget the last step's events; hook a new model's blocks."""
        self.pairs = []
        if self.model is model:
            return
        from anyshard.trainer_integration.gpt.model import TransformerBlock

        self.model = model
        hook_blocks(model, TransformerBlock, self._before_forward, self._after_forward)

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _before_forward(self, module: Any, args: Any) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad: self._end(module, "_timer_backward"))
        module._timer_forward = self._event()

    def _end(self, module: Any, name: str) -> None:
        began = getattr(module, name, None)
        if began is not None:
            self.pairs.append((began, self._event()))
            setattr(module, name, None)

    def _after_forward(self, module: Any, args: Any, out: Any) -> None:
        self._end(module, "_timer_forward")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: setattr(module, "_timer_backward", self._event()))

    def seconds(self) -> float:
        """The blocks' device time in the step (synchronises the device)."""
        if not self.pairs:
            return 0.0
        torch.cuda.synchronize()
        total = sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        self.pairs = []
        return total
