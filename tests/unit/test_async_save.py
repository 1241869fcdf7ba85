"""Async save: staged at return, written and committed in the background, errors surface."""

import pytest
import torch

import anyshard
from anyshard.errors import SaveError


def test_tensors_changed_right_after_an_async_save_do_not_change_the_checkpoint(tmp_path):
    w = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    before = w.clone()
    handle = anyshard.save(str(tmp_path / "s1"), {"w": w, "step": 1}, async_=True)
    w.mul_(-1)  # the training step goes on
    handle.result()
    assert handle.done()
    got = {"w": torch.empty_like(w), "step": 0}
    anyshard.load(str(tmp_path / "s1"), got)
    assert torch.equal(got["w"], before) and got["step"] == 1


def test_staging_buffers_are_reused_between_saves(tmp_path):
    from anyshard.api import async_save as _async

    w = torch.ones(1000)
    anyshard.save(str(tmp_path / "a"), {"w": w}, async_=True).result()
    buf = _async._STAGING["w"]
    w.add_(1)
    anyshard.save(str(tmp_path / "b"), {"w": w}, async_=True).result()
    assert _async._STAGING["w"] is buf
    assert torch.equal(anyshard.open(str(tmp_path / "a")).get_tensor("w"), torch.ones(1000))
    assert torch.equal(anyshard.open(str(tmp_path / "b")).get_tensor("w"), torch.full((1000,), 2.0))


def test_a_failed_async_save_raises_at_result(tmp_path):
    path = str(tmp_path / "s")
    anyshard.save(path, {"w": torch.ones(2)})
    handle = anyshard.save(path, {"w": torch.zeros(2)}, async_=True)
    with pytest.raises(SaveError, match="already holds a committed checkpoint"):
        handle.result()
    anyshard.save(str(tmp_path / "next"), {"w": torch.ones(2)})  # seen once: not raised again
    assert torch.equal(anyshard.open(path).get_tensor("w"), torch.ones(2))


def test_a_failure_nobody_waited_for_surfaces_at_the_next_save(tmp_path):
    path = str(tmp_path / "s")
    anyshard.save(path, {"w": torch.ones(2)})
    anyshard.save(path, {"w": torch.zeros(2)}, async_=True)  # will fail: path committed
    with pytest.raises(SaveError, match="already holds"):
        anyshard.save(str(tmp_path / "other"), {"w": torch.ones(2)})


def test_an_async_save_of_non_contiguous_and_empty_tensors_is_exact(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    state = {"t": base.t(), "s": base[:, 1:3], "e": torch.zeros(0, 3), "z": torch.tensor(2.5)}
    want = {k: v.clone() for k, v in state.items()}
    anyshard.save(str(tmp_path / "c"), state, async_=True).result()
    with anyshard.open(str(tmp_path / "c")) as view:
        for k, v in want.items():
            assert torch.equal(view.get_tensor(k), v), k
