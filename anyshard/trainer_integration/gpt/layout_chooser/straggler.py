"""The injected straggler (``ANYSHARD_SLOW``): one rank's transformer blocks made slower, for
trying the layout chooser's data shares on a machine whose ranks are alike."""

from __future__ import annotations

import time
from typing import Any

import torch


class Straggler:
    """``ANYSHARD_SLOW`` on this rank: from step ``slow_from`` on, each transformer block's
    forward and backward take ``slow_factor`` times their compute, by sleeping the difference
    as each ends (sleeping, not spinning: the shared cores stay with the others). The sleeps
    land where a slow device's compute would, between the block's collectives: the other ranks
    compute meanwhile, and a smaller data share shortens them. Compute is this thread's CPU
    time on CPU (backward runs on the calling thread there; a wait in a collective is not
    compute), the synchronised wall time on an accelerator. ``slept``: seconds slept so far."""

    def __init__(self, factor: float, from_step: int, cuda: bool):
        self.factor, self.from_step, self.on, self.slept = factor, from_step, False, 0.0
        self.model: Any = None  # the model whose blocks are hooked (a switch builds another)
        self.cuda = cuda

    def arm(self, model, step: int) -> None:
        """Before a step of ``model``: slow from ``slow_from`` on; hook a new model's blocks."""
        self.on = step >= self.from_step
        if self.model is model:
            return
        from anyshard.trainer_integration.gpt.model import TransformerBlock

        self.model = model
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                block.register_forward_pre_hook(self._before_forward)
                block.register_forward_hook(self._after_forward)

    def _clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def _slow(self, began: float) -> None:
        if self.on:
            pause = (self.factor - 1) * max(0.0, self._clock() - began)
            self.slept += pause
            time.sleep(pause)

    def _before_forward(self, module, args) -> None:
        x = args[0] if args else None
        if self.on and isinstance(x, torch.Tensor) and x.requires_grad:
            # the gradient of the block's input is the last its backward computes
            x.register_hook(lambda grad: self._slow(module._straggler_backward))
        module._straggler_forward = self._clock()

    def _after_forward(self, module, args, out) -> None:
        self._slow(module._straggler_forward)
        if self.on and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: setattr(module, "_straggler_backward", self._clock()))
