"""torch.save files (one file, or Hugging Face's legacy sharded ``pytorch_model.bin``) read as a
lazy view with torch.load(weights_only=True, mmap=True), converted to Hugging Face and to
anyshard; a file holding other objects is refused without building any of them.

Run: python -m pytest tests/unit/test_loaders_torchsave.py -q
"""

from __future__ import annotations

import json
import os
import uuid
import warnings

import fsspec
import pytest
import torch
from safetensors.torch import load_file

import anyshard
from anyshard.errors import AnyshardError, CheckpointNotFoundError, CorruptCheckpointError
from anyshard.loaders import write_anyshard, write_hf
from anyshard.loaders.torchsave import TorchSaveView, looks_like_torch_save


def state(seed=0):
    """A state dict with the cases that matter, and its flat truth (tensors, values)."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(6, 5, generator=g)
    base = torch.randn(4, 7, generator=g)
    sd = {
        "model": {
            "emb.weight": emb,
            "head.weight": emb,  # tied: one storage, two names
            "proj.weight": base.t(),  # non-contiguous, stored with its strides
            "norm": torch.randn(5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
            "scale": torch.tensor(2.5),  # 0-d
            "empty": torch.zeros(0, 3),
        },
        "layers": [torch.randn(2, 3, generator=g), {"w": torch.randn(3, generator=g)}],
        "step": 7,
        "lr": 0.001,
        "name": "run-1",
        "sched": {"warmup": 10, "betas": (0.9, 0.95)},
        "dtype": torch.float16,  # loads under weights_only, but is no JSON value
    }
    tensors = {
        "model.emb.weight": emb,
        "model.head.weight": emb,
        "model.proj.weight": base.t(),
        "model.norm": sd["model"]["norm"],
        "model.ids": sd["model"]["ids"],
        "model.scale": sd["model"]["scale"],
        "model.empty": sd["model"]["empty"],
        "layers.0": sd["layers"][0],
        "layers.1.w": sd["layers"][1]["w"],
    }
    values = {
        "step": 7,
        "lr": 0.001,
        "name": "run-1",
        "sched": {"warmup": 10, "betas": [0.9, 0.95]},
    }
    return sd, tensors, values


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_torch_save_file_reads_as_flat_names_bit_exactly(tmp_path):
    sd, tensors, values = state()
    path = str(tmp_path / "ckpt.pt")
    torch.save(sd, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the zip format maps: no legacy warning
        view = TorchSaveView(path)
    with view:
        assert view.format == "torch-save" and view.memory_mapped
        assert sorted(view.keys()) == sorted(tensors)
        for name, t in tensors.items():
            assert exact(view.get_tensor(name), t), name
            m = view.metadata(name)
            assert (m.shape, m.dtype, m.num_shards) == (tuple(t.shape), t.dtype, 1)
        assert sorted(view.value_keys()) == sorted(values)
        assert view.values == values and view.get_value("sched") == values["sched"]
        assert list(view.skipped) == ["dtype"]
        with pytest.raises(KeyError, match="nope"):
            view.get_tensor("nope")


def test_region_reads_return_exactly_the_slices(tmp_path):
    sd, tensors, _ = state(1)
    path = str(tmp_path / "ckpt.pth")
    torch.save(sd, path)
    view = TorchSaveView(path)
    emb, proj = tensors["model.emb.weight"], tensors["model.proj.weight"]
    assert exact(view.get_slice("model.emb.weight")[1:3], emb[1:3])
    assert exact(view.get_slice("model.emb.weight")[2, 1:4], emb[2, 1:4])
    assert exact(view.get_slice("model.proj.weight")[1:6, 2:4], proj[1:6, 2:4])
    assert exact(view.get_slice("model.norm")[...], tensors["model.norm"])
    assert exact(view.get_slice("model.scale")[()], tensors["model.scale"])
    assert view.get_slice("model.empty")[0:0].shape == (0, 3)
    out = view.read_region("model.ids", ((1, 3), (0, 2)))
    assert exact(out, tensors["model.ids"][1:3, 0:2]) and out.is_contiguous()
    out[:] = -1  # a copy: the mapped file is not written through
    assert exact(view.get_tensor("model.ids"), tensors["model.ids"])
    with pytest.raises(IndexError, match="outside"):
        view.read_region("model.ids", ((0, 4), (0, 3)))


def test_a_bare_tensor_file_is_named_by_its_stem(tmp_path):
    t = torch.randn(3, 4)
    torch.save(t, str(tmp_path / "embeddings.bin"))
    view = TorchSaveView(str(tmp_path / "embeddings.bin"))
    assert view.keys() == ["embeddings"] and exact(view.get_tensor("embeddings"), t)


def write_sharded(root, tensors, groups):
    """Hugging Face's legacy sharded layout: pytorch_model-0000i-of-0000n.bin + the index."""
    os.makedirs(root, exist_ok=True)
    n = len(groups)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        torch.save({k: tensors[k] for k in names}, os.path.join(root, file))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(root, "pytorch_model.bin.index.json"), "w") as f:
        json.dump(index, f)


