"""A run's layouts: the one it starts under (``parallel.auto`` may choose it), and the switches
it makes while it runs (``parallel.relayout_at``, the online scheduler), each moving the
running state to the new layout over the network (`relayout`)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from anyshard._compat import process_groups
from anyshard.api.redistribute import redistribute
from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.events import layout_name, log_event, status_bytes
from anyshard.trainer_integration.gpt.parallel import forget_cached_placements
from anyshard.trainer_integration.gpt.state import TrainState, _loader, build_training


def relayout(cfg: Config, state: TrainState, parallel) -> tuple[Config, TrainState, Any, dict]:
    """Switch a running job to the layout ``parallel`` over the same ranks: build the model,
    AdamW and data loader under it, then move model, optimizer state, data position, RNG and
    step into them over the network (`anyshard.redistribute`); no checkpoint is written or read.
    Returns the new config, state and `TrainStep`, and what the move cost. Collective."""
    start = time.time()
    src = {"train": state.state_dict()}  # first: it holds the RNG state of the run
    new_cfg = dataclasses.replace(cfg, parallel=parallel)
    par, model, optimizer, step_fn = build_training(new_cfg)
    new = TrainState(model, optimizer, _loader(new_cfg, par))
    dst = {"train": new.state_dict()}
    built = time.time()
    plan = redistribute(src, dst)
    new.load_state_dict(dst["train"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    cost = {
        "build_s": built - start,
        "redistribute_s": time.time() - built,
        "sent_bytes": plan.sent_bytes(rank),
        "received_bytes": plan.received_bytes(rank),
    }
    return new_cfg, new, step_fn, cost


class Layouts:
    """The layout changes of a run: the configured switch (``parallel.relayout_at``) and the
    scheduler's answers (``parallel.auto``, `scheduler.Scheduler`), each carried out through
    `relayout`; the process groups of a layout the job leaves are destroyed as it leaves it."""

    def __init__(
        self,
        cfg: Config,
        rates,
        groups: set,
        *,
        end: int,
        step: int,
        rank: int,
        rss0: int = -1,
        malloc_mode: str = "default",
    ):
        self.pending = cfg.parallel.relayout()
        self.groups = groups  # the running layout's process groups
        self.rank = rank
        self.cfg = cfg
        self.rss0 = rss0 if cfg.ft.replicas == 1 else -1  # bytes before the model was built
        self.malloc_mode = malloc_mode  # the ranks' allocator: "lean" or "default" (`malloc`)
        self.steps = 0
        self.scheduler = None
        self.decision = None
        self.own_s: list[float] | None = None  # every rank's own work in the last step (auto)
        if rates is not None:
            from anyshard.trainer_integration.gpt.layout_chooser.cluster import job_topology
            from anyshard.trainer_integration.gpt.layout_chooser.scheduler import Policy, Scheduler

            if rank == 0:  # for `anyshard layouts --rates`
                with open(os.path.join(cfg.run_dir, "rates.json"), "w") as f:
                    f.write(rates.to_json())
            p = cfg.parallel
            policy = Policy(
                trials=p.auto_trials, trial_steps=p.auto_trial_steps, margin=p.auto_margin
            )
            self.scheduler = Scheduler(
                cfg,
                p,
                rates,
                total_steps=end,
                online=p.auto == "online",
                policy=policy,
                memory_bytes=memory_budget(cfg),
                topology=job_topology(),  # collective: every rank builds its scheduler here
            )

    def target(self, state: TrainState):
        """The layout to switch to before this step, or None."""
        if self.pending is not None and state.step >= self.pending[0]:
            target, self.pending = self.pending[1], None
            return target
        if self.scheduler is None:
            return None
        self.decision = self.scheduler.decide(state.step)
        return self.decision.parallel

    def switch(self, cfg: Config, state: TrainState, parallel) -> tuple[Config, TrainState, Any]:
        """Move the job into ``parallel`` (collective); log it; leave the old layout's groups."""
        old = layout_name(cfg)
        before = process_groups()
        cfg, state, step_fn, cost = relayout(cfg, state, parallel)
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = process_groups() - before
        self.cfg = cfg
        forget_cached_placements()  # its entries may name the destroyed meshes
        gc.collect()  # the old model's cycles hold the old meshes, and they the groups' threads
        seconds = torch.tensor([cost["build_s"] + cost["redistribute_s"]], dtype=torch.float64)
        if dist.is_initialized():
            on = "cuda" if dist.get_backend() == "nccl" else "cpu"
            seconds = seconds.to(on)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # every rank decides alike
        if self.scheduler is not None:
            self.scheduler.switched(float(seconds))
        if self.rank == 0:
            event = {"event": "relayout", "step": state.step, "from": old, "to": layout_name(cfg)}
            log_event(cfg.run_dir, {**event, **cost})
        return cfg, state, step_fn

    def apply_shares(self, cfg: Config, state: TrainState, step_fn) -> None:
        """Carry out the scheduler's data shares (a switch starts even) and log its decision."""
        d, self.decision = self.decision, None
        if d is None or (d.action == "keep" and not d.reason):
            return
        shares, par = self.scheduler.shares, step_fn.par
        state.loader.set_shares(shares)
        even = cfg.train.global_batch / par.data_size
        step_fn.weight = 1.0 if shares is None else shares[par.data_rank] / even
        if self.rank == 0:
            record = {**self.scheduler.decisions[-1], "time": time.time()}
            log_event(cfg.run_dir, record)

    def measured(self, wall_s: float, own_s: float, par) -> None:
        """Tell the scheduler what this step cost: the slowest rank's wall time, and every
        rank's own work (its step less its waits for the others in collectives, `waits`)
        and data rank."""
        self.steps += 1
        if self.steps == MEMORY_STEPS and self.rss0 >= 0:
            self._log_memory()
        if self.scheduler is None:
            return
        mine = torch.tensor([wall_s, own_s, float(par.data_rank)], dtype=torch.float64)
        rows = _every_rank(mine)
        busy = [float(r[1]) for r in rows]
        self.own_s = busy
        self.scheduler.observe(max(float(r[0]) for r in rows), busy, [int(r[2]) for r in rows])

    def _log_memory(self) -> None:
        """The ``memory`` event: each rank's RSS before the model was built and its peak over
        the first steps, beside what the cost model counts for the layout (collective)."""
        from anyshard.trainer_integration.gpt.layout_chooser.memory import memory_per_rank

        mine = torch.tensor([self.rss0, status_bytes("VmHWM"), status_bytes("VmRSS")])
        rows = _every_rank(mine)
        if self.rank == 0:
            start, peak, now = ([int(r[i]) for r in rows] for i in range(3))
            event = {"event": "memory", "steps": self.steps, "layout": layout_name(self.cfg)}
            event["counted_bytes"] = memory_per_rank(self.cfg, self.cfg.parallel)
            event["malloc"] = self.malloc_mode
            event.update(rss_start=start, rss_peak=peak, rss_end=now, time=time.time())
            log_event(self.cfg.run_dir, event)


