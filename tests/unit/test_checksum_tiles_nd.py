"""Checksum tiles of shards of 3 and 4 dims (data file version 4): such a shard is tiled as the
2-d array of its rows (every dim but the last flattened), so that a verified column split of an
expert weight [experts, rows, cols] reads the bytes it needs, as one of a 2-d weight does.
Truth: crc32c of the tiles computed here with torch slicing and the crc32c package, the bytes
the planner reads, and bit-exact values.

Run: python -m pytest tests/unit/test_checksum_tiles_nd.py -q
"""

from __future__ import annotations

import json
import os
import struct

import crc32c
import pytest
import torch
from sealing import header_bytes

import anyshard
from anyshard.errors import ChecksumError, CorruptCheckpointError
from anyshard.format.datafile import read_header
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard import planner
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.reshard.verify import verify_checkpoint

# [experts, rows, cols]: 8 KiB rows, checksum blocks of one expert (64 rows), 16 column blocks
X = (4, 64, 2048)
# 4 dims, 16 KiB rows: blocks of 64 rows (2 x 32), 16 column blocks of 1 KiB
Y = (2, 2, 32, 4096)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    state = {"x": torch.randn(*X, generator=g), "y": torch.randn(*Y, generator=g)}
    state["flat"] = state["x"].reshape(-1, X[-1]).clone()  # the same bytes as a 2-d shard
    path = str(tmp_path_factory.mktemp("nd") / "c")
    anyshard.save(path, state)
    return path, state


@pytest.fixture()
def every_split(monkeypatch):
    """Tiles for every column slice of a local file, as for object storage."""
    monkeypatch.setattr(planner, "TILE_SKIP_LOCAL", 0)


def _data(path: str) -> str:
    return os.path.join(path, "data", "rank-00000.safetensors")


def _read(path: str, name: str, box, strided: bool = False) -> tuple[torch.Tensor, int]:
    """Box ``box`` of tensor ``name``, read verified into a new tensor (``strided``: a view of
    every other column block of a wider one, which the reads cannot fill in place)."""
    shape = tuple(hi - lo for lo, hi in box)
    dest = torch.empty(shape) if not strided else torch.zeros(*shape[:-1], 2 * shape[-1])
    dest = dest[..., : shape[-1]]
    piece = Piece(0, shape, tuple((0, n) for n in shape), tuple(box))
    plan = fill_regions(path, read_manifest(path), [Fill(name, dest, (piece,))])
    return dest, plan.bytes_read