def hf_tensors(seed=2):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(11, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.randn(11, 8, generator=g),
    }


def test_a_sharded_pytorch_model_bin_reads_through_its_index(tmp_path):
    truth = hf_tensors()
    names = sorted(truth)
    root = str(tmp_path / "hf-legacy")
    write_sharded(root, truth, [names[:2], names[2:]])
    for path in (root, os.path.join(root, "pytorch_model.bin.index.json")):
        view = TorchSaveView(path)
        assert view.keys() == names and view.index_name == "pytorch_model.bin.index.json"
        q = "model.layers.0.self_attn.q_proj.weight"
        assert exact(view.get_slice(q)[1:3], truth[q][1:3])
        assert view.metadata(q).shards[0].file == "pytorch_model-00002-of-00002.bin"
        for k, t in truth.items():
            assert exact(view.get_tensor(k), t), k
        assert view.value_keys() == [] and view.memory_mapped


def test_an_index_that_names_a_missing_tensor_or_file_is_corrupt(tmp_path):
    truth = hf_tensors(3)
    names = sorted(truth)
    root = tmp_path / "bad"
    write_sharded(str(root), truth, [names[:2], names[2:]])
    index = json.loads((root / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["extra.weight"] = "pytorch_model-00001-of-00002.bin"
    index["weight_map"]["gone.weight"] = "pytorch_model-00009-of-00009.bin"
    (root / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    view = TorchSaveView(str(root))
    with pytest.raises(CorruptCheckpointError, match="holds no tensor 'extra.weight'"):
        view.get_tensor("extra.weight")
    with pytest.raises(CorruptCheckpointError, match="00009-of-00009.bin: missing"):
        view.get_tensor("gone.weight")
    index["weight_map"]["evil"] = "../../etc/passwd"
    (root / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="not a relative path"):
        TorchSaveView(str(root))


def test_torch_save_to_hugging_face_and_back(tmp_path):
    truth = hf_tensors(4)
    torch.save(truth, str(tmp_path / "pytorch_model.bin"))
    view = TorchSaveView(str(tmp_path))
    report = write_hf(view, str(tmp_path / "hf"), max_shard_size=600)
    assert len(report.files) > 2  # sharded, with the index
    with anyshard.open(str(tmp_path / "hf")) as back:
        assert sorted(back.keys()) == sorted(truth)
        assert all(exact(back.get_tensor(k), t) for k, t in truth.items())
    sd, tensors, values = state(5)
    torch.save(sd, str(tmp_path / "full.pt"))
    write_hf(TorchSaveView(str(tmp_path / "full.pt")), str(tmp_path / "one.safetensors"))
    got = load_file(str(tmp_path / "one.safetensors"))
    assert sorted(got) == sorted(tensors) and all(exact(got[k], t) for k, t in tensors.items())


def test_torch_save_to_anyshard_keeps_tensors_and_values(tmp_path):
    sd, tensors, values = state(6)
    torch.save(sd, str(tmp_path / "ckpt.pt"))
    write_anyshard(TorchSaveView(str(tmp_path / "ckpt.pt")), str(tmp_path / "as"))
    with anyshard.open(str(tmp_path / "as")) as back:
        assert all(exact(back.get_tensor(k), t) for k, t in tensors.items())
        assert back.values == values


class Payload:
    """A class instance: unpickling it would have to build it."""

    def __init__(self):
        self.x = 1


class CreatesMarker:
    """Unpickling this calls open(marker, "w"): the marker proves code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("evil", ["marker", "instance"])
def test_a_file_with_other_objects_is_refused_and_builds_none_of_them(tmp_path, evil):
    marker = tmp_path / "MARKER"
    obj = CreatesMarker(str(marker)) if evil == "marker" else Payload()
    path = str(tmp_path / "pytorch_model.bin")
    torch.save({"w": torch.ones(2), "extra": obj}, path)
    with pytest.raises(CorruptCheckpointError) as e:
        TorchSaveView(path)
    assert not marker.exists()
    msg = str(e.value)
    assert path in msg and "objects other than tensors and plain containers" in msg
    assert ("open" in msg) if evil == "marker" else ("Payload" in msg)
    assert isinstance(e.value, AnyshardError)


def test_a_refused_shard_is_named_when_it_is_read(tmp_path):
    marker = tmp_path / "MARKER"
    root = tmp_path / "sharded"
    write_sharded(str(root), {"a": torch.ones(2), "b": torch.zeros(2)}, [["a"], ["b"]])
    bad = root / "pytorch_model-00002-of-00002.bin"
    torch.save({"b": torch.zeros(2), "x": CreatesMarker(str(marker))}, str(bad))
    view = TorchSaveView(str(root))
    assert exact(view.get_tensor("a"), torch.ones(2))
    with pytest.raises(CorruptCheckpointError, match="00002-of-00002.bin: holds objects other"):
        view.get_tensor("b")
    assert not marker.exists()


def test_a_legacy_format_file_is_read_whole_with_a_warning(tmp_path):
    sd, tensors, values = state(7)
    path = str(tmp_path / "old.pt")
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    with pytest.warns(UserWarning, match="legacy .* cannot be memory-mapped"):
        view = TorchSaveView(path)
    assert not view.memory_mapped
    assert all(exact(view.get_tensor(k), t) for k, t in tensors.items())
    assert exact(view.get_slice("model.emb.weight")[1:3], tensors["model.emb.weight"][1:3])
    assert view.values == values


def test_a_url_is_fetched_whole_and_read(tmp_path):
    truth = hf_tensors(8)
    root = f"memory://torchsave-{uuid.uuid4().hex}"
    local = str(tmp_path / "pytorch_model.bin")
    torch.save(truth, local)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/pytorch_model.bin", open(local, "rb").read())
    try:
        assert looks_like_torch_save(root)
        view = TorchSaveView(root)
        assert not view.memory_mapped
        assert all(exact(view.get_tensor(k), t) for k, t in truth.items())
    finally:
        fs.rm(root, recursive=True)


def test_detection_and_missing_paths(tmp_path):
    assert looks_like_torch_save("x/model.pt") and looks_like_torch_save("a.bin.index.json")
    assert not looks_like_torch_save(str(tmp_path))
    torch.save({"w": torch.ones(1)}, str(tmp_path / "pytorch_model.bin"))
    assert looks_like_torch_save(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError):
        TorchSaveView(str(tmp_path / "nothing.pt"))
    with pytest.raises(CheckpointNotFoundError):
        TorchSaveView(str(tmp_path / "nodir"))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CorruptCheckpointError, match="junk.pt: not a torch.save file"):
        TorchSaveView(str(tmp_path / "junk.pt"))
    truncated = (tmp_path / "pytorch_model.bin").read_bytes()[:200]
    (tmp_path / "cut.bin").write_bytes(truncated)
    with pytest.raises(CorruptCheckpointError, match="cut.bin: not a readable torch.save file"):
        TorchSaveView(str(tmp_path / "cut.bin"))


def test_docstring_examples_run():
    import doctest

    from anyshard.loaders import torchsave

    result = doctest.testmod(torchsave, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_anyshard_open_detects_torch_save_files_and_directories(tmp_path):
    from anyshard.loaders import TorchSaveView

    truth = {"a.weight": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    torch.save(truth, str(tmp_path / "pytorch_model.bin"))
    torch.save(truth, str(tmp_path / "model.pt"))
    for path in (tmp_path / "pytorch_model.bin", tmp_path / "model.pt", tmp_path):
        with anyshard.open(str(path)) as view:
            assert isinstance(view, TorchSaveView), path
            assert torch.equal(view.get_tensor("a.weight"), truth["a.weight"])
