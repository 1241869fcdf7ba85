"""Read plans, executed against fake per-rank files with numpy, give exactly the target shard.

Stored shards and target shards are cut with plain torch ops (the oracle of test_compile.py)
from a numbered logical tensor; the plan only decides which bytes go where.

Run: python -m pytest tests/unit/test_planner.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compile import AXES, PAD, all_coords, materialise, numbered, pipelines, shapes

from anyshard.errors import CorruptCheckpointError
from anyshard.geometry.boxes import Piece, box_shape, full_box
from anyshard.reshard.planner import match_shards, plan_reads
from anyshard.reshard.read_plan import GAP, STAGING, TARGET, StoredShardInfo, Transfer
from anyshard.ucl.lowering import compile_mapping
from anyshard.ucl.mapping import Chunk, Mapping, On, Replicate, parse_mapping

FAST = settings(max_examples=200, deadline=None)
ITEMSIZE = 4
FILLER = 0xEE  # bytes of a file that belong to no stored shard


def rank_of_sizes(sizes):
    """Row-major rank over the mesh; dims a coordinate dict leaves out count as 0."""

    def rank_of(coords):
        rank = 0
        for a in AXES:
            rank = rank * sizes[a] + coords.get(a, 0)
        return rank

    return rank_of


def index(box):
    return tuple(slice(lo, hi) for lo, hi in box)


# ---------------------------------------------------------------- a fake checkpoint


class FakeCheckpoint:
    """Per-rank files of stored shards, laid out one after another with filler between."""

    def __init__(self, tensors, sizes, gaps):
        self.rank_of = rank_of_sizes(sizes)
        self.sizes = sizes
        parts: dict[int, list[tuple[str, np.ndarray]]] = {}
        for fqn, (shape, mapping, logical) in tensors.items():
            for coords, data in stored_shards(mapping, shape, sizes, logical):
                parts.setdefault(self.rank_of(coords), []).append((fqn, data))
        self.files: dict[int, np.ndarray] = {}
        self.info: dict[tuple[int, str], StoredShardInfo] = {}
        self.shapes: dict[tuple[int, str], tuple[int, ...]] = {}
        for rank, held in sorted(parts.items()):
            blob = bytearray()
            for fqn, data in held:
                blob += bytes([FILLER]) * next(gaps)
                raw = data.astype("<i4").tobytes()
                self.info[(rank, fqn)] = StoredShardInfo(
                    len(blob), len(blob) + len(raw), ITEMSIZE, 0
                )
                self.shapes[(rank, fqn)] = data.shape
                blob += raw
            blob += bytes([FILLER]) * next(gaps)
            self.files[rank] = np.frombuffer(bytes(blob), dtype=np.uint8)


def stored_shards(mapping, shape, sizes, logical):
    """Brute force over the whole mesh: the writer of each stored shard is the rank whose
    coordinates are 0 along every mesh dim the mapping replicates or does not name."""
    named = {op.axis_name for op in mapping.ops if op.axis_name and not isinstance(op, Replicate)}
    for coords in all_coords(sizes):
        if any(c for a, c in coords.items() if a not in named):
            continue
        data = materialise(mapping, logical, sizes, coords)
        if data is not None:
            yield coords, data.numpy()


def execute(plan, files, targets):
    """Run ``plan`` against ``files`` with numpy; return how often each target element was written.

    Spans go, in file order, straight into a target's bytes (TARGET), into a transfer's staging
    buffer (STAGING), or nowhere (GAP)."""
    buffers = [np.zeros(t.numel * ITEMSIZE, dtype=np.uint8) for t in plan.transfers]
    filled = [np.zeros(t.numel * ITEMSIZE, dtype=np.int64) for t in plan.transfers]
    direct_bytes = [np.zeros(t.size * ITEMSIZE, dtype=np.int64) for t in targets]
    for r in expand_repeats(plan.requests):
        assert 0 <= r.offset and r.offset + r.length <= len(files[r.rank]), (
            "read past the end of a file"
        )
        data = files[r.rank][r.offset : r.offset + r.length]
        pos = 0
        for kind, i, offset, n in r.spans:
            chunk = data[pos : pos + n]
            pos += n
            if kind == GAP:
                continue
            assert plan.transfers[i].rank == r.rank, "a request reads from one file"
            if kind == TARGET:
                assert plan.direct[i]
                target = plan.transfers[i].target
                targets[target].reshape(-1).view(np.uint8)[offset : offset + n] = chunk
                direct_bytes[target][offset : offset + n] += 1
            else:
                assert kind == STAGING and not plan.direct[i]
                buffers[i][offset : offset + n] = chunk
                filled[i][offset : offset + n] += 1
        assert pos == r.length, "spans tile the request"
    writes = [
        c.reshape(-1, ITEMSIZE)[:, 0].reshape(t.shape).copy()
        for c, t in zip(direct_bytes, targets, strict=True)
    ]
    for c in direct_bytes:
        assert (c.reshape(-1, ITEMSIZE) == c.reshape(-1, ITEMSIZE)[:, :1]).all(), (
            "whole elements arrive"
        )
    for i, (t, buf, count) in enumerate(zip(plan.transfers, buffers, filled, strict=True)):
        if plan.direct[i]:
            continue
        assert (count == 1).all(), "every byte of a staged transfer arrives exactly once"
        src = buf.view("<i4").reshape(box_shape(t.src.logical_box))
        if t.window is not None:  # whole blocks were read: the needed piece of them
            flat = src.reshape(-1)
            whole = np.arange(int(np.prod(t.window.array_shape))) + t.window.base
            keep = (whole >= 0) & (whole < flat.size)
            full = np.full(int(np.prod(t.window.array_shape)), -9, dtype=np.int32)
            full[keep] = flat[whole[keep]]
            full = full.reshape(t.window.array_shape)
            src = full[tuple(slice(lo, hi) for lo, hi in t.window.array_box)]
            assert (src != -9).all(), "the window lies in the blocks read"
        target_view(targets[t.target], t.dst)[...] = src
        target_view(writes[t.target], t.dst)[...] += 1
    return writes


def expand_repeats(requests):
    """A repeated request as the single reads it stands for."""
    for r in requests:
        if r.repeat is None:
            yield r
            continue
        count, file_stride, dst_stride = r.repeat
        ((kind, i, offset, n),) = r.spans
        assert not r.checks and count > 1
        for k in range(count):
            spans = ((kind, i, offset + k * dst_stride, n),)
            yield r._replace(offset=r.offset + k * file_stride, spans=spans, repeat=None)


def target_view(arr: np.ndarray, p: Piece) -> np.ndarray:
    flat = arr.reshape(-1)[p.base : p.base + math.prod(p.array_shape)]
    return flat.reshape(p.array_shape)[(*index(p.array_box), ...)]  # a view even when 0-d


# ---------------------------------------------------------------- strategies


SLACKS = st.sampled_from([0.0, 0.05, 0.5, 1.0, 4.0])
wide_meshes = st.fixed_dictionaries({a: st.integers(1, 4) for a in AXES})
big_shapes = st.one_of(shapes, st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple))


@st.composite
def reshard_cases(draw):
    """One to three logical tensors, a source layout that stores each exactly once over one
    mesh, and a target layout over another mesh with the target rank's coordinates."""
    src_sizes, dst_sizes = draw(wide_meshes), draw(wide_meshes)
    dst_coords = {a: draw(st.integers(0, n - 1)) for a, n in dst_sizes.items()}
    tensors = {}
    for k in range(draw(st.integers(1, 3))):
        shape = draw(big_shapes)
        src = draw(pipelines(shape, src_sizes, covering=True))
        if shape and draw(st.booleans()):
            # Columns of row-major data: strided runs, where gaps get read through.
            widest = max(AXES, key=dst_sizes.get)
            dst = Mapping((Chunk(dim=len(shape) - 1, axis=widest),))
        else:
            dst = draw(pipelines(shape, dst_sizes))
        dst = Mapping(tuple(op for op in dst.ops if not isinstance(op, On)))  # every rank loads
        tensors[f"t{k}"] = (shape, src, dst)
    gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 4, 9]), min_size=1, max_size=8))
    knobs = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries({"slack": SLACKS}),
            st.fixed_dictionaries({"slack": SLACKS}),
            st.fixed_dictionaries(
                {
                    "max_staging": st.integers(ITEMSIZE, 64),
                    "max_part": st.integers(1, 64),
                    "max_gap": st.integers(0, 64),
                    "max_request": st.integers(1, 256),
                    "slack": SLACKS,
                }
            ),
        )
    )
    if "max_staging" in knobs:
        knobs["batch_bytes"] = knobs["max_staging"] * draw(st.integers(1, 4))
    return src_sizes, dst_sizes, dst_coords, tensors, gaps, knobs


