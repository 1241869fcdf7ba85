"""Megatron-Core 0.16 with anyshard checkpoints, end to end on 2 gloo ranks (CPU): a tiny
GPTModel trains 4 steps under tensor parallelism 2; after step 2 its model, Adam state, common
state and a ShardedObject per rank are saved through ``dist_checkpointing`` with anyshard's
strategies (`anyshard.dcp.megatron.save`: nothing pickled; and ``dist_checkpointing.save`` with
`AnyshardSaveStrategy`: Megatron's common.pt) and with Megatron's own ``torch_dist`` format.

- Each checkpoint resumed under tp=2 gives steps 3-4 the very losses of the uninterrupted run,
  bit for bit, as Megatron's own format does, and the weights restored are the saved ones.
- anyshard's checkpoint resumed under tp=1 x pp=2 restores every weight bit-exact against the
  tp=2 run's weights gathered at step 2 (each stage its own layers). Its losses are held to the
  tp=2 run's within 1e-5 relative, not bit for bit: tp=2 sums each row-parallel matmul's two
  halves in an all-reduce, tp=1 in one matmul, a different order of float additions.

One spawned job runs every save, load and step (Megatron's import is most of its time).

Run: python -m pytest tests/dist/test_trainer_megatron.py -q
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

import anyshard
from anyshard.cli import main as cli

# megatron-core is imported by the spawned ranks, and here only by the test that needs it: its
# import registers classes as safe for weights-only loading, process-wide (undone after each use)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="needs megatron-core"
)

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_megatron_tasks.py")


@pytest.fixture(scope="module")
def job(pool2, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron"))
    return root, pool2.run(TASKS, "run", root, timeout=300)


def test_anyshard_strategies_write_anyshard_checkpoints_and_no_pickle(job):
    root, ranks = job
    files = ranks[0]["files"]
    assert files["anyshard"] == ["data", "manifest.json", "metadata.json"]  # no common.pt
    assert files["anyshard_common_pt"] == ["common.pt", "data", "manifest.json", "metadata.json"]
    assert "common.pt" in files["torch_dist"] and ".metadata" in files["torch_dist"]
    for kind, common in (("anyshard", "anyshard"), ("anyshard_common_pt", "torch")):
        path = os.path.join(root, kind)
        with open(os.path.join(path, "metadata.json")) as f:
            config = json.load(f)
        assert config["sharded_backend"] == "anyshard" and config["common_backend"] == common
        assert cli(["verify", path]) == 0
        assert all(n.endswith(".safetensors") for n in os.listdir(os.path.join(path, "data")))


def test_resume_under_the_same_layout_is_bit_exact_as_from_megatrons_own_format(job):
    _, ranks = job
    for rank, out in enumerate(ranks):
        ref = out["losses"]
        assert len(ref) == 4
        for kind in ("anyshard", "anyshard_common_pt", "torch_dist"):
            got = out[kind]
            assert got["losses"] == ref[2:], (kind, got["losses"], ref)
            assert got["iteration"] == 2 and got["params_dtype"] == "torch.float32"
            assert got["opt_param_scheduler"] == {
                "max_lr": 1e-2,
                "num_steps": 2,
                "decay_style": "constant",
            }
            obj = got["rng_state"]
            assert obj["seed"] == 1234 + rank and tuple(obj["calls"]) == (rank, 2), kind
            assert set(got["restored"]) == set(out["weights"])
            for name, w in out["weights"].items():
                assert torch.equal(got["restored"][name], w), (kind, name)


def test_resume_as_tp1_pp2_restores_every_weight_bit_exact_and_the_losses_go_on(job):
    root, ranks = job
    names = set()
    for out in ranks:
        pp = out["tp1_pp2"]
        names |= set(pp["restored"])
        for name, w in pp["restored"].items():
            assert torch.equal(w, ranks[0]["weights"][name]), name
        for got, want in zip(pp["losses"], out["losses"][2:], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5), (pp["losses"], out["losses"])
        assert pp["iteration"] == 2
    assert names == set(ranks[0]["weights"])  # the two stages hold the model between them
    with anyshard.open(os.path.join(root, "anyshard")) as view:  # the checkpoint, read whole
        stored = view.get_tensor("embedding.word_embeddings.weight")
    assert torch.equal(stored, ranks[0]["weights"]["embedding.word_embeddings.weight"])


def test_a_value_anyshard_cannot_store_is_refused_on_every_rank_naming_it(job):
    _, ranks = job
    for out in ranks:
        assert "['opt_param_scheduler']['hook']" in out["refused"] and "object" in out["refused"]
        assert (
            "manifest.json" not in out["refused_files"]
            and "metadata.json" not in out["refused_files"]
        )
        # Megatron's own common strategy is back in its registry after the call
        assert out["common_default_after"] == "TorchCommonSaveStrategy"


def test_the_sharded_metadata_is_what_megatrons_own_strategy_reads_of_its_own_checkpoint(job):
    _, ranks = job
    got = ranks[0]["sharded_metadata"]
    assert got["anyshard"] == got["torch_dist"]
    kinds = {v[0] for v in got["anyshard"].values()}
    assert kinds == {"ShardedTensor", "ShardedObject"}, kinds


@pytest.fixture
def megatron_here():
    """anyshard.dcp.megatron imported in this process, and megatron-core's safe globals dropped
    after the test."""
    import anyshard.dcp.megatron

    yield anyshard.dcp.megatron
    sys.path.insert(0, HERE)
    try:
        from _megatron_tasks import forget_megatron_safe_globals
    finally:
        sys.path.remove(HERE)
    forget_megatron_safe_globals()


def test_the_common_state_encoding_round_trips_what_json_alone_would_lose(tmp_path, megatron_here):
    import argparse

    from anyshard.api.views import CheckpointView
    from anyshard.dcp.megatron import COMMON, _decoded, _put_encoded

    value = {
        "args": argparse.Namespace(lr=0.1, params_dtype=torch.bfloat16, sizes=(1, 2)),
        "optimizer": {"state": {3: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1}]},
        "none": None,
        "text": "#not a tensor",
    }
    pyt: dict = {}
    _put_encoded(pyt, COMMON, value, "the common state")
    assert set(pyt) == {COMMON, f"{COMMON}#0"}  # the one tensor stored as a tensor
    anyshard.save(str(tmp_path / "c"), pyt)
    back = _decoded(CheckpointView(str(tmp_path / "c")), COMMON)
    assert back["args"] == value["args"] and isinstance(back["args"].sizes, tuple)
    assert list(back["optimizer"]["state"]) == [3]  # an int key stays an int
    assert torch.equal(back["optimizer"]["state"][3]["step"], torch.tensor(5.0))
    assert {k: back[k] for k in ("none", "text")} == {"none": None, "text": "#not a tensor"}
    with pytest.raises(anyshard.AnyshardError, match=r"\['bad'\]\[0\] is a set"):
        _put_encoded({}, COMMON, {"bad": [{1, 2}]}, "the common state")
