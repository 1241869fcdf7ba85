"""Format version 2 (data files with the crc32c of every checksum block of every shard) is
pinned by a golden checkpoint (tests/golden/v2, made by tests/golden/make_v2.py).

Reading it must keep working in every later version; writing the same state must keep producing
the same bytes until the format version changes.
"""

import json
import os
import sys

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


def test_writing_the_golden_state_reproduces_the_v2_bytes(tmp_path):
    out = str(tmp_path / "again")
    anyshard.save(out, golden_state())
    with (
        open(os.path.join(V2, "data", "rank-00000.safetensors"), "rb") as a,
        open(os.path.join(out, "data", "rank-00000.safetensors"), "rb") as b,
    ):
        assert a.read() == b.read()
    old, new = (json.load(open(os.path.join(p, "manifest.json"))) for p in (V2, out))
    old.pop("library"), new.pop("library")
    assert old == new
