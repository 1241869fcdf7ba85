"""What a save writes survives a crash of the machine: files, and the directory entries that
name them, are synced before the commit.

Run: python -m pytest tests/unit/test_durability.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import anyshard

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_save_syncs_every_directory_it_creates_and_the_data_directory_after_its_files(
    tmp_path, monkeypatch
):
    """A file is durable only once the directory entry naming it is: after a save, the data
    directory is synced after its file was written, and each new directory's parent after it
    was made (the manifest's own directory is synced by the commit)."""
    synced: list[tuple[str, set[str]]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(target):
            synced.append((target, set(os.listdir(target))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "root"
    path = root / "step-000000001"
    anyshard.save(str(path), {"w": torch.ones(4), "step": 1})
    data = str(path / "data")
    assert any(d == data and "rank-00000.safetensors" in names for d, names in synced), synced
    assert any(d == str(path) and "data" in names for d, names in synced), synced
    assert any(d == str(root) and "step-000000001" in names for d, names in synced), synced
    assert any(d == str(tmp_path) and "root" in names for d, names in synced), synced
