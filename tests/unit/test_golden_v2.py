"""Format version 2 (data files with the crc32c of every checksum block of every shard) is
pinned by a golden checkpoint (tests/golden/v2, made by tests/golden/make_v2.py): reading it
must keep working in every later version (tests/unit/test_golden_v3.py pins what is written).
"""

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

import anyshard
from anyshard.format.datafile import block_size

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
sys.path.insert(0, GOLDEN)
from make_v1 import golden_state  # noqa: E402

V2 = os.path.join(GOLDEN, "v2")


def test_the_v2_golden_checkpoint_loads_bit_exact():
    want = golden_state()
    state = {
        "model": {k: torch.full_like(v, -1) for k, v in want["model"].items()},
        "step": 0,
        "config": {},
    }
    anyshard.load(V2, state)
    for k, v in want["model"].items():
        assert state["model"][k].dtype == v.dtype and torch.equal(state["model"][k], v), k
    assert state["step"] == 42 and state["config"] == {"lr": 0.5, "name": "golden"}


def test_the_v2_data_file_is_plain_safetensors_with_block_checksums():
    with safe_open(os.path.join(V2, "data", "rank-00000.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["anyshard"])
        assert meta["format_version"] == 2
        assert set(meta["blocks"]) == set(f.keys())
        for name in f.keys():
            t = f.get_tensor(name)
            blocks = meta["blocks"][name]
            assert blocks["bytes"] == block_size(tuple(t.shape), t.element_size())
            assert len(blocks["crc32c"]) == max(
                1, -(-t.numel() * t.element_size() // blocks["bytes"])
            )


def test_the_v2_golden_checkpoint_loads_with_a_warning_that_its_metadata_is_unverified():
    want = golden_state()
    state = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
    state["config"] = {}
    with pytest.warns(UserWarning, match="unverified") as warned:
        anyshard.load(V2, state)
    said = " ".join(str(w.message) for w in warned)
    assert "manifest.json is format_version 1" in said and "data file format_version 2" in said
