"""The executor's read paths give the same bytes: iovec scatter, bounce-and-copy, repeated rows."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import anyshard
from anyshard.errors import ChecksumError
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard.fill import Fill, fill_regions


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "c")
    anyshard.save(path, {"w": torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)})
    return path


def fill_columns(path, rows, verify=True):
    """Load stored ``w`` (64 x 4) into columns 2..6 of a (64, 8) tensor: the file is read as one
    run, the destination is ``rows`` strided rows."""
    dest = torch.full((64, 8), -1.0)
    piece = Piece(0, (64, 8), ((0, rows), (2, 6)), ((0, rows), (0, 4)))
    plan = fill_regions(path, read_manifest(path), [Fill("w", dest, (piece,))], verify=verify)
    return dest, plan


@pytest.mark.parametrize("rows", [3, 64])  # few rows: iovecs; many rows: bounce buffer and one copy
def test_a_contiguous_run_scattered_over_strided_rows_lands_exactly(ckpt, rows):
    # unverified, so that 3 rows (part of the shard's one checksum block) are read as they are
    dest, plan = fill_columns(ckpt, rows, verify=False)
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    assert torch.equal(dest[:rows, 2:6], full[:rows])
    assert (
        (dest[:rows, :2] == -1).all()
        and (dest[:rows, 6:] == -1).all()
        and (dest[rows:] == -1).all()
    )
    assert plan.bytes_read == rows * 4 * 4
    (request,) = plan.requests
    assert len(request.spans) == rows  # 64 rows take the bounce path (>= 16 equal rows)
    # the planner's summary: target 0, 16 bytes a row from byte 8, every 32 bytes
    assert request.rows == (0, 8, 32, 16) and not request.staged


def test_a_corrupt_shard_read_through_the_bounce_buffer_fails_its_checksum(ckpt):
    data = os.path.join(ckpt, "data", "rank-00000.safetensors")
    with open(data, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff")
    with pytest.raises(ChecksumError, match="'w'"):
        fill_columns(ckpt, 64)


@pytest.mark.parametrize("part_rows", [1, 5, 64])  # the bounce buffer holds this many rows
def test_rows_through_a_small_bounce_buffer_land_exactly_and_are_checksummed(
    ckpt, monkeypatch, part_rows
):
    from anyshard.reshard import executor

    monkeypatch.setattr(executor, "_BOUNCE_BYTES", part_rows * 16)  # 16-byte rows
    dest, plan = fill_columns(ckpt, 64)
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    assert (
        torch.equal(dest[:, 2:6], full) and (dest[:, :2] == -1).all() and (dest[:, 6:] == -1).all()
    )
    data = os.path.join(ckpt, "data", "rank-00000.safetensors")
    with open(data, "r+b") as f:  # a flipped byte in the middle part, then in the last
        for where in (-16 * 33 + 3, -5):
            f.seek(where, os.SEEK_END)
            good = f.read(1)
            f.seek(where, os.SEEK_END)
            f.write(bytes([good[0] ^ 0x10]))
            f.flush()
            with pytest.raises(ChecksumError, match="'w'"):
                fill_columns(ckpt, 64)
            f.seek(where, os.SEEK_END)
            f.write(good)
            f.flush()


def test_strided_source_rows_are_read_as_repeated_requests(ckpt):
    with anyshard.open(ckpt) as view:
        got = view.get_slice("w")[:, 1:3]
    assert torch.equal(got, torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)[:, 1:3])


@pytest.mark.parametrize("rows", [3, 63, 200])
def test_repeated_rows_of_any_count_read_the_same(tmp_path, rows):
    path = str(tmp_path / "c")
    full = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6)
    anyshard.save(path, {"w": full})
    with anyshard.open(path) as view:
        assert torch.equal(view.get_slice("w")[:, 2:5], full[:, 2:5])
        assert torch.equal(view.get_slice("w")[1:, 5], full[1:, 5])


def test_a_truncated_file_under_repeated_rows_is_a_clear_error(tmp_path):
    from anyshard.errors import CorruptCheckpointError

    path = str(tmp_path / "c")
    anyshard.save(path, {"w": torch.ones(200, 6)})
    data = os.path.join(path, "data", "rank-00000.safetensors")
    os.truncate(data, os.path.getsize(data) - 100)
    with anyshard.open(path) as view, pytest.raises(CorruptCheckpointError, match="truncated"):
        view.get_slice("w")[:, 2:5]


def test_column_slices_of_checksummed_rows_stream_through_the_bounce_buffer(tmp_path, monkeypatch):
    """A column slice of a shard of several checksum blocks reads whole rows (to verify them):
    each staged part goes through the thread's bounce buffer and lands exactly; a flipped byte
    in any part is a ChecksumError."""
    from anyshard.reshard import executor, planner

    streamed = []
    real = executor._run_streamed
    monkeypatch.setattr(
        executor, "_run_streamed", lambda *a: streamed.extend(a[1].spans) or real(*a)
    )
    real_plan = planner.plan_reads
    monkeypatch.setattr(  # small staged parts: several per shard
        "anyshard.reshard.fill.plan_reads",
        lambda *a, **k: real_plan(*a, **{**k, "max_staging": 96 << 10}),
    )
    path = str(tmp_path / "c")
    full = torch.randn(1024, 96)  # 384 KiB: two checksum blocks of rows
    anyshard.save(path, {"w": full})
    with anyshard.open(path) as view:
        assert torch.equal(view.get_slice("w")[:, 7:50], full[:, 7:50])
    assert len(streamed) >= 4
    data = os.path.join(path, "data", "rank-00000.safetensors")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        for where in (size - 5, size - 200 * 1024):  # the last part, then an earlier one
            f.seek(where)
            good = f.read(1)
            f.seek(where)
            f.write(bytes([good[0] ^ 0x01]))
            f.flush()
            with anyshard.open(path) as view, pytest.raises(ChecksumError, match="'w'"):
                view.get_slice("w")[:, 7:50]
            f.seek(where)
            f.write(good)
            f.flush()


def test_a_verified_read_across_several_gaps_checks_each_gap_on_its_own_bytes(tmp_path):
    """Three row bands of a shard, a checksum block apart, are read as one request with two gaps
    (read through and dropped, but checksummed): each gap gets its own bytes."""
    from anyshard.reshard.read_plan import GAP

    rows = 16384  # one checksum block of (n, 4) fp32 rows: 256 KiB
    path = str(tmp_path / "c")
    full = torch.randn(64 * rows, 4)
    anyshard.save(path, {"w": full})
    dest = torch.zeros(62 * rows, 4)

    def band(at, lo, hi):
        return Piece(
            0,
            tuple(dest.shape),
            ((at * rows, (at + hi - lo) * rows), (0, 4)),
            ((lo * rows, hi * rows), (0, 4)),
        )

    pieces = (band(0, 0, 21), band(21, 22, 43), band(42, 44, 64))
    plan = fill_regions(path, read_manifest(path), [Fill("w", dest, pieces)])
    assert max(sum(k == GAP for k, *_ in r.spans) for r in plan.requests) == 2
    want = torch.cat([full[: 21 * rows], full[22 * rows : 43 * rows], full[44 * rows :]])
    assert torch.equal(dest, want)


@given(
    sizes=st.lists(st.integers(0, 40), max_size=12),
    size=st.integers(1, 24),
    at=st.integers(0, 9),
)
@settings(max_examples=300, deadline=None)
def test_parts_cover_the_buffers_in_order_each_at_most_the_part_size(sizes, size, at):
    from anyshard.reshard.executor import _parts

    blob = bytes(range(256)) * 2
    mv, pos, buffers = memoryview(blob[: sum(sizes)]), 0, []
    for n in sizes:
        buffers.append(mv[pos : pos + n])
        pos += n
    parts = list(_parts(buffers, size, at))
    where, joined = at, b""
    for part, start in parts:
        n = sum(len(b) for b in part)
        assert start == where and n <= size
        assert n > 0 or len(parts) == 1  # an empty part only when there are no bytes
        where += n
        joined += b"".join(bytes(b) for b in part)
    assert joined == blob[: sum(sizes)]


@pytest.mark.parametrize("flip_at", [0.1, 0.5, 0.97])  # in the first, a middle and the last part
def test_a_local_read_in_parts_checks_every_part(tmp_path, monkeypatch, flip_at):
    from anyshard.reshard import executor

    monkeypatch.setattr(executor, "_CHECK_PART", 4096)  # a 64 KiB shard read in 16 parts
    path = str(tmp_path / "c")
    w = torch.randn(64, 256)
    anyshard.save(path, {"w": w})
    back = {"w": torch.zeros(64, 256)}
    anyshard.load(path, back)
    assert torch.equal(back["w"], w)
    data = os.path.join(path, "data", "rank-00000.safetensors")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        at = size - w.nbytes + int(flip_at * w.nbytes)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="'w'"):
        anyshard.load(path, {"w": torch.zeros(64, 256)})


def test_cpu_share_divides_the_affinity_mask_among_the_local_ranks(monkeypatch):
    from anyshard.format import pool

    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pool.cpu_share() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert pool.cpu_share() == 1  # never below one thread
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert pool.cpu_share() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert pool.cpu_share() == 16
