"""The reference training loop: any layout, checkpoints through anyshard, faults and restarts.

Launch with torchrun (one process per rank; gloo on CPU, nccl on CUDA)::

    torchrun --nproc-per-node 4 --max-restarts 1 -m anyshard.trainer_integration.gpt.train \\
        --parallel.dp_shard 2 --parallel.tp 2 --train.steps 20 [--stop-at 10] [--config FILE] \\
        [--relayout-at 10:tp=4]

Each run restores the newest committed checkpoint under ``checkpoint.root`` (whatever layout
saved it), trains to ``train.steps`` and saves every ``checkpoint.every_steps``. A fault
(``fault.kill_rank`` at ``fault.kill_step``, or ANYSHARD_FAULT=rank:step[:mode]) kills a rank
with SIGKILL (or raises) on the first attempt; torchrun restarts the group, which resumes. Rank 0
appends one JSON line per step to ``run_dir/losses.jsonl`` and one per (re)start to
``run_dir/events.jsonl`` (restored step, recovery time, lost steps). ``--relayout-at STEP:LAYOUT``
(``parallel.relayout_at``) switches the running job to another layout over the same ranks after
STEP steps, moving its state over the network with no checkpoint round trip.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from anyshard._compat import REDISTRIBUTE_LOGGER, local_tensor, module_members, process_groups
from anyshard.api.redistribute import redistribute
from anyshard.trainer_integration.checkpointer import Checkpointer
from anyshard.trainer_integration.gpt import malloc
from anyshard.trainer_integration.gpt.config import (
    CheckpointConfig,
    Config,
    heal_parallel,
    trainer_config,
)
from anyshard.trainer_integration.gpt.data import DataLoader, load_corpus
from anyshard.trainer_integration.gpt.parallel import (
    TrainStep,
    build,
    forget_cached_placements,
    forget_older_placements,
    lr_at,
    make_optimizer,
    setup_mesh,
)

__all__ = ["TrainState", "build_training", "init_distributed", "main", "relayout", "run"]


_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"


def _renamed(sd: dict[str, Any], old: str, new: str, *, only: bool = False) -> dict[str, Any]:
    """``sd`` with parameter ``old`` named ``new`` in the ``state.{fqn}.*`` and
    ``param_groups.{fqn}.*`` keys of a flattened optimizer state dict (``only``: just those
    entries)."""
    out = {}
    for k, v in sd.items():
        for head in ("state.", "param_groups."):
            if k.startswith(head + old + "."):
                out[head + new + k[len(head + old) :]] = v
                break
        else:
            if not only:
                out[k] = v
    return out


class TrainState:
    """Everything a resume needs, as one Stateful: model, AdamW, data position, RNG, step."""

    def __init__(self, model, optimizer, loader: DataLoader):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.step = 0
        self._cache: tuple | None = None  # of `_get_state_dict`
        self._walk: list | None = None  # of `_holdings`

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def _tied(self) -> bool:
        """Whether this rank's embedding and output are one parameter (tied, one stage)."""
        m = self.model
        cfg = getattr(m, "cfg", None)
        return bool(cfg and cfg.tie_embeddings) and None not in (m.output, m.tok_embeddings)

    def _holdings(self) -> tuple[list[Any], list[Any]]:
        """What a state dict's tensors are, as objects to compare by identity (every parameter,
        buffer and optimizer state tensor, and every module's children: the modules walked last
        time are the model's while those stay the same) and values to compare by equality (the
        storage each parameter and buffer holds, the names of each group's hyperparameters).
        Both stay the same while training only updates the tensors in place."""
        if self._walk is None:  # the modules, walked once (`modules()` builds every name)
            self._walk = list(self.model.modules())
        objects: list[Any] = []
        children: list[Any] = []  # a submodule added, removed or replaced: walked anew
        for m in self._walk:
            modules, parameters, buffers = module_members(m)
            children += modules.values()
            objects += parameters.values()
            objects += buffers.values()
        values: list[Any] = [local_tensor(t).data_ptr() for t in objects if t is not None]
        objects += children
        for st in self.optimizer.state.values():
            objects += st.values()
        values += (tuple(g) for g in self.optimizer.param_groups)
        return objects, values

    def _get_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """DCP's ``get_state_dict``, remembered while the tensors it returns stay the same ones
        (`_holdings`), with the optimizer's hyperparameters read anew (those whose value changed
        are written into the remembered dict): a save then costs its caller a fraction of a
        millisecond instead of DCP's walk over the model (milliseconds per call, on the
        training thread)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        objects, values = self._holdings()
        cached = self._cache
        if (
            cached is not None
            and cached[1] == values
            and len(cached[0]) == len(objects)
            and all(a is b for a, b in zip(cached[0], objects, strict=True))
        ):
            model_sd, optim_sd, pairs = cached[2:]
            groups = self.optimizer.param_groups
            for (g, h), names in pairs.items():  # kept up to date in place: a few change
                v = groups[g][h]
                if optim_sd[names[0]] is not v:
                    for k in names:
                        optim_sd[k] = v
            return model_sd.copy(), optim_sd.copy()
        forget_older_placements()  # its detached tensors must be on this model's meshes
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        # taken after DCP's call, which makes the state of an optimizer that has none
        self._walk = None
        objects, values = self._holdings()
        # (group, name) -> its param_groups.{fqn}.{name} entries, each fqn's group found
        # through its state tensors
        group_of = {
            id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]
        }
        owner = {id(v): id(p) for p, st in self.optimizer.state.items() for v in st.values()}
        fqn_group = {}
        for k, v in optim_sd.items():
            if k.startswith("state.") and id(v) in owner:
                fqn_group[k[len("state.") : k.rindex(".")]] = group_of.get(owner[id(v)])
        pairs: dict[tuple[int, str], list[str]] = {}
        for k in optim_sd:
            if k.startswith("param_groups."):
                fqn, name = k[len("param_groups.") : k.rindex(".")], k[k.rindex(".") + 1 :]
                if fqn_group.get(fqn) is None:  # no state to tell its group by: not cached
                    self._cache = None
                    return model_sd, optim_sd
                pairs.setdefault((fqn_group[fqn], name), []).append(k)
        for (g, h), names in pairs.items():  # the group's own values, as later on
            for k in names:
                optim_sd[k] = self.optimizer.param_groups[g][h]
        self._cache = (objects, values, model_sd, optim_sd, pairs)
        return dict(model_sd), dict(optim_sd)

    def prime(self) -> None:
        """Take the state dict once before training, so that neither the first save nor a heal
        pays for DCP's walk over the model and optimizer (milliseconds) inside the training
        loop: `state_dict` remembers it (see `_get_state_dict`).

        An AdamW that has not stepped yet gets its state now: DCP makes it with one step of
        lr 0 and zero gradients, which leaves parameters and moments as they were, and the step
        counts go back to 0, so the first step computes exactly what it would have. Other
        optimizers are left without state (for them, DCP's step would be a real one)."""
        if not self.optimizer.state and not isinstance(
            self.optimizer, (torch.optim.Adam, torch.optim.AdamW)
        ):
            return
        fresh = not self.optimizer.state
        self.state_dict()
        if fresh:
            for st in self.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"].zero_()

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._get_state_dict()
        if self._tied():
            # tied weights are saved under both names, model and optimizer state alike, as a
            # pipeline's first and last stages hold them: checkpoints of either kind of
            # layout load into the other
            optim_sd = {**optim_sd, **_renamed(optim_sd, _EMBEDDING, _OUTPUT, only=True)}
        return {
            "model": model_sd,
            "optim": optim_sd,
            "data": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def _filled_in_place(self, sd: dict[str, Any]) -> bool:
        """Whether ``sd`` is this state's own state dict, its tensors filled in place (as a heal
        fills it): the same names, and under each the very tensor `state_dict` returns now."""
        if self._cache is None:
            return False
        mine = self.state_dict()
        if self._cache is None:  # taken anew, and not remembered: not the tensors of ``sd``
            return False
        for part in ("model", "optim"):
            theirs, ours = sd.get(part), mine[part]
            if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
                return False
            for k, v in ours.items():
                if isinstance(v, torch.Tensor) and theirs[k] is not v:
                    return False
        return True

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self._filled_in_place(sd):
            # the model's and the optimizer's tensors already hold the values: only the
            # hyperparameters are left (DCP's load would copy every tensor onto itself)
            groups = self.optimizer.param_groups
            for (g, name), names in self._cache[4].items():
                groups[g][name] = sd["optim"][names[-1]]  # the last of its entries, as DCP's
        else:
            model_sd, optim_sd = sd["model"], sd["optim"]
            if self._tied():
                alias = _renamed(optim_sd, _EMBEDDING, _OUTPUT, only=True)
                optim_sd = {k: v for k, v in optim_sd.items() if k not in alias}
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=self._options(),
            )
        self.loader.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"])
        self.step = int(sd["step"])


def init_distributed() -> None:
    """Join the process group that torchrun describes, in a store namespace of its own per
    restart attempt (a restarted group must not meet the keys of the one it replaces)."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"anyshard-attempt-{attempt}/", store),
        rank=rank,
        world_size=world,
    )


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _fault(cfg: Config) -> tuple[int | None, int | None, str, bool]:
    """The fault to inject in this attempt: (rank, step, mode, armed).

    ``fault.*`` (or ANYSHARD_FAULT=rank:step[:mode]) strikes on the first attempt only (unless
    ``only_first_attempt`` is false); ANYSHARD_FAULTS="rank:step[:mode],..." is a schedule whose
    k-th entry strikes on attempt k, for runs that fail repeatedly (torchrun --max-restarts).
    """
    schedule = os.environ.get("ANYSHARD_FAULTS", "").strip()
    if schedule:
        entries = [e.split(":") for e in schedule.split(",") if e.strip()]
        if _attempt() >= len(entries):
            return None, None, "sigkill", False
        e = entries[_attempt()]
        return int(e[0]), int(e[1]), e[2] if len(e) > 2 else "sigkill", True
    f = cfg.fault
    armed = f.kill_step is not None and (_attempt() == 0 or not f.only_first_attempt)
    return f.kill_rank, f.kill_step, f.mode, armed


def _layout_name(cfg: Config) -> str:
    p = cfg.parallel
    parts = [f"{d}={getattr(p, d)}" for d in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")]
    return " ".join(x for x in parts if not x.endswith("=1")) or "single"


def _since_process_start(now: float) -> float | None:
    """Seconds from this process's start (Linux's /proc) to ``now``; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return now - (boot + ticks / os.sysconf("SC_CLK_TCK"))


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def build_training(cfg: Config):
    """This rank's mesh, model part, AdamW and `TrainStep` for ``cfg`` (no checkpoint, no data)."""
    par = setup_mesh(cfg.parallel)
    model, experts = build(cfg.model, par, cfg.train.seed)
    t = cfg.train
    optimizer = make_optimizer(model, t.lr, (t.beta1, t.beta2), t.weight_decay)
    step_fn = TrainStep(
        model,
        par,
        optimizer,
        experts,
        grad_clip=t.grad_clip,
        microbatches=cfg.parallel.microbatches,
        schedule=cfg.parallel.pp_schedule,
    )
    return par, model, optimizer, step_fn


