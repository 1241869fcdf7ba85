"""`write_zarr`: a consolidated zarr v3 store via tensorstore, read back by zarr-python (an
independent reader) and by `anyshard.open` (`ZarrView`), bit-exact, in chunk-aligned blocks.

Run: python -m pytest tests/unit/test_zarr_export.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_runner import cli

pytest.importorskip("tensorstore")
zarr = pytest.importorskip("zarr")

import anyshard  # noqa: E402
from anyshard.errors import AnyshardError  # noqa: E402
from anyshard.loaders import (  # noqa: E402
    ZarrView,
    diff,
    write_zarr,
    zarr_store,  # noqa: E402
)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(50, 33, generator=g),
            "emb": torch.randn(21, 8, generator=g).to(torch.bfloat16),
            "ids": torch.arange(-5, 7, dtype=torch.int64),
            "scale": torch.tensor(2.5, dtype=torch.float64),
            "cube": torch.randn(3, 4, 70, generator=g).half(),
            "empty": torch.zeros(0, 3),
        },
        "step": 11,
        "tag": "run-a",
    }


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    anyshard.save(path, state())
    return path


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(zarr_store, "_BLOCK", 512)  # many blocks per tensor


def test_zarr_python_reads_every_array_bit_exact(ckpt, tmp_path, small_blocks):
    out = str(tmp_path / "export.zarr")
    with anyshard.open(ckpt) as view:
        report = write_zarr(view, out, chunk_size=256)
    assert report.format == "zarr" and report.num_tensors == 6
    group = zarr.open_group(out, mode="r")
    truth = state()
    assert sorted(group.array_keys()) == sorted(f"model.{k}" for k in truth["model"])
    for k, t in truth["model"].items():
        arr = group[f"model.{k}"]
        assert arr.shape == tuple(t.shape), k
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert arr.dtype == want.dtype, k
        assert np.array_equal(arr[...], want), k
        assert (
            arr.attrs["anyshard"]["dtype"]
            == {
                torch.bfloat16: "BF16",
                torch.float32: "F32",
                torch.float16: "F16",
                torch.int64: "I64",
                torch.float64: "F64",
            }[t.dtype]
        )
    assert group["model.w"].chunks[0] < 50  # chunked, not one piece
    assert group.attrs["anyshard"]["values"] == {"step": 11, "tag": "run-a"}


def test_anyshard_open_reads_the_store_back_with_dtypes(ckpt, tmp_path, small_blocks):
    out = str(tmp_path / "export.zarr")
    with anyshard.open(ckpt) as view:
        write_zarr(view, out, chunk_size=300)
    truth = state()
    with anyshard.open(out) as z:
        assert isinstance(z, ZarrView)
        for k, t in truth["model"].items():
            got = z.get_tensor(f"model.{k}")
            assert got.dtype == t.dtype and torch.equal(got, t), k
        assert torch.equal(z.get_slice("model.w")[7:19, 3], truth["model"]["w"][7:19, 3])
        assert torch.equal(z.get_slice("model.cube")[1, :, 60:], truth["model"]["cube"][1, :, 60:])
        assert z.get_value("step") == 11
        assert z.metadata("model.w").num_shards > 1
    assert diff(ckpt, out).equal


def test_bfloat16_extension_type_and_zstd(ckpt, tmp_path):
    out = str(tmp_path / "export.zarr")
    with anyshard.open(ckpt) as view:
        write_zarr(view, out, bf16="bfloat16", compression="zstd", only="emb|w$")
    meta = json.loads((tmp_path / "export.zarr" / "model.emb" / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16"
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
    with anyshard.open(out) as z:
        assert torch.equal(z.get_tensor("model.emb"), state()["model"]["emb"])
        assert torch.equal(z.get_tensor("model.w"), state()["model"]["w"])


def test_bad_names_options_and_existing_targets_are_refused(ckpt, tmp_path):
    with anyshard.open(ckpt) as view:
        with pytest.raises(AnyshardError, match="cannot be a zarr array name"):
            write_zarr(view, str(tmp_path / "a.zarr"), rename={r"\.w$": "/w"})
        with pytest.raises(AnyshardError, match="compression"):
            write_zarr(view, str(tmp_path / "b.zarr"), compression="lz9")
        write_zarr(view, str(tmp_path / "c.zarr"))
        with pytest.raises(AnyshardError, match="already holds a zarr store"):
            write_zarr(view, str(tmp_path / "c.zarr"))


def test_chunk_shape_bounds_chunk_bytes():
    for shape, item in [((1000, 256), 4), ((4, 1 << 20), 2), ((3, 5, 7), 8), ((), 4), ((0, 9), 4)]:
        c = zarr_store.chunk_shape(shape, item, 1 << 12)
        assert len(c) == len(shape) and all(x >= 1 for x in c)
        assert np.prod(c, dtype=np.int64) * item <= max(1 << 12, item)


def test_cli_convert_to_zarr_and_dcp(ckpt, tmp_path):
    for to, name in (("zarr", "z.zarr"), ("dcp", "dcp")):
        r = cli("convert", ckpt, str(tmp_path / name), "--to", to)
        assert r.returncode == 0, r.stderr
        assert "wrote 6 tensors" in r.stdout
        r = cli("diff", ckpt, str(tmp_path / name))
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_module_examples_run():
    import doctest

    result = doctest.testmod(zarr_store, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_export_to_s3_through_tensorstore_and_read_back(ckpt, s3):
    """tensorstore's own S3 driver writes the store into the bucket (endpoint from the
    standard AWS_ENDPOINT_URL); zarr-python reads it back through fsspec, and ZarrView too."""
    out = s3 + "/export.zarr"
    with anyshard.open(ckpt) as view:
        write_zarr(view, out, only="w$|emb")
    truth = state()
    with anyshard.open(out) as z:
        assert isinstance(z, ZarrView)
        assert torch.equal(z.get_tensor("model.w"), truth["model"]["w"])
        assert torch.equal(z.get_tensor("model.emb"), truth["model"]["emb"])
    group = zarr.open_group(out, mode="r")
    assert np.array_equal(group["model.w"][...], truth["model"]["w"].numpy())
