"""The injected straggler (``ANYSHARD_SLOW``): one rank made slower, in one of four ways, for
trying the layout chooser's data shares on a machine whose ranks are alike.

``ANYSHARD_SLOW=rank:factor[:from_step[:until_step]][:mode]``, from step ``from_step`` until
step ``until_step`` (left out: to the end), the rank runs ``factor`` times slower:

- ``sleep`` (the default): each transformer block's forward and backward sleep ``factor - 1``
  times their compute as they end, where a slow device's compute would be (between the block's
  collectives: the other ranks compute meanwhile, and a smaller data share shortens it);
- ``compute``: the same blocks do ``factor - 1`` times their compute more, for real (matrix
  multiplies on the rank's own tensors), as a rank with more work does;
- ``data``: the rank's data loading takes ``factor - 1`` times its blocks' compute of the step
  before (sleeping, as a slow reader does): a rank slow in one phase only;
- ``neighbour``: every rank is pinned to a core of its own (`pin_to_own_core`) and
  ``factor - 1`` busy processes are pinned beside the slow rank, which gets ``1/factor`` of its
  core: it waits for the CPU and burns no more CPU time than the others.

The scheduler never reads the factor: it measures each rank's own work (`waits`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch

from anyshard.trainer_integration.gpt.layout_chooser.waits import hook_blocks

__all__ = ["Straggler", "pin_to_own_core", "set_process_affinity"]

_BUSY = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:  # a neighbour that outlives its rank stops at once
    for _ in range(100000):
        pass
"""


def set_process_affinity(cores: set[int]) -> None:
    """Let every thread of this process (gloo's and torch's included, which
    ``os.sched_setaffinity(0, ...)`` alone leaves as they are) run only on ``cores``."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            pass
    os.sched_setaffinity(0, cores)


def pin_to_own_core(local_rank: int) -> int | None:
    """Pin this process (every thread) to one core of those it may run on, the
    ``local_rank``-th (modulo their number: ranks share cores only when there are fewer); the
    core, or None where the platform cannot pin (no ``os.sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local_rank % len(cores)]
    set_process_affinity({core})
    return core


class Straggler:
    """``ANYSHARD_SLOW`` on this rank (see the module's description). ``slept``: seconds
    slept so far (sleep and data modes); ``extra``: seconds of extra compute so far."""

    def __init__(
        self,
        factor: float,
        from_step: int,
        cuda: bool,
        *,
        until: int | None = None,
        mode: str = "sleep",
    ):
        self.factor, self.from_step, self.until = factor, from_step, until
        self.mode, self.cuda = mode, cuda
        self.on, self.slept, self.extra = False, 0.0, 0.0
        self.model: Any = None  # the model whose blocks are hooked (a switch builds another)
        self.blocks_s = 0.0  # the blocks' compute in the current step
        self.last_blocks_s = 0.0  # and in the step before (the data mode's measure)
        self.neighbours: list[subprocess.Popen] = []
        self._work: tuple[torch.Tensor, torch.Tensor] | None = None

    def due(self, step: int) -> bool:
        """Whether step ``step`` is slow."""
        return self.from_step <= step and (self.until is None or step < self.until)

    def arm(self, model, step: int) -> None:
        """Before step ``step`` of ``model``: slow or not; start or stop the neighbours; hook a
        new model's blocks."""
        self.on = self.due(step)
        self.last_blocks_s, self.blocks_s = self.blocks_s, 0.0
        if self.mode == "neighbour":
            if self.on and not self.neighbours:
                self._start_neighbours()
            elif not self.on and self.neighbours:
                self.close()
        if self.model is model:
            return
        from anyshard.trainer_integration.gpt.model import TransformerBlock

        self.model = model
        hook_blocks(model, TransformerBlock, self._before_forward, self._after_forward)

    def data_phase(self) -> None:
        """After this rank's batch is loaded: the data mode's slow loading."""
        if self.on and self.mode == "data":
            pause = (self.factor - 1) * self.last_blocks_s
            self.slept += pause
            time.sleep(pause)

    def close(self) -> None:
        """Stop the neighbours (the end of the slow steps, or of the run)."""
        for p in self.neighbours:
            p.terminate()
        for p in self.neighbours:
            p.wait()
        self.neighbours = []

    def _start_neighbours(self) -> None:
        # children inherit this rank's affinity: pinned to its core (`pin_to_own_core`)
        for _ in range(round(self.factor) - 1):
            args = [sys.executable, "-c", _BUSY, str(os.getpid())]
            self.neighbours.append(subprocess.Popen(args, stdin=subprocess.DEVNULL))

    def _clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def _compute_more(self, seconds: float) -> None:
        """``seconds`` of real extra compute on this rank: multiplies of its own tensors."""
        if self._work is None:
            on = "cuda" if self.cuda else "cpu"
            a = torch.randn(128, 128, device=on)
            self._work = (a, torch.randn(128, 128, device=on))
        a, b = self._work
        # by the wall clock: a thread's CPU time misses the multiplies' intra-op threads
        if self.cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            for _ in range(4):
                a = torch.tanh(a @ b)  # tanh keeps the values finite
            if self.cuda:
                torch.cuda.synchronize()
        self._work = (a, b)
        self.extra += seconds

    def _slow(self, began: float) -> None:
        spent = max(0.0, self._clock() - began)
        self.blocks_s += spent
        if not self.on or self.mode in ("data", "neighbour"):
            return
        pause = (self.factor - 1) * spent
        if self.mode == "compute":
            self._compute_more(pause)
        else:
            self.slept += pause
            time.sleep(pause)

    def _before_forward(self, module, args) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            # the gradient of the block's input is the last its backward computes
            x.register_hook(lambda grad: self._slow(module._straggler_backward))
        module._straggler_forward = self._clock()

    def _after_forward(self, module, args, out) -> None:
        self._slow(module._straggler_forward)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: setattr(module, "_straggler_backward", self._clock()))