def _loader(cfg: Config, par) -> DataLoader:
    """This rank's data: under FT-HSDP each replica group takes its own share of every step's
    global batch (`ReplicaGroup.data_share` adjusts it to the groups of each step's quorum)."""
    t = cfg.train
    groups, group = cfg.ft.replicas, cfg.ft.replica
    return DataLoader(
        load_corpus(),
        seq_len=t.seq_len,
        global_batch=t.global_batch,
        dp_rank=group * par.data_size + par.data_rank,
        dp_size=groups * par.data_size,
        seed=t.seed,
    )


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


class _Layouts:
    """The layout changes of a run: the configured switch (``parallel.relayout_at``) and the
    scheduler's answers (``parallel.auto``, `autolayout.Scheduler`), each carried out through
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
        if rates is not None:
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
                start_step=step,
                online=p.auto == "online",
                policy=policy,
                memory_bytes=_budget(cfg),
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
        old = _layout_name(cfg)
        before = _process_groups()
        cfg, state, step_fn, cost = relayout(cfg, state, parallel)
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = _process_groups() - before
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
            event = {"event": "relayout", "step": state.step, "from": old, "to": _layout_name(cfg)}
            _append(os.path.join(cfg.run_dir, "events.jsonl"), {**event, **cost})
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
            _append(os.path.join(cfg.run_dir, "events.jsonl"), record)

    def measured(self, wall_s: float, compute_s: float, par) -> None:
        """Tell the scheduler what this step cost: the slowest rank's wall time, and every
        rank's compute time (its work, not its waits for the others) and data rank."""
        self.steps += 1
        if self.steps == MEMORY_STEPS and self.rss0 >= 0:
            self._log_memory()
        if self.scheduler is None:
            return
        mine = torch.tensor([wall_s, compute_s, float(par.data_rank)], dtype=torch.float64)
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            on = "cuda" if dist.get_backend() == "nccl" else "cpu"
            out = torch.empty(dist.get_world_size() * 3, dtype=torch.float64, device=on)
            dist.all_gather_into_tensor(out, mine.to(on))
            rows = list(out.cpu().view(-1, 3))
        busy = [float(r[1]) for r in rows]
        self.scheduler.observe(max(float(r[0]) for r in rows), busy, [int(r[2]) for r in rows])

    def _log_memory(self) -> None:
        """The ``memory`` event: each rank's RSS before the model was built and its peak over
        the first steps, beside what the cost model counts for the layout (collective)."""
        from anyshard.trainer_integration.gpt.layout_chooser.costmodel import memory_per_rank

        mine = torch.tensor([self.rss0, _status_bytes("VmHWM"), _status_bytes("VmRSS")])
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            on = "cuda" if dist.get_backend() == "nccl" else "cpu"
            out = torch.empty(dist.get_world_size() * 3, dtype=mine.dtype, device=on)
            dist.all_gather_into_tensor(out, mine.to(on))
            rows = list(out.cpu().view(-1, 3))
        if self.rank == 0:
            start, peak, now = ([int(r[i]) for r in rows] for i in range(3))
            event = {"event": "memory", "steps": self.steps, "layout": _layout_name(self.cfg)}
            event["counted_bytes"] = memory_per_rank(self.cfg, self.cfg.parallel)
            event["malloc"] = self.malloc_mode
            event.update(rss_start=start, rss_peak=peak, rss_end=now, time=time.time())
            _append(os.path.join(self.cfg.run_dir, "events.jsonl"), event)


