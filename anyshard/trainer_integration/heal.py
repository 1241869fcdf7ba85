"""Peer heal for torchft: a recovering replica group is filled from a healthy one by
`anyshard.redistribute`, into whatever layout it has, with nothing pickled.

torchft (``pip install torchft``) makes each data-parallel replica group its own fault domain:
a lighthouse keeps the quorum, a ``Manager`` per group rank votes on every step, and a group
that comes back after a fault is caught up from a healthy group before it takes part again.
Its own transports send pickles (``torch.save`` streams over HTTP, pickled metadata over a
process group) and fill only an identical layout. `AnyshardTransport` replaces them:

- the source group's ranks and the recovering group's ranks meet in one `PeerGroup`, through
  the source group's store (its address is in the metadata that torchft hands the healer);
- the recovering ranks describe their own state (its DTensor meshes and placements, which may
  differ from the source's: tp instead of dp_shard, say), every rank plans its own part, and
  the bytes move point to point; the healer's state is filled in place;
- only JSON descriptions and raw tensor bytes cross processes;
- every piece is checked on arrival against the crc32c its sender computed
  (`anyshard.format.transit`): a piece damaged on the way is a `ChecksumError` on every rank
  of both groups, naming the tensor, the sending rank and the receiving one, and the healer's
  state is not handed to the Manager.

    transport = AnyshardTransport(state=lambda: {"default": train_state.state_dict()}, ...)
    manager = torchft.Manager(pg=..., state_dict=train_state.state_dict,
                              load_state_dict=train_state.load_state_dict,
                              checkpoint_transport=transport, use_async_quorum=False, ...)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from anyshard.api.collectives import PeerGroup
from anyshard.api.redistribute import DEFAULT_MAX_INFLIGHT_BYTES, redistribute
from anyshard.errors import AnyshardError

try:  # torchft is optional: only the fault-tolerant trainer needs it
    from torchft.checkpointing.transport import CheckpointTransport
except ImportError:  # pragma: no cover - exercised where torchft is not installed
    CheckpointTransport = object  # type: ignore[assignment,misc]

__all__ = ["AnyshardTransport", "HealError"]


class HealError(AnyshardError):
    """A heal from a peer replica group could not be arranged (bad metadata, a peer gone)."""


def _parse_metadata(metadata: str) -> dict[str, Any]:
    try:
        m = json.loads(metadata)
        host, port = m["store"].rsplit(":", 1)
        fields = {
            "host": str(host),
            "port": int(port),
            "world": int(m["world"]),
            "round": int(m["round"]),
            "replica": str(m["replica"]),
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HealError(
            f"the healthy replica's checkpoint metadata is not an anyshard heal address: "
            f"{metadata[:200]!r} ({e}); every replica group must use AnyshardTransport"
        ) from None
    if fields["world"] < 1:
        raise HealError(f"the healthy replica reports a group of {fields['world']} ranks")
    return fields


class AnyshardTransport(CheckpointTransport):  # type: ignore[misc,valid-type]
    """A torchft ``CheckpointTransport`` that heals by `anyshard.redistribute`.

    ``state`` returns this rank's user state dicts, keyed as they are registered with the
    Manager (``{"default": ...}`` for ``Manager(state_dict=..., load_state_dict=...)``), in this
    group's own layout: the recovering side fills them in place and hands them to the
    Manager's load functions. ``store_addr``/``store_port`` is this group's TCPStore (torchrun's
    MASTER_ADDR/MASTER_PORT), which the other groups must reach; ``replica_id`` names the group.
    ``last`` holds what the latest send or receive moved and how long it took.
    ``check_transit=False`` (or ``ANYSHARD_CHECK_TRANSIT=0``) skips the transit checksums
    (`anyshard.redistribute`'s argument; made only where every rank of the heal asks for them).
    """

    def __init__(
        self,
        *,
        state: Callable[[], dict[str, Any]],
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        store_addr: str,
        store_port: int,
        timeout: timedelta = timedelta(seconds=60),
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        device: torch.device | str = "cpu",
        check_transit: bool | None = None,
    ):
        self._state = state
        self.replica_id = replica_id
        self.group_rank, self.group_world_size = group_rank, group_world_size
        self.store_addr, self.store_port = store_addr, store_port
        self.timeout = timeout
        self.max_inflight_bytes = max_inflight_bytes
        self.device = torch.device(device)
        self.check_transit = check_transit
        self._round = 0
        self.last: dict[str, Any] = {}

    def metadata(self) -> str:
        """Where a healer meets this rank: called once per quorum, so the round number names the
        quorum (every rank of a group counts the same rounds)."""
        self._round += 1
        return json.dumps(
            {
                "store": f"{self.store_addr}:{self.store_port}",
                "world": self.group_world_size,
                "round": self._round,
                "replica": self.replica_id,
            }
        )

    def _store(self, host: str, port: int, key: str, timeout: timedelta) -> dist.Store:
        base = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        return dist.PrefixStore(key, base)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Serve ``state_dict`` (this group's state) to the ``dst_ranks`` replicas that heal
        from this group in this quorum; returns when they have it."""
        start = time.perf_counter()
        key = f"anyshard-heal/{self.replica_id}/{self._round}/{step}/"
        store = self._store(self.store_addr, self.store_port, key, timeout)
        # each healing group registers its size under a slot; the member ranks follow the
        # source group's, slot by slot
        sizes = [int(store.get(f"size/{slot}")) for slot in range(len(dst_ranks))]
        total = self.group_world_size + sum(sizes)
        if self.group_rank == 0:
            store.set("total", str(total))
        group = PeerGroup(
            dist.PrefixStore("pg/", store),
            self.group_rank,
            total,
            world_offset=0,
            timeout=timeout,
            device=self.device,
        )
        try:
            plan = redistribute(
                state_dict,
                None,
                process_group=group,
                max_inflight_bytes=self.max_inflight_bytes,
                check_transit=self.check_transit,
            )
        finally:
            group.shutdown()
        self.last = {
            "role": "source",
            "step": step,
            "healers": len(dst_ranks),
            "sent_bytes": plan.sent_bytes(self.group_rank),
            "seconds": time.perf_counter() - start,
        }

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """This group's state, filled from the healthy group that ``metadata`` names, in this
        group's own layout; the Manager's state (step, batches committed) with it."""
        start = time.perf_counter()
        m = _parse_metadata(metadata)
        key = f"anyshard-heal/{m['replica']}/{m['round']}/{step}/"
        try:
            store = self._store(m["host"], m["port"], key, timeout)
            if self.group_rank == 0:
                slot = store.add("slots", 1) - 1
                store.set(f"slot/{self.replica_id}", str(slot))
                store.set(f"size/{slot}", str(self.group_world_size))
            slot = int(store.get(f"slot/{self.replica_id}"))
            offset = m["world"] + sum(int(store.get(f"size/{s}")) for s in range(slot))
            total = int(store.get("total"))
        except (RuntimeError, dist.DistStoreError) as e:
            raise HealError(
                f"could not meet the healthy replica group {m['replica']!r} through its store "
                f"{m['host']}:{m['port']} for step {step}: {e}"
            ) from e
        dst = {"user": self._state(), "torchft": {"step": 0, "batches_committed": 0}}
        group = PeerGroup(
            dist.PrefixStore("pg/", store),
            offset + self.group_rank,
            total,
            world_offset=offset,
            timeout=timeout,
            device=self.device,
        )
        try:
            plan = redistribute(
                None,
                dst,
                process_group=group,
                max_inflight_bytes=self.max_inflight_bytes,
                check_transit=self.check_transit,
            )
        finally:
            group.shutdown()
        self.last = {
            "role": "healer",
            "step": step,
            "source": m["replica"],
            "received_bytes": plan.received_bytes(offset + self.group_rank),
            "seconds": time.perf_counter() - start,
        }
        return dst

    def disallow_checkpoint(self) -> None:
        """Nothing to do: a send returns only once the healers have their bytes."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to release: each heal's process group lives for that heal only."""
