"""Format version 1 is pinned by a golden checkpoint (tests/golden/v1, made by make_v1.py).

Reading it must keep working in every later version; writing the same state must keep producing
the same bytes until the format version changes.
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


def test_writing_the_golden_state_reproduces_the_v1_bytes(tmp_path):
    out = str(tmp_path / "again")
    anyshard.save(out, golden_state())
    with (
        open(os.path.join(V1, "data", "rank-00000.safetensors"), "rb") as a,
        open(os.path.join(out, "data", "rank-00000.safetensors"), "rb") as b,
    ):
        assert a.read() == b.read()
    old, new = (json.load(open(os.path.join(p, "manifest.json"))) for p in (V1, out))
    old.pop("library"), new.pop("library")
    assert old == new


@pytest.mark.parametrize("version", [0, 3, "1"])
def test_a_manifest_of_another_version_is_refused_by_name(tmp_path, version):
    import shutil

    path = tmp_path / "v"
    shutil.copytree(V1, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = version
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(anyshard.AnyshardError, match="format_version"):
        anyshard.open(str(path))
