"""Box algebra against numpy indexing of an ``arange`` array.

Run: python -m pytest tests/unit/test_boxes.py -q
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyshard.geometry.boxes import (
    Piece,
    box_numel,
    box_runs,
    box_shape,
    flat_range_to_boxes,
    full_box,
    intersect,
    is_empty,
)

FAST = settings(max_examples=200, deadline=None)


def numbered(shape):
    """Every element holds its own C-order flat index."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def index(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def runs_to_indices(runs):
    return [i for start, n in runs for i in range(start, start + n)]


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@st.composite
def shape_and_box(draw, shape_strategy=shapes):
    shape = draw(shape_strategy)
    box = []
    for n in shape:
        lo = draw(st.integers(0, n))
        box.append((lo, draw(st.integers(lo, n))))
    return shape, tuple(box)


@st.composite
def shape_and_flat_range(draw):
    shape = draw(shapes)
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    return shape, start, draw(st.integers(start, total))


@FAST
@given(shape_and_flat_range())
def test_flat_range_boxes_cover_the_range_once_in_order_with_consecutive_indices(case):
    shape, start, stop = case
    arr = numbered(shape)
    boxes = flat_range_to_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    seen = []
    for box in boxes:
        assert len(box) == len(shape)
        assert not is_empty(box)
        flat = arr[index(box)].reshape(-1).tolist()
        assert flat == list(range(flat[0], flat[0] + len(flat))), box
        seen += flat
    assert seen == list(range(start, stop))


@FAST
@given(shapes, st.data())
def test_flat_range_boxes_clamp_a_range_that_runs_past_either_end(shape, data):
    total = math.prod(shape)
    start = data.draw(st.integers(-5, total + 5))
    stop = data.draw(st.integers(-5, total + 5))
    got = [
        i
        for box in flat_range_to_boxes(shape, start, stop)
        for i in numbered(shape)[index(box)].reshape(-1)
    ]
    assert got == list(range(max(start, 0), min(stop, total)))


def test_flat_range_of_a_0d_shape_is_the_empty_box_or_nothing():
    assert flat_range_to_boxes((), 0, 1) == [()]
    assert flat_range_to_boxes((), 0, 0) == []
    assert flat_range_to_boxes((), 1, 1) == []
    assert flat_range_to_boxes((), -1, 2) == [()]


def test_flat_range_of_a_zero_size_shape_is_empty():
    assert flat_range_to_boxes((3, 0, 2), 0, 5) == []
    assert flat_range_to_boxes((0,), 0, 1) == []


def test_flat_range_across_three_slabs_needs_the_full_2_ndim_minus_1_boxes():
    # From the middle of the first row of the first slab to the middle of the last one.
    boxes = flat_range_to_boxes((3, 3, 3), 1, 26)
    assert len(boxes) == 5
    assert [i for b in boxes for i in numbered((3, 3, 3))[index(b)].reshape(-1)] == list(
        range(1, 26)
    )


@FAST
@given(shape_and_box())
def test_box_runs_are_the_sorted_flat_indices_of_the_box_merged_into_maximal_runs(case):
    shape, box = case
    want = sorted(numbered(shape)[index(box)].reshape(-1).tolist())
    runs = box_runs(shape, box)
    assert runs_to_indices(runs) == want
    assert all(n > 0 for _, n in runs)
    for (a, n), (b, _) in itertools.pairwise(runs):
        assert a + n < b, "adjacent runs must be merged"


def test_box_runs_of_a_0d_array_is_its_single_element():
    assert box_runs((), ()) == [(0, 1)]


def test_box_runs_of_an_empty_box_is_nothing():
    assert box_runs((4, 5), ((1, 3), (2, 2))) == []
    assert box_runs((4, 0), ((0, 4), (0, 0))) == []


@st.composite
def two_boxes(draw):
    shape, a = draw(shape_and_box())
    b = []
    for n in shape:
        lo = draw(st.integers(0, n))
        b.append((lo, draw(st.integers(lo, n))))
    return shape, a, tuple(b)


