"""Async save: staged at return, written and committed in the background, errors surface."""

import threading
from collections import OrderedDict

import pytest
import torch

import anyshard
from anyshard.errors import AnyshardError, SaveError


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


def _hold_background_thread():
    """Keep the save thread busy until the returned event is set (a save behind it waits)."""
    from anyshard.api import async_save as _async

    _async.submit(lambda: None).result()  # the thread exists
    _async.wait_for_previous()
    release = threading.Event()
    _async._EXECUTOR[0].submit(release.wait)
    return release


def test_deferred_staging_returns_before_the_copy_and_saves_the_values_of_that_moment(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    before = w.clone()
    release = _hold_background_thread()  # staging cannot start yet
    handle = anyshard.save(str(tmp_path / "s"), {"w": w}, async_=True, defer_staging=True)
    assert not handle.staged()  # returned before any copy
    release.set()
    assert handle.wait_staged(timeout=30)
    w.mul_(-1)  # only now may the tensors change
    handle.result()
    got = {"w": torch.empty_like(w)}
    anyshard.load(str(tmp_path / "s"), got)
    assert torch.equal(got["w"], before)


def test_a_deferred_save_plans_in_the_background_and_keeps_the_values_of_the_call(tmp_path):
    meta = {"step": 7, "lrs": [0.1, 0.2], "pair": (1, [2, 3])}
    state = {"w": torch.ones(3), "meta": meta, "opt": {"b": torch.zeros(2)}}
    release = _hold_background_thread()  # planning cannot start yet either
    handle = anyshard.save(str(tmp_path / "s"), state, async_=True, defer_staging=True)
    # the caller's containers change after the call, values and structure alike
    meta["step"], meta["lrs"][0] = 8, 9.9
    meta["pair"][1].append(4)
    meta["late"] = 1
    state["opt"]["extra"] = torch.ones(5)
    del state["w"]
    release.set()
    handle.result()
    with anyshard.open(str(tmp_path / "s")) as view:
        assert view.get_value("meta") == {"step": 7, "lrs": [0.1, 0.2], "pair": [1, [2, 3]]}
        assert sorted(view.keys()) == ["opt.b", "w"]  # the tensors
        assert torch.equal(view.get_tensor("w"), torch.ones(3))


def test_a_deferred_save_of_a_value_it_cannot_store_fails_in_the_background(tmp_path):
    handle = anyshard.save(
        str(tmp_path / "s"), {"w": torch.ones(3), "bad": {1, 2}}, async_=True, defer_staging=True
    )
    assert handle.wait_staged(timeout=30)
    with pytest.raises(AnyshardError, match="bad: a value of type set cannot be stored"):
        handle.result()
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_a_deferred_save_that_fails_to_plan_releases_the_waiters_and_raises(tmp_path):
    anyshard.save(str(tmp_path / "s"), {"w": torch.ones(3)})
    handle = anyshard.save(  # a committed path: refused while planning, in the background
        str(tmp_path / "s"), {"w": torch.zeros(3)}, async_=True, defer_staging=True
    )
    assert handle.wait_staged(timeout=30)  # an optimizer step waiting here is not stuck
    with pytest.raises(SaveError, match="committed"):
        handle.result()
    got = {"w": torch.zeros(3)}
    anyshard.load(str(tmp_path / "s"), got)
    assert torch.equal(got["w"], torch.ones(3))  # the committed checkpoint is untouched


def test_guarded_optimizer_steps_wait_for_the_staging_copy(tmp_path):
    from anyshard.trainer_integration import Checkpointer

    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(str(tmp_path), async_=True)
    ckpt.guard(opt)
    saved = []
    for step in range(1, 4):
        model(torch.randn(4, 256)).square().sum().backward()
        release = _hold_background_thread()  # staging is still pending after save returns
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        assert not ckpt._pending[0].staged()  # save returned before the copy
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
        threading.Timer(0.2, release.set).start()
        opt.step()  # the hook waits for the copy: the checkpoint keeps the values of the save
        opt.zero_grad()
    ckpt.wait()
    for step, want in enumerate(saved, 1):
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        anyshard.load(ckpt.step_path(step), {"model": got}, strict=False)
        assert all(torch.equal(got[k], want[k]) for k in want), step


def test_prepare_reserves_staging_buffers_that_the_first_save_reuses(tmp_path):
    from anyshard.api import async_save as _async
    from anyshard.trainer_integration import Checkpointer

    state = {"model": {"w": torch.ones(1000), "b": torch.zeros(10)}}
    ckpt = Checkpointer(str(tmp_path), async_=True)
    ckpt.prepare(state).result()  # reserved on the save thread
    buf = _async._STAGING["model.w"]
    assert buf.numel() * buf.element_size() == 1000 * 4
    assert _async._STAGING["model.b"].numel() * _async._STAGING["model.b"].element_size() == 40
    ckpt.save(1, state)
    ckpt.wait()
    assert _async._STAGING["model.w"] is buf


def test_copy_containers_copies_every_container_and_keeps_every_tensor():
    from anyshard.api.state import copy_containers

    class Tagged(torch.Tensor):  # a subclass, as DTensor is one
        pass

    w = torch.ones(2)
    p = torch.nn.Parameter(torch.zeros(2))
    sub = torch.ones(3).as_subclass(Tagged)
    state = {"m": {"w": w, "p": p, "s": sub}, "groups": [{"lr": 0.1, "params": [1, 2]}], "n": 3}
    state.update(betas=(0.9, 0.95), pair=([1], 2), ordered=OrderedDict(a=1), ints=[4, 5])
    for _ in range(2):  # the second time, the subclass is a type already met
        snap = copy_containers(state)
        assert snap["m"]["w"] is w and snap["m"]["p"] is p and snap["m"]["s"] is sub
        assert snap["betas"] is state["betas"]  # a tuple of scalars cannot change
        assert snap["pair"] == ([1], 2) and snap["pair"][0] is not state["pair"][0]
        assert type(snap["ordered"]) is dict and snap["ordered"] == {"a": 1}
        assert snap["ints"] == [4, 5] and snap["ints"] is not state["ints"]
        assert snap["m"] is not state["m"] and snap["groups"] is not state["groups"]
        assert snap["groups"][0] is not state["groups"][0]
        assert snap["groups"][0]["params"] is not state["groups"][0]["params"]
        state["groups"][0]["params"].append(3)
        state["m"]["w"] = torch.zeros(1)
        assert snap["groups"][0]["params"] == [1, 2] and snap["m"]["w"] is w
        state["groups"][0]["params"].pop()
        state["m"]["w"] = w