def cycle(values):
    while True:
        yield from values


# ---------------------------------------------------------------- the property


@FAST
@given(reshard_cases(), st.data())
def test_executing_the_plan_fills_the_target_exactly_once_reading_little_more_than_needed(
    case, data
):
    src_sizes, dst_sizes, dst_coords, tensors, gaps, knobs = case
    logicals = {
        fqn: numbered(shape) + 1000 * k for k, (fqn, (shape, _, _)) in enumerate(tensors.items())
    }
    ckpt = FakeCheckpoint(
        {fqn: (shape, src, logicals[fqn]) for fqn, (shape, src, _) in tensors.items()},
        src_sizes,
        cycle(gaps),
    )
    transfers, targets, expected, used = [], [], [], {}
    for i, (fqn, (shape, src, dst)) in enumerate(tensors.items()):
        target = compile_mapping(dst, shape, dst_sizes, dst_coords)
        transfers += match_shards(fqn, i, target.pieces, src, shape, src_sizes, ckpt.rank_of, used)
        want = materialise(dst, logicals[fqn], dst_sizes, dst_coords).numpy().astype(np.int32)
        expected.append(want)
        targets.append(np.full(want.shape, -7, dtype=np.int32))
    for key, shape in used.items():
        assert tuple(shape) == ckpt.shapes[key], "shard_shapes reports the stored shard's shape"
    direct_ok = data.draw(st.lists(st.booleans(), min_size=len(tensors), max_size=len(tensors)))
    # Unverified: only the needed bytes (and small gaps) are read, within the staging budget.
    plan = plan_reads(transfers, ckpt.info, direct_ok, **knobs, verify=False)
    assert_fills_exactly(plan, ckpt, expected, targets)
    assert plan.bytes_needed == sum(t.numel for t in plan.transfers) * ITEMSIZE
    assert plan.bytes_read <= (1 + knobs.get("slack", 0.05)) * plan.bytes_needed
    assert_reads_stay_in_needed_shards(plan, ckpt)
    assert not any(r.checks for r in plan.requests)
    assert_batches_fit_the_staging_budget(plan, direct_ok, knobs)
    assert_request_summaries_match_their_spans(plan)

    # Verified: every byte read lies in a checksum block (here a whole shard) read whole and
    # checked, and the targets are filled the same.
    targets = [np.full(t.shape, -7, dtype=np.int32) for t in targets]
    plan = plan_reads(transfers, ckpt.info, direct_ok, **knobs)
    assert_fills_exactly(plan, ckpt, expected, targets)
    assert_reads_stay_in_needed_shards(plan, ckpt)
    assert_checks_match_the_bytes_read(plan, ckpt)
    assert_shards_read_in_full_are_checked_in_full(plan, ckpt)
    assert_every_byte_read_is_checked(plan, ckpt)
    assert_request_summaries_match_their_spans(plan)


