"""Plans of live resharding: which rank sends which region of which logical tensor to which.

Inputs are two layouts of the same logical tensors over the ranks of one process group: for
each logical tensor, the boxes of it that each rank holds in the source state and needs in the
destination state. The plan is a pure function of them, so every rank that computes it gets the
same one:

* a destination region that the rank already holds in its source state is copied locally;
* every other destination element is received exactly once, from one of the ranks holding it,
  the least loaded so far (a region replicated on several ranks is spread over its holders);
* the moves between two ranks are cut into messages of at most ``max_message_bytes``.

`schedule` puts the messages into rounds, first fit: in a round, a rank sends and receives at
most the budget. A rank posts all of its messages of a round at once and waits for them before
the next round; both ends of a message place it in the same round, so every round completes
(the rounds are deadlock free) and a rank never has more than the budget in flight.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from anyshard.errors import LayoutError
from anyshard.geometry.boxes import Box, box_numel, box_shape, intersect

__all__ = [
    "Move",
    "Plan",
    "Round",
    "TensorSides",
    "plan_moves",
    "rounds_of",
    "schedule",
    "split_box",
]


@dataclass(frozen=True, slots=True)
class TensorSides:
    """One logical tensor: its shape, element size, and the boxes each rank holds of it in the
    source state (``src``) and needs in the destination state (``dst``)."""

    shape: tuple[int, ...]
    itemsize: int
    src: Mapping[int, Sequence[Box]]
    dst: Mapping[int, Sequence[Box]]


@dataclass(frozen=True, slots=True, order=True)
class Move:
    """``box`` of logical tensor ``fqn`` goes from rank ``src`` to rank ``dst`` (a local copy
    when they are the same rank)."""

    src: int
    dst: int
    fqn: str
    box: Box
    nbytes: int


@dataclass(slots=True)
class Plan:
    """Every move of a redistribution: local copies, and messages between ranks (lists of
    moves, at most ``max_message_bytes`` each unless one element is larger)."""

    local: list[Move] = field(default_factory=list)
    messages: dict[tuple[int, int], list[list[Move]]] = field(default_factory=dict)

    def sent_bytes(self, rank: int) -> int:
        return sum(
            m.nbytes for (s, _), msgs in self.messages.items() if s == rank for g in msgs for m in g
        )

    def received_bytes(self, rank: int) -> int:
        return sum(
            m.nbytes for (_, d), msgs in self.messages.items() if d == rank for g in msgs for m in g
        )

    def for_rank(self, rank: int) -> Plan:
        """The part of the plan rank ``rank`` takes part in."""
        return Plan(
            local=[m for m in self.local if m.dst == rank],
            messages={k: v for k, v in self.messages.items() if rank in k},
        )


@dataclass(slots=True)
class Round:
    """What one rank sends and receives in one round: ``(peer, moves)`` lists, each a message.
    Every message of a round is posted at once; a round ends when all of them are done."""

    send: list[tuple[int, list[Move]]] = field(default_factory=list)
    recv: list[tuple[int, list[Move]]] = field(default_factory=list)


def _distinct(boxes: Mapping[int, Sequence[Box]]) -> dict[Box, list[int]]:
    """Each distinct box, with the ranks holding it (ascending)."""
    out: dict[Box, list[int]] = {}
    for rank in sorted(boxes):
        for box in dict.fromkeys(boxes[rank]):
            out.setdefault(box, []).append(rank)
    return out


def _describe(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def plan_moves(tensors: Mapping[str, TensorSides], max_message_bytes: int) -> Plan:
    """The plan that fills every destination box from the source boxes.

    `LayoutError` (naming the tensor, the rank and the region) when the source boxes leave part
    of a needed region uncovered or cover part of it twice with different boxes.
    """
    plan = Plan()
    load: dict[int, int] = {}  # bytes each rank sends so far, to spread replicated regions
    pairs: dict[tuple[int, int], list[Move]] = {}
    templates: dict[tuple, list[tuple[int, Box, tuple[int, ...], int]]] = {}
    held: dict[int, tuple] = {}  # id of a rank -> boxes map -> its contents, as a key

    def contents(boxes: Mapping[int, Sequence[Box]]) -> tuple:
        k = held.get(id(boxes))
        if k is None:  # the maps live in ``tensors`` until the plan is done: ids stay theirs
            k = held[id(boxes)] = tuple((r, tuple(b)) for r, b in sorted(boxes.items()))
        return k

    for fqn in sorted(tensors):
        t = tensors[fqn]
        # Tensors of one shape under the same two layouts (every layer's) share their regions;
        # tensors that share their maps of boxes (`redistribute` builds one per layout) are
        # told apart without reading the maps again.
        key = (t.shape, contents(t.src), contents(t.dst))
        regions = templates.get(key)
        if regions is None:
            regions = templates[key] = _regions(fqn, t)
        for q, region, ranks, numel in regions:
            nbytes = numel * t.itemsize
            if q in ranks:
                plan.local.append(Move(q, q, fqn, region, nbytes))
                continue
            sender = min(ranks, key=lambda r: (load.get(r, 0), r))
            load[sender] = load.get(sender, 0) + nbytes
            pairs.setdefault((sender, q), []).append(Move(sender, q, fqn, region, nbytes))
    for pair in sorted(pairs):
        plan.messages[pair] = _cut(pairs[pair], tensors, max_message_bytes)
    return plan


class _SourceIndex:
    """Distinct source boxes (sorted), and those that may meet a box, found without testing
    every one: along the dim that splits them into the most intervals, when those intervals
    do not overlap (a sharded dim), by bisection. A destination box then costs the boxes near
    it, not every rank's: planning N ranks is not N^2 intersections per tensor."""

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = boxes
        self.dim: int | None = None
        if len(boxes) < 8 or not boxes[0]:
            return
        dim = max(range(len(boxes[0])), key=lambda d: len({b[d] for b in boxes}))
        spans = sorted({b[dim] for b in boxes})
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
            return  # overlapping intervals: test every box
        self.dim, self.spans = dim, spans
        self.ends = [hi for _, hi in spans]
        self.by_span: dict[tuple[int, int], list[Box]] = {}
        for b in boxes:
            self.by_span.setdefault(b[dim], []).append(b)

    def meeting(self, need: Box) -> list[Box]:
        """The boxes that may meet ``need``, in sorted order (a superset of those that do)."""
        if self.dim is None:
            return self.boxes
        lo, hi = need[self.dim]
        out: list[Box] = []
        i = bisect.bisect_right(self.ends, lo)  # the first interval ending after lo
        while i < len(self.spans) and self.spans[i][0] < hi:
            out += self.by_span[self.spans[i]]
            i += 1
        return sorted(out)


