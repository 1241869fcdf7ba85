"""Carrying out one rank's part of a redistribution plan: the local copies, and the messages
between ranks with every piece in them checked on arrival.

A message holds the small moves to one peer packed together (copied into a staging buffer), then
each large move on its own, sent from and received into the local tensors where those are
contiguous. With the checks on (`anyshard.format.transit`), the sender computes the crc32c of
each piece where it already touches the bytes (as it packs it, or over the region it sends in
place), sends the values as a side tensor of int64 after the message, and the receiver checks
each piece before it is used (as it unpacks it, or where it landed in place); the pieces that
arrived damaged are collected, every round is completed all the same so that the ranks stay in
step, and `agree_on_transit` then raises the same `ChecksumError` on every rank.

`anyshard.redistribute` plans the moves (`anyshard.reshard.exchange`) and calls `execute_plan`;
read-once loads (`anyshard.api.read_once`) agree on their own forwards with `agree_on_transit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from anyshard.api import collectives as coll
from anyshard.errors import LayoutError
from anyshard.format import transit
from anyshard.format.checksum import crc32c
from anyshard.geometry.boxes import Box, Piece, intersect
from anyshard.reshard.exchange import Move, Plan, Round

__all__ = ["DIRECT_MIN_BYTES", "Held", "agree_on_transit", "execute_plan"]


@dataclass(frozen=True, slots=True)
class Held:
    """A local tensor holding ``piece`` of a logical tensor."""

    tensor: torch.Tensor
    piece: Piece


class _Holder(Protocol):
    """What one side of a call holds: logical tensor -> the local tensors holding its pieces."""

    held: dict[str, list[Held]]


def _region(held: list[Held], box: Box, fqn: str, what: str) -> list[torch.Tensor]:
    """Views of ``box`` in every local tensor holding all of it."""
    views = []
    for h in held:
        inter = intersect(h.piece.logical_box, box)
        if inter != box:
            continue
        p = h.piece.restrict(box)
        assert p is not None  # the piece holds all of ``box``
        t = h.tensor
        if p.base == 0 and tuple(p.array_shape) == tuple(t.shape):
            arr = t
        else:
            try:
                flat = t.view(-1)
            except RuntimeError:
                raise LayoutError(
                    f"{fqn}: the {what} local tensor is not contiguous; pass contiguous tensors"
                ) from None
            n = 1
            for s in p.array_shape:
                n *= s
            arr = flat[p.base : p.base + n].view(p.array_shape)
        views.append(arr[tuple(slice(lo, hi) for lo, hi in p.array_box)])
    if not views:  # the plan only moves regions some piece holds whole
        raise AssertionError(f"{fqn}: no {what} piece holds {box}")
    return views


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# Moves of at least this many bytes travel as their own message, straight from and into the
# local tensors where those are contiguous; smaller ones are packed into one message per peer.
DIRECT_MIN_BYTES = 256 << 10


class _Staging:
    """The bytes that cannot travel in place (small moves packed together, strided regions)
    are staged in one buffer per call, reused round after round: a round's messages hold at
    most the in-flight budget, and every message of a round is done before the next round
    packs. Fresh pages for every packed message cost more than the copies themselves (the
    kernel zeroes each page at its first touch); untouched pages of the buffer cost nothing.

    A call that repeats an earlier one (its plan reused) keeps its buffer on CPU for the next
    such call, as CUDA's caching allocator does on GPUs: one buffer in the process, taken by
    one call at a time."""

    def __init__(self, rounds: list[Round], dev: torch.device, repeated: bool) -> None:
        self.size = max(
            (sum(m.nbytes for _, ms in (*r.send, *r.recv) for m in ms) for r in rounds), default=0
        )
        self.dev = dev
        self.keep = repeated and dev.type == "cpu"
        self.buf: torch.Tensor | None = None
        self.used = 0

    def next_round(self) -> None:
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None:
            spare = _SPARE.pop() if self.keep and _SPARE else None
            if spare is not None and spare.numel() >= self.size:
                self.buf = spare
            else:
                self.buf = torch.empty(self.size, dtype=torch.uint8, device=self.dev)
        if self.used + nbytes > self.size:  # the plan bounds each round; this cannot happen
            raise AssertionError(f"staging: {self.used} + {nbytes} bytes over {self.size}")
        out = self.buf[self.used : self.used + nbytes]
        self.used += nbytes
        return out

    def release(self) -> None:
        if self.keep and self.buf is not None:
            _SPARE[:] = [self.buf]
        self.buf = None


_SPARE: list[torch.Tensor] = []  # the staging buffer kept for the next repeated call


def _outgoing(
    moves: list[Move], src: _Holder, stage: _Staging, checked: bool
) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors to send for one message (the small moves packed, then each large one), and,
    when ``checked``, the crc32c of each move (in the order of ``moves``), computed as the move
    is packed (the bytes just written) or over the region sent in place."""
    out = []
    crcs = [transit.UNCHECKED] * len(moves) if checked else []
    small = [i for i, m in enumerate(moves) if m.nbytes < DIRECT_MIN_BYTES]
    if small:
        buf = stage.take(sum(moves[i].nbytes for i in small))
        raw = transit.host_bytes(buf) if checked else None
        off = 0
        for i in small:
            m = moves[i]
            view = _region(src.held[m.fqn], m.box, m.fqn, "source")[0]
            seg = buf[off : off + m.nbytes]
            seg.view(view.dtype).view(view.shape).copy_(view)
            if checked:
                end = off + m.nbytes
                crcs[i] = transit.crc_of(seg) if raw is None else crc32c(raw[off:end])
            off += m.nbytes
        out.append(buf)
    for i, m in enumerate(moves):
        if m.nbytes >= DIRECT_MIN_BYTES:
            view = _region(src.held[m.fqn], m.box, m.fqn, "source")[0]
            if view.is_contiguous() and view.device == stage.dev:
                t = _bytes_of(view)
            else:
                t = stage.take(m.nbytes)
                t.view(view.dtype).view(view.shape).copy_(view)
            if checked:
                crcs[i] = transit.crc_of(t)
            out.append(t)
    return out, crcs


