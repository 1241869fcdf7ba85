"""Damaged checkpoints: each defect raises one specific error naming the file and the likely cause,
and a failed load never changes the checkpoint's files.

Run: python -m pytest tests/unit/test_corrupt.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from sealing import header_bytes, manifest_bytes

import anyshard
import anyshard.reshard.fill
from anyshard.errors import (
    AnyshardError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    FormatVersionError,
)

DATA_FILE = os.path.join("data", "rank-00000.safetensors")
W = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
V = torch.arange(5, dtype=torch.int64)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "step-1")
    anyshard.save(path, {"w": W, "v": V, "step": 1})
    return path


@pytest.fixture
def ckpt(pristine, tmp_path) -> str:
    """A fresh copy of a good checkpoint, to damage."""
    path = str(tmp_path / "step-1")
    shutil.copytree(pristine, path)
    return path


def dest() -> dict:
    return {"w": torch.zeros(8, 16), "v": torch.zeros(5, dtype=torch.int64), "step": 0}


def files_of(path: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def fails_without_touching_files(path: str, error: type[Exception], *, action=None) -> str:
    """Run a load (or ``action``), expect ``error``, check the files are unchanged; the message."""
    before = files_of(path) if os.path.isdir(path) else None
    with pytest.raises(error) as info:
        (action or (lambda: anyshard.load(path, dest())))()
    if before is not None:
        assert files_of(path) == before
    return str(info.value)


def edit_manifest(path: str, edit) -> None:
    where = os.path.join(path, "manifest.json")
    with open(where) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(where, "wb") as f:
        f.write(manifest_bytes(manifest))


def split_data_file(path: str) -> tuple[dict, bytes]:
    with open(os.path.join(path, DATA_FILE), "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_data_file(path: str, header: dict, body: bytes) -> None:
    text = header_bytes(header)
    text += b" " * (-len(text) % 8)
    with open(os.path.join(path, DATA_FILE), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)


def flip_byte_of(path: str, fqn: str, at: int) -> None:
    """Flip one bit of byte ``at`` of the stored bytes of ``fqn``."""
    header, body = split_data_file(path)
    start = header[fqn]["data_offsets"][0]
    body = bytearray(body)
    body[start + at] ^= 0x01
    write_data_file(path, header, bytes(body))


def cut_data_file(path: str, keep: int) -> None:
    where = os.path.join(path, DATA_FILE)
    with open(where, "rb") as f:
        raw = f.read()
    with open(where, "wb") as f:
        f.write(raw[:keep])


# --- not a checkpoint ----------------------------------------------------------------------


def test_directory_without_manifest_is_not_a_committed_checkpoint(ckpt):
    os.remove(os.path.join(ckpt, "manifest.json"))  # as an interrupted save leaves it
    for action in (lambda: anyshard.load(ckpt, dest()), lambda: anyshard.open(ckpt)):
        message = fails_without_touching_files(ckpt, CheckpointNotFoundError, action=action)
        assert ckpt in message
        assert "not a committed checkpoint" in message and "interrupted save?" in message


def test_nonexistent_path_raises_checkpoint_not_found_naming_it(tmp_path):
    path = str(tmp_path / "no-such-step")
    message = fails_without_touching_files(path, CheckpointNotFoundError)
    assert path in message and "no such checkpoint" in message
    with pytest.raises(FileNotFoundError):  # also catchable as the builtin
        anyshard.open(path)
    assert not os.path.exists(path)


# --- manifest defects ----------------------------------------------------------------------


def test_unknown_manifest_format_version_says_to_upgrade(ckpt):
    edit_manifest(ckpt, lambda m: m.update(format_version=99))
    message = fails_without_touching_files(ckpt, FormatVersionError)
    assert os.path.join(ckpt, "manifest.json") in message
    assert "format_version 99" in message and "upgrade anyshard" in message


@pytest.mark.parametrize("version", ["1", True, None], ids=["string", "bool", "null"])
def test_manifest_format_version_that_is_not_an_integer_is_corrupt(ckpt, version):
    edit_manifest(ckpt, lambda m: m.update(format_version=version))
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert "manifest.json" in message and f"format_version {version!r} is not an integer" in message


@pytest.mark.parametrize(
    "text", [b"{not json", b"", b"\xff\xfe"], ids=["garbage", "empty", "binary"]
)
def test_manifest_that_is_not_json_is_corrupt(ckpt, text):
    with open(os.path.join(ckpt, "manifest.json"), "wb") as f:
        f.write(text)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert os.path.join(ckpt, "manifest.json") in message and "not valid JSON" in message


def test_manifest_of_another_format_is_rejected(ckpt):
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump({"format": "something-else", "format_version": 1}, f)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert "manifest.json" in message and "not an anyshard manifest" in message


def test_manifest_missing_a_section_is_malformed(ckpt):
    edit_manifest(ckpt, lambda m: m.pop("tensors"))
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert "manifest.json" in message and "malformed" in message and "tensors" in message


@pytest.mark.parametrize(
    ("field", "value", "cause"),
    [
        ("dtype", "F31", "dtype 'F31' is not one of"),
        ("mesh", 7, "mesh 7 does not exist"),
        ("mapping", "chunk(0,", "does not parse"),
        ("mapping", "chunk(0, tp)", "names mesh dim(s) ['tp'] that its mesh lacks"),
    ],
)
def test_malformed_tensor_entry_in_the_manifest_names_the_tensor(ckpt, field, value, cause):
    edit_manifest(ckpt, lambda m: m["tensors"]["w"].update({field: value}))
    for action in (lambda: anyshard.load(ckpt, dest()), lambda: anyshard.open(ckpt)):
        message = fails_without_touching_files(ckpt, CorruptCheckpointError, action=action)
        assert "manifest.json" in message and "'w'" in message and cause in message


@pytest.mark.parametrize(
    "name",
    [
        "../x.safetensors",
        "/etc/passwd",
        "s3://bucket/x",
        "data/../../x.safetensors",
        "./data/rank-00000.safetensors",
    ],
)
def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(ckpt, name):
    # A readable, valid data file really is there: the refusal must not depend on it missing.
    shutil.copy(os.path.join(ckpt, DATA_FILE), os.path.join(os.path.dirname(ckpt), "x.safetensors"))
    edit_manifest(ckpt, lambda m: m["files"].update({"0": name}))
    for action in (lambda: anyshard.load(ckpt, dest()), lambda: anyshard.open(ckpt)):
        message = fails_without_touching_files(ckpt, CorruptCheckpointError, action=action)
        assert (
            "manifest.json" in message
            and repr(name) in message
            and "outside the checkpoint" in message
        )


def test_manifest_without_a_data_file_for_a_needed_rank_is_corrupt(ckpt):
    edit_manifest(ckpt, lambda m: m.update(files={}))
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert ckpt in message and "no data file for rank 0" in message


# --- data file defects ---------------------------------------------------------------------


def test_missing_data_file_is_named(ckpt):
    os.remove(os.path.join(ckpt, DATA_FILE))
    for action in (
        lambda: anyshard.load(ckpt, dest()),
        lambda: anyshard.open(ckpt).get_tensor("w"),
    ):
        message = fails_without_touching_files(ckpt, CorruptCheckpointError, action=action)
        assert os.path.join(ckpt, DATA_FILE) in message and "missing" in message


@pytest.mark.parametrize("cut", [1, 4, 20], ids=lambda n: f"tail-{n}")
def test_data_file_cut_in_its_tensor_bytes_is_truncated(ckpt, cut):
    size = os.path.getsize(os.path.join(ckpt, DATA_FILE))
    cut_data_file(ckpt, size - cut)
    for action in (
        lambda: anyshard.load(ckpt, dest()),
        lambda: anyshard.open(ckpt).get_tensor("v"),
    ):
        message = fails_without_touching_files(ckpt, CorruptCheckpointError, action=action)
        assert os.path.join(ckpt, DATA_FILE) in message and "truncated" in message


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -1], ids=lambda n: f"keep-{n}")
def test_data_file_cut_inside_its_header_is_truncated(ckpt, keep):
    header_end = 8 + struct.unpack("<Q", files_of(ckpt)[DATA_FILE][:8])[0]
    cut_data_file(ckpt, keep if keep >= 0 else header_end + keep)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert (
        os.path.join(ckpt, DATA_FILE) in message and "truncated" in message and "header" in message
    )


def test_flipped_byte_raises_checksum_error_naming_the_file_and_tensor(ckpt):
    flip_byte_of(ckpt, "w", 4 * 16 * 3 + 5)
    for action in (
        lambda: anyshard.load(ckpt, dest()),
        lambda: anyshard.open(ckpt).get_tensor("w"),
    ):
        message = fails_without_touching_files(ckpt, ChecksumError, action=action)
        assert (
            os.path.join(ckpt, DATA_FILE) in message
            and "'w'" in message
            and "checksum mismatch" in message
        )


def test_flipped_byte_is_caught_when_loading_into_a_non_contiguous_or_cast_destination(ckpt):
    flip_byte_of(ckpt, "w", 0)
    for w in (torch.zeros(16, 8).t(), torch.zeros(8, 16, dtype=torch.bfloat16)):
        state = {"w": w, "v": torch.zeros(5, dtype=torch.int64), "step": 0}
        message = fails_without_touching_files(
            ckpt, ChecksumError, action=lambda s=state: anyshard.load(ckpt, s, cast=True)
        )
        assert "'w'" in message


@pytest.fixture
def reads_in_small_parts(monkeypatch):
    """Plan reads with tiny limits so that one stored shard is read in several requests."""
    plans = []
    real = anyshard.reshard.fill.plan_reads

    def plan_reads(*args, **kwargs):
        plan = real(*args, **kwargs, max_staging=128, max_request=128, max_part=128)
        plans.append(plan)
        return plan

    monkeypatch.setattr(anyshard.reshard.fill, "plan_reads", plan_reads)
    return plans


def requests_of_w(plan) -> list:
    """The requests of ``plan`` that read bytes of the stored shard of ``w``."""
    ((start, stop),) = [(a, b) for _, fqn, a, b, _ in plan.shards if fqn == "w"]
    return [r for r in plan.requests if start <= r.offset < stop]


def test_a_shard_read_in_several_parts_still_loads_bit_exact(ckpt, reads_in_small_parts):
    for w in (torch.zeros(8, 16), torch.zeros(16, 8).t()):
        state = {"w": w, "v": torch.zeros(5, dtype=torch.int64), "step": 0}
        anyshard.load(ckpt, state)
        assert torch.equal(state["w"], W)
        assert len(requests_of_w(reads_in_small_parts[-1])) >= 4


@pytest.mark.parametrize(
    "at", [0, 200, 8 * 16 * 4 - 1], ids=["first-part", "middle-part", "last-part"]
)
def test_flipped_byte_is_caught_when_a_shard_is_read_in_several_parts(
    ckpt, reads_in_small_parts, at
):
    flip_byte_of(ckpt, "w", at)
    for w in (torch.zeros(8, 16), torch.zeros(16, 8).t()):
        state = {"w": w, "v": torch.zeros(5, dtype=torch.int64), "step": 0}
        message = fails_without_touching_files(
            ckpt, ChecksumError, action=lambda s=state: anyshard.load(ckpt, s)
        )
        assert os.path.join(ckpt, DATA_FILE) in message and "'w'" in message
        assert len(requests_of_w(reads_in_small_parts[-1])) >= 4


def test_a_flipped_byte_in_one_tensor_does_not_fail_reads_of_another(ckpt):
    flip_byte_of(ckpt, "w", 7)
    with anyshard.open(ckpt) as view:
        assert torch.equal(view.get_tensor("v"), V)


@pytest.mark.parametrize(
    ("field", "value", "found"),
    [("shape", [16, 8], "F32 [16, 8]"), ("dtype", "I32", "I32 [8, 16]")],
)
def test_data_file_header_disagreeing_with_the_manifest_is_corrupt(ckpt, field, value, found):
    header, body = split_data_file(ckpt)
    header["w"][field] = value
    write_data_file(ckpt, header, body)
    for action in (
        lambda: anyshard.load(ckpt, dest()),
        lambda: anyshard.open(ckpt).get_tensor("w"),
    ):
        message = fails_without_touching_files(ckpt, CorruptCheckpointError, action=action)
        assert os.path.join(ckpt, DATA_FILE) in message
        assert "'w'" in message and "F32 [8, 16]" in message and found in message
        assert "does not belong to this manifest" in message


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["w"].update(data_offsets=[0, 8]),
        lambda h: h["w"].update(data_offsets=[0, 10**6]),
        lambda h: h["w"].update(dtype="X9"),
        lambda h: h["w"].update(shape=[-8, -16]),
        lambda h: h["w"].pop("data_offsets"),
    ],
    ids=["too-short", "too-long", "unknown-dtype", "negative-shape", "no-offsets"],
)
def test_data_file_header_entry_that_does_not_add_up_is_corrupt(ckpt, edit):
    header, body = split_data_file(ckpt)
    edit(header)
    write_data_file(ckpt, header, body)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert os.path.join(ckpt, DATA_FILE) in message and "'w'" in message and "corrupt" in message


def test_data_file_without_a_checksum_for_a_tensor_is_corrupt(ckpt):
    header, body = split_data_file(ckpt)
    meta = json.loads(header["__metadata__"]["anyshard"])
    del meta["blocks"]["w"]
    header["__metadata__"]["anyshard"] = json.dumps(meta)
    write_data_file(ckpt, header, body)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert os.path.join(ckpt, DATA_FILE) in message and "'w'" in message


@pytest.mark.parametrize(
    "header",
    [[], {"w": 1}, {"__metadata__": {}}],
    ids=["list", "no-metadata", "no-anyshard-metadata"],
)
def test_a_safetensors_file_not_written_by_anyshard_is_rejected(ckpt, header):
    write_data_file(ckpt, header, b"")
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert os.path.join(ckpt, DATA_FILE) in message and "not an anyshard data file" in message


def test_unknown_data_file_format_version_says_to_upgrade(ckpt):
    header, body = split_data_file(ckpt)
    meta = json.loads(header["__metadata__"]["anyshard"])
    header["__metadata__"]["anyshard"] = json.dumps({**meta, "format_version": 9})
    write_data_file(ckpt, header, body)
    message = fails_without_touching_files(ckpt, FormatVersionError)
    assert (
        os.path.join(ckpt, DATA_FILE) in message
        and "format_version 9" in message
        and "upgrade" in message
    )


def test_implausible_header_size_is_corrupt(ckpt):
    body = files_of(ckpt)[DATA_FILE][8:]
    with open(os.path.join(ckpt, DATA_FILE), "wb") as f:
        f.write(struct.pack("<Q", 2**40) + body)
    message = fails_without_touching_files(ckpt, CorruptCheckpointError)
    assert os.path.join(ckpt, DATA_FILE) in message and "header size" in message


def test_every_corruption_error_is_an_anyshard_error():
    for error in (
        CheckpointNotFoundError,
        CorruptCheckpointError,
        ChecksumError,
        FormatVersionError,
    ):
        assert issubclass(error, AnyshardError)


@pytest.fixture
def memory_ckpt(request):
    """A good checkpoint on fsspec's in-memory filesystem (a URL path), removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/anyshard-test-corrupt/{request.node.name}"
    anyshard.save(f"memory://{root}", {"w": W, "v": V, "step": 1})
    yield fs, root
    fs.rm(root, recursive=True)


def test_missing_or_truncated_data_file_behind_a_url_is_reported_like_a_local_one(memory_ckpt):
    fs, root = memory_ckpt
    data = f"{root}/data/rank-00000.safetensors"
    raw = fs.cat_file(data)
    fs.pipe_file(data, raw[:-3])
    with pytest.raises(
        CorruptCheckpointError, match=r"rank-00000\.safetensors: data file is truncated"
    ):
        anyshard.load(f"memory://{root}", dest())
    fs.rm(data)
    with pytest.raises(
        CorruptCheckpointError, match=r"rank-00000\.safetensors: data file is missing"
    ):
        anyshard.load(f"memory://{root}", dest())
