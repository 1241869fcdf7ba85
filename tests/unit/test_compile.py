"""Compiled mappings against shards cut with plain torch ops from an ``arange`` tensor.

The strategies and the torch oracle here are also used by test_planner.py.

Run: python -m pytest tests/unit/test_compile.py -q
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from anyshard.errors import MappingError
from anyshard.geometry.boxes import intersect
from anyshard.geometry.shards import chunk_bounds
from anyshard.ucl.lowering import compile_mapping, enumerate_shards
from anyshard.ucl.mapping import (
    Chunk,
    Flatten,
    Mapping,
    On,
    Pad,
    Range,
    Replicate,
    Slice,
    Split,
    parse_mapping,
)

FAST = settings(max_examples=150, deadline=None)
PAD = -1  # padding in oracle shards; logical elements are >= 0

# ---------------------------------------------------------------- the oracle


def numbered(shape) -> torch.Tensor:
    """The logical tensor: every element holds its own C-order flat index."""
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def materialise(mapping: Mapping, logical: torch.Tensor, sizes, coords) -> torch.Tensor | None:
    """The shard at ``coords``, cut with torch ops; None where an ``on()`` excludes it."""
    t = logical
    for op in mapping.ops:
        if isinstance(op, Chunk):
            n, i = (
                (sizes[op.axis], coords[op.axis]) if op.axis is not None else (op.parts, op.index)
            )
            parts = torch.chunk(t, n, op.dim)
            t = parts[i] if i < len(parts) else t.narrow(op.dim, t.shape[op.dim], 0)
        elif isinstance(op, Split):
            t = torch.split(t, list(op.sizes), op.dim)[coords[op.axis]]
        elif isinstance(op, Slice):
            t = t.narrow(op.dim, op.start, op.stop - op.start)
        elif isinstance(op, Pad):
            extra = [0, 0] * (t.dim() - 1 - op.dim) + [0, op.size - t.shape[op.dim]]
            t = F.pad(t, extra, value=PAD)
        elif isinstance(op, Flatten):
            t = t.flatten()
        elif isinstance(op, Range):
            t = t[op.start : op.stop]
        elif isinstance(op, On) and coords[op.axis] != op.index:
            return None
    return t


def runs_to_indices(runs) -> list[int]:
    return [i for start, n in runs for i in range(start, start + n)]


def index(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def assert_shard_is(shard, expected: torch.Tensor, logical: torch.Tensor) -> None:
    """Every piece holds its logical box; every other position of the shard is padding."""
    assert shard.shape == tuple(expected.shape)
    flat = expected.reshape(-1)
    covered = torch.zeros(flat.numel(), dtype=torch.int64)
    for p in shard.pieces:
        assert p.base >= 0 and p.base + math.prod(p.array_shape) <= flat.numel(), p
        where = runs_to_indices(p.runs())
        assert torch.equal(flat[where], logical[index(p.logical_box)].reshape(-1)), p
        covered[where] += 1
    assert bool((covered <= 1).all()), "two pieces claim one position"
    assert torch.equal(covered == 0, flat == PAD), "uncovered positions must be exactly the padding"


def all_coords(sizes, axes=None):
    axes = list(sizes) if axes is None else list(axes)
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        yield dict(zip(axes, values, strict=True))


# ---------------------------------------------------------------- strategies

AXES = ("a", "b", "c")
meshes = st.fixed_dictionaries({a: st.integers(1, 3) for a in AXES})
shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)


def _chunk_extents(lo: int, hi: int, parts: int, indices) -> tuple[int, int]:
    lens = [
        b - a for e in range(lo, hi + 1) for i in indices for a, b in [chunk_bounds(e, parts, i)]
    ]
    return min(lens), max(lens)


@st.composite
def pipelines(draw, shape, sizes, *, covering=False, max_ops=5):
    """A mapping valid for every coordinate of the mesh ``sizes`` on a tensor of ``shape``.

    It tracks, per dim, the least and greatest extent the shard can have over the mesh.
    With ``covering``, only ops that together cover the tensor exactly once, each mesh dim
    used by one op at most.
    """
    ext = [(n, n) for n in shape]
    flat = False
    free, used = list(AXES), set()
    ops = []
    want = draw(st.integers(0, max_ops))
    for _ in range(3 * want):
        if len(ops) == want:
            break
        kinds = ["chunk_axis", "pad", "flatten", "replicate", "on"]
        if not covering:
            kinds += ["chunk_fixed", "slice", "range"]
        if ext:
            kinds.append("split")
        kind = draw(st.sampled_from(kinds))
        # A replicated mesh dim is named by no other op.
        choices = [a for a in free if a not in used] if kind == "replicate" else free
        axis = draw(st.sampled_from(choices)) if choices else None
        if axis is None and kind in ("chunk_axis", "split", "replicate", "on"):
            continue
        dim = 0 if flat else (draw(st.integers(0, len(ext) - 1)) if ext else None)
        if dim is None and kind not in ("flatten", "replicate", "on"):
            continue
        if kind == "chunk_axis":
            op = Chunk(dim=dim, axis=axis)
            ext[dim] = _chunk_extents(*ext[dim], sizes[axis], range(sizes[axis]))
        elif kind == "chunk_fixed":
            parts = draw(st.integers(1, 4))
            op = Chunk(dim=dim, parts=parts, index=draw(st.integers(0, parts - 1)))
            ext[dim] = _chunk_extents(*ext[dim], parts, [op.index])
        elif kind == "split":
            lo, hi = ext[dim]
            if lo != hi:
                continue
            cuts = sorted(
                draw(
                    st.lists(st.integers(0, lo), min_size=sizes[axis] - 1, max_size=sizes[axis] - 1)
                )
            )
            parts = [b - a for a, b in itertools.pairwise([0, *cuts, lo])]
            op = Split(dim=dim, axis=axis, sizes=tuple(parts))
            ext[dim] = (min(parts), max(parts))
        elif kind == "slice":
            start = draw(st.integers(0, ext[dim][0]))
            op = Slice(dim=dim, start=start, stop=draw(st.integers(start, ext[dim][0])))
            ext[dim] = (op.stop - op.start,) * 2
        elif kind == "range":
            if len(ext) != 1:
                continue
            start = draw(st.integers(0, ext[0][0]))
            op = Range(start=start, stop=draw(st.integers(start, ext[0][0])))
            ext[0] = (op.stop - op.start,) * 2
        elif kind == "pad":
            size = ext[dim][1] + draw(st.integers(0, 3))
            op = Pad(dim=dim, size=size)
            ext[dim] = (size, size)
        elif kind == "flatten":
            op = Flatten()
            ext = [(math.prod(lo for lo, _ in ext), math.prod(hi for _, hi in ext))]
            flat = True
        elif kind == "replicate":
            op = Replicate(axis=axis)
        else:
            op = On(axis=axis, index=draw(st.integers(0, sizes[axis] - 1)))
        if op.axis_name is not None:
            used.add(axis)
            if covering or kind == "replicate":
                free.remove(axis)
        ops.append(op)
    return Mapping(tuple(ops))


@st.composite
def layouts(draw, covering=False):
    shape = draw(shapes)
    sizes = draw(meshes)
    return shape, sizes, draw(pipelines(shape, sizes, covering=covering))


@st.composite
def boxes_in(draw, shape):
    box = []
    for n in shape:
        lo = draw(st.integers(0, n))
        box.append((lo, draw(st.integers(lo, n))))
    return tuple(box)


# ---------------------------------------------------------------- chunk_bounds


@pytest.mark.parametrize("parts", range(1, 10))
def test_chunk_bounds_are_the_parts_torch_chunk_makes(parts):
    for extent in range(41):
        chunks = torch.chunk(torch.arange(extent), parts)
        start = 0
        for i in range(parts):
            n = chunks[i].numel() if i < len(chunks) else 0
            if i >= len(chunks):
                start = extent
            assert chunk_bounds(extent, parts, i) == (start, start + n), (extent, parts, i)
            start += n


# ---------------------------------------------------------------- compile_mapping


@FAST
@given(layouts())
def test_every_piece_of_a_compiled_shard_holds_what_torch_ops_put_there(layout):
    shape, sizes, mapping = layout
    logical = numbered(shape)
    assert parse_mapping(str(mapping)) == mapping
    for coords in all_coords(sizes):
        shard = compile_mapping(mapping, shape, sizes, coords)
        expected = materialise(mapping, logical, sizes, coords)
        if expected is None:
            assert shard is None
        else:
            assert_shard_is(shard, expected, logical)


@pytest.mark.parametrize(
    ("text", "shape", "rows"),
    [
        ("", (), [[0]]),
        ("replicate(a)", (), [[0]]),
        ("flatten()", (), [[0]]),
        ("flatten() | range(0, 1)", (), [[0]]),
        ("flatten() | range(1, 1)", (), [[]]),
        ("flatten() | pad(0, 3)", (), [[0, PAD, PAD]]),
        ("chunk(0, a)", (0, 3), [[], []]),
        ("flatten() | chunk(0, a)", (2, 0), [[], []]),
        ("pad(1, 2) | chunk(0, a)", (3, 0), [[PAD] * 4, [PAD] * 2]),
    ],
)
def test_0d_and_zero_size_tensors_compile_to_what_torch_ops_give(text, shape, rows):
    mapping, sizes, logical = parse_mapping(text), {"a": 2}, numbered(shape)
    for a, want in enumerate(rows if len(rows) == 2 else rows * 2):
        expected = materialise(mapping, logical, sizes, {"a": a})
        assert expected.reshape(-1).tolist() == want
        assert_shard_is(compile_mapping(mapping, shape, sizes, {"a": a}), expected, logical)


def test_fsdp2_over_tp_and_the_dtensor_order_give_different_rows_on_uneven_sizes():
    shape, sizes, logical = (10, 3), {"dp": 3, "tp": 2}, numbered((10, 3))
    strided = parse_mapping("chunk(0, tp) | chunk(0, dp)")  # FSDP2 over TP: _StridedShard
    dtensor = parse_mapping("chunk(0, dp) | chunk(0, tp)")  # DTensor's (Shard(0), Shard(0))
    want_strided = {
        (0, 0): [0, 1],
        (0, 1): [2, 3],
        (0, 2): [4],
        (1, 0): [5, 6],
        (1, 1): [7, 8],
        (1, 2): [9],
    }
    want_dtensor = {
        (0, 0): [0, 1],
        (0, 1): [2, 3],
        (1, 0): [4, 5],
        (1, 1): [6, 7],
        (2, 0): [8],
        (2, 1): [9],
    }
    for mapping, want in ((strided, want_strided), (dtensor, want_dtensor)):
        for coords in all_coords(sizes):
            shard = compile_mapping(mapping, shape, sizes, coords)
            expected = materialise(mapping, logical, sizes, coords)
            assert_shard_is(shard, expected, logical)
            rows = sorted({lo for p in shard.pieces for lo in range(*p.logical_box[0])})
            key = (
                (coords["tp"], coords["dp"]) if mapping is strided else (coords["dp"], coords["tp"])
            )
            assert rows == want[key], (str(mapping), coords)
        assert_covered_once(mapping, shape, sizes)


def test_a_flattened_fsdp1_fragment_of_a_tp_shard_holds_the_rows_torch_gives():
    shape, sizes, logical = (5, 4), {"tp": 2, "dp": 3}, numbered((5, 4))
    mapping = parse_mapping("chunk(1, tp) | flatten() | pad(0, 12) | chunk(0, dp)")
    for coords in all_coords(sizes):
        expected = materialise(mapping, logical, sizes, coords)
        shard = compile_mapping(mapping, shape, sizes, coords)
        assert_shard_is(shard, expected, logical)
    assert_covered_once(mapping, shape, sizes)


# ---------------------------------------------------------------- enumerate_shards


def distinct_shards(mapping, shape, sizes):
    """Brute force: compile at every coordinate of the dims the mapping names, replicas at 0."""
    replicated = {op.axis for op in mapping.ops if isinstance(op, Replicate)}
    out = {}
    for coords in all_coords(sizes, mapping.axes):
        if any(coords[a] for a in replicated):
            continue
        shard = compile_mapping(mapping, shape, sizes, coords)
        if shard is not None:
            out[tuple(sorted(coords.items()))] = shard
    return out


def enumerated(mapping, shape, sizes, needed=None):
    out = {}
    for coords, shard in enumerate_shards(mapping, shape, sizes, needed=needed):
        key = tuple(sorted(coords.items()))
        assert key not in out, f"shard at {coords} produced twice"
        out[key] = shard
    return out


def assert_covered_once(mapping, shape, sizes):
    count = torch.zeros(shape, dtype=torch.int64)
    for shard in enumerated(mapping, shape, sizes).values():
        for p in shard.pieces:
            count[index(p.logical_box)] += 1
    assert torch.equal(count, torch.ones_like(count)), str(mapping)


@FAST
@given(layouts(), st.data())
def test_enumerate_with_needed_gives_exactly_the_shards_that_hold_part_of_it(layout, data):
    shape, sizes, mapping = layout
    needed = data.draw(boxes_in(shape))
    want = {
        key: shard
        for key, shard in distinct_shards(mapping, shape, sizes).items()
        if any(intersect(p.logical_box, needed) is not None for p in shard.pieces)
    }
    assert enumerated(mapping, shape, sizes, needed) == want


@FAST
@given(layouts())
def test_enumerate_without_needed_gives_every_distinct_shard(layout):
    shape, sizes, mapping = layout
    assert enumerated(mapping, shape, sizes) == distinct_shards(mapping, shape, sizes)


@FAST
@given(layouts(covering=True))
def test_shards_of_a_mapping_without_slices_cover_every_element_exactly_once(layout):
    shape, sizes, mapping = layout
    assert_covered_once(mapping, shape, sizes)


def test_enumerate_leaves_out_mesh_dims_the_mapping_does_not_name():
    got = enumerated(parse_mapping("chunk(0, a) | replicate(b)"), (4,), {"a": 2, "b": 3, "c": 2})
    assert sorted(got) == [(("a", 0), ("b", 0)), (("a", 1), ("b", 0))]


def test_enumerate_for_one_row_of_a_big_mesh_visits_only_its_holder():
    mapping, sizes = parse_mapping("chunk(0, dp) | chunk(1, tp)"), {"dp": 64, "tp": 8}
    got = enumerated(mapping, (1000, 64), sizes, needed=((500, 501), (0, 64)))
    assert sorted(got) == [(("dp", 31), ("tp", t)) for t in range(8)]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "shape", "why"),
    [
        ("split(0, a, [2, 2])", (5,), "summing to 5"),
        ("split(0, a, [5])", (5,), "needs 2 sizes"),
        ("slice(0, 0, 6)", (5,), "beyond the extent 5"),
        ("pad(0, 4)", (5,), "already has 5 elements"),
        ("chunk(2, a)", (5, 3), "the shard has 2 dim(s)"),
        ("flatten() | chunk(1, a)", (5, 3), "the shard has 1 dim(s)"),
        ("chunk(0, tp)", (5,), "mesh dim 'tp' is not in the mesh"),
        ("on(a, 2)", (5,), "outside mesh dim a"),
        ("range(0, 2)", (5, 3), "flatten()"),
    ],
)
def test_a_mapping_that_does_not_fit_the_tensor_or_mesh_is_a_mapping_error(text, shape, why):
    with pytest.raises(MappingError, match=why.replace("(", r"\(").replace(")", r"\)")):
        compile_mapping(parse_mapping(text), shape, {"a": 2}, {"a": 0})


def test_a_missing_coordinate_is_a_mapping_error():
    with pytest.raises(MappingError, match="no coordinate given for mesh dim 'b'"):
        compile_mapping(
            parse_mapping("chunk(0, a) | chunk(0, b)"), (8,), {"a": 2, "b": 2}, {"a": 0}
        )


def test_range_on_a_1d_tensor_needs_no_flatten():
    shard = compile_mapping(parse_mapping("range(2, 5)"), (7,), {}, {})
    assert_shard_is(shard, numbered((7,))[2:5], numbered((7,)))
