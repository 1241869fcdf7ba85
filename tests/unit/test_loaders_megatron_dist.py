"""Megatron-core torch_dist checkpoints, written by the real library (committed fixtures, made by
tests/fixtures/make_megatron.py with megatron-core 0.16.1 and, for the distributed optimizer's
flattened shards, 0.13.1), read as logical tensors and values and converted to Hugging Face.

Run: python -m pytest tests/unit/test_loaders_megatron_dist.py -q
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import anyshard
from anyshard.errors import AnyshardError, CorruptCheckpointError
from anyshard.loaders import write_anyshard, write_hf
from anyshard.loaders.megatron_dist import (
    MegatronDistView,
    flat_range_boxes,
    looks_like_megatron_dist,
)

FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron_torch_dist"
)
KINDS = ["tp2", "flat"]


def fixture(kind):
    path = os.path.join(FIXTURES, kind)
    with open(os.path.join(path, "truth.json")) as f:
        values = json.load(f)["values"]
    return path, load_file(os.path.join(path, "truth.safetensors")), values


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def boxes(shape, limit=4):
    """Sub-boxes of ``shape``: every (lo, hi) per dim with hi - lo >= 1, sampled."""
    per_dim = [[(lo, hi) for lo in range(n) for hi in range(lo + 1, n + 1)] for n in shape]
    g = torch.Generator().manual_seed(len(shape))
    every = list(itertools.product(*per_dim))
    picks = torch.randperm(len(every), generator=g)[: 60 * limit].tolist()
    return [every[i] for i in picks]


@pytest.mark.parametrize("kind", KINDS)
def test_the_megatron_checkpoint_reads_bit_exactly(kind):
    path, truth, values = fixture(kind)
    assert looks_like_megatron_dist(path)
    with MegatronDistView(path) as view:
        assert view.format == "megatron-torch-dist"
        assert view.config["sharded_backend"] == "torch_dist"
        assert sorted(view.keys()) == sorted(truth)
        for name, t in truth.items():
            assert exact(view.get_tensor(name), t), name
            m = view.metadata(name)
            assert (m.shape, m.dtype) == (tuple(t.shape), t.dtype)
        assert view.values == values and sorted(view.value_keys()) == sorted(values)
        assert view.iteration == 100
        assert view.skipped == {"params_dtype": "a dtype, neither a tensor nor a JSON value"}


def test_region_reads_of_sharded_stacked_and_replicated_tensors():
    path, truth, _ = fixture("tp2")
    view = MegatronDistView(path)
    emb = truth["embedding.word_embeddings.weight"]  # rows split over tp
    assert exact(view.get_slice("embedding.word_embeddings.weight")[1:3], emb[1:3])
    assert exact(view.get_slice("embedding.word_embeddings.weight")[3:5, 2], emb[3:5, 2])
    proj = truth["decoder.layers.self_attention.linear_proj.weight"]  # layers stacked, cols split
    name = "decoder.layers.self_attention.linear_proj.weight"
    assert exact(view.get_slice(name)[1:3], proj[1:3])
    assert exact(view.get_slice(name)[1, :, 3:6], proj[1, :, 3:6])
    out = view.get_slice("output_layer.weight")[2:7]
    assert out.dtype == torch.bfloat16 and exact(out, truth["output_layer.weight"][2:7])
    ln = truth["decoder.final_layernorm.weight"]  # replicated: stored once
    assert view.metadata("decoder.final_layernorm.weight").num_shards == 1
    assert exact(view.get_slice("decoder.final_layernorm.weight")[1:3], ln[1:3])


@pytest.mark.parametrize(
    "name",
    [
        "optimizer.state.exp_avg.embedding.word_embeddings.weight",
        "optimizer.state.fp32_param.decoder.layers.self_attention.linear_proj.weight",
        "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight",
    ],
)
def test_flattened_optimizer_shards_read_as_the_original_tensor(name):
    path, truth, _ = fixture("flat")
    view = MegatronDistView(path)
    t = truth[name]
    # the shards' regions tile the tensor exactly once
    count = torch.zeros(t.shape, dtype=torch.int32)
    for shard in view.metadata(name).shards:
        for box in shard.regions:
            count[tuple(slice(lo, hi) for lo, hi in box)] += 1
    assert bool((count == 1).all())
    for box in boxes(tuple(t.shape)):
        got = view.read_region(name, box)
        assert exact(got, t[tuple(slice(lo, hi) for lo, hi in box)]), box
    assert exact(view.get_slice(name)[1:3], t[1:3])


def test_flat_range_boxes_are_contiguous_runs_that_tile_the_range():
    for shape in [(3, 4, 5), (2, 3), (7,), (1, 1, 6), (2, 0, 3), ()]:
        n = 1
        for s in shape:
            n *= s
        order = torch.arange(n).view(shape)
        for lo in range(n + 1):
            for hi in range(lo, n + 1):
                hit = torch.zeros(shape, dtype=torch.int64)
                for box, start in flat_range_boxes(lo, hi, shape):
                    part = tuple(slice(a, b) for a, b in box)
                    run = order[part].reshape(-1)
                    assert torch.equal(run, torch.arange(start, start + run.numel()))
                    hit[part] += 1
                want = ((order >= lo) & (order < hi)).long()
                assert torch.equal(hit, want), (shape, lo, hi)


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_to_hugging_face_and_back(tmp_path, kind):
    path, truth, values = fixture(kind)
    write_hf(MegatronDistView(path), str(tmp_path / "hf"), max_shard_size=400)
    with anyshard.open(str(tmp_path / "hf")) as back:
        assert sorted(back.keys()) == sorted(truth)
        assert all(exact(back.get_tensor(k), t) for k, t in truth.items())
    write_anyshard(MegatronDistView(path), str(tmp_path / "as"))
    with anyshard.open(str(tmp_path / "as")) as back:
        assert all(exact(back.get_tensor(k), t) for k, t in truth.items())
        assert back.values == values


def copy_fixture(tmp_path, kind="tp2"):
    src, truth, values = fixture(kind)
    dst = tmp_path / "run" / "iter_0000100"
    shutil.copytree(src, dst)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("100")
    return tmp_path / "run", dst, truth


def test_a_megatron_lm_run_root_opens_its_latest_iteration(tmp_path):
    root, _, truth = copy_fixture(tmp_path)
    assert looks_like_megatron_dist(str(root))
    view = MegatronDistView(str(root))
    assert view.path.endswith("iter_0000100") and view.iteration == 100
    assert all(exact(view.get_tensor(k), t) for k, t in truth.items())


def test_a_common_pt_with_args_is_skipped_with_a_warning_and_tensors_still_read(tmp_path):
    _, ckpt, truth = copy_fixture(tmp_path)
    args = argparse.Namespace(hidden_size=6, num_layers=3)
    torch.save({"args": args, "iteration": 5}, str(ckpt / "common.pt"))
    with pytest.warns(UserWarning, match="common.pt: holds objects other than tensors"):
        view = MegatronDistView(str(ckpt))
    assert "Namespace" in view.skipped["common.pt"]
    assert view.iteration is None and sorted(view.value_keys()) == [
        "rng_state/shard_0_2",
        "rng_state/shard_1_2",
    ]
    assert all(exact(view.get_tensor(k), t) for k, t in truth.items())


class CreatesMarker:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_hostile_common_pt_runs_no_code(tmp_path):
    _, ckpt, truth = copy_fixture(tmp_path)
    marker = tmp_path / "MARKER"
    torch.save({"iteration": 1, "x": CreatesMarker(str(marker))}, str(ckpt / "common.pt"))
    with pytest.warns(UserWarning, match="common.pt"):
        view = MegatronDistView(str(ckpt))
    assert not marker.exists()
    assert exact(view.get_tensor("output_layer.weight"), truth["output_layer.weight"])


def test_common_tensors_are_tensors_and_clashing_names_are_refused(tmp_path):
    _, ckpt, truth = copy_fixture(tmp_path)
    extra = torch.arange(6.0).reshape(2, 3)
    torch.save({"iteration": 3, "buffers": {"alibi": extra}}, str(ckpt / "common.pt"))
    view = MegatronDistView(str(ckpt))
    assert "buffers.alibi" in view.keys() and exact(view.get_slice("buffers.alibi")[1:], extra[1:])
    assert view.metadata("buffers.alibi").shards[0].file == "common.pt"
    torch.save({"output_layer.weight": 1}, str(ckpt / "common.pt"))
    with pytest.raises(CorruptCheckpointError, match="both name output_layer.weight"):
        MegatronDistView(str(ckpt))


def test_other_backends_and_missing_files_are_named(tmp_path):
    _, ckpt, _ = copy_fixture(tmp_path)
    config = json.loads((ckpt / "metadata.json").read_text())
    (ckpt / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    assert looks_like_megatron_dist(str(ckpt))
    with pytest.raises(AnyshardError, match="'zarr'.*'torch_dist' checkpoints only"):
        MegatronDistView(str(ckpt))
    (ckpt / "metadata.json").write_text(json.dumps(config))
    (ckpt / "common.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match="common.pt: missing"):
        MegatronDistView(str(ckpt))
    (ckpt / "metadata.json").unlink()
    assert not looks_like_megatron_dist(str(ckpt))
    assert not looks_like_megatron_dist(str(tmp_path / "nowhere"))


def test_docstring_examples_run():
    import doctest

    from anyshard.loaders import megatron_dist

    result = doctest.testmod(megatron_dist, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("kind", KINDS)
def test_anyshard_open_detects_megatron_torch_dist(kind):
    path, truth, _ = fixture(kind)
    with anyshard.open(path) as view:
        assert isinstance(view, MegatronDistView)
        name = sorted(truth)[0]
        assert exact(view.get_tensor(name), truth[name])