def assert_request_summaries_match_their_spans(plan):
    """`Request.staged` and `Request.rows` say what walking the spans finds."""
    for r in plan.requests:
        assert r.staged == any(kind == STAGING for kind, *_ in r.spans)
        rows = None
        spans = r.spans
        if len(spans) > 1 and all(kind == TARGET for kind, *_ in spans):
            targets = {plan.transfers[i].target for _, i, _, _ in spans}
            sizes = {n for *_, n in spans}
            first, stride = spans[0][2], spans[1][2] - spans[0][2]
            at = [offset for _, _, offset, _ in spans]
            if (
                len(targets) == 1
                and len(sizes) == 1
                and stride >= spans[0][3]
                and at == [first + k * stride for k in range(len(spans))]
            ):
                rows = (targets.pop(), first, stride, spans[0][3])
        assert r.rows == rows, (r.spans[:4], r.rows, rows)


def assert_fills_exactly(plan, ckpt, expected, targets):
    writes = execute(plan, ckpt.files, targets)
    for want, got, count in zip(expected, targets, writes, strict=True):
        padding = want == PAD
        np.testing.assert_array_equal(got[~padding], want[~padding])
        assert (count[~padding] == 1).all(), "every target element is written exactly once"
        assert (count[padding] == 0).all(), "padding of the target is not written"


