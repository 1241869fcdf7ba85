"""Format detection tells "not this format" (nothing there, a file where a directory would be,
metadata of another format) from a failed look (access denied, an I/O error): the first makes
`anyshard.open` try the next format, the second reaches its caller as a `StorageError` naming
the path, never as "no checkpoint here".

Run: python -m pytest tests/unit/test_detectors.py -q
"""

from __future__ import annotations

import errno
import importlib
import os

import pytest

import anyshard
from anyshard.errors import CheckpointNotFoundError, StorageError
from anyshard.format import storage
from anyshard.loaders import dcp, deepspeed, hf, megatron_dist, torchsave, zarr_store

DETECTORS = {
    "deepspeed-zero": deepspeed.looks_like_deepspeed_zero,
    "deepspeed-universal": deepspeed.looks_like_deepspeed_universal,
    "megatron-torch-dist": megatron_dist.looks_like_megatron_dist,
    "huggingface": hf.looks_like_hf,
    "dcp": dcp.looks_like_dcp,
    "zarr": zarr_store.looks_like_zarr,
    "torch-save": torchsave.looks_like_torch_save,
}


class _FailingStorage:
    """`anyshard.format.storage` as one loader module sees it, where ``method`` raises
    ``error`` for paths ending in ``suffix``; every other call goes through."""

    def __init__(self, method: str, suffix: str, error: BaseException):
        self.method, self.suffix, self.error = method, suffix, error
        self.failed: list[str] = []

    def __getattr__(self, name):
        real = getattr(storage, name)
        if name != self.method:
            return real

        def failing(path, *args, **kwargs):
            if path.rstrip("/").endswith(self.suffix):
                self.failed.append(path)
                raise self.error
            return real(path, *args, **kwargs)

        return failing


def _denied(path: str) -> OSError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


def _eio(path: str) -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO), path)


def _remote_denied(path: str) -> OSError:
    """What the storage layer raises for an object store's AccessDenied (s3fs raises
    PermissionError, `retry` wraps what retrying cannot fix)."""
    try:
        raise PermissionError(errno.EACCES, "Access Denied")
    except PermissionError as e:
        try:
            raise StorageError(f"{path}: read failed: PermissionError: Access Denied") from e
        except StorageError as wrapped:
            return wrapped


# (format, loader module, storage function that fails, on paths ending in, what the error says,
# files to create so that the detectors tried before it answer "no" and this one looks)
CASES = [
    ("deepspeed-zero", "deepspeed", "listdir", "", "DeepSpeed ZeRO", {}),
    (
        "deepspeed-universal",
        "deepspeed",
        "read_bytes",
        "latest_universal",
        "DeepSpeed universal",
        {"latest_universal": "global_step1", "global_step1/readme": ""},
    ),
    ("megatron-torch-dist", "megatron_dist", "read_bytes", "metadata.json", "Megatron-core", {}),
    ("huggingface", "hf", "listdir", "", "Hugging Face", {}),
    ("dcp", "dcp", "exists", ".metadata", "DCP", {}),
    ("zarr", "zarr_store", "read_bytes", "zarr.json", "zarr", {}),
    ("torch-save", "torchsave", "listdir", "", "torch.save", {}),
]


def _make(root, files: dict[str, str]) -> str:
    root.mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


@pytest.mark.parametrize("error", [_denied, _eio, _remote_denied], ids=["EACCES", "EIO", "S3"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_failed_look_reaches_the_caller_of_anyshard_open_naming_the_path(
    case, error, tmp_path, monkeypatch
):
    fmt, module, method, suffix, says, files = case
    path = _make(tmp_path / "ckpt", files)
    # first: without the fault, the directory is no checkpoint at all
    with pytest.raises(CheckpointNotFoundError):
        anyshard.open(path)
    target = os.path.join(path, suffix) if suffix else path
    injected = error(target)
    faulty = _FailingStorage(method, suffix, injected)
    monkeypatch.setattr(importlib.import_module(f"anyshard.loaders.{module}"), "storage", faulty)
    with pytest.raises(StorageError) as got:
        anyshard.open(path)
    assert faulty.failed, f"the {fmt} detector never called storage.{method}"
    assert not isinstance(got.value, CheckpointNotFoundError)
    assert path in str(got.value) and says in str(got.value), str(got.value)
    assert got.value.__cause__ is injected
    # the detector on its own raises the same
    with pytest.raises(StorageError, match=says):
        DETECTORS[fmt](path)


def test_a_denied_read_through_the_storage_layer_is_no_answer(tmp_path, monkeypatch):
    """The real storage layer wraps the PermissionError of ``open`` in a `StorageError`; the
    first detector that reads a file (Megatron-core's ``metadata.json``) lets it through."""
    path = _make(tmp_path / "ckpt", {})
    real_open = open

    def denying_open(name, *args, **kwargs):
        if str(name).startswith(path) and not str(name).endswith("manifest.json"):
            raise _denied(str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(storage, "open", denying_open, raising=False)
    with pytest.raises(StorageError, match="Megatron-core") as got:
        anyshard.open(path)
    assert path in str(got.value) and "Permission denied" in str(got.value)
    assert isinstance(got.value.__cause__, StorageError)
    assert isinstance(got.value.__cause__.__cause__, PermissionError)


@pytest.mark.parametrize("fmt", sorted(DETECTORS))
def test_nothing_there_is_not_this_format(fmt, tmp_path):
    """A missing path, a regular file and an empty directory each answer "no"."""
    detect = DETECTORS[fmt]
    plain = tmp_path / "plain.txt"
    plain.write_text("not a checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "missing", plain, empty):
        assert detect(str(path)) is False, path


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_missing_file_behind_a_storage_error_is_not_this_format(case, tmp_path, monkeypatch):
    """A `StorageError` whose cause says the file is not there answers "no"."""
    fmt, module, method, suffix, _, files = case
    path = _make(tmp_path / "ckpt", files)
    try:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    except FileNotFoundError as e:
        try:
            raise StorageError(f"cannot read {path}: {e}") from e
        except StorageError as wrapped:
            missing = wrapped
    faulty = _FailingStorage(method, suffix, missing)
    monkeypatch.setattr(importlib.import_module(f"anyshard.loaders.{module}"), "storage", faulty)
    assert DETECTORS[fmt](path) is False
    assert faulty.failed
    with pytest.raises(CheckpointNotFoundError):
        anyshard.open(path)


@pytest.mark.parametrize(
    "fmt, files",
    [
        ("deepspeed-zero", {"latest": "../elsewhere"}),
        ("deepspeed-universal", {"latest_universal": ""}),
        ("megatron-torch-dist", {"metadata.json": "{not json"}),
        ("megatron-torch-dist", {"latest_checkpointed_iteration.txt": "release"}),
        ("zarr", {"zarr.json": "{not json"}),
    ],
)
def test_metadata_of_another_kind_is_not_this_format(fmt, files, tmp_path):
    assert DETECTORS[fmt](_make(tmp_path / "ckpt", files)) is False
