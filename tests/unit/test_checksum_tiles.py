"""2-d checksum tiles: a 2-d shard's checksum blocks are also cut into column blocks, each tile
checksummed on its own, so that a verified load of a column slice (a tensor-parallel split of
the last dim) reads only the tiles it needs. Truth: crc32c of the tiles computed here with
torch slicing and the crc32c package, the bytes the planner reads, and bit-exact values.

Run: python -m pytest tests/unit/test_checksum_tiles.py -q
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
from anyshard.format.datafile import read_header, tile_count
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Piece
from anyshard.reshard import planner
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.reshard.verify import verify_checkpoint

ROWS, COLS = 512, 4096  # 16 KiB rows of fp32: blocks of 16 rows, 16 column blocks of 1 KiB


@pytest.fixture()
def saved(tmp_path):
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "c")
    narrow = torch.randn(128, 1024, generator=torch.Generator().manual_seed(2))  # 4 KiB rows
    state = {"w": w, "v": torch.randn(1 << 16), "tall": torch.randn(4096, 64), "narrow": narrow}
    anyshard.save(path, state)
    return path, w


def _data(path: str) -> str:
    return os.path.join(path, "data", "rank-00000.safetensors")


def _read_cols(
    path: str, c0: int, c1: int, rows=(0, ROWS), name: str = "w"
) -> tuple[torch.Tensor, int]:
    r0, r1 = rows
    dest = torch.empty(r1 - r0, c1 - c0)
    box = ((0, r1 - r0), (0, c1 - c0))
    fill = Fill(name, dest, (Piece(0, tuple(dest.shape), box, ((r0, r1), (c0, c1))),))
    plan = fill_regions(path, read_manifest(path), [fill])
    return dest, plan.bytes_read


def test_the_writer_records_the_crc32c_of_every_tile(saved):
    path, w = saved
    e = read_header(_data(path)).shards["w"]
    assert e.tiles == 16 and tile_count((ROWS, COLS), 4) == 16
    band, width = e.block // (COLS * 4), COLS // e.tiles
    want = [
        crc32c.crc32c(w[r : r + band, c : c + width].contiguous().numpy().tobytes())
        for r in range(0, ROWS, band)
        for c in range(0, COLS, width)
    ]
    assert list(e.tile_crcs) == want
    # 1-d shards, and 2-d ones whose column blocks would be under 512 bytes, have none
    h = read_header(_data(path))
    assert h.shards["v"].tiles == 1 and h.shards["tall"].tiles == 1
    assert h.shards["narrow"].tiles == 1  # 4 KiB rows: under `TILE_MIN_ROW`


@pytest.fixture()
def every_split(monkeypatch):
    """Tiles for every column slice of a local file, as for object storage (where a read call
    costs nothing next to the bytes it skips)."""
    monkeypatch.setattr(planner, "TILE_SKIP_LOCAL", 0)


@pytest.mark.parametrize("ways", [2, 4, 8, 16])
def test_a_verified_column_split_reads_only_the_bytes_it_needs(saved, ways, every_split):
    path, w = saved
    part = COLS // ways
    for k in (0, ways - 1):
        got, read = _read_cols(path, k * part, (k + 1) * part)
        assert torch.equal(got, w[:, k * part : (k + 1) * part])
        assert read == got.numel() * 4  # 1.00x: whole tiles, no whole rows


@pytest.mark.parametrize(
    "name, cols, rows_read",
    [("w", COLS // 2, COLS // 2), ("w", 13 * 256, COLS), ("narrow", 512, 1024)],
)
def test_a_local_file_is_read_by_tiles_where_they_skip_a_page_of_each_row(
    saved, name, cols, rows_read
):
    """Half of a 16 KiB row skips 8 KiB of it: tiles, the bytes needed. Thirteen of its sixteen
    column blocks skip 3 KiB, less than a page (`TILE_SKIP_LOCAL`), which a local read would
    not skip: whole blocks, whole rows. A 4 KiB row has no tiles: whole rows."""
    path, _ = saved
    got, read = _read_cols(path, 0, cols, rows=(0, 128), name=name)
    with anyshard.open(path) as view:
        assert torch.equal(got, view.get_tensor(name)[:128, :cols])
    assert read == 128 * rows_read * 4


def test_an_unaligned_slice_reads_the_tiles_it_touches(saved, every_split):
    path, w = saved
    got, read = _read_cols(path, 1000, 1100, rows=(20, 40))
    assert torch.equal(got, w[20:40, 1000:1100])
    # rows 16..47 (2 blocks) x column blocks 3..4 (1 KiB each of a 16 KiB row)
    assert read == 32 * 2 * 256 * 4


def test_a_flip_in_a_tile_is_caught_by_the_loads_that_read_it(saved, every_split):
    path, w = saved
    with open(_data(path), "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        at = 8 + n + (100 * COLS + 3000) * 4  # row 100, column 3000: column block 11
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x04]))
    with pytest.raises(
        ChecksumError, match=r"'w' \(the tile of rows 96\.\.112, columns 2816\.\.3072"
    ):
        _read_cols(path, 2048, 3072)  # a 4-way split's third part
    got, _ = _read_cols(path, 0, 2048)  # the tiles it reads are intact
    assert torch.equal(got, w[:, :2048])
    with pytest.raises(ChecksumError):  # whole rows: the block's checksum
        _read_cols(path, 0, COLS, rows=(96, 112))
    with pytest.raises(ChecksumError):
        verify_checkpoint(path)


def _rewrite_meta(path: str, change) -> None:
    """Change the data file header's anyshard metadata, seal it again, keep its length."""
    with open(_data(path), "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["anyshard"])
        change(meta["blocks"]["w"])
        header["__metadata__"]["anyshard"] = json.dumps(meta, separators=(",", ":"))
        raw = header_bytes(header)
        assert len(raw) <= n
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def _over_ten_digits(crcs: list[int]) -> None:
    """Set a ten-digit item of ``crcs`` to 2**32, also ten digits: the header keeps its length."""
    crcs[next(i for i, c in enumerate(crcs) if c >= 10**9)] = 1 << 32


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.update(tiles=8),  # not what the writer lays out for this shape
        lambda b: b["tile_crc32c"].pop(),  # one checksum short
        lambda b: b["tile_crc32c"].__setitem__(0, -1),  # not a crc32c
        lambda b: _over_ten_digits(b["tile_crc32c"]),  # not a crc32c: 2**32
        lambda b: b["tile_crc32c"].__setitem__(1, True),  # a bool, not an int
        lambda b: b["tile_crc32c"].__setitem__(2, 1.0),  # a float, not an int
        lambda b: b["crc32c"].__setitem__(0, True),  # a block's, a bool
        lambda b: _over_ten_digits(b["crc32c"]),  # a block's, out of range
    ],
)
def test_a_header_whose_tiles_are_not_a_writer_s_is_refused(saved, change):
    path, _ = saved
    _rewrite_meta(path, change)
    with pytest.raises(CorruptCheckpointError, match="header entry of 'w' is inconsistent"):
        _read_cols(path, 0, 256)