# What one received tensor holds: (index in the message, move, byte offset) of each move in it,
# and whether they must be copied out (a staging buffer) or arrived in place.
_Part = tuple[torch.Tensor, list[tuple[int, Move, int]], bool]


def _incoming(moves: list[Move], dst: _Holder, stage: _Staging) -> list[_Part]:
    """The tensors to receive one message into, in the order `_outgoing` sends them, each with
    the moves it holds and whether they are to be unpacked once it has arrived."""
    out: list[_Part] = []
    small = [i for i, m in enumerate(moves) if m.nbytes < DIRECT_MIN_BYTES]
    if small:
        buf = stage.take(sum(moves[i].nbytes for i in small))
        entries, off = [], 0
        for i in small:
            entries.append((i, moves[i], off))
            off += moves[i].nbytes
        out.append((buf, entries, True))
    for i, m in enumerate(moves):
        if m.nbytes >= DIRECT_MIN_BYTES:
            views = _region(dst.held[m.fqn], m.box, m.fqn, "destination")
            if len(views) == 1 and views[0].is_contiguous() and views[0].device == stage.dev:
                out.append((_bytes_of(views[0]), [(i, m, 0)], False))
            else:
                out.append((stage.take(m.nbytes), [(i, m, 0)], True))
    return out


def _arrived(
    parts: list[_Part],
    crcs: list[int] | None,
    frm: int,
    me: int,
    dst: _Holder,
    failed: list[transit.Mismatch],
) -> None:
    """One message has arrived: each move's bytes checked against the sender's crc32c
    (``crcs``, None when unchecked), then unpacked where they were staged (the check reads
    them into cache for the copy)."""
    for t, entries, staged in parts:
        raw = transit.host_bytes(t) if crcs is not None else None
        for i, m, off in entries:
            seg = t[off : off + m.nbytes]
            if crcs is not None and crcs[i] != transit.UNCHECKED:
                got = transit.crc_of(seg) if raw is None else crc32c(raw[off : off + m.nbytes])
                bad = transit.mismatch(crcs[i], got, m.fqn, m.box, frm, me)
                if bad is not None:
                    failed.append(bad)
            if staged:
                _unpack(m, seg, dst)


