"""Format version 3 of data files and 4 of manifests (the manifest and every data file header
carry the crc32c of their own bytes) is pinned by a golden checkpoint (tests/golden/v3, made by
tests/golden/make_v3.py).

Reading it must keep working in every later version; writing the same state must keep producing
the same bytes until the format version changes.
"""

import json
import os
import struct
import sys
import warnings

import crc32c
import torch
from safetensors import safe_open

import anyshard

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
sys.path.insert(0, GOLDEN)
from make_v1 import golden_state  # noqa: E402

V3 = os.path.join(GOLDEN, "v3")
DATA = os.path.join("data", "rank-00000.safetensors")


def test_the_v3_golden_checkpoint_loads_bit_exact_without_a_warning():
    want = golden_state()
    state = {
        "model": {k: torch.full_like(v, -1) for k, v in want["model"].items()},
        "step": 0,
        "config": {},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sealed metadata: nothing loads unverified
        anyshard.load(V3, state)
    for k, v in want["model"].items():
        assert state["model"][k].dtype == v.dtype and torch.equal(state["model"][k], v), k
    assert state["step"] == 42 and state["config"] == {"lr": 0.5, "name": "golden"}


def _unsealed_crc(data: bytes, prefix: bytes) -> tuple[str, int]:
    """The stored seal of ``data`` and the crc32c of ``data`` with it as "00000000"."""
    assert data.startswith(prefix)
    n = len(prefix)
    return data[n : n + 8].decode(), crc32c.crc32c(data[:n] + b"00000000" + data[n + 8 :])


def test_the_v3_manifest_and_header_carry_the_crc32c_of_their_own_bytes():
    with open(os.path.join(V3, "manifest.json"), "rb") as f:
        manifest = f.read()
    stored, crc = _unsealed_crc(
        manifest, b'{"format":"anyshard-checkpoint","format_version":4,"crc32c":"'
    )
    assert stored == f"{crc:08x}"
    assert json.loads(manifest)["crc32c"] == stored
    with open(os.path.join(V3, DATA), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n).rstrip(b" ")
    stored, crc = _unsealed_crc(header, b'{"__metadata__":{"anyshard_crc32c":"')
    assert stored == f"{crc:08x}"
    with safe_open(os.path.join(V3, DATA), "pt") as f:  # still plain safetensors
        assert f.metadata()["anyshard_crc32c"] == stored
        assert json.loads(f.metadata()["anyshard"])["format_version"] == 3
        assert torch.equal(f.get_tensor("model.w"), golden_state()["model"]["w"])


def test_writing_the_golden_state_reproduces_the_v3_bytes(tmp_path):
    out = str(tmp_path / "again")
    anyshard.save(out, golden_state())
    with open(os.path.join(V3, DATA), "rb") as a, open(os.path.join(out, DATA), "rb") as b:
        assert a.read() == b.read()
    old, new = (json.load(open(os.path.join(p, "manifest.json"))) for p in (V3, out))
    for m in (old, new):  # the writer's version string, and so the seal, may differ
        m.pop("library"), m.pop("crc32c")
    assert old == new
