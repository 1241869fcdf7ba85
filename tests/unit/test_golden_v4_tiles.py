"""Data file version 4 (checksum tiles of shards of 3 and 4 dims) is pinned by a golden
checkpoint (tests/golden/v4-tiles, made by tests/golden/make_v4_tiles.py): it must keep loading
bit-exact, its tile checksums must be the crc32c of each tile of the 2-d array of its rows
(computed here with torch slicing), a verified column slice of it must read only its tiles, and
writing the same state must keep producing the same bytes. Every earlier golden checkpoint
(versions 1, 2, 3, 3 with tiles) still loads bit-exact under the same reader.
"""

import json
import os
import struct
import sys
import warnings

import crc32c
import pytest
import torch

import anyshard
from anyshard.format.datafile import read_header
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard import planner
from anyshard.reshard.fill import Fill, fill_regions

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
sys.path.insert(0, GOLDEN)
from make_v1 import golden_state  # noqa: E402
from make_v3_tiles import tiles_state  # noqa: E402
from make_v4_tiles import tiles_nd_state  # noqa: E402

PATH = os.path.join(GOLDEN, "v4-tiles")
DATA = os.path.join("data", "rank-00000.safetensors")


def test_the_v4_golden_checkpoint_loads_bit_exact():
    want = tiles_nd_state()
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    anyshard.load(PATH, state)
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_it_is_data_file_version_4_with_the_crc32c_of_each_tile_of_its_rows():
    with open(os.path.join(PATH, DATA), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(json.loads(f.read(n))["__metadata__"]["anyshard"])
    assert meta["format_version"] == 4
    header = read_header(os.path.join(PATH, DATA))
    for name, t in tiles_nd_state().items():
        e, rows = header.shards[name], t.reshape(-1, 2048)
        assert (e.block, e.tiles) == (8 * 8192, 16)
        want = [
            crc32c.crc32c(rows[r : r + 8, c : c + 128].contiguous().numpy().tobytes())
            for r in range(0, rows.shape[0], 8)
            for c in range(0, 2048, 128)
        ]
        assert list(e.tile_crcs) == want


def test_a_verified_column_slice_of_it_reads_only_its_tiles(monkeypatch):
    monkeypatch.setattr(planner, "TILE_SKIP_LOCAL", 0)
    w, dest = tiles_nd_state()["experts"], torch.empty(2, 8, 256)
    box = ((0, 2), (0, 8), (0, 256))
    piece = Piece(0, (2, 8, 256), box, ((0, 2), (0, 8), (256, 512)))
    plan = fill_regions(PATH, read_manifest(PATH), [Fill("experts", dest, (piece,))])
    assert torch.equal(dest, w[..., 256:512])
    assert plan.bytes_read == dest.numel() * 4


def test_writing_its_state_reproduces_the_data_file(tmp_path):
    out = str(tmp_path / "again")
    anyshard.save(out, tiles_nd_state())
    with open(os.path.join(PATH, DATA), "rb") as a, open(os.path.join(out, DATA), "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("name", ["v1", "v2", "v3", "v3-tiles"])
def test_every_earlier_golden_checkpoint_still_loads_bit_exact(name):
    want = tiles_state() if name == "v3-tiles" else golden_state()
    flat = want if name == "v3-tiles" else want["model"]
    state = {k: torch.zeros_like(v) for k, v in flat.items()}
    if name != "v3-tiles":
        state = {"model": state, "step": 0, "config": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # versions 1 and 2: their metadata loads unverified
        anyshard.load(os.path.join(GOLDEN, name), state)
    got = state if name == "v3-tiles" else state["model"]
    assert all(torch.equal(got[k], flat[k]) for k in flat)
    if name != "v3-tiles":
        assert (state["step"], state["config"]) == (want["step"], want["config"])
