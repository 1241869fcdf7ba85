"""Small JSON messages between ranks over tensor collectives (never pickle)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from anyshard._compat import set_nccl_timeout

__all__ = [
    "PeerGroup",
    "active",
    "all_equal",
    "all_gather_json",
    "broadcast_json",
    "device",
    "gather_json",
    "raise_together",
    "rank",
    "world_size",
]


class _Backend(Protocol):
    """What `PeerGroup` calls of its c10d backend (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)."""

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], /
    ) -> dist.Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int, /) -> dist.Work: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...


class PeerGroup:
    """A process group over processes that need not share a torch.distributed world: the
    ranks of one replica group and those of another (each its own job, with its own default
    process group), met through a store that all of them reach.

    Member ranks run from 0 to ``size - 1``; this process's world ranks map to member ranks
    ``world_offset + world_rank``, so the device meshes of its DTensors translate into member
    ranks. Only what `anyshard.redistribute` needs is offered: all-gather, broadcast and
    point-to-point messages. Gloo on CPU; NCCL when ``device`` is a CUDA device.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        world_offset: int = 0,
        timeout: timedelta = timedelta(seconds=60),
        device: torch.device | str = "cpu",
    ):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank, self.size, self.world_offset = rank, size, world_offset
        self.device = torch.device(device)
        backend: object
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            set_nccl_timeout(opts, timeout)
            backend = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        # torch's stubs list no collectives on a backend class, which has them at run time
        self.pg = cast(_Backend, backend)

    def member_rank(self, world_rank: int) -> int:
        """The member rank of this process's world rank ``world_rank``."""
        return self.world_offset + world_rank

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.pg.allgather([outs], [tensor]).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.broadcast(tensor, src).wait()

    def exchange(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
    ) -> list:
        """Post every send and receive (tensor, member rank) at once; returns the works to
        wait on. Receives are posted first, so that a message lands in its buffer as it
        arrives (posting sends first made a 1 GiB heal five times slower on gloo), and the
        messages between two ranks are tagged by their order, the same on both sides."""
        works = []
        seen: dict[int, int] = {}
        for t, frm in recvs:
            seen[frm] = seen.get(frm, -1) + 1
            works.append(self.pg.recv([t], frm, seen[frm]))
        seen = {}
        for t, to in sends:
            seen[to] = seen.get(to, -1) + 1
            works.append(self.pg.send([t], to, seen[to]))
        return works

    def shutdown(self) -> None:
        abort = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if abort is not None:
            abort()


def active(group=None) -> bool:
    if isinstance(group, PeerGroup):
        return True
    return dist.is_available() and dist.is_initialized()


def alive(group) -> bool:
    """Whether ``group``, a process group this process created, has not been destroyed since
    (``destroy_process_group`` of it, or of the default group, which destroys them all)."""
    if not active():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def rank(group=None) -> int:
    if isinstance(group, PeerGroup):
        return group.rank
    return dist.get_rank(group) if active(group) else 0


def world_size(group=None) -> int:
    if isinstance(group, PeerGroup):
        return group.size
    return dist.get_world_size(group) if active(group) else 1


def device(group) -> torch.device:
    """The device collectives of ``group`` take their tensors on (CUDA for NCCL)."""
    if isinstance(group, PeerGroup):
        return group.device
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )


def _decode(t: torch.Tensor, n: int) -> Any:
    return json.loads(bytes(t[:n].cpu().numpy()))