def assert_every_byte_read_is_checked(plan, ckpt):
    """Each byte a request reads of a needed shard lies in a check, and a shard with any byte
    read is read (and checked) whole: its one checksum block."""
    for r in expand_repeats(plan.requests):
        assert r.repeat is None, "verified reads are not repeated reads without checks"
        spans = sorted((r.offset + c.start, r.offset + c.stop) for c in r.checks)
        for key, info in ckpt.info.items():
            a, b = max(r.offset, info.start), min(r.offset + r.length, info.stop)
            if key[0] == r.rank and a < b and key in {(t.rank, t.fqn) for t in plan.transfers}:
                assert covers(spans, a, b), (key, r)


def assert_reads_stay_in_needed_shards(plan, ckpt):
    needed = {(t.rank, t.fqn) for t in plan.transfers}
    for r in expand_repeats(plan.requests):
        spans = [(ckpt.info[k].start, ckpt.info[k].stop) for k in needed if k[0] == r.rank]
        assert covers(spans, r.offset, r.offset + r.length), f"{r} reads bytes of no needed shard"


def assert_checks_match_the_bytes_read(plan, ckpt):
    for r in plan.requests:
        for c in r.checks:
            rank, fqn, start, stop, crc = plan.shards[c.shard]
            assert rank == r.rank and ckpt.info[(rank, fqn)] == StoredShardInfo(
                start, stop, ITEMSIZE, crc
            )
            assert (r.offset + c.start, r.offset + c.stop) == (
                max(r.offset, start),
                min(r.offset + r.length, stop),
            )
            assert c.start < c.stop
    assert len({(s[0], s[1]) for s in plan.shards}) == len(plan.shards)


def covers(spans, start, stop) -> bool:
    for a, b in sorted(spans):
        if a <= start:
            start = max(start, b)
    return start >= stop


def assert_shards_read_in_full_are_checked_in_full(plan, ckpt):
    """The executor verifies a shard's checksum from the parts the plan lists; a shard whose
    every byte is read must be listed in parts that tile it, or its checksum goes unchecked."""
    read, checked = {}, {}
    for r in expand_repeats(plan.requests):
        for key, info in ckpt.info.items():
            a, b = max(r.offset, info.start), min(r.offset + r.length, info.stop)
            if key[0] == r.rank and a < b:
                read.setdefault(key, []).append((a, b))
        for c in r.checks:
            key = tuple(plan.shards[c.shard][:2])
            checked.setdefault(key, []).append((r.offset + c.start, r.offset + c.stop))
    for key, spans in read.items():
        info = ckpt.info[key]
        if covers(spans, info.start, info.stop):
            # parts that follow one another from start to stop (two transfers widened into one
            # block each read it whole, so parts may repeat or overlap)
            reach, parts = {info.start}, sorted(set(checked.get(key, [])))
            for a, b in parts:
                if a in reach:
                    reach.add(b)
            assert info.stop in reach, (key, parts)


def assert_batches_fit_the_staging_budget(plan, direct_ok, knobs):
    max_staging = knobs.get("max_staging", 32 << 20)
    batch_bytes = knobs.get("batch_bytes", 256 << 20)
    seen: dict[int, int] = {}
    for b, batch in enumerate(plan.batches):
        staged = set()
        for r in batch:
            for kind, i, _, _ in r.spans:
                if kind == GAP:
                    continue
                assert seen.setdefault(i, b) == b, "a transfer's reads all lie in one batch"
                if not plan.direct[i]:
                    staged.add(i)
        sizes = [plan.transfers[i].numel * ITEMSIZE for i in staged]
        assert all(n <= max(max_staging, ITEMSIZE) for n in sizes)
        assert sum(sizes) <= batch_bytes
    for t, direct in zip(plan.transfers, plan.direct, strict=True):
        if direct:
            assert direct_ok[t.target]


# ---------------------------------------------------------------- worked examples


def one_file_transfers(runs, stored=(300,)):
    """Transfers from a 1-d stored shard of rank 0 (the whole tensor) into a like target."""
    out = []
    for lo, hi in runs:
        box = ((lo, hi),)
        out.append(Transfer("w", 0, 0, Piece(0, stored, box, box), Piece(0, stored, box, box)))
    return out


INFO = {(0, "w"): StoredShardInfo(16, 16 + 300 * ITEMSIZE, ITEMSIZE, 0)}


