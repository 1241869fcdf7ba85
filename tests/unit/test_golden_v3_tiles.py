"""Checksum tiles in data file version 3 are pinned by a golden checkpoint (tests/golden/v3-tiles,
made by tests/golden/make_v3_tiles.py): it must keep loading bit-exact, its tile checksums must
be the crc32c of each tile (computed here with torch slicing), a verified column slice must read
only its tiles, and writing the same state must keep producing the same bytes.
"""

import os
import sys

import crc32c
import torch

import anyshard
from anyshard.format.datafile import read_header
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard import planner
from anyshard.reshard.fill import Fill, fill_regions

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
sys.path.insert(0, GOLDEN)
from make_v3_tiles import tiles_state  # noqa: E402

PATH = os.path.join(GOLDEN, "v3-tiles")
DATA = os.path.join("data", "rank-00000.safetensors")


def test_the_tiles_golden_checkpoint_loads_bit_exact():
    want = tiles_state()["w"]
    state = {"w": torch.zeros_like(want)}
    anyshard.load(PATH, state)
    assert torch.equal(state["w"], want)


def test_its_tile_checksums_are_the_crc32c_of_each_tile():
    w, e = tiles_state()["w"], read_header(os.path.join(PATH, DATA)).shards["w"]
    assert (e.block, e.tiles) == (4 * 8192, 16)
    want = [
        crc32c.crc32c(w[r : r + 4, c : c + 128].contiguous().numpy().tobytes())
        for r in range(0, 32, 4)
        for c in range(0, 2048, 128)
    ]
    assert list(e.tile_crcs) == want


def test_a_verified_column_slice_of_it_reads_only_its_tiles(monkeypatch):
    monkeypatch.setattr(planner, "TILE_SKIP_LOCAL", 0)
    w, dest = tiles_state()["w"], torch.empty(32, 256)
    box = ((0, 32), (0, 256))
    piece = Piece(0, (32, 256), box, ((0, 32), (256, 512)))
    plan = fill_regions(PATH, read_manifest(PATH), [Fill("w", dest, (piece,))])
    assert torch.equal(dest, w[:, 256:512])
    assert plan.bytes_read == dest.numel() * 4


def test_writing_its_state_reproduces_the_data_file(tmp_path):
    out = str(tmp_path / "again")
    anyshard.save(out, tiles_state())
    with open(os.path.join(PATH, DATA), "rb") as a, open(os.path.join(out, DATA), "rb") as b:
        assert a.read() == b.read()