@FAST
@given(two_boxes())
def test_intersect_holds_exactly_the_elements_both_boxes_hold(case):
    shape, a, b = case
    arr = numbered(shape)
    both = set(arr[index(a)].reshape(-1).tolist()) & set(arr[index(b)].reshape(-1).tolist())
    got = intersect(a, b)
    if got is None:
        # No common element; for a 0-d shape two empty boxes meet in the one element.
        assert not both
        assert shape != ()
    else:
        assert not is_empty(got)
        assert set(arr[index(got)].reshape(-1).tolist()) == both
        assert box_numel(got) == len(both)


def test_intersect_of_boxes_with_a_zero_extent_dim_is_none():
    assert intersect(((0, 3), (1, 1)), ((0, 3), (0, 4))) is None


def test_intersect_of_0d_boxes_is_the_empty_box():
    assert intersect((), ()) == ()


def test_intersect_refuses_boxes_of_different_rank():
    with pytest.raises(ValueError):
        intersect(((0, 1),), ((0, 1), (0, 1)))


@st.composite
def piece_and_region(draw):
    """A piece of a (possibly flattened) shard array, and a region of a logical tensor."""
    logical_shape = draw(nonempty_shapes)
    _, logical_box = draw(shape_and_box(st.just(logical_shape)))
    sub = box_shape(logical_box)
    # Put the block somewhere inside a bigger array, after some leading elements.
    array_shape = tuple(n + draw(st.integers(0, 2)) for n in sub)
    offsets = [draw(st.integers(0, a - n)) for a, n in zip(array_shape, sub, strict=True)]
    array_box = tuple((o, o + n) for o, n in zip(offsets, sub, strict=True))
    base = draw(st.integers(0, 7))
    _, region = draw(shape_and_box(st.just(logical_shape)))
    return logical_shape, Piece(base, array_shape, array_box, logical_box), region


@FAST
@given(piece_and_region())
def test_restricted_piece_holds_the_region_at_the_same_shard_positions(case):
    logical_shape, piece, region = case
    logical = numbered(logical_shape)
    # The shard's flat data as the piece describes it: unrelated elements are -1.
    size = piece.base + math.prod(piece.array_shape)
    flat = np.full(size, -1, dtype=np.int64)
    view = flat[piece.base :].reshape(piece.array_shape)
    view[index(piece.array_box)] = logical[index(piece.logical_box)]
    got = piece.restrict(region)
    want = set(logical[index(piece.logical_box)].reshape(-1).tolist()) & set(
        logical[index(region)].reshape(-1).tolist()
    )
    if got is None:
        assert not want
        return
    assert got.base == piece.base and got.array_shape == piece.array_shape
    assert got.logical_box == intersect(piece.logical_box, region)
    assert box_shape(got.array_box) == box_shape(got.logical_box)
    # The runs of the restricted piece, in order, hold the logical region in C order.
    held = flat[runs_to_indices(got.runs())]
    np.testing.assert_array_equal(held, logical[index(got.logical_box)].reshape(-1))
    assert set(held.tolist()) == want


def test_restrict_to_a_disjoint_region_is_none():
    p = Piece(0, (4,), ((0, 2),), ((6, 8),))
    assert p.restrict(((0, 6),)) is None


def test_piece_of_a_0d_tensor_runs_over_its_single_element():
    p = Piece(3, (), (), ())
    assert p.restrict(()) == p
    assert p.runs() == [(3, 1)]


def test_piece_refuses_boxes_of_different_shapes():
    with pytest.raises(AssertionError):
        Piece(0, (4,), ((0, 2),), ((0, 3),))


def test_full_box_covers_every_element():
    shape = (2, 0, 3)
    assert full_box(shape) == ((0, 2), (0, 0), (0, 3))
    assert box_numel(full_box(shape)) == 0
    assert full_box(()) == ()
