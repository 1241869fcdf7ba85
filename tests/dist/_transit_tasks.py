"""Task run on two gloo ranks by tests/dist/test_transit_checksums.py: bytes that cross ranks
(read-once forwarding, `anyshard.redistribute`, a peer heal) damaged at the transport, one bit
in each tensor a rank sends, must be a `ChecksumError` on every rank, naming the tensor and the
sender; undamaged, the same calls are bit-exact."""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import anyshard
from anyshard.api import collectives as coll
from anyshard.errors import AnyshardError, ChecksumError


def _damaged(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the lowest bit of its first byte flipped: what the wire delivers."""
    bad = t.detach().clone()
    bad.reshape(-1).view(torch.uint8)[0] ^= 1
    return bad


def _is_payload(t: torch.Tensor) -> bool:
    # the side tensors of checksums are int64; the payloads here are uint8 bytes or float32
    return t.dtype != torch.int64 and t.numel() > 0


@contextlib.contextmanager
def _flipping(sender: int):
    """On group rank ``sender``, every payload tensor handed to ``batch_isend_irecv`` or to a
    `PeerGroup`'s sends is replaced by a damaged copy (the sender's own tensors stay intact)."""
    real_batch, real_exchange = dist.batch_isend_irecv, coll.PeerGroup.exchange

    def batch(ops):
        if dist.get_rank() == sender:
            for op in ops:
                if op.op is dist.isend and _is_payload(op.tensor):
                    op.tensor = _damaged(op.tensor)
        return real_batch(ops)

    def exchange(self, sends, recvs):
        if self.rank == sender:
            sends = [(_damaged(t) if _is_payload(t) else t, to) for t, to in sends]
        return real_exchange(self, sends, recvs)

    dist.batch_isend_irecv = batch
    coll.PeerGroup.exchange = exchange
    try:
        yield
    finally:
        dist.batch_isend_irecv = real_batch
        coll.PeerGroup.exchange = real_exchange


def _outcome(fn) -> dict:
    try:
        fn()
    except ChecksumError as e:
        return {"type": "ChecksumError", "tensor": e.tensor, "sender": e.sender,
                "receiver": e.receiver, "failures": len(e.failures), "text": str(e)}  # fmt: skip
    except AnyshardError as e:
        return {"type": type(e).__name__, "text": str(e)}
    return {"type": None}


def _redistribute(rank: int) -> dict:
    """Shard(0) -> Shard(1) over two ranks: bit-exact, then damaged by rank 1, then damaged with
    the checks off (the damage reaches the destination: the injection is real)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = {"w": torch.arange(96, dtype=torch.float32).reshape(8, 12) / 7,
            "big": torch.arange(320_000, dtype=torch.float32).reshape(400, 800)}  # fmt: skip
    src = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}

    def fresh():
        return {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()
        }

    dst = fresh()
    anyshard.redistribute(src, dst)
    exact = all(torch.equal(dst[k].full_tensor(), full[k]) for k in full)
    with _flipping(sender=1):
        damaged = _outcome(lambda: anyshard.redistribute(src, fresh()))
        unchecked = fresh()
        anyshard.redistribute(src, unchecked, check_transit=False)
    silently = [k for k in full if not torch.equal(unchecked[k].full_tensor(), full[k])]
    return {"exact": exact, "damaged": damaged, "unchecked_differs": silently}


def _read_once(rank: int, path: str) -> dict:
    """Two plain tensors (whole on each rank) loaded with ``read_once=True``: each rank reads
    one and forwards it; bit-exact, then with rank 1's forwarding damaged."""
    full = {"a": torch.arange(3000, dtype=torch.float32) / 3,
            "b": torch.arange(2000, dtype=torch.float32).reshape(40, 50) * 5}  # fmt: skip
    anyshard.save(path, {**full, "step": 4})

    def load():
        target = {"a": torch.zeros(3000), "b": torch.zeros(40, 50), "step": 0}
        anyshard.load(path, target, read_once=True)
        return target

    got = load()
    exact = all(torch.equal(got[k], full[k]) for k in full) and got["step"] == 4
    with _flipping(sender=1):
        damaged = _outcome(load)
    return {"exact": exact, "damaged": damaged}


def _heal(rank: int, port: int) -> dict:
    """A heal across two replica groups of one rank each, rank 0 the healthy source and rank 1
    the healer, through `AnyshardTransport`: bit-exact, then with the source's sends damaged."""
    from anyshard.trainer_integration.heal import AnyshardTransport

    w = torch.arange(5000, dtype=torch.float32).reshape(50, 100) / 9
    m = torch.arange(40, dtype=torch.float32) - 3

    def state(fill: bool) -> dict:
        return {"default": {"w": w.clone() if fill else torch.zeros_like(w),
                            "m": m.clone() if fill else torch.zeros_like(m),
                            "step": 7 if fill else 0}}  # fmt: skip

    role = "source" if rank == 0 else "healer"
    # the source group's store (torchrun's, in a job); the healer meets it through the metadata
    master = (
        dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        if rank == 0
        else None
    )
    timeout = timedelta(seconds=60)
    meta = json.dumps({"store": f"127.0.0.1:{port}", "world": 1, "round": 1, "replica": "source"})

    def heal(step: int):
        transport = AnyshardTransport(
            state=lambda: state(False),
            replica_id=role,
            group_rank=0,
            group_world_size=1,
            store_addr="127.0.0.1",
            store_port=port,
            timeout=timeout,
        )
        transport.metadata()
        if role == "source":
            payload = {"user": state(True), "torchft": {"step": step, "batches_committed": 2}}
            transport.send_checkpoint([1], step, payload, timeout)
            return None
        return transport.recv_checkpoint(0, meta, step, timeout)

    got = heal(1)
    exact = True
    if got is not None:
        sd = got["user"]["default"]
        exact = torch.equal(sd["w"], w) and torch.equal(sd["m"], m) and sd["step"] == 7
    with _flipping(sender=0):
        damaged = _outcome(lambda: heal(2))
    dist.barrier()  # the source's store outlives the healer's last request
    del master
    return {"exact": exact, "damaged": damaged}


def every_hop_task(path: str, port: int) -> dict:
    """The three hops, each undamaged and damaged, on this rank: their outcomes."""
    rank = dist.get_rank()
    out = {"redistribute": _redistribute(rank)}
    out["read_once"] = _read_once(rank, os.path.join(path, "ckpt"))
    out["heal"] = _heal(rank, port)
    return out
