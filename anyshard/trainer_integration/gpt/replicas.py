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
from anyshard.trainer_integration.ft import AnyshardTransport

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

    def _state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def _load(self, sd: dict[str, Any]) -> None:
        self.state.load_state_dict(sd)

    def restored(self, step: int) -> None:
        """The group restored ``step`` from storage: the Manager counts from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def start_step(self) -> dict[str, Any] | None:
        """Join this step's quorum (healing from a peer if this group is behind, or serving a
        group that is); returns what a heal moved (this group's ranks together), if one ran:
        ``event`` "heal" (this group healed) or "heal_sent"."""
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
        t, p = self.cfg.train, self.cfg.parallel
        n, r = self.manager.num_participants(), self.manager.participating_rank()
        size = n * data_size
        fits = r is not None and n > 0 and t.global_batch % size == 0
        if fits and p.pp > 1:
            fits = (t.global_batch // size) % p.microbatches == 0
        if not fits:
            return self.replica * data_size + data_rank, self.cfg.ft.replicas * data_size
        return r * data_size + data_rank, size

    def is_primary(self) -> bool:
        """Whether this group writes the storage checkpoints (the quorum's first replica)."""
        return self.manager.participating_rank() == 0

    @torch.no_grad()
    def sync(self, model) -> bool:
        """Average the gradients over the groups of the quorum; whether the step commits."""
        start = time.perf_counter()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for _, p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        code = _layout_code(self.layout)
        pp = float(self.cfg.parallel.pp)
        probe = torch.tensor([code, -code, pp], dtype=torch.float64)
        self.manager.allreduce(probe, reduce_op=dist.ReduceOp.MAX).wait()
        mixed = float(probe[0]) != -float(probe[1])
        if mixed and float(probe[2]) > 1:  # every group sees it: none waits for the others
            raise RuntimeError(
                f"replica group {self.replica} ({self.layout}) meets a group of another layout, "
                f"and one of them has pipeline stages (pp={int(probe[2])}): gradients are "
                "averaged across differing layouts only without pipeline stages; give every "
                "group a layout without pp, or the same layout (ft.heal_layout)"
            )
        if mixed:
            self._reduce_canonical(params)
        else:
            self._reduce([p.grad for _, p in params])
        self.reduce_s += time.perf_counter() - start
        return self.manager.should_commit()

    def _reduce(self, grads: list[torch.Tensor]) -> None:
        """Average local tensors over the groups (rank r of every group holds the same part)."""
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not locals_:
            return
        flat = torch.cat([x.reshape(-1).to(torch.float32) for x in locals_])
        self.manager.allreduce(flat).wait()
        off = 0
        for x in locals_:
            n = x.numel()
            x.copy_(flat[off : off + n].view(x.shape))
            off += n

    def _reduce_canonical(self, params) -> None:
        """Average gradients of differing layouts: through row chunks over this group's ranks."""
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
        self._reduce(list(self._canon.values()))
        redistribute(self._canon, native)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
