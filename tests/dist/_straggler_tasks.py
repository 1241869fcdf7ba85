"""Task functions for the straggler measurement: the tiny model trained under dp_shard=2 with
rank 1 made slow in one way after another, each step's own work and waits measured on every
rank (`waits.WaitClock`)."""

from __future__ import annotations

import os
import statistics
import time


def own_work(kinds: list[str], steps: int) -> dict[str, tuple[float, float] | None]:
    """For each of ``kinds``, ``steps`` steps (after one that warms up) with rank 1 slow by it:
    ``compute``, a fixed number of extra multiplies in each of its blocks' forwards;
    ``data``, a fixed sleep (0.2 s) after loading its batch, outside any collective; ``neighbour``,
    each rank pinned to a core of its own and five busy processes beside rank 1 (None where
    fewer than 2 cores can be used, or none can be pinned). This rank's median (own work,
    blocked) seconds per step of each kind."""
    import torch
    import torch.distributed as dist

    from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
    from anyshard.trainer_integration.gpt.layout_chooser.straggler import (
        Straggler,
        pin_to_own_core,
        set_process_affinity,
    )
    from anyshard.trainer_integration.gpt.layout_chooser.waits import WaitClock
    from anyshard.trainer_integration.gpt.model import TransformerBlock
    from anyshard.trainer_integration.gpt.state import _loader, build_training

    cfg = load_config(TINY_CONFIG, ["--parallel.dp_shard", "2"], environ={})
    torch.manual_seed(0)
    par, model, optimizer, step_fn = build_training(cfg)
    loader = _loader(cfg, par)
    slow = dist.get_rank() == 1
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    work = torch.randn(160, 160) / 16

    # the same real work every time, 160 multiplies, several times a step's own: the other
    # processes that share the two cores in the suite cannot make up for it on rank 0
    def more(module, args, out) -> None:
        x = work
        for _ in range(160):
            x = torch.tanh(x @ work)

    out: dict[str, tuple[float, float] | None] = {}
    for kind in kinds:
        hooks, straggler, affinity = [], None, None
        if kind == "neighbour":
            can = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
            if not can:
                out[kind] = None
                continue
            affinity = os.sched_getaffinity(0)
            pin_to_own_core(dist.get_rank())
            if slow:
                straggler = Straggler(6, 0, False, mode="neighbour")
                straggler.arm(model, 0)
        if kind == "compute" and slow:
            hooks = [b.register_forward_hook(more) for b in blocks]
        rows = []
        try:
            with WaitClock() as clock:
                for _ in range(steps + 1):
                    clock.begin()
                    began = time.perf_counter()
                    inputs, targets = loader.next_batch()
                    if kind == "data" and slow:
                        time.sleep(0.2)
                    step_fn(inputs, targets)
                    wall = time.perf_counter() - began
                    rows.append((clock.own(wall), clock.blocked_s))
        finally:
            for hook in hooks:
                hook.remove()
            if straggler is not None:
                straggler.close()
            if affinity is not None:
                set_process_affinity(affinity)
        rows = rows[1:]
        out[kind] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
    return out