MEMORY_STEPS = 3  # the memory event's peak covers the first steps (a step builds AdamW's state)


def _status_bytes(field: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in bytes; -1 where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":")), -1)
    except OSError:
        return -1


def _rss_mark() -> int:
    """This process's RSS now, its peak reset to it (/proc/self/clear_refs); -1 where the
    kernel keeps either from us, so that the memory event is not logged."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return _status_bytes("VmRSS")


def _on_accelerator() -> bool:
    return torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


class _Straggler:
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


def _log_failed_saves(cfg: Config, ckpt: Checkpointer, rank: int) -> None:
    """Rank 0 prints and logs (a ``save_failed`` event) each checkpoint save the Checkpointer
    skipped (``checkpoint.on_error = "skip"``) since the last call."""
    new, ckpt.failures = ckpt.failures, []
    for f in new if rank == 0 else ():
        print(
            f"checkpoint of step {f['step']} failed, training goes on and the next save tries "
            f"again (checkpoint.max_failures = {cfg.checkpoint.max_failures} in a row stop the "
            f"job): {f['error']}",
            flush=True,
        )
        _append(os.path.join(cfg.run_dir, "events.jsonl"), {"event": "save_failed", **f})


def _budget(cfg: Config) -> int | None:
    """``parallel.auto_memory_gib`` in bytes (None: the host's or accelerator's default)."""
    gib = cfg.parallel.auto_memory_gib
    return None if gib is None else int(gib * 2**30)


def _starting_layout(cfg: Config, rank: int) -> tuple[Config, Any, Any]:
    """The config to start under, the `layouts.Choice` that changed its layout (None when
    kept) and the scheduler's measured rates (None unless ``parallel.auto`` is on for a job of
    one replica group). On a world its degrees do not fit, ``auto`` chooses: the model's
    fastest layout, or `layouts.choose_layout`'s rules for replica groups. Collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rates = chosen = None
    if cfg.parallel.auto != "off" and cfg.ft.replicas == 1:
        from anyshard.trainer_integration.gpt.layout_chooser.costmodel import calibrate

        rates = calibrate(cfg=cfg)
    if cfg.parallel.auto != "off" and cfg.parallel.world_size != world:
        from anyshard.trainer_integration.gpt.layout_chooser.candidates import (
            choose_layout,
            layout_text,
        )
        from anyshard.trainer_integration.gpt.layout_chooser.scheduler import first_layout

        budget = _budget(cfg)
        chosen = (
            choose_layout(cfg, world, memory_bytes=budget)
            if rates is None
            else first_layout(cfg, world, rates, memory_bytes=budget)
        )
        cfg = dataclasses.replace(cfg, parallel=chosen.parallel)
        if rank == 0:
            why = "; ".join(chosen.reasons)
            print(f"layout for {world} ranks: {layout_text(chosen.parallel)} ({why})", flush=True)
    return cfg, chosen, rates


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


