"""What DCP's own users rely on, through `AnyshardWriter` / `AnyshardReader` in one process
(``no_dist=True``): saving over a checkpoint (``overwrite``, safely), DCP's flatten mapping
(``planner_data``) for loads that rebuild the state dict, raw ``bytes`` and ``io.BytesIO``
values, FileSystemWriter's options honoured or refused, pickling the writer and reader, loads of
some keys, and FileSystemWriter's checkpoints read without unpickling code. The truth is DCP's
own FileSystemWriter / FileSystemReader on the same state.

Run: python -m pytest tests/unit/test_dcp_writer_behaviours.py -q
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import anyshard
from anyshard.dcp import AnyshardReader, AnyshardWriter
from anyshard.dcp.writer import CheckpointExistsError
from anyshard.errors import AnyshardError, ChecksumError
from anyshard.reshard.verify import verify_checkpoint


def _state(scale: float) -> dict:
    return {
        "model": {
            "net1.weight": torch.arange(12.0).reshape(3, 4) * scale,
            "net1.bias": torch.ones(3),
        },
        "optim": {"param_groups": [{"lr": 0.1 * scale, "betas": [0.9, 0.95]}]},
        "step": int(scale),
    }


def _template() -> dict:
    return {
        "model": {"net1.weight": torch.zeros(3, 4), "net1.bias": torch.zeros(3)},
        "optim": {"param_groups": [{"lr": 0.0, "betas": [0.0, 0.0]}]},
        "step": 0,
    }


def _cause(info) -> BaseException:
    ((cause, _),) = info.value.failures.values()
    return cause


def _data_files(path) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "data")))


def _rebuilt(reader, keys=None) -> dict:
    sd: dict = {}
    _load_state_dict(
        sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True
    )
    return sd


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------- overwrite


def test_a_second_save_to_one_path_replaces_the_first_and_removes_its_files(tmp_path):
    ckpt = str(tmp_path / "latest")
    dcp.save(_state(1), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    first = _data_files(ckpt)
    dcp.save(_state(2), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    second = _data_files(ckpt)
    assert len(second) == 1 and second != first  # new names; the old file is gone
    back = _template()
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert _same(back, _state(2))
    assert verify_checkpoint(ckpt).files == 1


def test_overwrite_false_raises_as_dcp_does_and_keeps_the_checkpoint(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    dcp.save(_state(1), storage_writer=AnyshardWriter(ours), no_dist=True)
    dcp.save(_state(1), storage_writer=FileSystemWriter(theirs), no_dist=True)
    with pytest.raises(CheckpointException) as dcp_info:
        dcp.save(_state(2), storage_writer=FileSystemWriter(theirs, overwrite=False), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(2), storage_writer=AnyshardWriter(ours, overwrite=False), no_dist=True)
    assert isinstance(_cause(dcp_info), RuntimeError)
    cause = _cause(info)
    assert isinstance(cause, CheckpointExistsError) and isinstance(cause, RuntimeError)
    assert "Checkpoint already exists and self.overwrite=False" in str(cause) and ours in str(cause)
    back = _template()
    dcp.load(back, storage_reader=AnyshardReader(ours), no_dist=True)
    assert _same(back, _state(1))


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_failed_overwrite_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch, where):
    """A replacement that fails writing its data file or committing its manifest: the old
    checkpoint loads bit-exact, and the next replacement removes what the failed one left."""
    from anyshard.dcp import writer

    ckpt = str(tmp_path / "c")
    dcp.save(_state(1), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    real_write, real_commit = writer.write_datafile, writer.commit_manifest

    def write_then_fail(path, *a, **k):
        real_write(path, *a, **k)  # all the bytes are there; then the storage fails
        raise OSError(5, "Input/output error", path)

    def fail_commit(*a, **k):
        raise OSError(28, "No space left on device")

    if where == "write":
        monkeypatch.setattr(writer, "write_datafile", write_then_fail)
    else:
        monkeypatch.setattr(writer, "commit_manifest", fail_commit)
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    monkeypatch.setattr(writer, "write_datafile", real_write)
    monkeypatch.setattr(writer, "commit_manifest", real_commit)
    left = _data_files(ckpt)
    assert len(left) == (1 if where == "write" else 2), left  # a failed write keeps no file
    back = _template()
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert _same(back, _state(1))
    dcp.save(_state(3), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    assert len(_data_files(ckpt)) == 1
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert _same(back, _state(3))


def test_overwrite_keeps_the_files_a_later_incremental_step_references(tmp_path):
    root = tmp_path / "run"
    one, two = str(root / "step-000000001"), str(root / "step-000000002")
    w = torch.randn(64, 64)
    anyshard.save(one, {"w": w, "step": 1})
    anyshard.save(two, {"w": w, "step": 2}, base=one)  # references step 1's bytes of w
    assert anyshard.api.load.read_manifest(two).refs
    dcp.save({"w": w * 2, "step": 10}, storage_writer=AnyshardWriter(one), no_dist=True)
    assert "rank-00000.safetensors" in _data_files(one)  # still referenced by step 2
    back = {"w": torch.zeros(64, 64), "step": 0}
    anyshard.load(two, back)
    assert torch.equal(back["w"], w) and back["step"] == 2
    anyshard.load(one, back)
    assert torch.equal(back["w"], w * 2) and back["step"] == 10


# --------------------------------------------------------------------------- planner_data


def test_loads_that_rebuild_the_state_dict_match_filesystem_reader(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    state = _state(3)
    dcp.save(state, storage_writer=AnyshardWriter(ours), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(theirs), no_dist=True)
    want = _rebuilt(FileSystemReader(theirs))
    assert "net1.weight" in want["model"]  # nested, as saved
    assert _same(_rebuilt(AnyshardReader(ours)), want)
    for keys in ({"model"}, {"step"}, {"model.net1.bias", "optim"}):
        assert _same(_rebuilt(AnyshardReader(ours), keys), _rebuilt(FileSystemReader(theirs), keys))
    # FileSystemWriter's checkpoint through anyshard's reader: the same nesting
    assert _same(_rebuilt(AnyshardReader(theirs)), want)


def test_dcp_to_torch_save_of_an_anyshard_checkpoint(tmp_path):
    """format_utils' conversion, reading through AnyshardReader as it reads through
    FileSystemReader (it names FileSystemReader itself, so its reader is swapped in)."""
    from torch.distributed.checkpoint import format_utils

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    dcp.save(_state(2), storage_writer=AnyshardWriter(ours), no_dist=True)
    dcp.save(_state(2), storage_writer=FileSystemWriter(theirs), no_dist=True)
    format_utils.dcp_to_torch_save(theirs, str(tmp_path / "theirs.pt"))
    real = format_utils.FileSystemReader
    try:
        format_utils.FileSystemReader = AnyshardReader  # type: ignore[misc]
        format_utils.dcp_to_torch_save(ours, str(tmp_path / "ours.pt"))
    finally:
        format_utils.FileSystemReader = real  # type: ignore[misc]
    want = torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert _same(torch.load(tmp_path / "ours.pt", weights_only=True), want)


def test_a_load_of_some_keys(tmp_path):
    ckpt = str(tmp_path / "c")
    dcp.save(_state(2), storage_writer=AnyshardWriter(ckpt), no_dist=True)
    part = {"model": {"net1.bias": torch.zeros(3)}, "step": 0}
    dcp.load(part, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert torch.equal(part["model"]["net1.bias"], torch.ones(3)) and part["step"] == 2


# --------------------------------------------------------------------------- bytes


def test_bytes_and_bytesio_values_round_trip_as_bytes_without_pickle(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "c")
    blob = bytes(range(256)) * 3
    state = {"w": torch.ones(4), "rng": blob, "losses": io.BytesIO(b"\x00loss\xff"), "none": b""}
    for name in ("loads", "load", "dumps", "dump"):
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("pickle used"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load used"))
    monkeypatch.setattr(torch, "save", lambda *a, **k: pytest.fail("torch.save used"))
    dcp.save(state, storage_writer=AnyshardWriter(ckpt), no_dist=True)
    back = {"w": torch.zeros(4), "rng": b"", "losses": io.BytesIO(), "none": b"x"}
    dcp.load(back, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert back["rng"] == blob and type(back["rng"]) is bytes
    assert isinstance(back["losses"], io.BytesIO) and back["losses"].getvalue() == b"\x00loss\xff"
    assert back["none"] == b""
    manifest = anyshard.api.load.read_manifest(ckpt)
    assert manifest.byte_values == {"rng": "bytes", "losses": "BytesIO", "none": "bytes"}
    assert manifest.tensors["rng"].dtype == "U8" and manifest.tensors["rng"].shape == (768,)


def test_a_flipped_byte_of_a_bytes_value_is_a_checksum_error(tmp_path):
    ckpt = str(tmp_path / "c")
    blob = b"tokenizer" * 100
    dcp.save({"tok": blob}, storage_writer=AnyshardWriter(ckpt), no_dist=True)
    (name,) = _data_files(ckpt)
    path = os.path.join(ckpt, "data", name)
    raw = bytearray(open(path, "rb").read())
    at = raw.rindex(b"tokenizer") + 3
    raw[at] ^= 0x01
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"tok": b""}, storage_reader=AnyshardReader(ckpt), no_dist=True)
    assert isinstance(_cause(info), ChecksumError) and name in str(_cause(info))


# --------------------------------------------------------------------------- options


def test_filesystem_writer_options_are_honoured_or_refused(tmp_path):
    class Compress:  # a stream transform, as DCP's ZStandard extension is one
        pass

    with pytest.raises(AnyshardError, match="_extensions \\(Compress\\) are not supported"):
        AnyshardWriter(str(tmp_path / "a"), _extensions=[Compress()])
    with pytest.raises(AnyshardError, match="serialization_format='torch_save' is not supported"):
        AnyshardWriter(str(tmp_path / "a"), serialization_format=SerializationFormat.TORCH_SAVE)
    w = AnyshardWriter(
        str(tmp_path / "a"),
        single_file_per_rank=False,
        sync_files=False,
        thread_count=3,
        per_thread_copy_ahead=0,
        cache_staged_state_dict=True,
        serialization_format=SerializationFormat.SAFETENSORS,
    )
    assert w.threads == 3 and w.cache_staged_state_dict
    dcp.save({"w": torch.ones(3)}, storage_writer=w, no_dist=True)
    back = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=AnyshardReader(str(tmp_path / "a"), None), no_dist=True)
    assert torch.equal(back["w"], torch.ones(3))


def test_the_writer_and_reader_pickle(tmp_path):
    """DCP's process-based async save sends the writer to another process."""
    ckpt = str(tmp_path / "c")
    w = pickle.loads(pickle.dumps(AnyshardWriter(ckpt, thread_count=2, overwrite=False)))  # noqa: S301 - made here
    assert (w.path, w.threads, w.overwrite) == (ckpt, 2, False)
    dcp.save({"w": torch.arange(5.0)}, storage_writer=w, no_dist=True)
    r = pickle.loads(pickle.dumps(AnyshardReader(ckpt, verify=False)))  # noqa: S301 - made here
    back = {"w": torch.zeros(5)}
    dcp.load(back, storage_reader=r, no_dist=True)
    assert torch.equal(back["w"], torch.arange(5.0))


