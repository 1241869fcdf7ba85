"""The training loop as a class: building, restoring, one step, the FT-HSDP quorum, faults,
relayouts and the run's events, each a method of `Trainer`; `Trainer.run` is the loop."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from anyshard._compat import process_groups
from anyshard.trainer_integration.checkpointer import Checkpointer
from anyshard.trainer_integration.gpt import malloc
from anyshard.trainer_integration.gpt.config import CheckpointConfig, Config, heal_parallel
from anyshard.trainer_integration.gpt.events import (
    append,
    attempt,
    layout_name,
    log_event,
    log_failed_saves,
    rss_mark,
    start_event,
    status_bytes,
)
from anyshard.trainer_integration.gpt.faults import Fault
from anyshard.trainer_integration.gpt.layout_chooser.straggler import Straggler, pin_to_own_core
from anyshard.trainer_integration.gpt.layout_chooser.waits import BlockTimer, WaitClock
from anyshard.trainer_integration.gpt.parallel import forget_cached_placements, lr_at
from anyshard.trainer_integration.gpt.relayout import Layouts, starting_layout
from anyshard.trainer_integration.gpt.state import TrainState, _loader, build_training


def _on_accelerator() -> bool:
    return torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def _checkpointer(c: CheckpointConfig) -> Checkpointer:
    """The run's `Checkpointer`, from the ``[checkpoint]`` settings ``c``."""
    return Checkpointer(
        c.root,
        every_steps=c.every_steps,
        keep_last=c.keep_last,
        async_=c.async_,
        local_dir=c.local_dir,
        on_error=c.on_error,
        max_failures=c.max_failures,
    )


def _replica_config(cfg: Config) -> Config:
    """``cfg`` for this replica group under FT-HSDP (``cfg`` itself otherwise): each group logs
    into its own folder; a restarted group may take another layout (``ft.heal_layout``)."""
    if cfg.ft.replicas > 1:
        cfg = dataclasses.replace(
            cfg, run_dir=os.path.join(cfg.run_dir, f"replica-{cfg.ft.replica}")
        )
        heal = heal_parallel(cfg)
        if heal is not None and attempt() > 0:
            cfg = dataclasses.replace(cfg, parallel=heal)
    return cfg