def test_a_gap_of_five_percent_of_the_run_before_it_is_read_through():
    plan = plan_reads(one_file_transfers([(0, 100), (105, 200)]), INFO, [False], verify=False)
    assert [(r.offset, r.length) for r in plan.requests] == [(16, 200 * ITEMSIZE)]
    assert plan.bytes_read == plan.bytes_needed + 5 * ITEMSIZE


def test_a_gap_over_five_percent_of_the_run_before_it_splits_the_read():
    plan = plan_reads(one_file_transfers([(0, 100), (106, 200)]), INFO, [False], verify=False)
    assert [(r.offset, r.length) for r in plan.requests] == [(16, 400), (16 + 424, 376)]
    assert plan.bytes_read == plan.bytes_needed


def test_requests_from_different_files_never_merge_even_at_the_same_offsets():
    shape, sizes = (8,), {"a": 2}
    info = {(r, "w"): StoredShardInfo(0, 16, ITEMSIZE, 0) for r in range(2)}
    full = (Piece(0, shape, full_box(shape), full_box(shape)),)
    transfers = match_shards(
        "w", 0, full, parse_mapping("chunk(0, a)"), shape, sizes, lambda c: c["a"]
    )
    plan = plan_reads(transfers, info, [True], verify=False)
    assert sorted((r.rank, r.offset, r.length) for r in plan.requests) == [(0, 0, 16), (1, 0, 16)]


def test_two_tensors_adjacent_in_one_file_are_read_in_one_request():
    info = {
        (0, "w"): StoredShardInfo(0, 40, ITEMSIZE, 1),
        (0, "x"): StoredShardInfo(40, 80, ITEMSIZE, 2),
    }
    transfers = []
    for i, fqn in enumerate(("w", "x")):
        box = ((0, 10),)
        transfers.append(Transfer(fqn, i, 0, Piece(0, (10,), box, box), Piece(0, (10,), box, box)))
    plan = plan_reads(transfers, info, [False, False])
    (r,) = plan.requests
    assert (r.offset, r.length) == (0, 80)
    assert [(plan.shards[c.shard][1], c.start, c.stop) for c in r.checks] == [
        ("w", 0, 40),
        ("x", 40, 80),
    ]


def test_a_small_unneeded_shard_between_two_needed_ones_is_not_read():
    # w and y are needed and x (4 bytes) lies between them: 4 <= 5% of 400, yet x is not needed.
    info = {
        (0, "w"): StoredShardInfo(0, 400, ITEMSIZE, 0),
        (0, "x"): StoredShardInfo(400, 404, ITEMSIZE, 0),
        (0, "y"): StoredShardInfo(404, 804, ITEMSIZE, 0),
    }
    box = ((0, 100),)
    transfers = [
        Transfer(f, i, 0, Piece(0, (100,), box, box), Piece(0, (100,), box, box))
        for i, f in enumerate("wy")
    ]
    plan = plan_reads(transfers, info, [True, True], verify=False)
    assert sorted((r.offset, r.length) for r in plan.requests) == [(0, 400), (404, 400)]