# --------------------------------------------------------------------------- FileSystemWriter's


def test_a_filesystem_writer_checkpoint_loads_through_the_reader(tmp_path):
    theirs = str(tmp_path / "theirs")
    state = _state(5)
    dcp.save(state, storage_writer=FileSystemWriter(theirs), no_dist=True)
    back = _template()
    dcp.load(back, storage_reader=AnyshardReader(theirs), no_dist=True)
    assert _same(back, state)
    # a value FileSystemWriter pickled as an object weights-only loading refuses
    dcp.save({"b": io.BytesIO(b"zz")}, storage_writer=FileSystemWriter(theirs + "-b"), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"b": io.BytesIO()}, storage_reader=AnyshardReader(theirs + "-b"), no_dist=True)
    assert "cannot be read without running its pickle" in str(_cause(info))


def test_gc_removes_what_a_replacement_killed_after_its_commit_left(tmp_path, monkeypatch):
    """A replacement killed between its commit and its cleanup leaves the old data files:
    `anyshard gc --stale-after` removes them once they are that old, and nothing else."""
    from anyshard.cli import main as cli
    from anyshard.dcp import writer

    root = tmp_path / "run"
    one, two = str(root / "step-000000001"), str(root / "step-000000002")
    dcp.save(_state(1), storage_writer=AnyshardWriter(one), no_dist=True)
    dcp.save(_state(1), storage_writer=AnyshardWriter(two), no_dist=True)
    monkeypatch.setattr(writer, "remove_unnamed", lambda root, files: None)  # killed
    dcp.save(_state(2), storage_writer=AnyshardWriter(one), no_dist=True)
    assert len(_data_files(one)) == 2
    assert cli(["gc", str(root), "--stale-after", "3600"]) == 0  # too young: kept
    assert len(_data_files(one)) == 2
    assert cli(["gc", str(root), "--stale-after", "0"]) == 0
    assert _data_files(one) == [n for n in _data_files(one) if n != "rank-00000.safetensors"]
    assert len(_data_files(one)) == 1 and len(_data_files(two)) == 1
    for path, want in ((one, _state(2)), (two, _state(1))):
        back = _template()
        dcp.load(back, storage_reader=AnyshardReader(path), no_dist=True)
        assert _same(back, want)
