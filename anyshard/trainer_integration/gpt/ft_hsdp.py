"""FT-HSDP for the reference trainer: replica groups on torchft that fail and heal alone.

Each replica group is its own launch (its own ranks, store and process group) with the
configured layout inside (FSDP2, TP, PP). One torchft ``Manager`` per rank keeps the group in
the quorum that the lighthouse computes every step; gradients are averaged across the groups
that take part (torchft's fault-tolerant process group), and a step is applied only where the
quorum commits it. The groups of a step's quorum split its global batch between them, so every
sample is trained on once whether one group or all of them take part. A group that comes back after a fault is caught up from a healthy group by
`AnyshardTransport` (`anyshard.redistribute` across the two groups: model, optimizer, step,
data position and RNG, into whatever layout the group now has; nothing pickled).

When the groups' layouts differ (a group healed into ``ft.heal_layout``), the gradients are
averaged in one layout common to all groups: each group moves its gradients into row chunks
over its ranks (`anyshard.redistribute`, inside the group), the groups average those rank by
rank, and each group moves the average back. Groups that share a layout average their local
shards directly. The groups agree on which case holds with one small reduction per step.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from anyshard.api.redistribute import redistribute
from anyshard.trainer_integration.heal import AnyshardTransport

__all__ = ["ReplicaGroup"]


def _layout_code(name: str) -> float:
    """A number naming a layout, exact in float64 (40 bits of its hash)."""
    return float(int.from_bytes(hashlib.sha256(name.encode()).digest()[:5], "big"))


def state_digest(state) -> str | None:
    """SHA-256 of the logical training state (every tensor whole, in name order, with the data
    position and step), the same under any layout; on group rank 0, None elsewhere. Collective
    over the group; it gathers every tensor, so it is for tests and checks."""
    from anyshard.api import collectives as coll
    from anyshard.api.state import flatten_state

    digests: dict[str, str] = {}
    for fqn, leaf in sorted(flatten_state(state.state_dict()).items()):
        value = leaf.value
        if isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            data = whole.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            digests[fqn] = hashlib.sha256(data).hexdigest()
        elif fqn.startswith(("data.", "step")):
            digests[fqn] = repr(value)
    every = coll.gather_json(digests)
    if every is None:
        return None
    merged: dict[str, str] = {}
    for d in every:
        merged.update(d)
    if "rng" in merged:  # each rank's own generator; the logical state is the rest
        del merged["rng"]
    return hashlib.sha256(repr(sorted(merged.items())).encode()).hexdigest()


def _forget_previous_manager(rank: int) -> None:
    """A restarted group meets in the store its previous attempt used (torchrun's agent store
    outlives the ranks), where the dead Manager's address still stands: rank 0 removes it, and
    no rank builds its Manager before that (otherwise a rank would dial the dead one)."""
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if rank == 0:
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
        )
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    if dist.is_initialized():
        dist.barrier()


class ReplicaGroup:
    """This rank's part in FT-HSDP: the torchft Manager of its group, the heal transport, and
    the cross-group gradient average that `TrainStep` calls before the optimizer step."""

    def __init__(self, cfg, state, layout: str):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        f = cfg.ft
        self.cfg, self.state, self.layout = cfg, state, layout
        self.replica = f.replica
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        timeout = timedelta(seconds=f.timeout_s)
        self.transport = AnyshardTransport(
            state=lambda: {"default": self.state.state_dict()},
            replica_id=f"replica_{f.replica}",
            group_rank=rank,
            group_world_size=world,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            timeout=timeout,
        )
        _forget_previous_manager(rank)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state_dict,
            min_replica_size=f.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world,
            replica_id=f"replica_{f.replica}",
            lighthouse_addr=f.lighthouse,
            hostname="127.0.0.1",
            checkpoint_transport=self.transport,
            init_sync=False,
        )
        self._canon: dict[str, Any] | None = None
        self.reduce_s = 0.0
        self._step_share: tuple[int, int] | None = None  # (groups, this group's rank) this step
        self._kept: tuple[int, int] | None = None  # the share of an uncommitted step, kept
        # the share of the kept step trained ahead; `train_ahead` sets it before each quorum
        self._ahead: int | None = None
        self._ahead_s = 0.0
        # this step saves the last one: (groups then, shares nobody kept, groups that kept none,
        # {share trained ahead: the rank in this quorum of the group that trained it})
        self._lost: tuple[int, list[int], list[int], dict[int, int]] | None = None
        self._resuming = False  # the step being averaged is a saved one
        self.rescue_info: dict[str, Any] | None = None  # what this step's rescue trains
        wait = cfg.ft.wait_all_s
        self._wait_until = time.monotonic() + wait if wait > 0 else None  # see _waits_for_all

    def _state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def _load(self, sd: dict[str, Any]) -> None:
        self.state.load_state_dict(sd)

    def attach(self, step_fn) -> None:
        """Make ``step_fn`` (a `TrainStep`) average over the groups and vote before its
        optimizer step, keeping the gradients of a step the quorum does not commit."""
        step_fn.replica_sync = self.sync
        step_fn.keep_uncommitted = True

    def rebind(self, state, layout: str, step_fn) -> None:
        """The group switched to ``layout`` in the run (``parallel.relayout_at``): heals serve
        ``state`` from now on, the layout probe names the new layout, and ``step_fn`` (the new
        layout's `TrainStep`) is attached. Gradients kept from an uncommitted step belonged to
        the old model: the group keeps none, and the next quorum gives it the shares to train
        as it would a group that has just joined."""
        self.state, self.layout, self._kept = state, layout, None
        self.attach(step_fn)

    def restored(self, step: int) -> None:
        """The group restored ``step`` from storage: the Manager counts from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def train_ahead(self, step_fn, loader, data_rank: int, data_size: int) -> None:
        """Before the quorum that follows a step of two groups that did not commit, while the
        lighthouse has not yet noticed that the other group is gone: train the other group's
        share of that step (``step_fn.train_ahead``), so that `rescue` need not train it after
        the quorum. Wasted only when the other group lived on (then it kept its share). With
        more groups it is unknown which were lost, and nothing is trained ahead. Off with
        ``ft.head_start = false``; it holds one more set of gradients meanwhile."""
        self._ahead = None
        if not self.cfg.ft.head_start or self._kept is None or self._kept[0] != 2:
            return
        start = time.perf_counter()
        other = 1 - self._kept[1]
        # the loader was set back to the uncommitted step's first sample
        step_fn.train_ahead(
            *loader.batch_at(loader.samples_consumed, other * data_size + data_rank, 2 * data_size)
        )
        self._ahead, self._ahead_s = other, time.perf_counter() - start

    def start_step(self) -> dict[str, Any] | None:
        """Join this step's quorum (healing from a peer if this group is behind, or serving a
        group that is), and agree with the quorum whether this step saves the last one (see
        `rescue`); returns what a heal moved (this group's ranks together), if one ran:
        ``event`` "heal" (this group healed) or "heal_sent"."""
        self._step_share, self.rescue_info = None, None
        healed = self._join()
        while self._waits_for_all():  # the job's first step: until every group is in
            time.sleep(0.1)
            healed = self._join() or healed
        self._lost = self._agree(healed is not None and healed["event"] == "heal")
        return healed

    def _waits_for_all(self) -> bool:
        """At the job's first quorum (``ft.wait_all_s`` > 0), whether to ask for another: some
        group is missing and the wait is not over. The group's ranks decide together."""
        if self._wait_until is None:
            return False
        wait = self.manager.num_participants() < self.cfg.ft.replicas
        flag = torch.tensor([1.0 if wait and time.monotonic() < self._wait_until else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            self._wait_until = None
        return self._wait_until is not None

    def _agree(self, healed: bool) -> tuple[int, list[int], list[int], dict[int, int]] | None:
        """Whether the quorum just joined saves the step the previous one did not commit: when
        the groups in it that trained that step kept their gradients and agree on its split,
        and every other group in it (one that joined or healed since) stands at the same step.
        Then (groups of that split, the shares nobody kept, the ranks in this quorum of the
        groups that kept none, the shares trained ahead and by whom). One small reduction (MAX)
        across the quorum every step, and one in the group: every participant and every rank
        decides alike, and one quorum per step keeps the groups in step."""
        kept, self._kept = self._kept, None
        slots = self.cfg.ft.replicas
        rank = self.manager.participating_rank()
        # [0, slots): shares of the old split kept; [slots, 2 slots): fresh groups by their rank
        # in this quorum; then the old split's group count, and its negation (MAX of both: all
        # keepers agree on it); then, per share of the old split, 1 + the rank in this quorum
        # of the group that trained it ahead
        held = torch.zeros(3 * slots + 2, dtype=torch.float64)
        if kept is not None and not healed:
            groups, old = kept
            held[old], held[2 * slots], held[2 * slots + 1] = 1.0, groups, -groups
            if self._ahead is not None and rank is not None:
                held[2 * slots + 2 + self._ahead] = 1.0 + rank
        else:
            held[2 * slots + 1] = -float(2**20)
            if rank is not None:
                held[slots + rank] = 1.0
        self.manager.allreduce(held, reduce_op=dist.ReduceOp.MAX).wait()
        groups = int(held[2 * slots])
        ok = (
            self.manager.errored() is None
            and rank is not None
            and groups >= 1
            and held[2 * slots] == -held[2 * slots + 1]
        )
        agreed = torch.tensor([1.0 if ok else 0.0])
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not agreed.item():
            return None
        fresh = [j for j in range(self.manager.num_participants()) if held[slots + j] > 0]
        lost = [g for g in range(groups) if held[g] == 0]
        ahead = {g: int(held[2 * slots + 2 + g]) - 1 for g in lost if held[2 * slots + 2 + g] > 0}
        return groups, lost, fresh, ahead

    def _join(self) -> dict[str, Any] | None:
        before = self.transport.last
        start = time.perf_counter()
        self.manager.start_quorum()
        last = self.transport.last
        if last is before or not last:
            return None
        healer = last["role"] == "healer"
        moved = torch.tensor(
            [float(last["received_bytes" if healer else "sent_bytes"])], dtype=torch.float64
        )
        if dist.is_initialized():
            dist.all_reduce(moved)
        out: dict[str, Any] = {
            "event": "heal" if healer else "heal_sent",
            "heal_s": time.perf_counter() - start,
        }
        if healer:
            out.update(source=last["source"], received_bytes=int(moved.item()))
        else:
            out.update(healers=last["healers"], sent_bytes=int(moved.item()))
        if self.cfg.ft.check_heals:
            out["digest"] = state_digest(self.state)
        return out

    def data_share(self, data_rank: int, data_size: int) -> tuple[int, int]:
        """This rank's (dp_rank, dp_size) in this step's global batch: the groups in the quorum
        split the whole batch between them, so a step processes every sample of its batch
        whatever the number of groups (the configured share when the batch does not split)."""
        n, r = self.manager.num_participants(), self.manager.participating_rank()
        if r is None or not self._splits(n, data_size):
            self._step_share = None
            return self.replica * data_size + data_rank, self.cfg.ft.replicas * data_size
        self._step_share = (n, r)
        return r * data_size + data_rank, n * data_size

    def _splits(self, groups: int, data_size: int) -> bool:
        """Whether a step's global batch splits between ``groups`` groups of ``data_size``
        data ranks (and, with pipeline stages, each share into the microbatches)."""
        t, p = self.cfg.train, self.cfg.parallel
        size = groups * data_size
        if groups < 1 or t.global_batch % size:
            return False
        return p.pp == 1 or (t.global_batch // size) % p.microbatches == 0

    def is_primary(self) -> bool:
        """Whether this group writes the storage checkpoints (the quorum's first replica)."""
        return self.manager.participating_rank() == 0

    @torch.no_grad()
    def sync(self, model) -> bool:
        """Average the gradients over the groups of the quorum; whether the step commits.
        The gradients change only if it commits: a step that does not can be saved by the next
        quorum (`rescue`), which this group then offers."""
        start = time.perf_counter()
        resuming, self._resuming = self._resuming, False
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for _, p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        code = _layout_code(self.layout)
        pp = float(self.cfg.parallel.pp)
        probe = torch.tensor([code, -code, pp], dtype=torch.float64)
        self.manager.allreduce(probe, reduce_op=dist.ReduceOp.MAX).wait()
        apply = None
        if self.manager.errored() is None:  # a failed probe holds garbage: the step fails
            mixed = float(probe[0]) != -float(probe[1])
            if mixed and float(probe[2]) > 1:  # every group sees it: none waits for the others
                raise RuntimeError(
                    f"replica group {self.replica} ({self.layout}) meets a group of another "
                    f"layout, and one of them has pipeline stages (pp={int(probe[2])}): "
                    "gradients are averaged across differing layouts only without pipeline "
                    "stages; give every group a layout without pp, or the same layout "
                    "(ft.heal_layout)"
                )
            if mixed:
                apply = self._reduce_canonical(params)
            else:
                apply = self._reduce([p.grad for _, p in params])
        committed = self.manager.should_commit()
        if committed and apply is not None:
            apply()
        elif not committed and not resuming:
            self._kept = self._step_share
        self.reduce_s += time.perf_counter() - start
        return committed

    def rescue(
        self, loader, data_rank: int, data_size: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float, bool, bool] | None:
        """What saves the last step, which the quorum did not commit because groups were lost
        during it: (batches, scale, kept, ahead), or None when this step is a fresh one.

        The groups that trained it kept their gradients (``kept``); `start_step` agreed on it.
        A lost share that a group of this quorum trained ahead (`train_ahead`) is that group's
        (``ahead``). The other lost groups' shares of the same batch go to the groups of this
        quorum, first to those that kept none (a group that came back and healed to the step,
        which would otherwise wait), then to the others, in turn. Each group adds the gradients
        of its shares to what it kept and scales the sum by (groups now / groups then): their
        average over the quorum is the gradient of the whole batch, the same as the
        uninterrupted step's. Pass the result to ``TrainStep.resume``."""
        if self._lost is None:
            return None
        before, lost, fresh, ahead_by = self._lost
        n, r = self.manager.num_participants(), self.manager.participating_rank()
        order = fresh + [j for j in range(n) if j not in fresh]
        rest = [g for g in lost if g not in ahead_by]
        mine = [g for i, g in enumerate(rest) if order[i % n] == r]
        ahead = [g for g in lost if ahead_by.get(g) == r]  # this group's claim: `_agree`
        position = loader.samples_consumed - loader.global_batch  # this step's first sample
        batches = [
            loader.batch_at(position, g * data_size + data_rank, before * data_size) for g in mine
        ]
        kept = r not in fresh
        self._resuming = True
        self.rescue_info = {
            "groups_before": before,
            "groups_now": n,
            "lost": lost,
            "trained": ahead + mine,
            "trained_ahead": ahead,
            "kept": kept,
        }
        if ahead:
            self.rescue_info["ahead_s"] = round(self._ahead_s, 4)
        return batches, n / before, kept, bool(ahead)

    def _reduce(self, grads: list[torch.Tensor]):
        """Average local tensors over the groups (rank r of every group holds the same part);
        returns what writes the average into them."""
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not locals_:
            return lambda: None
        flat = torch.cat([x.reshape(-1).to(torch.float32) for x in locals_])
        self.manager.allreduce(flat).wait()

        def apply() -> None:
            off = 0
            for x in locals_:
                n = x.numel()
                x.copy_(flat[off : off + n].view(x.shape))
                off += n

        return apply

    def _reduce_canonical(self, params):
        """Average gradients of differing layouts: through row chunks over this group's ranks;
        returns what moves the average back into them."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import empty as dt_empty

        if self._canon is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ft_reduce",))
            self._canon = {
                n: dt_empty(*p.shape, dtype=p.dtype, device_mesh=mesh, placements=[Shard(0)])
                for n, p in params
            }
        for _, p in params:  # partial sums (a TP-replicated weight's gradient) reduced first
            g = p.grad
            if any(x.is_partial() for x in getattr(g, "placements", ())):
                whole = [Replicate() if x.is_partial() else x for x in g.placements]
                p.grad = g.redistribute(g.device_mesh, whole)
        native = {n: p.grad for n, p in params}
        redistribute(native, self._canon)
        apply = self._reduce(list(self._canon.values()))
        return lambda: (apply(), redistribute(self._canon, native))

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