def _regions(fqn: str, t: TensorSides) -> list[tuple[int, Box, tuple[int, ...], int]]:
    """Each destination rank's needed regions, cut by the distinct source boxes: ``(rank,
    region, the ranks holding it, its elements)``; `LayoutError` where the source does not
    cover a region exactly once."""
    holders = _distinct(t.src)
    sources = _SourceIndex(sorted(holders))
    out = []
    for q in sorted(t.dst):
        for need in dict.fromkeys(t.dst[q]):
            covered = 0
            for box in sources.meeting(need):
                region = intersect(need, box)
                if region is None:
                    continue
                numel = box_numel(region)
                covered += numel
                out.append((q, region, tuple(holders[box]), numel))
            want = box_numel(need)
            if covered < want:
                raise LayoutError(
                    f"{fqn}: rank {q} needs the region {_describe(need)} of the logical tensor "
                    f"{list(t.shape)}, but the source layout holds only {covered} of its "
                    f"{want} elements on any rank; the source state does not cover the tensor"
                )
            if covered > want:
                raise LayoutError(
                    f"{fqn}: the source layout holds parts of the region {_describe(need)} "
                    "in boxes that overlap without being equal; describe the source so that "
                    "each element is held in one box (replicas hold equal boxes)"
                )
    return out


def split_box(box: Box, itemsize: int, cap: int) -> list[Box]:
    """``box`` cut into C-ordered boxes of at most ``cap`` bytes (single elements excepted)."""
    if box_numel(box) * itemsize <= cap or not box:
        return [box]
    shape = box_shape(box)
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None:
        return [box]
    inner = math.prod(shape[d + 1 :]) * itemsize
    if inner > cap:  # one slab along d is too big: cut each slab further
        out: list[Box] = []
        lo = box[d][0]
        for i in range(lo, box[d][1]):
            slab = box[:d] + ((i, i + 1),) + box[d + 1 :]
            out += split_box(slab, itemsize, cap)
        return out
    step = max(1, cap // inner)
    lo, hi = box[d]
    return [box[:d] + ((s, min(s + step, hi)),) + box[d + 1 :] for s in range(lo, hi, step)]


def _cut(moves: list[Move], tensors: Mapping[str, TensorSides], cap: int) -> list[list[Move]]:
    messages: list[list[Move]] = []
    current: list[Move] = []
    size = 0
    for m in moves:
        itemsize = tensors[m.fqn].itemsize
        for box in split_box(m.box, itemsize, cap):
            nbytes = box_numel(box) * itemsize
            if current and size + nbytes > cap:
                messages.append(current)
                current, size = [], 0
            current.append(Move(m.src, m.dst, m.fqn, box, nbytes))
            size += nbytes
    if current:
        messages.append(current)
    return messages


def schedule(plan: Plan, budget: int) -> list[list[tuple[int, int, list[Move]]]]:
    """The messages of ``plan`` in rounds: each round a list of ``(src, dst, moves)``, with at
    most ``budget`` bytes sent plus received per rank (a message larger than the budget, which
    only a single element can make, is the only one its two ranks handle in its round; other
    ranks' messages may share the round). Messages between two ranks keep their order.
    A pure function of the plan: every rank computes the same rounds."""
    rounds: list[list[tuple[int, int, list[Move]]]] = []
    used: list[dict[int, int]] = []  # per round: bytes in flight per rank
    last: dict[tuple[int, int], int] = {}
    for (src, dst), msgs in sorted(plan.messages.items()):
        for moves in msgs:
            n = sum(m.nbytes for m in moves)
            k = last.get((src, dst), 0)
            while k < len(rounds) and (
                used[k].get(src, 0) + n > budget or used[k].get(dst, 0) + n > budget
            ):
                k += 1
            if k == len(rounds):
                rounds.append([])
                used.append({})
            rounds[k].append((src, dst, moves))
            used[k][src] = used[k].get(src, 0) + n
            used[k][dst] = used[k].get(dst, 0) + n
            last[(src, dst)] = k
    return rounds


def rounds_of(rounds: list[list[tuple[int, int, list[Move]]]], rank: int) -> list[Round]:
    """The rounds as ``rank`` takes part in them (rounds without it left out)."""
    out = []
    for r in rounds:
        mine = Round(
            send=[(d, m) for s, d, m in r if s == rank],
            recv=[(s, m) for s, d, m in r if d == rank],
        )
        if mine.send or mine.recv:
            out.append(mine)
    return out
