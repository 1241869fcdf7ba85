"""Plans of live resharding: which rank sends which region of which logical tensor to which.

Inputs are two layouts of the same logical tensors over the ranks of one process group: for
each logical tensor, the boxes of it that each rank holds in the source state and needs in the
destination state. Each rank plans its own part from them alone (`plan_rank`), and the parts
agree, because every choice is a pure function of the layouts:

* a destination region that the rank already holds in its source state is copied locally;
* every other destination element is received exactly once, from one of the ranks holding it:
  the receivers of a source box held by several ranks take its holders in turn, rotated by the
  tensor's place in the sorted names (replicas share the sending);
* the moves between two ranks are cut into messages of at most ``max_message_bytes``
  (`message_cap`).

Tensors of one shape under the same two layouts (every layer's) share one template of regions,
so a rank's planning costs the layouts (every rank's boxes, once per template) plus what the
rank itself sends and receives, not every rank's moves of every tensor.

`rounds_for` puts a rank's messages into rounds, the same on both ends of each message without
a global schedule: the k-th message between ``s`` and ``d`` goes in round ``(k, g)``, where
``g`` groups the shift ``(d - s) mod world`` by `concurrency`. In a round a rank sends to at
most `concurrency` ranks and receives from as many, one message each, so it has at most
``2 * concurrency * max_message_bytes`` (the budget) in flight; where one element is larger
than ``max_message_bytes`` (a budget of a few bytes), its message is that element, and the
round's bound is ``2 * concurrency`` times the larger of the two. A rank posts all of its
messages of a round at once and waits for them before its next round; every rank takes the
rounds in the same order, so the earliest unfinished round always has both ends of each of its
messages posted: the rounds are deadlock free.
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
    "concurrency",
    "message_cap",
    "plan_moves",
    "plan_rank",
    "rounds_for",
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
    key: tuple[int, int] = (0, 0)  # (message index, shift group): the same on both ends


def _distinct(boxes: Mapping[int, Sequence[Box]]) -> dict[Box, list[int]]:
    """Each distinct box, with the ranks holding it (ascending)."""
    out: dict[Box, list[int]] = {}
    for rank in sorted(boxes):
        for box in dict.fromkeys(boxes[rank]):
            out.setdefault(box, []).append(rank)
    return out


def _describe(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def plan_rank(tensors: Mapping[str, TensorSides], rank: int, max_message_bytes: int) -> Plan:
    """Rank ``rank``'s part of the plan that fills every destination box from the source boxes:
    its local copies and the messages it sends and receives.

    `LayoutError` (naming the tensor, the rank and the region) when the source boxes leave part
    of a needed region on any rank uncovered, or cover part of it twice with different boxes:
    every rank finds the same error.
    """
    plan = Plan()
    pairs: dict[tuple[int, int], list[tuple[int, Box, Move]]] = {}
    templates: dict[tuple, _Template] = {}
    held: dict[int, tuple] = {}  # id of a rank -> boxes map -> its contents, as a key

    def contents(boxes: Mapping[int, Sequence[Box]]) -> tuple:
        k = held.get(id(boxes))
        if k is None:  # the maps live in ``tensors`` until the plan is done: ids stay theirs
            k = held[id(boxes)] = tuple((r, tuple(b)) for r, b in sorted(boxes.items()))
        return k

    for ordinal, fqn in enumerate(sorted(tensors)):
        t = tensors[fqn]
        # tensors that share their maps of boxes (`redistribute` builds one per layout) are
        # told apart without reading the maps again
        key = (t.shape, contents(t.src), contents(t.dst))
        tpl = templates.get(key)
        if tpl is None:
            tpl = templates[key] = _template(fqn, t, rank)
        size = t.itemsize
        for region, numel in tpl.local:
            plan.local.append(Move(rank, rank, fqn, region, numel * size))
        for region, numel, holders, j in tpl.recv:
            sender = holders[(j + ordinal) % len(holders)]
            move = Move(sender, rank, fqn, region, numel * size)
            pairs.setdefault((sender, rank), []).append((ordinal, region, move))
        for holders, receivers in tpl.send:  # the j-th receiver, where (j + ordinal) % h is us
            h = len(holders)
            for j in range((holders.index(rank) - ordinal) % h, len(receivers), h):
                q, region, numel = receivers[j]
                move = Move(rank, q, fqn, region, numel * size)
                pairs.setdefault((rank, q), []).append((ordinal, region, move))
    for pair in sorted(pairs):  # both ends order a pair's moves by tensor, then region
        moves = [m for _, _, m in sorted(pairs[pair], key=lambda x: (x[0], x[1]))]
        plan.messages[pair] = _cut(moves, tensors, max_message_bytes)
    return plan


def plan_moves(tensors: Mapping[str, TensorSides], max_message_bytes: int) -> Plan:
    """The whole plan: every rank's part (`plan_rank`) together, each message as its sender
    plans it. For tests and tools; a rank that redistributes plans only its own part."""
    ranks = sorted({r for t in tensors.values() for r in (*t.src, *t.dst)})
    plan = Plan()
    for r in ranks:
        mine = plan_rank(tensors, r, max_message_bytes)
        plan.local += mine.local
        plan.messages.update({k: v for k, v in mine.messages.items() if k[0] == r})
    plan.messages = dict(sorted(plan.messages.items()))
    return plan


@dataclass(frozen=True, slots=True)
class _Template:
    """One rank's view of the regions of one (shape, source layout, destination layout):
    ``local`` (region, elements) it copies; ``recv`` (region, elements, holders, j) it receives
    from ``holders[(j + tensor's ordinal) % len(holders)]``; ``send`` (holders, receivers) for
    each source box it holds: the receivers' (rank, region, elements), the j-th served by
    ``holders[(j + ordinal) % len(holders)]``."""

    local: list[tuple[Box, int]]
    recv: list[tuple[Box, int, tuple[int, ...], int]]
    send: list[tuple[tuple[int, ...], list[tuple[int, Box, int]]]]


def _template(fqn: str, t: TensorSides, rank: int) -> _Template:
    local, recv = [], []
    receivers: dict[Box, list[tuple[int, Box, int]]] = {}
    holders_of: dict[Box, tuple[int, ...]] = {}
    for q, region, holders, numel, box in _regions(fqn, t):
        if q in holders:
            if q == rank:
                local.append((region, numel))
            continue
        served = receivers.setdefault(box, [])
        holders_of[box] = holders
        if q == rank:
            recv.append((region, numel, holders, len(served)))
        served.append((q, region, numel))
    send = [(holders_of[b], r) for b, r in receivers.items() if rank in holders_of[b]]
    return _Template(local, recv, send)


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


def _regions(fqn: str, t: TensorSides) -> list[tuple[int, Box, tuple[int, ...], int, Box]]:
    """Each destination rank's needed regions, cut by the distinct source boxes: ``(rank,
    region, the ranks holding it, its elements, the source box)``, by rank, then needed box,
    then source box; `LayoutError` where the source does not cover a region exactly once."""
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
                out.append((q, region, tuple(holders[box]), numel, box))
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


def concurrency(world: int) -> int:
    """How many ranks a rank sends to (and receives from) at once, in a group of ``world``."""
    return max(1, min(world - 1, 8))


def message_cap(world: int, budget: int) -> int:
    """The largest message under a budget of ``budget`` bytes in flight per rank: a round has
    at most `concurrency` messages each way."""
    return max(1, budget // (2 * concurrency(world)))


def rounds_for(plan: Plan, rank: int, world: int) -> list[Round]:
    """``rank``'s messages in ``plan`` in rounds (see the module's doc); rounds without it are
    left out. Both ends of a message place it in the same round."""
    k = concurrency(world)
    slots: dict[tuple[int, int], Round] = {}
    for (s, d), msgs in sorted(plan.messages.items()):
        if rank not in (s, d) or s == d:
            continue
        group = ((d - s) % world - 1) // k
        for i, moves in enumerate(msgs):
            r = slots.setdefault((i, group), Round(key=(i, group)))
            if s == rank:
                r.send.append((d, moves))
            else:
                r.recv.append((s, moves))
    return [slots[key] for key in sorted(slots)]