class Trainer:
    """One call of `train.run`: built and restored on construction, trained by `run`.

    It trains until ``cfg.train.steps`` (or step ``stop_at``, for a job that is to be
    relaunched: the LR schedule still spans ``cfg.train.steps``), for at most ``max_steps``
    steps. torch.distributed must be initialised if the layout has more than one rank."""

    def __init__(
        self, cfg: Config, *, max_steps: int | None = None, stop_at: int | None = None
    ) -> None:
        self.started = time.time()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.groups_before = process_groups()
        self.max_steps = max_steps
        self.cfg, self.chosen, self.rates = starting_layout(_replica_config(cfg), self.rank)
        self._build()
        self._restore()
        self._prepare_loop(stop_at)

    def _build(self) -> None:
        """The ranks' allocator, then this layout's model, AdamW, `TrainStep`, data and
        Checkpointer."""
        cfg = self.cfg
        budget = cfg.parallel.auto_memory_gib
        lean = malloc.wanted(cfg.train.malloc, budget, on_accelerator=_on_accelerator())
        lean = lean and malloc.set_lean()
        self.malloc_mode = "lean" if lean else "default"
        self.rss0 = rss_mark()
        torch.manual_seed(cfg.train.seed)
        self.par, model, optimizer, self.step_fn = build_training(cfg)
        self.layout_groups = process_groups() - self.groups_before
        self.built = time.time()
        self.state = TrainState(model, optimizer, _loader(cfg, self.par))
        c = cfg.checkpoint
        self.ckpt = _checkpointer(c)
        self.guarded = c.async_ and c.stage_in_background
        if self.guarded:
            self.ckpt.guard(self.state.optimizer)
        os.makedirs(cfg.run_dir, exist_ok=True)

    def _restore(self) -> None:
        """Restore the newest committed checkpoint (replica groups restore after their first
        quorum instead, `_join_quorum`); join the replica groups; take the first state dict."""
        cfg, state = self.cfg, self.state
        before_restore = time.time()
        self.restored = None
        if cfg.ft.replicas == 1:  # replica groups restore after their first quorum
            self.restored = self.ckpt.restore_latest({"train": state}, strict=cfg.parallel.pp == 1)
        self.restore_s = time.time() - before_restore
        self.layout = layout_name(cfg)
        self.replicas: Any = None
        if cfg.ft.replicas > 1:
            from anyshard.trainer_integration.gpt.ft_hsdp import ReplicaGroup

            self.replicas = ReplicaGroup(cfg, state, self.layout)
            self.replicas.attach(self.step_fn)
        # The state dict, taken now, before the first step: the first save does not walk the model
        # inside the loop, and a restarted replica group's first quorum (which waits for the state
        # dict a heal fills) does not either, which would hold the healthy group up
        state.prime()
        if self.guarded:  # fault in the staging buffers on the save thread, as the first step runs
            start = time.perf_counter()
            self.ckpt.prepare({"train": state})
            self.ckpt.blocked_s += time.perf_counter() - start

    def _prepare_loop(self, stop_at: int | None) -> None:
        """The last step, the layout changes to come, the fault and the straggler."""
        cfg, t = self.cfg, self.cfg.train
        self.end = t.steps if stop_at is None else min(t.steps, stop_at)
        self.layouts = Layouts(
            cfg,
            self.rates,
            self.layout_groups,
            end=self.end,
            step=self.state.step,
            rank=self.rank,
            rss0=self.rss0,
            malloc_mode=self.malloc_mode,
        )
        self.fault = Fault.planned(cfg)
        self.fault_file = os.path.join(cfg.run_dir, "fault.json")
        self.losses: list[float] = []
        f, self.accelerator = cfg.fault, _on_accelerator()
        if t.pin_cores or (f.slow_rank is not None and f.slow_mode == "neighbour"):
            pin_to_own_core(int(os.environ.get("LOCAL_RANK", self.rank)))
        self.straggler = (
            Straggler(
                f.slow_factor,
                f.slow_from,
                self.accelerator,
                until=f.slow_until,
                mode=f.slow_mode,
            )
            if f.slow_rank == self.rank
            else None
        )
        # each rank's own work per step (`waits`): its wall time less its waits in collectives
        # on the host, its blocks' device time on an accelerator
        self.clock = WaitClock()
        self.blocks = BlockTimer() if self.accelerator else None
        self.first = True
        self.joined = False  # FT-HSDP: whether this group has been through its first quorum
        self.saves = 0

    def run(self) -> list[float]:
        """Train to the end (or for ``max_steps`` steps); returns this call's losses."""
        try:
            with self.clock:
                self._loop()
        finally:
            if self.straggler is not None:
                self.straggler.close()
        self._finish()
        return self.losses

    def _loop(self) -> None:
        while self.state.step < self.end and (
            self.max_steps is None or len(self.losses) < self.max_steps
        ):
            self._change_layout()
            if self.replicas is not None and not self._join_quorum():
                break  # the quorum brought the state to the end
            loss, rescue = self._step()
            if not self._committed(rescue):
                continue  # the step's batch is trained again
            self.state.step += 1
            self.losses.append(loss)
            if self.rank == 0:
                self._log_step(loss, rescue)
            self.first = False
            self._save()

    def _change_layout(self) -> None:
        """Switch to the layout due before this step (configured, or the scheduler's), if any;
        carry out the scheduler's data shares."""
        target = self.layouts.target(self.state)
        if target is not None:
            self.ckpt.wait()  # a save in flight still reads the old layout's tensors
            self.cfg, self.state, self.step_fn = self.layouts.switch(self.cfg, self.state, target)
            self.layout, self.par = layout_name(self.cfg), self.step_fn.par
            if self.guarded:
                self.ckpt.guard(self.state.optimizer)
            if self.replicas is not None:  # this group alone changes layout; the quorum goes on
                self.replicas.rebind(self.state, self.layout, self.step_fn)
        self.layouts.apply_shares(self.cfg, self.state, self.step_fn)

    def _join_quorum(self) -> bool:
        """FT-HSDP, before each step: the quorum of replica groups (which may heal this group
        from a healthy one, or leave it to restore the newest checkpoint on joining), and this
        group's share of the step's batch. False where the state is already at the end."""
        replicas, state, par = self.replicas, self.state, self.par
        # a step that lost the other group: train its share while the lighthouse notices
        replicas.train_ahead(self.step_fn, state.loader, par.data_rank, par.data_size)
        healed = replicas.start_step()  # may fill the state from a healthy group
        if not self.joined and (healed is None or healed["event"] != "heal"):
            # no group is ahead (the whole job starts or restarts): the newest committed
            # checkpoint is the state; a group that healed never reads storage (and so
            # never races the writing group's retention)
            before_restore = time.time()
            strict = self.cfg.parallel.pp == 1
            self.restored = self.ckpt.restore_latest({"train": state}, strict=strict)
            replicas.restored(state.step)
            self.restore_s = time.time() - before_restore
        self.joined = True
        if healed is not None and self.rank == 0:
            event = {**healed, "step": state.step, "layout": self.layout, "attempt": attempt()}
            log_event(self.cfg.run_dir, {**event, "time": time.time()})
        if state.step >= self.end:
            return False
        state.loader.dp_rank, state.loader.dp_size = replicas.data_share(
            par.data_rank, par.data_size
        )
        return True

    def _step(self) -> tuple[float, Any]:
        """One training step at this step's LR, with the fault or the straggler where due;
        under FT-HSDP, the rescue of a step that lost a group instead. Returns the loss and
        the rescue (None: a step of its own)."""
        state, t, straggler, par = self.state, self.cfg.train, self.straggler, self.par
        step_began = time.perf_counter()
        self.clock.begin()
        for group in state.optimizer.param_groups:
            group["lr"] = lr_at(
                state.step, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio
            )
        if straggler is not None:
            straggler.arm(state.model, state.step)
        inputs, targets = state.loader.next_batch()
        if straggler is not None:
            straggler.data_phase()
        self.fault.strike(state.step, self.rank, self.ckpt, self.fault_file)
        if self.blocks is not None:  # after the straggler's hooks: its slowdown falls inside
            self.blocks.arm(state.model)
        before_model = time.perf_counter() - step_began
        # FT-HSDP: the quorum may save the last step, which lost a group, instead of redoing it
        rescue = (
            None
            if self.replicas is None
            else self.replicas.rescue(state.loader, par.data_rank, par.data_size)
        )
        loss = self.step_fn(inputs, targets) if rescue is None else self.step_fn.resume(*rescue)
        padding = 0.0
        if t.min_step_s > 0:  # a larger model's step time: faults land mid-run
            padding = max(0.0, t.min_step_s - (time.perf_counter() - step_began))
            time.sleep(padding)
        wall = time.perf_counter() - step_began
        if self.blocks is not None:  # kernels run asynchronously: the host's clocks miss them
            own = before_model + self.blocks.seconds()
        else:  # the step less this rank's waits for the others (and the padding)
            own = self.clock.own(wall - padding)
        self.layouts.measured(wall, own, par)
        return loss, rescue

    def _committed(self, rescue) -> bool:
        """Whether the quorum committed the step (always, without replica groups); logs a
        rescued step, and rewinds the data of one that was not committed, to be redone."""
        state, step_fn = self.state, self.step_fn
        if rescue is not None and step_fn.committed and self.rank == 0:
            event = {"event": "rescued", "step": state.step, **self.replicas.rescue_info}
            log_event(self.cfg.run_dir, {**event, "time": time.time()})
        if not step_fn.committed:  # the quorum did not commit: redo this step's batch
            state.loader.samples_consumed -= state.loader.global_batch
            if self.rank == 0:
                event = {"event": "uncommitted", "step": state.step, "time": time.time()}
                log_event(self.cfg.run_dir, event)
            return False
        return True

    def _log_step(self, loss: float, rescue) -> None:
        """Rank 0: the step's line in ``losses.jsonl``; after the first, the ``start`` event."""
        state, replicas, par = self.state, self.replicas, self.par
        record = {
            "step": state.step,
            "loss": loss,
            "layout": self.layout,
            "attempt": attempt(),
            "time": time.time(),
        }
        if self.layouts.own_s is not None:  # each rank's own work in the step (`waits`)
            record["own_s"] = [round(x, 6) for x in self.layouts.own_s]
        if replicas is not None:  # the groups that took part, and this group's data share
            loader = state.loader
            record["groups"] = replicas.manager.num_participants()
            record["share"] = [loader.dp_rank // par.data_size, loader.dp_size // par.data_size]
            if rescue is not None:  # a saved step: the shares of its split this group trained
                info = replicas.rescue_info
                record["share"][1] = info["groups_before"]
                record["shares"] = int(info["kept"]) + len(info["trained"])
        append(os.path.join(self.cfg.run_dir, "losses.jsonl"), record)
        if self.first:
            times = (self.started, self.built - self.started, self.restore_s)
            event = start_event(self.layout, self.restored, times, self.chosen, self.fault_file)
            event["malloc"] = self.malloc_mode
            log_event(self.cfg.run_dir, event)

    def _save(self) -> None:
        """Save the step where due (`Checkpointer.save`); one replica group writes checkpoints."""
        if self.replicas is None or self.replicas.is_primary():
            self.saves += self.ckpt.save(self.state.step, {"train": self.state})
            log_failed_saves(self.cfg, self.ckpt, self.rank)

    def _finish(self) -> None:
        """Wait for the last save, leave the replica groups, log the ``end`` event and destroy
        the process groups of this run's meshes."""
        cfg, ckpt, replicas = self.cfg, self.ckpt, self.replicas
        ckpt.wait()
        log_failed_saves(cfg, ckpt, self.rank)
        final_digest = None
        if replicas is not None:
            if cfg.ft.check_heals:
                from anyshard.trainer_integration.gpt.ft_hsdp import state_digest

                final_digest = state_digest(self.state)
            replicas.shutdown()
        blocked, grown = self._slowest_blocked_and_growth()
        if self.rank == 0 and self.losses:
            event = {
                "event": "end",
                "step": self.state.step,
                "attempt": attempt(),
                "saves": self.saves,
            }
            event.update(ckpt_blocked_s=blocked, rss_growth_max=grown)
            if replicas is not None:
                event["reduce_s"] = replicas.reduce_s
                event["digest"] = final_digest
            log_event(cfg.run_dir, event)
        self._release_groups()

    def _slowest_blocked_and_growth(self) -> tuple[float, int]:
        """How long checkpointing held training up on the slowest rank (save calls: planning,
        a sync save's whole write; optimizer steps waiting for a staging copy; faulting in the
        buffers), and the most any rank's RSS grew over the run (from before the model was
        built). Collective."""
        on = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
        grown = status_bytes("VmHWM") - self.rss0 if self.rss0 >= 0 else -1
        blocked = torch.tensor([self.ckpt.blocked_s, grown], dtype=torch.float64, device=on)
        if dist.is_initialized():
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
        return float(blocked[0]), int(blocked[1])

    def _release_groups(self) -> None:
        """Destroy the process groups of this run's meshes, which a process that trains again
        (a warm pool, a notebook) would keep, each with its sockets and threads. Every rank is
        done with them: the end's all-reduce is the run's last collective."""
        for group in process_groups() - self.groups_before:
            if group is not dist.GroupMember.WORLD:  # one the run initialised stays, as before
                dist.destroy_process_group(group)
        forget_cached_placements()  # DTensor's cache may hand out tensors on the destroyed meshes
        gc.collect()  # cycles may hold the meshes, and they the destroyed groups' threads