def _unpack(m: Move, seg: torch.Tensor, dst: _Holder) -> None:
    for view in _region(dst.held[m.fqn], m.box, m.fqn, "destination"):
        view.copy_(seg.view(view.dtype).view(view.shape))


def _copy_local(plan: Plan, src: _Holder, dst: _Holder) -> None:
    for m in plan.local:
        (source,) = _region(src.held[m.fqn], m.box, m.fqn, "source")[:1]
        for view in _region(dst.held[m.fqn], m.box, m.fqn, "destination"):
            view.copy_(source)


def execute_plan(
    plan: Plan,
    rounds: list[Round],
    src: _Holder,
    dst: _Holder,
    group,
    repeated: bool = False,
    checked: bool = False,
) -> list[transit.Mismatch]:
    """The local copies run while the first round's messages are in flight. With ``checked``,
    each message carries a side tensor of its moves' crc32c, checked on arrival; the pieces
    that arrived damaged are returned (every round is completed all the same, so that the
    ranks stay in step and can agree on them)."""
    failed: list[transit.Mismatch] = []
    if not rounds:
        _copy_local(plan, src, dst)
        return failed
    dev = coll.device(group)
    peers = group if isinstance(group, coll.PeerGroup) else None
    me = coll.rank(group)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    stage = _Staging(rounds, dev, repeated)
    for i, rnd in enumerate(rounds):
        stage.next_round()
        recvs: list[tuple[torch.Tensor, int]] = []
        arriving = []
        for frm, moves in rnd.recv:
            parts = _incoming(moves, dst, stage)
            recvs += [(t, frm) for t, _, _ in parts]
            side = None
            if checked:  # after the message's tensors, as the sender sends it
                side = torch.empty(len(moves), dtype=torch.int64, device=dev)
                recvs.append((side, frm))
            arriving.append((frm, parts, side))
        sends: list[tuple[torch.Tensor, int]] = []
        for to, moves in rnd.send:
            out, crcs = _outgoing(moves, src, stage, checked)
            sends += [(t, to) for t in out]
            if checked:
                sends.append((transit.crcs_tensor(crcs, dev), to))
        if peers is not None:
            reqs = peers.exchange(sends, recvs)
        else:
            ops = [dist.P2POp(dist.isend, t, peer(to), group) for t, to in sends]
            ops += [dist.P2POp(dist.irecv, t, peer(frm), group) for t, frm in recvs]
            reqs = dist.batch_isend_irecv(ops)
        if i == 0:
            _copy_local(plan, src, dst)
        for req in reqs:
            req.wait()
        for frm, parts, side in arriving:
            sent = side.tolist() if side is not None else None
            _arrived(parts, sent, frm, me, dst, failed)
    stage.release()  # not after an error: a message may still be landing in the buffer
    return failed


def agree_on_transit(failed: list[transit.Mismatch], group, what: str) -> None:
    """Collective over ``group``: return if no rank found a piece damaged in transit, else raise
    on every rank the same `ChecksumError` (`anyshard.format.transit.transit_error`), naming
    the tensor, the sender and the receiver. One all-gather of 32 bytes per rank when none did;
    their reports are exchanged only when some did."""
    mine = [f.to_json() for f in failed] or None
    if not coll.active(group) or coll.world_size(group) == 1:
        if mine:
            raise transit.transit_error(mine, what)
        return
    digests = coll.gather_digests(mine, group)
    if mine is None and len(set(digests)) == 1:  # every rank has None: nothing failed
        return
    everyone = coll.all_gather_json(mine, group, digests=digests)
    raise transit.transit_error([f for fs in everyone if fs for f in fs], what)
