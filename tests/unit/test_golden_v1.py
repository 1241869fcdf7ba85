"""Format version 1 is pinned by a golden checkpoint (tests/golden/v1): data files with one
crc32c per shard. Reading it must keep working in every later version (writers now emit version
2: tests/unit/test_golden_v2.py).
"""

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

import anyshard

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
sys.path.insert(0, GOLDEN)
from make_v1 import golden_state  # noqa: E402

V1 = os.path.join(GOLDEN, "v1")


def test_the_v1_golden_checkpoint_loads_bit_exact():
    want = golden_state()
    state = {
        "model": {k: torch.full_like(v, -1) for k, v in want["model"].items()},
        "step": 0,
        "config": {},
    }
    anyshard.load(V1, state)
    for k, v in want["model"].items():
        assert state["model"][k].dtype == v.dtype and torch.equal(state["model"][k], v), k
    assert state["step"] == 42 and state["config"] == {"lr": 0.5, "name": "golden"}


def test_the_v1_data_file_is_plain_safetensors_with_checksums():
    with safe_open(os.path.join(V1, "data", "rank-00000.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["anyshard"])
        assert meta["format_version"] == 1
        assert (
            set(meta["crc32c"]) == set(f.keys()) == {f"model.{k}" for k in golden_state()["model"]}
        )


def test_a_read_of_part_of_a_v1_shard_is_verified_by_reading_the_whole_shard(tmp_path):
    import shutil
    import struct

    path = tmp_path / "v1"
    shutil.copytree(V1, path)
    with anyshard.open(str(path)) as view:
        assert torch.equal(view.get_slice("model.w")[1:2], golden_state()["model"]["w"][1:2])
    name = path / "data" / "rank-00000.safetensors"
    data = bytearray(name.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start = json.loads(data[8 : 8 + n])["model.w"]["data_offsets"][0]
    data[8 + n + start + 2 * 16] ^= 1  # row 2 of w: outside the row read below
    name.write_bytes(bytes(data))
    with anyshard.open(str(path)) as view, pytest.raises(anyshard.errors.ChecksumError):
        view.get_slice("model.w")[1:2]
    with anyshard.open(str(path), verify=False) as view:
        assert torch.equal(view.get_slice("model.w")[1:2], golden_state()["model"]["w"][1:2])


@pytest.mark.parametrize("version", [0, 5, "1"])
def test_a_manifest_of_another_version_is_refused_by_name(tmp_path, version):
    import shutil

    path = tmp_path / "v"
    shutil.copytree(V1, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = version
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(anyshard.AnyshardError, match="format_version"):
        anyshard.open(str(path))
