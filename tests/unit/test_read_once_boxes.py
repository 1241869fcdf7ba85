"""A reader of several regions of one tensor reads them as one box where they tile it exactly
(`anyshard.api.read_once._tiled_by`): column slices of the same rows become one request of whole
rows. Truth: boxes written out by hand.

Run: python -m pytest tests/unit/test_read_once_boxes.py -q
"""

from __future__ import annotations

import pytest

from anyshard.api.read_once import _tiled_by


def test_neighbouring_column_slices_of_the_same_rows_are_read_as_one_box():
    quarters = [((0, 8192), (c, c + 64)) for c in (128, 0, 192, 64)]  # in any order
    assert _tiled_by(quarters) == ((0, 8192), (0, 256))
    assert _tiled_by([((0, 4), (0, 2)), ((4, 8), (0, 2))]) == ((0, 8), (0, 2))  # rows too


@pytest.mark.parametrize(
    "boxes",
    [
        [((0, 8), (0, 2))],  # one box: nothing to merge
        [((0, 8), (0, 2)), ((0, 8), (3, 4))],  # a gap: the box would read a column not asked for
        [((0, 8), (0, 3)), ((0, 8), (2, 4)), ((0, 8), (5, 6))],  # overlap and gap, same volume
        [((0, 4), (0, 2)), ((4, 8), (2, 4))],  # a diagonal pair: the box's other corners unasked
    ],
    ids=["one", "gap", "overlap", "diagonal"],
)
def test_boxes_that_do_not_tile_their_hull_are_read_each_on_its_own(boxes):
    assert _tiled_by(boxes) is None
