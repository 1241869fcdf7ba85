"""Property tests of live-resharding plans (`anyshard.reshard.exchange`): for random layouts of
random tensors over random ranks, every destination element is received exactly once, from a
rank that holds it, no rank is sent what it already holds, and messages respect the budget.

Run: python -m pytest tests/unit/test_exchange_plan.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from anyshard.errors import LayoutError
from anyshard.geometry.boxes import box_numel, full_box, intersect
from anyshard.geometry.shards import chunk_bounds
from anyshard.reshard import exchange
from anyshard.reshard.exchange import (
    TensorSides,
    concurrency,
    message_cap,
    plan_moves,
    plan_rank,
    rounds_for,
    split_box,
)


@st.composite
def layouts(draw, shape, world):
    """A layout as DTensor makes them: each tensor dim split over some mesh dims, the rest of
    the mesh replicating; on some ranks only (leaving and joining ranks hold nothing)."""
    holders = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
    n = len(holders)
    # factor n into mesh dims; each shards one tensor dim or replicates
    sizes, rest = [], n
    for f in (2, 3, 5, 7):
        while rest % f == 0:
            sizes.append(f)
            rest //= f
    if rest > 1:
        sizes.append(rest)
    roles = [draw(st.sampled_from([None, *range(len(shape))])) for _ in sizes]
    out = {}
    for i, rank in enumerate(holders):
        coords, flat = [], i
        for s in reversed(sizes):
            flat, c = divmod(flat, s)
            coords.append(c)
        coords.reverse()
        box = list(full_box(shape))
        for c, s, role in zip(coords, sizes, roles, strict=True):
            if role is not None:  # chunk the current range of that dim
                lo, hi = box[role]
                a, b = chunk_bounds(hi - lo, s, c)
                box[role] = (lo + a, lo + b)
        box = tuple(box)
        out[rank] = [] if box_numel(box) == 0 and shape else [box]
    return out


@st.composite
def problems(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    world = draw(st.integers(1, 8))
    tensors = {}
    for name in ("a", "b")[: draw(st.integers(1, 2))]:
        src = draw(layouts(shape, world))
        dst = draw(layouts(shape, world))
        tensors[name] = TensorSides(shape, draw(st.sampled_from([1, 2, 4])), src, dst)
    return tensors, world, draw(st.integers(1, 64))


@settings(max_examples=300, deadline=None)
@given(problems())
def test_every_destination_element_is_received_exactly_once_from_a_holder(problem):
    tensors, world, cap = problem
    plan = plan_moves(tensors, cap)
    for fqn, t in tensors.items():
        for q, boxes in t.dst.items():
            for need in set(boxes):
                count = np.zeros([hi - lo for lo, hi in need], dtype=np.int64)
                moves = [m for m in plan.local if m.fqn == fqn and m.dst == q]
                moves += [
                    m
                    for (s, d), g in plan.messages.items()
                    if d == q
                    for msg in g
                    for m in msg
                    if m.fqn == fqn
                ]
                for m in moves:
                    inter = intersect(m.box, need)
                    if inter is None:
                        continue
                    assert inter == m.box  # a move lies inside one needed box
                    # the sender holds it; a remote sender is not the receiver, who lacks it
                    assert any(intersect(b, m.box) == m.box for b in t.src[m.src])
                    if m.src != q:
                        assert not any(intersect(b, m.box) for b in t.src.get(q, []))
                    count[
                        tuple(
                            slice(lo - n0, hi - n0)
                            for (lo, hi), (n0, _) in zip(m.box, need, strict=True)
                        )
                    ] += 1
                assert (count == 1).all(), (fqn, q, need)


# a message of one element larger than the budget (0 -> 1) shares its round with the
# messages of other ranks (2 -> 3): each rank's load is what is bounded
_OVERSIZED = (
    {
        "a": TensorSides(
            shape=(1, 1, 3),
            itemsize=4,
            src={0: [((0, 1), (0, 1), (0, 3))]},
            dst={0: [((0, 1), (0, 1), (0, 3))], 1: [((0, 1), (0, 1), (0, 3))]},
        ),
        "b": TensorSides(
            shape=(1, 1, 3),
            itemsize=1,
            src={r: [((0, 1), (0, 1), (r, r + 1))] for r in range(3)},
            dst={r: [((0, 1), (0, 1), (0, 3))] for r in range(4)},
        ),
    },
    4,
    1,
)

# elements larger than the cap next to a message within it, in one round
_MIXED = (
    {
        "a": TensorSides(
            shape=(4,),
            itemsize=4,
            src={r: [((r, r + 1),)] for r in range(4)},
            dst={0: [((0, 4),)]},
        ),
        "b": TensorSides(
            shape=(4,), itemsize=1, src={0: [((0, 4),)]}, dst={0: [((0, 4),)], 1: [((0, 4),)]}
        ),
    },
    4,
    2,
)


@settings(max_examples=200, deadline=None)
@given(problems())
@example(_OVERSIZED)
@example(_MIXED)
def test_every_rank_plans_its_part_and_its_rounds_alone_and_the_parts_agree(problem):
    """Each rank's part, planned alone: both ends of a pair plan the same messages; messages
    fit the cap; each rank's rounds hold each of its messages once, at most `concurrency`
    messages each way and the budget in flight; taking the rounds in order never deadlocks."""
    tensors, world, cap = problem
    budget = 2 * concurrency(world) * cap
    assert message_cap(world, budget) == cap
    parts = {r: plan_rank(tensors, r, cap) for r in range(world)}
    whole = plan_moves(tensors, cap)
    for (s, d), msgs in whole.messages.items():
        assert s != d
        assert parts[s].messages[(s, d)] == parts[d].messages[(s, d)] == msgs
        for msg in msgs:
            size = sum(m.nbytes for m in msg)
            assert size <= cap or len(msg) == 1 and box_numel(msg[0].box) == 1
    for r, part in parts.items():
        assert {k for k in part.messages} == {k for k in whole.messages if r in k}
        assert part.local == [m for m in whole.local if m.dst == r]
    rounds = {r: rounds_for(parts[r], r, world) for r in range(world)}
    for r, mine in rounds.items():
        keys = [x.key for x in mine]
        assert keys == sorted(set(keys))
        placed = sorted((r, d, tuple(m)) for x in mine for d, m in x.send)
        placed += sorted((s, r, tuple(m)) for x in mine for s, m in x.recv)
        expected = sorted(
            (r, d, tuple(m)) for (s, d), g in whole.messages.items() if s == r for m in g
        )
        expected += sorted(
            (s, r, tuple(m)) for (s, d), g in whole.messages.items() if d == r for m in g
        )
        assert placed == expected  # every message of the rank in exactly one round
        for x in mine:
            assert len(x.send) <= concurrency(world) and len(x.recv) <= concurrency(world)
            assert len({d for d, _ in x.send}) == len(x.send)  # one message per peer each way
            both = (*x.send, *x.recv)
            load = sum(m.nbytes for _, ms in both for m in ms)
            # a message is at most the cap, or one element larger than it: a round holds at most
            # 2 * concurrency messages of at most the larger of the two (the budget when no
            # element is larger than the cap)
            elements = [
                ms[0].nbytes for _, ms in both if len(ms) == 1 and box_numel(ms[0].box) == 1
            ]
            largest = max([cap, *elements])
            assert load <= 2 * concurrency(world) * largest, (x, budget)
            assert largest > cap or load <= budget, (x, budget)
    # run the rounds: a message is done once both of its ends have posted it (are at its
    # round); a rank goes on to its next round once every message of its round is done
    at = {r: 0 for r in range(world)}
    done: set[tuple[int, int, tuple[int, int]]] = set()

    def posted(r: int) -> set:
        if at[r] == len(rounds[r]):
            return set()
        x = rounds[r][at[r]]
        return {(r, d, x.key) for d, _ in x.send} | {(s, r, x.key) for s, _ in x.recv}

    while any(at[r] < len(rounds[r]) for r in at):
        now = {r: posted(r) for r in at}
        for r in at:
            for msg in now[r]:
                s, d, _ = msg
                if msg in now[d if s == r else s]:
                    done.add(msg)
        moved = [r for r in at if now[r] and now[r] <= done]
        assert moved, f"deadlock: {at}"
        for r in moved:
            at[r] += 1


def test_replicated_regions_spread_over_their_holders():
    box = ((0, 8),)
    t = TensorSides((8,), 4, {0: [box], 1: [box]}, {2: [((0, 4),)], 3: [((4, 8),)]})
    plan = plan_moves({"w": t}, 1 << 20)
    assert {s for s, _ in plan.messages} == {0, 1}


def test_uncovered_destination_names_the_tensor_and_region():
    t = TensorSides((8, 2), 4, {0: [((0, 4), (0, 2))]}, {1: [((2, 6), (0, 2))]})
    with pytest.raises(
        LayoutError, match=r"w: rank 1 needs the region \[2:6, 0:2\].*holds only 4 of its 8"
    ):
        plan_moves({"w": t}, 1 << 20)


def test_split_box_cuts_to_the_cap():
    parts = split_box(((0, 3), (0, 5)), 4, 8)
    assert sum(box_numel(p) for p in parts) == 15 and all(box_numel(p) * 4 <= 8 for p in parts)


@st.composite
def wide_problems(draw):
    """Two layouts of one tensor over up to 48 ranks: enough distinct source boxes that the
    planner finds the ones meeting a destination box by bisection."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    world = draw(st.integers(8, 48))
    src, dst = draw(layouts(shape, world)), draw(layouts(shape, world))
    return {"t": TensorSides(shape, 4, src, dst)}, draw(st.integers(1, 4096))