@pytest.mark.parametrize(
    ("max_staging", "batch_bytes"), [(4, 4), (40, 40), (40, 100), (1000, 1000)]
)
def test_staged_transfers_are_cut_and_batched_within_the_staging_budget(max_staging, batch_bytes):
    # A column of a row-major tensor into a target that takes no direct reads (another dtype).
    shape = (30, 4)
    stored = Piece(0, shape, ((0, 30), (1, 2)), ((0, 30), (1, 2)))
    target = Piece(0, (30, 1), ((0, 30), (0, 1)), ((0, 30), (1, 2)))
    info = {(0, "w"): StoredShardInfo(0, 30 * 4 * ITEMSIZE, ITEMSIZE, 0)}
    plan = plan_reads(
        [Transfer("w", 0, 0, stored, target)],
        info,
        [False],
        max_staging=max_staging,
        batch_bytes=batch_bytes,
        verify=False,
    )
    assert not any(plan.direct)
    assert sum(t.numel for t in plan.transfers) == 30
    for batch in plan.batches:
        staged = {i for r in batch for kind, i, _, _ in r.spans if kind != GAP}
        assert sum(plan.transfers[i].numel * ITEMSIZE for i in staged) <= batch_bytes
    assert len(plan.batches) == math.ceil(30 * ITEMSIZE / (batch_bytes // ITEMSIZE * ITEMSIZE))


def test_a_region_no_stored_shard_holds_is_a_corrupt_checkpoint():
    shape = (5, 2)
    full = (Piece(0, shape, full_box(shape), full_box(shape)),)
    with pytest.raises(CorruptCheckpointError, match=r"hold 6 of the 10 elements"):
        match_shards("w", 0, full, parse_mapping("slice(0, 0, 3)"), shape, {}, lambda c: 0)


def test_a_stored_shard_shorter_in_its_file_than_its_mapping_is_a_corrupt_checkpoint():
    shape = (5, 2)
    full = (Piece(0, shape, full_box(shape), full_box(shape)),)
    transfers = match_shards("w", 0, full, Mapping(), shape, {}, lambda c: 0)
    info = {(0, "w"): StoredShardInfo(0, 9 * ITEMSIZE, ITEMSIZE, 0)}
    with pytest.raises(CorruptCheckpointError, match="shorter than its mapping says"):
        plan_reads(transfers, info, [False], verify=False)


def test_zero_size_and_0d_targets_plan_only_what_holds_data():
    empty = (Piece(0, (0, 3), ((0, 0), (0, 3)), ((0, 0), (0, 3))),)
    assert (
        match_shards("w", 0, empty, parse_mapping("chunk(1, a)"), (0, 3), {"a": 2}, lambda c: 0)
        == []
    )
    scalar = (Piece(0, (), (), ()),)
    transfers = match_shards(
        "s", 0, scalar, parse_mapping("on(a, 1)"), (), {"a": 2}, lambda c: c["a"]
    )
    plan = plan_reads(
        transfers, {(1, "s"): StoredShardInfo(8, 12, ITEMSIZE, 0)}, [True], verify=False
    )
    assert [(r.rank, r.offset, r.length) for r in plan.requests] == [(1, 8, 4)]
    assert plan.direct == [True]


def test_loading_the_fsdp2_over_tp_layout_into_dtensor_order_reads_each_row_once():
    shape, sizes = (10, 3), {"a": 3, "b": 2, "c": 1}
    logical = numbered(shape)
    src = parse_mapping("chunk(0, b) | chunk(0, a)")
    dst = parse_mapping("chunk(0, a) | chunk(0, b)")
    ckpt = FakeCheckpoint({"w": (shape, src, logical)}, sizes, cycle([0]))
    for coords in all_coords(sizes):
        target = compile_mapping(dst, shape, sizes, coords)
        plan = plan_reads(
            match_shards("w", 0, target.pieces, src, shape, sizes, ckpt.rank_of),
            ckpt.info,
            [True],
            verify=False,
        )
        got = np.full(target.shape, -7, dtype=np.int32)
        execute(plan, ckpt.files, [got])
        want = materialise(dst, logical, sizes, coords)
        assert torch.equal(torch.from_numpy(got).long(), want)
        assert plan.bytes_read == want.numel() * ITEMSIZE


def test_a_verified_column_read_widens_to_whole_blocks_within_the_staging_budget():
    rows, cols, block = 1024, 256, 16 * 256 * ITEMSIZE  # blocks of 16 whole rows
    size = rows * cols * ITEMSIZE
    info = {(0, "w"): StoredShardInfo(0, size, ITEMSIZE, block=block, crcs=(0,) * (rows // 16))}
    src = Piece(0, (rows, cols), ((0, rows), (0, cols // 4)), ((0, rows), (0, cols // 4)))
    dst = Piece(0, (rows, cols // 4), ((0, rows), (0, cols // 4)), ((0, rows), (0, cols // 4)))
    budget = 64 << 10
    plan = plan_reads([Transfer("w", 0, 0, src, dst)], info, [True], max_staging=budget)
    assert all(t.window is not None for t in plan.transfers)  # staged, the needed piece kept
    assert not any(plan.direct)
    assert all(t.numel * ITEMSIZE <= budget + 2 * block for t in plan.transfers)
    assert plan.bytes_read == size  # every block, once: the quarter columns of every row
    checked = sorted(
        (plan.shards[c.shard][2], plan.shards[c.shard][3]) for r in plan.requests for c in r.checks
    )
    assert checked == [(k * block, (k + 1) * block) for k in range(rows // 16)]
    unverified = plan_reads([Transfer("w", 0, 0, src, dst)], info, [True], verify=False)
    assert unverified.bytes_read == size // 4 and not any(r.checks for r in unverified.requests)
