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
    """What ``fn()`` raised: a `ChecksumError`'s fields, or another error's type and text (DCP
    wraps what its reader raised on each rank in a ``CheckpointException``: the lowest rank's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except CheckpointException as e:
        error = e.failures[min(e.failures)][0]
    except AnyshardError as e:
        error = e
    else:
        return {"type": None}
    if isinstance(error, ChecksumError):
        return {"type": "ChecksumError", "tensor": error.tensor, "sender": error.sender,
                "receiver": error.receiver, "failures": len(error.failures),
                "text": str(error)}  # fmt: skip
    return {"type": type(error).__name__, "text": str(error)}


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
    """Two plain tensors (whole on each rank) loaded reading each stored byte once, bit-exact,
    then with rank 1's sends damaged: through DCP's reader (a rank reads each tensor and
    forwards it, `read_once.fill_once`) and through `anyshard.load` (each rank reads a part of
    each, redistributed: the replica split)."""
    import torch.distributed.checkpoint as dcp

    from anyshard.dcp import AnyshardReader, AnyshardWriter

    full = {"a": torch.arange(3000, dtype=torch.float32) / 3,
            "b": torch.arange(2000, dtype=torch.float32).reshape(40, 50) * 5}  # fmt: skip
    dcp.save({k: v.clone() for k, v in full.items()}, storage_writer=AnyshardWriter(path))

    def target() -> dict:
        return {"a": torch.zeros(3000), "b": torch.zeros(40, 50)}

    def by_dcp() -> dict:
        got = target()
        dcp.load(got, storage_reader=AnyshardReader(path, read_once=True))
        return got

    def by_load() -> dict:
        got = target()
        anyshard.load(path, got, read_once=True)
        return got

    exact = all(torch.equal(got[k], full[k]) for got in (by_dcp(), by_load()) for k in full)
    with _flipping(sender=1):
        forwarded, split = _outcome(by_dcp), _outcome(by_load)
    return {"exact": exact, "forwarded": forwarded, "split": split}


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