def _start_event(layout: str, restored, times: tuple, chosen, fault_file: str) -> dict:
    """The ``start`` event, logged at the first step: ``times`` is (the run's start, the
    seconds building the model took, the seconds restoring took); a fault the previous
    attempt logged in ``fault_file`` gets its recovery time and lost steps (and is marked
    recovered)."""
    started, build_s, restore_s = times
    event = {
        "event": "start",
        "layout": layout,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "attempt": _attempt(),
        "time": time.time(),
        "pid": os.getpid(),
        "restored_step": restored,
        "startup_to_first_step_s": time.time() - started,
        # where a start goes: process start to `run` (imports, process group), building the
        # model, restoring the checkpoint
        "process_to_run_s": _since_process_start(started),
        "build_s": build_s,
        "restore_s": restore_s,
    }
    if chosen is not None:
        event["layout_reasons"] = list(chosen.reasons)
    if os.path.exists(fault_file):
        last = [json.loads(x) for x in open(fault_file)][-1]
        if last["time"] < started + 1e-9 and not last.get("recovered"):
            event["recovery_s"] = time.time() - last["time"]
            event["lost_steps"] = last["step"] - (restored or 0)
            _append(fault_file, {**last, "recovered": True, "time": last["time"]})
    return event


def run(cfg: Config, *, max_steps: int | None = None, stop_at: int | None = None) -> list[float]:
    """Train (restoring first) until ``cfg.train.steps`` (or step ``stop_at``, for a job that is
    to be relaunched: the LR schedule still spans ``cfg.train.steps``), for at most ``max_steps``
    steps of this call; returns this call's losses. torch.distributed must be initialised if
    the layout has more than one rank."""
    started = time.time()
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups_before = _process_groups()
    if cfg.ft.replicas > 1:
        # each replica group logs into its own folder; a restarted group may take another layout
        cfg = dataclasses.replace(
            cfg, run_dir=os.path.join(cfg.run_dir, f"replica-{cfg.ft.replica}")
        )
        heal = heal_parallel(cfg)
        if heal is not None and _attempt() > 0:
            cfg = dataclasses.replace(cfg, parallel=heal)
    cfg, chosen, rates = _starting_layout(cfg, rank)
    budget = cfg.parallel.auto_memory_gib
    lean = malloc.wanted(cfg.train.malloc, budget, on_accelerator=_on_accelerator())
    lean = lean and malloc.set_lean()
    malloc_mode = "lean" if lean else "default"
    rss0 = _rss_mark()
    torch.manual_seed(cfg.train.seed)
    par, model, optimizer, step_fn = build_training(cfg)
    layout_groups = _process_groups() - groups_before
    built = time.time()
    t = cfg.train
    state = TrainState(model, optimizer, _loader(cfg, par))
    c = cfg.checkpoint
    ckpt = _checkpointer(c)
    guarded = c.async_ and c.stage_in_background
    if guarded:
        ckpt.guard(state.optimizer)
    os.makedirs(cfg.run_dir, exist_ok=True)
    before_restore = time.time()
    restored = None
    if cfg.ft.replicas == 1:  # replica groups restore after their first quorum (below)
        restored = ckpt.restore_latest({"train": state}, strict=cfg.parallel.pp == 1)
    restore_s = time.time() - before_restore
    layout = _layout_name(cfg)
    replicas = None
    if cfg.ft.replicas > 1:
        from anyshard.trainer_integration.gpt.ft_hsdp import ReplicaGroup

        replicas = ReplicaGroup(cfg, state, layout)
        replicas.attach(step_fn)
    # The state dict, taken now, before the first step: the first save does not walk the model
    # inside the loop, and a restarted replica group's first quorum (which waits for the state
    # dict a heal fills) does not either, which would hold the healthy group up
    state.prime()
    if guarded:  # fault in the staging buffers on the save thread, while the first step runs
        start = time.perf_counter()
        ckpt.prepare({"train": state})
        ckpt.blocked_s += time.perf_counter() - start
    end = t.steps if stop_at is None else min(t.steps, stop_at)
    layouts = _Layouts(
        cfg,
        rates,
        layout_groups,
        end=end,
        step=state.step,
        rank=rank,
        rss0=rss0,
        malloc_mode=malloc_mode,
    )
    kill_rank, kill_step, mode, armed = _fault(cfg)
    fault_file = os.path.join(cfg.run_dir, "fault.json")
    losses: list[float] = []
    f, accelerator = cfg.fault, _on_accelerator()
    straggler = _Straggler(f.slow_factor, f.slow_from, accelerator) if f.slow_rank == rank else None
    first = True
    joined = False  # FT-HSDP: whether this group has been through its first quorum
    saves = 0
    while state.step < end and (max_steps is None or len(losses) < max_steps):
        target = layouts.target(state)
        if target is not None:
            ckpt.wait()  # a save in flight still reads the old layout's tensors
            cfg, state, step_fn = layouts.switch(cfg, state, target)
            layout, par = _layout_name(cfg), step_fn.par
            if guarded:
                ckpt.guard(state.optimizer)
            if replicas is not None:  # this group alone changes layout; the quorum goes on
                replicas.rebind(state, layout, step_fn)
        layouts.apply_shares(cfg, state, step_fn)
        if replicas is not None:
            # a step that lost the other group: train its share while the lighthouse notices
            replicas.train_ahead(step_fn, state.loader, par.data_rank, par.data_size)
            healed = replicas.start_step()  # may fill the state from a healthy group
            if not joined and (healed is None or healed["event"] != "heal"):
                # no group is ahead (the whole job starts or restarts): the newest committed
                # checkpoint is the state; a group that healed never reads storage (and so
                # never races the writing group's retention)
                before_restore = time.time()
                restored = ckpt.restore_latest({"train": state}, strict=cfg.parallel.pp == 1)
                replicas.restored(state.step)
                restore_s = time.time() - before_restore
            joined = True
            if healed is not None and rank == 0:
                event = {**healed, "step": state.step, "layout": layout, "attempt": _attempt()}
                _append(os.path.join(cfg.run_dir, "events.jsonl"), {**event, "time": time.time()})
            if state.step >= end:
                break
            state.loader.dp_rank, state.loader.dp_size = replicas.data_share(
                par.data_rank, par.data_size
            )
        optimizer, loader = state.optimizer, state.loader
        step_began, cpu_began = time.perf_counter(), time.thread_time()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(
                state.step, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio
            )
        inputs, targets = loader.next_batch()
        if armed and state.step == kill_step and rank == kill_rank:
            ckpt.wait(collective=False)  # this rank alone: no collective with the others
            _append(
                fault_file, {"time": time.time(), "step": state.step, "rank": rank, "mode": mode}
            )
            if mode == "raise":
                raise RuntimeError(f"injected fault on rank {rank} at step {state.step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if straggler is not None:
            straggler.arm(state.model, state.step)
        slept = straggler.slept if straggler is not None else 0.0
        # FT-HSDP: the quorum may save the last step, which lost a group, instead of redoing it
        rescue = None if replicas is None else replicas.rescue(loader, par.data_rank, par.data_size)
        loss = step_fn(inputs, targets) if rescue is None else step_fn.resume(*rescue)
        if t.min_step_s > 0:  # a larger model's step time: faults land mid-run
            time.sleep(max(0.0, t.min_step_s - (time.perf_counter() - step_began)))
        wall = time.perf_counter() - step_began
        if accelerator:
            compute = wall  # kernels run asynchronously: the host's clocks do not see them
        else:  # this thread's work, and what an injected straggler slept in its place
            compute = time.thread_time() - cpu_began
            compute += (straggler.slept - slept) if straggler is not None else 0.0
        layouts.measured(wall, compute, par)
        if rescue is not None and step_fn.committed and rank == 0:
            event = {"event": "rescued", "step": state.step, **replicas.rescue_info}
            _append(os.path.join(cfg.run_dir, "events.jsonl"), {**event, "time": time.time()})
        if not step_fn.committed:  # the quorum did not commit: redo this step's batch
            loader.samples_consumed -= loader.global_batch
            if rank == 0:
                event = {"event": "uncommitted", "step": state.step, "time": time.time()}
                _append(os.path.join(cfg.run_dir, "events.jsonl"), event)
            continue
        state.step += 1
        losses.append(loss)
        if rank == 0:
            record = {
                "step": state.step,
                "loss": loss,
                "layout": layout,
                "attempt": _attempt(),
                "time": time.time(),
            }
            if replicas is not None:  # the groups that took part, and this group's data share
                record["groups"] = replicas.manager.num_participants()
                record["share"] = [loader.dp_rank // par.data_size, loader.dp_size // par.data_size]
                if rescue is not None:  # a saved step: the shares of its split this group trained
                    info = replicas.rescue_info
                    record["share"][1] = info["groups_before"]
                    record["shares"] = int(info["kept"]) + len(info["trained"])
            _append(os.path.join(cfg.run_dir, "losses.jsonl"), record)
            if first:
                times = (started, built - started, restore_s)
                event = _start_event(layout, restored, times, chosen, fault_file)
                event["malloc"] = malloc_mode
                _append(os.path.join(cfg.run_dir, "events.jsonl"), event)
        first = False
        if replicas is None or replicas.is_primary():  # one replica group writes checkpoints
            saves += ckpt.save(state.step, {"train": state})
            _log_failed_saves(cfg, ckpt, rank)
    ckpt.wait()
    _log_failed_saves(cfg, ckpt, rank)
    final_digest = None
    if replicas is not None:
        if cfg.ft.check_heals:
            from anyshard.trainer_integration.gpt.ft_hsdp import state_digest

            final_digest = state_digest(state)
        replicas.shutdown()
    # how long checkpointing held training up (the slowest rank): save calls (planning; a sync
    # save's whole write), optimizer steps waiting for a staging copy, faulting in the buffers
    on = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    # and the most any rank's RSS grew over the run (from before the model was built)
    grown = _status_bytes("VmHWM") - rss0 if rss0 >= 0 else -1
    blocked = torch.tensor([ckpt.blocked_s, grown], dtype=torch.float64, device=on)
    if dist.is_initialized():
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    if rank == 0 and losses:
        event = {"event": "end", "step": state.step, "attempt": _attempt(), "saves": saves}
        event.update(ckpt_blocked_s=float(blocked[0]), rss_growth_max=int(blocked[1]))
        if replicas is not None:
            event["reduce_s"] = replicas.reduce_s
            event["digest"] = final_digest
        _append(os.path.join(cfg.run_dir, "events.jsonl"), event)
    # the all-reduce above is the last collective: every rank is done with the groups of this
    # run's meshes, which a process that trains again (a warm pool, a notebook) would keep,
    # each with its sockets and threads
    for group in _process_groups() - groups_before:
        if group is not dist.GroupMember.WORLD:  # one the run initialised stays, as before
            dist.destroy_process_group(group)
    forget_cached_placements()  # DTensor's cache may hand out tensors on the destroyed meshes
    gc.collect()  # cycles may hold the meshes, and they the destroyed groups' threads
    return losses


def _process_groups() -> set:
    """The process groups of this process, the default one included."""
    return process_groups()


def _quiet() -> None:
    """Keep torch's advice about its own internals out of the training log."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*flattened dim.*")
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None, *, hard_exit: bool = True) -> int:
    """``python -m anyshard.trainer_integration.gpt.train [--config FILE] [--stop-at N]
    [--relayout-at STEP:LAYOUT] [--section.key value ...]``"""
    cfg, stop_at = trainer_config(list(sys.argv[1:] if argv is None else argv))
    _quiet()
    init_distributed()
    try:
        run(cfg, stop_at=stop_at)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if hard_exit and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # Under torchrun, leave without interpreter finalization: gloo's worker threads can
        # abort a process there after a clean run (pytorch#179291), which torchrun would take
        # for a failure and restart the group.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