def test_a_wrong_tile_checksum_in_a_resealed_header_is_caught(saved, every_split):
    """A header sealed again over a wrong tile checksum (a writer's bug, not a flipped bit):
    the column load that reads the tile, and verify, both refuse it."""
    path, _ = saved

    def wrong(b):
        b["tile_crc32c"][5] ^= 1

    _rewrite_meta(path, wrong)
    with pytest.raises(ChecksumError, match="tile"):
        _read_cols(path, 5 * 256, 6 * 256, rows=(0, 16))
    with pytest.raises(ChecksumError, match="tile"):
        verify_checkpoint(path)


def test_block_checksums_computed_in_the_tiles_pass_are_each_block_s_crc32c(tmp_path):
    """A tiled shard's block checksums come from the pass that computes its tiles; with a last
    block shorter than the others (100 rows in blocks of 8) they are still each block's."""
    w = torch.randn(100, 2048, generator=torch.Generator().manual_seed(3))  # 8 KiB rows
    path = str(tmp_path / "c")
    anyshard.save(path, {"w": w})
    e = read_header(_data(path)).shards["w"]
    assert (e.block, e.tiles) == (8 * 8192, 16)
    raw = w.numpy().tobytes()
    assert list(e.crcs) == [
        crc32c.crc32c(raw[a : a + e.block]) for a in range(0, len(raw), e.block)
    ]
    want = [
        crc32c.crc32c(w[r : r + 8, c : c + 128].contiguous().numpy().tobytes())
        for r in range(0, 100, 8)
        for c in range(0, 2048, 128)
    ]
    assert list(e.tile_crcs) == want


def test_a_converted_checkpoint_carries_the_tiles_a_save_writes(saved, tmp_path):
    """`convert` into anyshard (here from Hugging Face safetensors) records the same block and
    tile checksums as `anyshard.save` for the same tensor, and a column split of the result
    reads only its tiles."""
    from safetensors.torch import save_file

    from anyshard.loaders import convert

    path, w = saved
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": w, "narrow": torch.randn(128, 1024)}, str(src / "model.safetensors"))
    dst = str(tmp_path / "converted")
    convert(str(src), dst)
    got, want = read_header(_data(dst)).shards["w"], read_header(_data(path)).shards["w"]
    assert got.tiles == want.tiles == 16
    assert got.tile_crcs == want.tile_crcs and got.crcs == want.crcs
    assert read_header(_data(dst)).shards["narrow"].tiles == 1  # 4 KiB rows: none
    cols, read = _read_cols(dst, COLS // 2, COLS)
    assert torch.equal(cols, w[:, COLS // 2 :]) and read == cols.numel() * 4
    verify_checkpoint(dst)