def gather_json(obj: Any, group=None, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` on group rank ``dst`` (None elsewhere)."""
    if not active(group):
        return [obj]
    dev = device(group)
    payload = _encode(obj, dev)
    n = world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(
        lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=dev), group=group
    )
    sizes = [int(x.item()) for x in lengths]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    me = rank(group)
    outs = (
        [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
        if me == dst
        else None
    )
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather(padded, outs, dst=dst_global, group=group)
    if outs is None:  # not the destination
        return None
    return [_decode(t, s) for t, s in zip(outs, sizes, strict=True)]


def _broadcast(t: torch.Tensor, src: int, group) -> None:
    if isinstance(group, PeerGroup):
        group.broadcast(t, src)
    else:
        dist.broadcast(
            t, src=dist.get_global_rank(group, src) if group is not None else src, group=group
        )


def _all_gather(outs: list[torch.Tensor], t: torch.Tensor, group) -> None:
    if isinstance(group, PeerGroup):
        group.all_gather(outs, t)
    else:
        dist.all_gather(outs, t, group=group)


def broadcast_json(obj: Any, group=None, src: int = 0) -> Any:
    """``obj`` of group rank ``src`` on every rank."""
    if not active(group):
        return obj
    dev = device(group)
    payload = _encode(obj, dev) if rank(group) == src else None
    length = torch.tensor(
        [payload.numel() if payload is not None else 0], dtype=torch.int64, device=dev
    )
    _broadcast(length, src, group)
    buf = (
        payload
        if payload is not None
        else torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    )
    if int(length.item()):
        _broadcast(buf, src, group)
    return _decode(buf, int(length.item()))


def all_equal(digest: bytes, group=None) -> bool:
    """Whether every rank passes the same ``digest`` (at most 32 bytes): one small all-gather."""
    if not active(group) or world_size(group) == 1:
        return True
    dev = device(group)
    mine = torch.zeros(32, dtype=torch.uint8, device=dev)
    mine[: len(digest)] = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(dev)
    outs = [torch.empty(32, dtype=torch.uint8, device=dev) for _ in range(world_size(group))]
    _all_gather(outs, mine, group)
    return all(torch.equal(o, outs[0]) for o in outs)


def gather_digests(obj: Any, group=None) -> list[bytes]:
    """The sha256 of every rank's ``obj`` (as canonical JSON), in rank order: one all-gather of
    32 bytes per rank."""
    import hashlib

    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.sha256(data).digest()
    if not active(group) or world_size(group) == 1:
        return [digest]
    dev = device(group)
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(dev)
    digests = [torch.empty(32, dtype=torch.uint8, device=dev) for _ in range(world_size(group))]
    _all_gather(digests, mine, group)
    return [bytes(d.cpu().numpy()) for d in digests]


def all_gather_json(obj: Any, group=None, *, digests: list[bytes] | None = None) -> list[Any]:
    """Every rank's ``obj`` on every rank, in rank order. Each distinct object crosses the
    network once: ranks all-gather 32-byte digests (or pass what `gather_digests` gave them),
    then the lowest rank holding each distinct object broadcasts it (ranks that share a layout
    describe it once)."""
    if not active(group) or world_size(group) == 1:
        return [obj]
    keys = digests if digests is not None else gather_digests(obj, group)
    first: dict[bytes, int] = {}
    for r, k in enumerate(keys):
        first.setdefault(k, r)
    me = rank(group)
    known: dict[bytes, Any] = {}
    for k, r in first.items():
        known[k] = broadcast_json(obj if r == me else None, group, src=r)
    return [known[k] for k in keys]


def raise_together(error: BaseException | None, group, what: str) -> None:
    """Collective: return if every rank passes ``error`` None; else every rank raises the same
    error: the lowest failing rank's class (an `anyshard.errors` class; `AnyshardError` for any
    other) with "``what`` failed on rank(s) ...: rank r: its error", its own exception (if any)
    as the cause. Ranks meet here instead of one raising while the others wait in the next
    collective until the process group times out."""
    if not active(group) or world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else [type(error).__name__, str(error)]
    everyone = all_gather_json(mine, group)
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    from anyshard import errors

    first, (name, text) = failed[0]
    ranks = ", ".join(str(r) for r, _ in failed)
    message = f"{what} failed on rank(s) {ranks}: rank {first}: {name}: {text}"
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.AnyshardError)):
        cls = errors.AnyshardError
    try:
        exc = cls(message)
    except Exception:  # a class that takes other arguments
        exc = errors.AnyshardError(message)
    raise exc from error
