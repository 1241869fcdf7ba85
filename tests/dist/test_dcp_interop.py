"""PyTorch DCP checkpoints written by torch.distributed.checkpoint itself (FSDP2 x TP DTensors
on 4 ranks) read through `anyshard.open` and converted to Hugging Face safetensors: equal to
what DCP itself loads. A crafted DCP metadata file runs no code.

Run: python -m pytest tests/dist/test_dcp_interop.py -q
"""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_tasks import full
from safetensors.torch import load_file

import anyshard
from anyshard.errors import CorruptCheckpointError
from anyshard.loaders import DCPCheckpointView, convert, write_dcp, write_hf

TASKS = os.path.join(os.path.dirname(__file__), "_dcp_tasks.py")


@pytest.fixture(scope="module")
def dcp_ckpt(pool4, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step-17")
    pool4.run(TASKS, "dcp_save_task", path, 3)
    return path


def dcp_own_load(path: str) -> dict:
    state = {k: torch.zeros_like(t) for k, t in full(3).items()}
    state["step"] = 0
    dcp.load(state, checkpoint_id=path)  # one process: DCP fills whole tensors
    return state


def test_anyshard_open_reads_a_dcp_checkpoint_as_dcp_loads_it(dcp_ckpt):
    own = dcp_own_load(dcp_ckpt)
    with anyshard.open(dcp_ckpt) as view:
        assert isinstance(view, DCPCheckpointView)
        assert sorted(view.keys()) == sorted(full(3))
        for name in full(3):
            got = view.get_tensor(name)
            assert got.dtype == own[name].dtype and torch.equal(got, own[name]), name
            assert torch.equal(got, full(3)[name])
        assert torch.equal(view.get_slice("model.w")[3:7, 5], own["model.w"][3:7, 5])
        assert view.get_value("step") == own["step"] == 17
        assert view.metadata("model.w").num_shards == 4


def test_dcp_to_hugging_face_equals_dcp_own_load(dcp_ckpt, tmp_path):
    own = dcp_own_load(dcp_ckpt)
    out = str(tmp_path / "hf")
    write_hf(anyshard.open(dcp_ckpt), out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(tensors) == sorted(full(3))
    for name, t in tensors.items():
        assert torch.equal(t, own[name]), name


def test_dcp_to_anyshard_to_dcp_loads_in_dcp_under_fsdp2_x_tp(dcp_ckpt, pool4, tmp_path):
    """DCP -> anyshard (tp=2 layout) -> DCP written by `write_dcp`: torch.distributed
    .checkpoint loads it into FSDP2 x TP DTensors on 4 ranks, equal to the original."""
    spec = (
        "mesh tp;"
        '"model.w" -> "model.w" [10, 12] : chunk(1, tp);'
        '"model.emb" -> "model.emb" [13, 8] : chunk(0, tp);'
        '"model.norm" -> "model.norm" [7] : replicate(tp);'
    )
    mid = str(tmp_path / "anyshard-tp2")
    convert(dcp_ckpt, mid, to="anyshard", spec=spec, layout={"tp": 2})
    out = str(tmp_path / "dcp")
    with anyshard.open(mid) as view:
        report = write_dcp(view, out)
    assert report.num_tensors == 3 and ".metadata" in report.files
    pool4.run(TASKS, "dcp_load_task", out, 3)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_crafted_dcp_metadata_runs_no_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil").mkdir()
    with open(tmp_path / "evil" / ".metadata", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(CorruptCheckpointError, match="posix.system|os.system"):
        anyshard.open(str(tmp_path / "evil"))
    assert not (tmp_path / "PWNED").exists()
