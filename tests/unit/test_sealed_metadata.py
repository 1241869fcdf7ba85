"""Every byte of a checkpoint's metadata is verified before it is used: each byte of the
manifest and of the data file's header (its length and JSON), flipped in turn, makes a load
refuse with an AnyshardError; none loads a wrong value (tools/fuzz_checkpoints.py --every-byte
does the same through every entry point)."""

import os
import shutil
import struct
import warnings

import pytest
import torch

import anyshard
from anyshard.errors import AnyshardError

STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "step": 42,
    "config": {"lr": 0.5, "name": "x"},
}


def _target() -> dict:
    return {
        "w": torch.zeros(3, 4),
        "b": torch.zeros(2, dtype=torch.bfloat16),
        "step": 0,
        "config": {},
    }


@pytest.mark.parametrize("file", ["manifest.json", "data/rank-00000.safetensors"])
def test_every_flipped_metadata_byte_is_refused(tmp_path, file):
    pristine = str(tmp_path / "pristine")
    anyshard.save(pristine, STATE)
    with open(os.path.join(pristine, file), "rb") as f:
        data = f.read()
    end = len(data) if file.endswith(".json") else 8 + struct.unpack("<Q", data[:8])[0]
    work = str(tmp_path / "work")
    refused, wrong = 0, []
    for at in range(end):
        for mask in (0x01, 0x80):
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(pristine, work)
            with open(os.path.join(work, file), "r+b") as f:
                f.seek(at)
                f.write(bytes([data[at] ^ mask]))
            state = _target()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a flip that reads as an older version
                    anyshard.load(work, state)
            except AnyshardError:
                refused += 1
                continue
            same = torch.equal(state["w"], STATE["w"]) and torch.equal(state["b"], STATE["b"])
            if not (same and state["step"] == 42 and state["config"] == STATE["config"]):
                wrong.append((at, mask))
    assert wrong == [], wrong[:10]
    assert refused == 2 * end, (refused, 2 * end)  # no flip goes unnoticed