def _index(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def test_the_writer_records_the_tiles_of_shards_of_three_and_four_dims(saved):
    path, state = saved
    h = read_header(_data(path))
    with open(_data(path), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(json.loads(f.read(n))["__metadata__"]["anyshard"])
    assert meta["format_version"] == 4
    for name, band in (("x", 64), ("y", 64)):
        e, t = h.shards[name], state[name]
        rows = t.reshape(-1, t.shape[-1])
        width = t.shape[-1] // 16
        assert e.tiles == 16 and e.block == band * t.shape[-1] * 4
        want = [
            crc32c.crc32c(rows[r : r + band, c : c + width].contiguous().numpy().tobytes())
            for r in range(0, rows.shape[0], band)
            for c in range(0, t.shape[-1], width)
        ]
        assert list(e.tile_crcs) == want
        raw = t.numpy().tobytes()
        assert list(e.crcs) == [
            crc32c.crc32c(raw[a : a + e.block]) for a in range(0, len(raw), e.block)
        ]


def test_a_file_without_tiles_of_three_dims_is_still_version_3(tmp_path):
    """Version 4 is written only where it is needed: a 2-d tiled shard and a 3-d one of narrow
    rows (no tiles) make a version-3 file, as before."""
    path = str(tmp_path / "c")
    anyshard.save(path, {"w": torch.randn(64, 2048), "narrow": torch.randn(4, 64, 1024)})
    with open(_data(path), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(json.loads(f.read(n))["__metadata__"]["anyshard"])
    assert meta["format_version"] == 3
    assert read_header(_data(path)).shards["narrow"].tiles == 1


@pytest.mark.parametrize("ways", [2, 4, 16])
def test_a_column_split_of_an_expert_weight_reads_what_a_2d_one_does(saved, ways, every_split):
    """Each part of a column split of [experts, rows, cols] reads exactly its bytes (no whole
    rows), the same bytes as the same split of the 2-d tensor of its rows."""
    path, state = saved
    part = X[-1] // ways
    for k in (0, ways - 1):
        cols = (k * part, (k + 1) * part)
        got, read = _read(path, "x", ((0, 4), (0, 64), cols))
        assert torch.equal(got, state["x"][..., cols[0] : cols[1]])
        flat, read_2d = _read(path, "flat", ((0, 256), cols))
        assert read == read_2d == got.numel() * 4


@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize(
    "name, box, read",
    [
        # experts 1..2, rows 5..36: each expert's band (64 rows) x column blocks 7..8 (256 cols)
        ("x", ((1, 3), (5, 37), (1000, 1100)), 2 * 64 * 256 * 4),
        # all of dims 0-2, half the columns: exactly the bytes
        ("y", ((0, 2), (0, 2), (0, 32), (2048, 4096)), 2 * 2 * 32 * 2048 * 4),
        # one of dim 1's two: runs of 32 rows, each in its own band of 64
        ("y", ((0, 2), (1, 2), (0, 32), (0, 1024)), 2 * 64 * 1024 * 4),
        # rows 3..29 of both of dim 1 under dim 0's second: one band, columns 0..3071
        ("y", ((1, 2), (0, 2), (3, 30), (100, 3000)), 64 * 3072 * 4),
    ],
)
def test_boxes_cutting_the_leading_dims_read_their_tiles_bit_exact(
    saved, name, box, read, strided, every_split
):
    path, state = saved
    got, took = _read(path, name, box, strided)
    assert torch.equal(got, state[name][_index(box)])
    assert took == read


def test_a_local_column_split_that_skips_under_a_page_reads_whole_rows(saved):
    """The rule for local files stays: 15 of 16 column blocks of an 8 KiB row skip 512 bytes,
    under `planner.TILE_SKIP_LOCAL`: whole rows (whole blocks), as a 2-d shard."""
    path, state = saved
    got, read = _read(path, "x", ((0, 4), (0, 64), (0, 1920)))
    assert torch.equal(got, state["x"][..., :1920]) and read == state["x"].numel() * 4


def _flip(path: str, at: int) -> None:
    with open(_data(path), "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + at)
        b = f.read(1)
        f.seek(8 + n + at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_flip_in_a_tile_of_an_expert_weight_is_caught(tmp_path, every_split):
    x = torch.randn(*X, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "c")
    anyshard.save(path, {"x": x})
    _flip(path, ((2 * 64 + 10) * X[-1] + 1500) * 4)  # expert 2, row 10, column block 11
    with pytest.raises(
        ChecksumError, match=r"'x' \(the tile of rows 128\.\.192, columns 1408\.\.1536"
    ):
        _read(path, "x", ((0, 4), (0, 64), (1024, 2048)))
    got, _ = _read(path, "x", ((0, 4), (0, 64), (0, 1024)))  # its tiles are intact
    assert torch.equal(got, x[..., :1024])
    with pytest.raises(ChecksumError):  # whole rows: the block's checksum
        _read(path, "x", ((2, 3), (0, 64), (0, X[-1])))
    with pytest.raises(ChecksumError):
        verify_checkpoint(path)


def test_a_version_3_header_with_tiles_of_three_dims_is_refused(tmp_path):
    """Version 3 tiles 2-d shards only: a header that says 3 over a tiled 3-d shard is not one
    a writer made."""
    path = str(tmp_path / "c")
    anyshard.save(path, {"x": torch.randn(*X)})
    with open(_data(path), "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["anyshard"])
        meta["format_version"] = 3
        header["__metadata__"]["anyshard"] = json.dumps(meta, separators=(",", ":"))
        raw = header_bytes(header)
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))
    with pytest.raises(CorruptCheckpointError, match="header entry of 'x' is inconsistent"):
        _read(path, "x", ((0, 4), (0, 64), (0, 1024)))


def test_seeded_random_boxes_read_by_tiles_are_bit_exact(saved, every_split):
    """Random boxes of the 3-d and 4-d shards, into plain and strided targets: bit-exact, and
    never more bytes than the whole rows (blocks) they touch."""
    path, state = saved
    g = torch.Generator().manual_seed(7)
    for k in range(40):
        name = ("x", "y")[k % 2]
        shape = state[name].shape
        box = []
        for n in shape:
            lo = int(torch.randint(0, n, (1,), generator=g))
            box.append((lo, int(torch.randint(lo + 1, n + 1, (1,), generator=g))))
        got, read = _read(path, name, tuple(box), strided=k % 4 >= 2)
        assert torch.equal(got, state[name][_index(box)]), box
        assert read <= state[name].numel() * 4, box
