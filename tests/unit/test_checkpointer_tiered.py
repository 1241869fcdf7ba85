"""The Checkpointer's tiered mode: save to local disk, upload to the root in the background,
restore from local disk where it is complete, else from the root (a replacement node).

Run: python -m pytest tests/unit/test_checkpointer_tiered.py -q
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from anyshard.errors import AnyshardError
from anyshard.format import steps
from anyshard.trainer_integration import Checkpointer


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 8, generator=g), "b": torch.randn(3, generator=g)},
        "meta": {"step": step},
    }


def fresh() -> dict:
    return {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(3)}, "meta": {"step": -1}}


def committed(root: str) -> list[int]:
    return [s.step for s in steps.list_steps(root) if s.committed]


def assert_state(got: dict, step: int) -> None:
    want = state_at(step)
    assert got["meta"]["step"] == step
    for k in ("w", "b"):
        assert torch.equal(got["model"][k], want["model"][k]), k


@pytest.mark.parametrize("async_", [False, True])
def test_steps_reach_the_root_and_local_disk_keeps_the_newest(tmp_path, async_):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    ckpt = Checkpointer(root, every_steps=2, keep_last=2, local_dir=local, async_=async_)
    for step in range(1, 9):
        ckpt.save(step, state_at(step))
    ckpt.wait()
    assert committed(root) == [6, 8]
    assert committed(local) == [8]  # keep_local=1

    got = fresh()
    assert Checkpointer(root, local_dir=local).restore_latest(got) == 8
    assert_state(got, 8)


def test_restore_prefers_complete_local_disk_and_falls_back_to_the_root(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    ckpt = Checkpointer(root, every_steps=1, local_dir=local, keep_local=2)
    for step in (1, 2):
        ckpt.save(step, state_at(step))
    ckpt.wait()

    reader = Checkpointer(root, local_dir=local)
    got = fresh()
    assert reader.restore_latest(got) == 2 and reader.restored_from.startswith(local)
    assert_state(got, 2)

    # a data file lost from local disk: the step is read from the root instead
    os.remove(os.path.join(local, "step-000000002", "data", "rank-00000.safetensors"))
    got = fresh()
    assert reader.restore_latest(got) == 2 and reader.restored_from.startswith(root)
    assert_state(got, 2)

    # a replacement node: no local directory at all
    shutil.rmtree(local)
    got = fresh()
    assert Checkpointer(root, local_dir=local).restore_latest(got) == 2
    assert_state(got, 2)


def test_a_step_committed_locally_but_not_uploaded_yet_restores_from_local(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    ckpt = Checkpointer(root, every_steps=1, local_dir=local, keep_local=3)
    ckpt.save(1, state_at(1))
    ckpt.wait()
    # step 2 committed on local disk; the job died before its upload
    Checkpointer(local, every_steps=1).save(2, state_at(2))
    assert committed(root) == [1] and committed(local) == [1, 2]
    got = fresh()
    reader = Checkpointer(root, local_dir=local)
    assert reader.restore_latest(got) == 2 and reader.restored_from.startswith(local)
    assert_state(got, 2)


def test_tiered_upload_to_s3_and_restore_on_a_replacement_node(tmp_path, s3):
    root, local = f"{s3}/run", str(tmp_path / "local")
    ckpt = Checkpointer(root, every_steps=3, keep_last=1, local_dir=local)
    for step in range(1, 7):
        ckpt.save(step, state_at(step))
    ckpt.wait()
    assert committed(root) == [6]
    shutil.rmtree(local)
    got = fresh()
    reader = Checkpointer(root, local_dir=local)
    assert reader.restore_latest(got) == 6 and reader.restored_from.startswith("s3://")
    assert_state(got, 6)


def test_an_upload_failure_surfaces_at_the_next_call_and_the_step_stays_local(
    tmp_path, s3_proxy, monkeypatch
):
    url = s3_proxy.bucket + "/run"
    local = str(tmp_path / "local")
    ckpt = Checkpointer(url, every_steps=1, local_dir=local, keep_local=2)
    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", "2")
    s3_proxy.always = "503"
    try:
        ckpt.save(1, state_at(1))  # returns: the upload runs in the background
        with pytest.raises(AnyshardError, match="upload of step 1"):
            ckpt.wait()
    finally:
        s3_proxy.always = None
    assert committed(local) == [1] and committed(url) == []
    got = fresh()
    assert Checkpointer(url, local_dir=local).restore_latest(got) == 1
    assert_state(got, 1)


def test_local_dir_must_be_local():
    with pytest.raises(ValueError, match="local directory"):
        Checkpointer("/tmp/x", local_dir="s3://bucket/x")
