"""Bit flips at seeded random offsets of data files: every flip in the tensor data is caught, by
a load (ChecksumError naming the file) and by verify_checkpoint; a flip in a header is either
caught or harmless, never a silently wrong value.

Two checkpoints: one saved by `anyshard.save` (plain tensors of several dtypes, one data file),
and one tensor set split over 2 ranks' data files (`anyshard.ucl.save_local_states`).

Run: python -m pytest tests/unit/test_bit_flips.py -q
"""

from __future__ import annotations

import os
import random
import struct

import pytest
import torch

import anyshard
from anyshard import ucl
from anyshard.errors import AnyshardError, ChecksumError
from anyshard.reshard.verify import verify_checkpoint

SEED = 1234
DATA_FLIPS = 60  # per checkpoint
HEADER_FLIPS = 40  # per checkpoint

_g = torch.Generator().manual_seed(SEED)
PLAIN = {
    "f32": torch.randn(37, 29, generator=_g),
    "i64": torch.randint(-(2**62), 2**62, (123,), generator=_g),
    "bf16": torch.randn(16, 24, generator=_g).to(torch.bfloat16),
    "u8": torch.randint(0, 256, (257,), dtype=torch.uint8, generator=_g),
    "f64": torch.randn(5, 7, generator=_g, dtype=torch.float64),
    "flag": torch.rand(33, generator=_g) > 0.5,
}
SHARDED = {"w": torch.randn(10, 6, generator=_g), "v": torch.arange(7, dtype=torch.int32)}
SPEC = 'mesh tp;\n"w" -> "w" [10, 6] : chunk(0, tp);\n"v" -> "v" [7] : chunk(0, tp);\n'


def _save_plain(path: str) -> dict:
    anyshard.save(path, {**PLAIN, "step": 7})
    return {**PLAIN, "step": 7}


def _save_sharded(path: str) -> dict:
    states = {r: {k: t.chunk(2)[r].clone() for k, t in SHARDED.items()} for r in range(2)}
    ucl.save_local_states(path, states, spec=SPEC, layout={"tp": 2})
    return dict(SHARDED)


@pytest.fixture(scope="module", params=["plain", "two-shards"])
def saved(request, tmp_path_factory):
    """(checkpoint path, the state it holds): a working copy, flipped and restored in place."""
    path = str(tmp_path_factory.mktemp(request.param) / "step-1")
    want = (_save_plain if request.param == "plain" else _save_sharded)(path)
    return path, want


def _data_files(path: str) -> list[str]:
    data = os.path.join(path, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data))


def _regions(file: str) -> tuple[int, int]:
    """(data start, file size): bytes [0, data start) are the 8-byte length and the JSON header
    (padding included), [data start, file size) the tensor data."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, os.path.getsize(file)


def _flip(file: str, offset: int, bit: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _load(path: str, want: dict) -> dict:
    state = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()
    }
    anyshard.load(path, state)
    return state


def _bit_exact(got: dict, want: dict) -> bool:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            a, b = got[k], v
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.view(torch.uint8).tolist() != b.view(torch.uint8).tolist():
                return False
        elif got[k] != v:
            return False
    return True


def _flips(path: str, region: str, count: int) -> list[tuple[str, int, int]]:
    """``count`` seeded (file, offset, bit) in the data or header region of the data files."""
    rng = random.Random(f"{SEED}-{os.path.basename(os.path.dirname(path))}-{region}")
    files = _data_files(path)
    out = []
    for _ in range(count):
        file = rng.choice(files)
        data_start, size = _regions(file)
        lo, hi = (data_start, size) if region == "data" else (0, data_start)
        out.append((file, rng.randrange(lo, hi), rng.randrange(8)))
    return out


def _pristine(path: str) -> dict[str, bytes]:
    out = {}
    for file in [os.path.join(path, "manifest.json"), *_data_files(path)]:
        with open(file, "rb") as f:
            out[file] = f.read()
    return out


def test_the_unflipped_checkpoint_loads_bit_exact_and_verifies(saved):
    path, want = saved
    assert _bit_exact(_load(path, want), want)
    verify_checkpoint(path)
    assert len(_data_files(path)) == (2 if "two-shards" in path else 1)


def test_every_bit_flip_in_tensor_data_is_caught_by_load_and_verify(saved):
    path, want = saved
    before = _pristine(path)
    detected = 0
    for file, offset, bit in _flips(path, "data", DATA_FLIPS):
        _flip(file, offset, bit)
        try:
            with pytest.raises(ChecksumError) as loading:
                _load(path, want)
            assert file in str(loading.value), (offset, bit, str(loading.value))
            with pytest.raises(ChecksumError) as verifying:
                verify_checkpoint(path)
            assert file in str(verifying.value), (offset, bit, str(verifying.value))
            detected += 1
        finally:
            _flip(file, offset, bit)
    assert _pristine(path) == before
    assert detected == DATA_FLIPS >= 50


def test_a_bit_flip_in_a_header_is_caught_or_harmless_never_a_wrong_value(saved):
    path, want = saved
    before = _pristine(path)
    outcomes = {"caught": 0, "harmless": 0}
    for file, offset, bit in _flips(path, "header", HEADER_FLIPS):
        _flip(file, offset, bit)
        try:
            try:
                got = _load(path, want)
            except AnyshardError as e:
                assert file in str(e), (offset, bit, str(e))
                loaded = False
            else:
                assert _bit_exact(got, want), (
                    f"flip of bit {bit} at {offset} of {file}: wrong value"
                )
                loaded = True
            try:
                verify_checkpoint(path)
                verified = True
            except AnyshardError:
                verified = False
            # a flip that leaves the header meaning the same passes both; any other fails both
            assert loaded == verified, (offset, bit, loaded, verified)
            outcomes["harmless" if loaded else "caught"] += 1
        finally:
            _flip(file, offset, bit)
    assert _pristine(path) == before
    assert outcomes["caught"] >= HEADER_FLIPS // 2, outcomes
