"""torch.distributed.checkpoint with anyshard's storage backends: `AnyshardWriter` saves FSDP2 x
TP training state (model and AdamW) as an anyshard checkpoint, with no pickle; `AnyshardReader`
loads it into tp=4, dp_shard=4 and one process bit-exact (torch's own full tensors are the
truth), reads only the bytes the target holds, loads a checkpoint saved by `anyshard.save` under
a UCL spec, and refuses a flipped bit.

Run: python -m pytest tests/dist/test_dcp_backend.py -q
"""

from __future__ import annotations

import os
import re
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

import anyshard
from anyshard.cli import main as cli
from anyshard.dcp import AnyshardReader, AnyshardWriter
from anyshard.errors import AnyshardError, ChecksumError

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_dcp_backend_tasks.py")
UCL_TASKS = os.path.join(HERE, "_ucl_tasks.py")


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-backend")
    ckpt, truth = str(root / "step-1"), str(root / "truth")
    files = pool4.run(TASKS, "dcp_save_task", "fsdp2_tp2", ckpt, truth, 3)
    return ckpt, truth, files[0]


def test_the_writer_writes_an_anyshard_checkpoint_and_no_pickle(saved):
    ckpt, truth, files = saved
    assert "manifest.json" in files and ".metadata" not in files
    assert all(f == "manifest.json" or f.endswith(".safetensors") for f in files), files
    assert cli(["verify", ckpt]) == 0
    with anyshard.open(ckpt) as view:
        for k, t in load_file(os.path.join(truth, "truth.safetensors")).items():
            assert torch.equal(view.get_tensor(k), t), k
        # DCP's flattened names: the nested "meta" dict's leaves, the param groups as one value
        assert view.get_value("meta.step") == 1
        assert view.get_value("optim.param_groups.0.lr") == 0.01


@pytest.mark.parametrize("layout", ["tp4", "fsdp4"])
def test_dcp_load_through_the_reader_is_bit_exact_and_reads_only_what_it_needs(
    pool4, saved, layout
):
    ckpt, truth, _ = saved
    out = pool4.run(TASKS, "dcp_load_task", layout, ckpt, truth, 3)
    for rank, io in enumerate(out):
        # the manifest and the data-file headers come on top of the target's bytes
        assert io["read"] <= 1.05 * io["needed"] + 64 * 1024, (rank, io)


def test_dcp_async_save_writes_the_state_of_the_call(pool4, tmp_path):
    ckpt = str(tmp_path / "step-2")
    checked = pool4.run(TASKS, "dcp_async_save_task", "fsdp2_tp2", ckpt, 4)
    assert all(n > 0 for n in checked), checked
    assert cli(["verify", ckpt]) == 0
    assert not os.path.exists(os.path.join(ckpt, ".metadata"))


def test_dcp_async_save_in_dcp_s_background_process(tmp_path):
    """AsyncCheckpointerType.PROCESS: the writer travels to DCP's own process and saves there."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = str(tmp_path / "step-3")
    script = os.path.join(HERE, "_dcp_process_async.py")
    out = subprocess.run(
        [sys.executable, script, ckpt, str(port)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    oks = sorted(re.findall(r"rank (\d+) ok (\d+)", out.stdout))
    assert [r for r, _ in oks] == ["0", "1"], out.stdout
    assert all(int(n) > 0 for _, n in oks)
    assert cli(["verify", ckpt]) == 0


@pytest.mark.parametrize("kind", ["chunk", "enum"])
def test_several_chunks_of_a_tensor_on_one_rank(pool2, tmp_path, kind):
    out = pool2.run(TASKS, "several_chunks_task", str(tmp_path / kind), kind)
    files = out[0]["files"]
    # each rank's second chunk of the tensor in a data file of its own
    if kind == "chunk":
        assert out[0]["held"] == out[1]["held"] == 2
        assert files == [
            "rank-00000-1.safetensors",
            "rank-00000.safetensors",
            "rank-00001-1.safetensors",
            "rank-00001.safetensors",
        ], files
    else:
        assert [r["held"] for r in out] == [3, 1], out
        assert files == [
            "rank-00000-1.safetensors",
            "rank-00000-2.safetensors",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ], files
    assert cli(["verify", str(tmp_path / kind)]) == 0


def test_the_reader_reads_each_region_once_per_job(pool4, tmp_path):
    """Targets replicated over dp=2, and w split by columns: read per rank, the job reads the
    stored bytes twice (a column split reads whole row blocks); read once, once."""
    out = pool4.run(TASKS, "read_once_task", str(tmp_path / "c"))
    stored = (512 * 256 + 4096) * 4
    each, once = sum(r["each"] for r in out), sum(r["once"] for r in out)
    assert each >= 2 * stored, (out, stored)
    assert stored <= once <= 1.02 * stored, (out, stored)
    # spread by stored shards: w's column halves share every stored shard (one reader); b's
    # halves share none (two more)
    assert sum(r["once"] > 0 for r in out) == 3, out


def test_dcp_load_in_one_process(saved):
    ckpt, truth, _ = saved
    from _dcp_backend_tasks import one_process_load

    assert one_process_load(ckpt, truth) > 10


def test_dcp_load_of_a_checkpoint_saved_under_a_ucl_spec(pool4, tmp_path):
    ckpt = str(tmp_path / "megatron")
    pool4.run(UCL_TASKS, "save_megatron", ckpt, 5, {"tp": 2, "pp": 2})
    assert all(n > 0 for n in pool4.run(TASKS, "spec_dcp_load_task", ckpt, 5))


def _cause(info) -> BaseException:
    """The error one rank raised inside DCP, which wraps each rank's error."""
    ((cause, _),) = info.value.failures.values()
    return cause


