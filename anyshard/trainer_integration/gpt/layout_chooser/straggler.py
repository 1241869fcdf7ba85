"""The injected straggler (``ANYSHARD_SLOW``): one rank made slower, in one of four ways, for
trying the layout chooser's data shares on a machine whose ranks are alike.

``ANYSHARD_SLOW=rank:factor[:from_step[:until_step]][:mode]``, from step ``from_step`` until
step ``until_step`` (left out: to the end), the rank's own work per step takes ``factor`` times
as long, whatever the mode:

- ``sleep`` (the default): each transformer block's forward and backward sleep ``factor - 1``
  times their compute as they end, where a slow device's compute would be (between the block's
  collectives: the other ranks compute meanwhile, and a smaller data share shortens it), and
  after its batch is loaded the rank sleeps ``factor - 1`` times its work outside the blocks
  in the step before (the embedding, the loss, the optimizer: the host's CPU time of the step
  less its blocks'; on an accelerator the blocks alone are slowed);
- ``compute``: the same, computed for real (matrix multiplies on the rank's own tensors), as a
  rank with more work does;
- ``data``: the rank's data loading takes ``factor - 1`` times its whole own work of the step
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
        self.blocks_s = 0.0  # the blocks' own compute in the current step (`_clock`'s units)
        self.last_blocks_s = 0.0  # and in the step before
        # the step before's own work outside the blocks (the embedding, the loss, the
        # optimizer: the host's CPU time less the blocks'; none on an accelerator)
        self.last_rest_s = 0.0
        self.injected = 0.0  # what the slowdown added to `_clock` so far
        self._step_mark: tuple[float, float] | None = None  # (`_clock`, `injected`) at arm
        self.neighbours: list[subprocess.Popen] = []
        self._work: tuple[torch.Tensor, torch.Tensor] | None = None

    def due(self, step: int) -> bool:
        """Whether step ``step`` is slow."""
        return self.from_step <= step and (self.until is None or step < self.until)

    def arm(self, model, step: int) -> None:
        """Before step ``step`` of ``model``: slow or not; start or stop the neighbours; hook a
        new model's blocks; what the step before did on its own (its blocks and the rest)."""
        self.on = self.due(step)
        if self._step_mark is not None and not self.cuda:
            step_s = self._since(self._step_mark)
            self.last_rest_s = max(0.0, step_s - self.blocks_s)
        self._step_mark = (self._clock(), self.injected)
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
        """After this rank's batch is loaded: the data mode's slow loading (the whole own work
        of the step before, ``factor - 1`` times); the sleep and compute modes' share of the
        rank's work outside its blocks (``factor - 1`` times the step before's)."""
        if not self.on or self.mode == "neighbour":
            return
        if self.mode == "data":
            self._pause((self.factor - 1) * (self.last_blocks_s + self.last_rest_s), sleep=True)
        else:
            self._pause((self.factor - 1) * self.last_rest_s, sleep=self.mode == "sleep")

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
        """The rank's own compute: the training thread's CPU time on the host (a sleep is not
        in it), the device's time on an accelerator (synchronised: a sleep is in it)."""
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def _since(self, mark: tuple[float, float]) -> float:
        """`_clock`'s time since ``mark``, less what the slowdown added meanwhile (a block's
        backward begins as the next block's ends: the next block's slowdown falls between)."""
        return max(0.0, (self._clock() - mark[0]) - (self.injected - mark[1]))

    def _pause(self, seconds: float, *, sleep: bool) -> None:
        """``seconds`` more on this rank: slept, or computed for real."""
        if seconds <= 0:
            return
        began = self._clock()
        if sleep:
            self.slept += seconds
            time.sleep(seconds)
        else:
            self._compute_more(seconds)
        self.injected += self._clock() - began

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

    def _slow(self, mark: tuple[float, float]) -> None:
        spent = self._since(mark)
        self.blocks_s += spent
        if self.on and self.mode in ("sleep", "compute"):
            self._pause((self.factor - 1) * spent, sleep=self.mode == "sleep")

    def _mark(self) -> tuple[float, float]:
        return (self._clock(), self.injected)

    def _before_forward(self, module, args) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            # the gradient of the block's input is the last its backward computes
            x.register_hook(lambda grad: self._slow(module._straggler_backward))
        module._straggler_forward = self._mark()

    def _after_forward(self, module, args, out) -> None:
        self._slow(module._straggler_forward)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: setattr(module, "_straggler_backward", self._mark()))