@settings(max_examples=200, deadline=None)
@given(wide_problems())
def test_the_source_index_plans_what_testing_every_source_box_plans(problem):
    tensors, cap = problem
    indexed = plan_moves(tensors, cap)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(exchange._SourceIndex, "meeting", lambda self, need: self.boxes)
        every = plan_moves(tensors, cap)
    assert indexed.local == every.local
    assert indexed.messages == every.messages


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
        lambda cuts: st.tuples(
            st.just(cuts),
            st.lists(
                st.tuples(st.integers(0, 30), st.integers(0, 30)),
                min_size=len(cuts),
                max_size=len(cuts),
            ),
        )
    )
)
def test_the_source_index_finds_every_box_that_meets_a_region(case):
    """The boxes of a grid with uneven cuts: `meeting` returns, in sorted order, at least every
    box that meets the region."""
    cuts, region = case
    axes = [sorted({0, 24, *np.linspace(0, 24, n + 1, dtype=int).tolist()}) for n in cuts]
    boxes = [()]
    for ax in axes:
        boxes = [b + ((lo, hi),) for b in boxes for lo, hi in zip(ax, ax[1:], strict=False)]
    boxes = sorted(boxes)
    need = tuple((min(a, b), max(a, b) + 1) for a, b in region)
    index = exchange._SourceIndex(boxes)
    got = index.meeting(need)
    assert got == sorted(got)
    assert {b for b in boxes if intersect(b, need) is not None} <= set(got)