def _flip_a_data_bit(ckpt: str) -> None:
    name = os.path.join(ckpt, "data", sorted(os.listdir(os.path.join(ckpt, "data")))[0])
    with open(name, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + 5)
        b = f.read(1)
        f.seek(8 + n + 5)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_bit_is_a_checksum_error(tmp_path):
    ckpt = str(tmp_path / "c")
    state = {"w": torch.randn(64, 32), "b": torch.randn(32), "step": 3}
    dcp.save(state, storage_writer=AnyshardWriter(ckpt), no_dist=True)
    back = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "step": 0}
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    _flip_a_data_bit(ckpt)
    with pytest.raises(CheckpointException) as info:
        dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    cause = _cause(info)
    assert isinstance(cause, ChecksumError) and "rank-00000.safetensors" in str(cause), cause
    with pytest.raises(ChecksumError):
        anyshard.open(ckpt).get_tensor("w")


def test_a_value_json_cannot_hold_is_refused_naming_it(tmp_path):
    ckpt = str(tmp_path / "c")
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            {"w": torch.ones(2), "extra": {1, 2}},
            storage_writer=AnyshardWriter(ckpt),
            no_dist=True,
        )
    assert isinstance(_cause(info), AnyshardError)
    assert str(_cause(info)).startswith("extra: a value of type set cannot be stored")
    assert not os.path.exists(os.path.join(ckpt, "manifest.json"))


def test_the_writer_replaces_a_committed_checkpoint_unless_told_not_to(tmp_path):
    ckpt = str(tmp_path / "c")
    anyshard.save(ckpt, {"w": torch.ones(2)})
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            {"w": torch.ones(2) * 2},
            storage_writer=AnyshardWriter(ckpt, overwrite=False),
            no_dist=True,
        )
    assert "Checkpoint already exists and self.overwrite=False" in str(_cause(info))
    assert torch.equal(anyshard.open(ckpt).get_tensor("w"), torch.ones(2))
    dcp.save({"w": torch.ones(2) * 2}, storage_writer=AnyshardWriter(ckpt), no_dist=True)
    assert torch.equal(anyshard.open(ckpt).get_tensor("w"), torch.ones(2) * 2)


def test_no_pickle_on_either_path(tmp_path, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    ckpt = str(tmp_path / "c")
    state = {"w": torch.randn(8, 4), "nested": {"lr": 0.1, "betas": [0.9, 0.95]}}
    for name in ("loads", "load", "dumps", "dump"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch, "save", refuse)
    dcp.save(state, storage_writer=AnyshardWriter(ckpt), no_dist=True)
    back = {"w": torch.zeros(8, 4), "nested": {"lr": 0.0, "betas": [0.0, 0.0]}}
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["nested"] == state["nested"]


def test_the_reader_needs_a_committed_checkpoint(tmp_path):
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(2)}, storage_reader=AnyshardReader(str(tmp_path)), no_dist=True)
    assert "not a committed checkpoint (no manifest.json)" in str(_cause(info))
    with pytest.raises(AnyshardError, match="needs the checkpoint's path"):
        AnyshardReader().read_metadata()


def test_the_reader_reads_only_the_regions_the_target_holds(pool4, tmp_path):
    out = pool4.run(TASKS, "big_save_load_task", str(tmp_path / "big"))
    for rank, io in enumerate(out):
        assert io["needed"] == 256 * 1024
        # a quarter of each stored shard, whole checksum blocks, plus manifest and headers
        assert io["read"] <= 1.05 * io["needed"] + 16 * 1024, (rank, io)
