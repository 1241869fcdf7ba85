"""Checksums of the bytes that travel between ranks: every hop checked.

Bytes that one rank sends another (a region fetched once and forwarded under read-once, the
messages of `anyshard.redistribute` and so of a peer heal) carry the crc32c of each piece they
hold: the sender computes it where it already touches the bytes (right after packing a piece
into the send buffer, or over the region it sends in place), sends the values as a small side
tensor of int64 in the same batch, and the receiver checks each piece before it is used (before
unpacking it, before placing it in a destination). A mismatch is not raised at once: the ranks
finish the exchange, then agree (one all-gather of 32 bytes per rank when nothing failed), so
that every rank raises the same `ChecksumError`, naming the tensor, its region, the sender and
the receiver.

Device tensors (NCCL) are checked on a host copy of their bytes: correct, at the price of a
device-to-host copy of what is sent and received; where a host copy exists anyway (read-once
sends what it read into host memory) that one is checked.

The checks are on by default. ``ANYSHARD_CHECK_TRANSIT=0`` turns them off (or the
``check_transit`` argument of `anyshard.redistribute`); under read-once, a sender that does
not compute checksums sends `UNCHECKED` in their place, and its receivers skip the check.

What the checks cost is one crc32c pass at each end over the bytes that cross ranks; the bytes a
rank keeps are not checksummed, and no byte twice. crc32c (the CPU's instruction, through the
crc32c package) runs at about 11 GB/s a core on bytes in cache and in memory alike, so folding
it into a copy that exists anyway, chunk by chunk while the chunk is in cache, saves nothing (it
measured slower: more calls). What it adds to a call follows the share of the call's bytes that
cross ranks: about 1.3x the CPU seconds without the checks where a rank sends and receives
nearly all it moves, in place, and 1.1x or less where it also copies what it keeps
(tools/bench_redistribute.py).

>>> import torch
>>> from anyshard.format.transit import Mismatch, crc_of, transit_error
>>> t = torch.arange(4, dtype=torch.float32)
>>> sent = crc_of(t)
>>> damaged = t.clone(); damaged[1] = 7.0
>>> m = Mismatch("w", ((0, 4),), sender=0, receiver=1, sent=sent, got=crc_of(damaged))
>>> e = transit_error([m.to_json()], "redistribute")
>>> (e.tensor, e.sender, e.receiver)
('w', 0, 1)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from anyshard.errors import ChecksumError
from anyshard.format.checksum import crc32c

__all__ = [
    "ENV",
    "UNCHECKED",
    "Mismatch",
    "check",
    "crc_of",
    "crcs_tensor",
    "enabled",
    "host_bytes",
    "mismatch",
    "transit_error",
]

ENV = "ANYSHARD_CHECK_TRANSIT"
UNCHECKED = -1  # a side value that is no crc32c: the sender computed none
_OFF = {"0", "false", "no", "off"}


def enabled(flag: bool | None = None) -> bool:
    """Whether transit checksums are on: ``flag`` where given, else ``ANYSHARD_CHECK_TRANSIT``
    (on unless "0", "false", "no" or "off")."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def crc_of(t: torch.Tensor, value: int = 0) -> int:
    """The crc32c of ``t``'s bytes in C order (continuing ``value``); a device tensor, or a
    strided one, is copied to contiguous host memory first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return value
    return crc32c(t.reshape(-1).view(torch.uint8).numpy(), value)


def host_bytes(t: torch.Tensor) -> Any:
    """``t``'s bytes as a numpy array without a copy where ``t`` is a contiguous 1-d uint8 tensor
    in host memory (a staging buffer, a message as sent or received), else None: slices of it
    give `crc32c` a piece's bytes at a fraction of `crc_of`'s cost per call, which counts for
    messages of many small pieces."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        return None
    return t.numpy()


def crcs_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The side tensor that carries ``values`` (crc32c values, or `UNCHECKED`)."""
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def _box_text(box: Sequence[Sequence[int]]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A piece that arrived with other bytes than it was sent with: region ``box`` of logical
    tensor ``tensor``, from rank ``sender`` to rank ``receiver``; ``sent`` and ``got`` are the
    sender's and the receiver's crc32c."""

    tensor: str
    box: tuple[tuple[int, int], ...]
    sender: int
    receiver: int
    sent: int
    got: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "box": [list(b) for b in self.box],
            "sender": self.sender,
            "receiver": self.receiver,
            "sent": self.sent,
            "got": self.got,
        }


def check(
    expected: int, got_of: Any, tensor: str, box, sender: int, receiver: int
) -> Mismatch | None:
    """A `Mismatch` unless ``expected`` (the sender's value) is `UNCHECKED` or equals the crc32c
    of ``got_of`` (a tensor)."""
    if expected == UNCHECKED:
        return None
    return mismatch(expected, crc_of(got_of), tensor, box, sender, receiver)


def mismatch(
    expected: int, got: int, tensor: str, box, sender: int, receiver: int
) -> Mismatch | None:
    """`check` of a crc32c already computed (``got``): a `Mismatch` unless it is ``expected``
    or ``expected`` is `UNCHECKED`."""
    if expected == UNCHECKED or got == expected:
        return None
    box = tuple((int(lo), int(hi)) for lo, hi in box)
    return Mismatch(tensor, box, sender, receiver, int(expected) & 0xFFFFFFFF, got)


def transit_error(failures: Iterable[dict[str, Any]], what: str) -> ChecksumError:
    """The `ChecksumError` of every rank's ``failures`` (`Mismatch.to_json` dicts): the first by
    receiver, sender and tensor named in its fields and message, the others counted."""
    every = sorted(failures, key=lambda f: (f["receiver"], f["sender"], f["tensor"], f["box"]))
    if not every:
        raise ValueError("no failures to report")
    f = every[0]
    pairs = sorted({(x["sender"], x["receiver"]) for x in every})
    more = ""
    if len(every) > 1:
        tensors = sorted({x["tensor"] for x in every})
        shown = ", ".join(tensors[:5]) + (", ..." if len(tensors) > 5 else "")
        links = ", ".join(f"{s}->{r}" for s, r in pairs[:8]) + (", ..." if len(pairs) > 8 else "")
        more = f"; {len(every)} pieces in all ({shown}) over sender->receiver {links}"
    message = (
        f"{what}: {f['tensor']} {_box_text(f['box'])} sent by rank {f['sender']} arrived at rank "
        f"{f['receiver']} damaged (crc32c {f['got']:08x}, the sender's {f['sent']:08x}){more}. "
        "The bytes changed between the sender's memory and the receiver's (network, NIC or "
        "memory); the call's destination holds no verified copy: run it again, and if this "
        f"recurs, check the hosts of ranks {f['sender']} and {f['receiver']} and the link "
        "between them"
    )
    return ChecksumError(
        message,
        tensor=f["tensor"],
        sender=f["sender"],
        receiver=f["receiver"],
        failures=tuple(every),
    )