def _every_rank(mine: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's row of three numbers ``mine``, in rank order (collective)."""
    rows = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        on = "cuda" if dist.get_backend() == "nccl" else "cpu"
        out = torch.empty(dist.get_world_size() * 3, dtype=mine.dtype, device=on)
        dist.all_gather_into_tensor(out, mine.to(on))
        rows = list(out.cpu().view(-1, 3))
    return rows


MEMORY_STEPS = 3  # the memory event's peak covers the first steps (a step builds AdamW's state)


def memory_budget(cfg: Config) -> int | None:
    """``parallel.auto_memory_gib`` in bytes (None: the host's or accelerator's default)."""
    gib = cfg.parallel.auto_memory_gib
    return None if gib is None else int(gib * 2**30)


def starting_layout(cfg: Config, rank: int) -> tuple[Config, Any, Any]:
    """The config to start under, the `candidates.Choice` that changed its layout (None when
    kept) and the scheduler's measured rates (None unless ``parallel.auto`` is on for a job of
    one replica group). On a world its degrees do not fit, ``auto`` chooses: the model's
    fastest layout, or `candidates.choose_layout`'s rules for replica groups. Collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rates = chosen = None
    if cfg.parallel.auto != "off" and cfg.ft.replicas == 1:
        from anyshard.trainer_integration.gpt.layout_chooser.costmodel import calibrate

        rates = calibrate(cfg=cfg)  # on the job's nodes, read from its process group
    if cfg.parallel.auto != "off" and cfg.parallel.world_size != world:
        from anyshard.trainer_integration.gpt.layout_chooser.candidates import (
            choose_layout,
            layout_text,
        )
        from anyshard.trainer_integration.gpt.layout_chooser.scheduler import first_layout

        budget = memory_budget(cfg)
        chosen = (
            choose_layout(cfg, world, memory_bytes=budget)
            if rates is None
            else first_layout(
                cfg, world, rates, memory_bytes=budget, topology=rates.measured_topology
            )
        )
        cfg = dataclasses.replace(cfg, parallel=chosen.parallel)
        if rank == 0:
            why = "; ".join(chosen.reasons)
            print(f"layout for {world} ranks: {layout_text(chosen.parallel)} ({why})", flush=True)
    return cfg, chosen, rates
