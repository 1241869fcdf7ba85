"""The Checkpointer saves plain JSON values of the app state (``{"step": 5}``, a config dict)
as JSON values and restores them into the caller's dict.

Run: python -m pytest tests/unit/test_checkpointer_json.py -q
"""

from __future__ import annotations

import copy
import json
import os
import types

import pytest
import torch

import anyshard
from anyshard.trainer_integration import Checkpointer


class Model:
    """A Stateful holding one tensor."""

    def __init__(self, value: float):
        self.w = torch.full((2, 3), value)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])


def _plain(step: int) -> dict:
    """Every kind of JSON value, changing with the step."""
    return {
        "step": step,
        "ratio": step / 4,
        "name": f"run-{step}",
        "done": step % 2 == 0,
        "best": None if step < 4 else step - 1,
        "history": [0.5 * i for i in range(step)],
        "config": {"lr": 0.1 / step, "name": "x", "layers": [2, step], "extra": {"a": None}},
    }


def _manifest_values(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "manifest.json")) as f:
        return json.load(f)["values"]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_plain_json_values_round_trip_into_the_callers_dict(tmp_path, async_):
    root = str(tmp_path)
    ckpt = Checkpointer(root, every_steps=1, keep_last=2, async_=async_)
    saved = {}
    for step in range(1, 6):
        app = {"model": Model(float(step)), **_plain(step)}
        ckpt.save(step, app)
        saved[step] = copy.deepcopy(_plain(step))
        # a change after the save call never reaches the saved step (async: still in flight)
        app["history"].append(-1.0)
        app["config"]["lr"] = -1.0
    ckpt.wait()
    # stored as JSON values, exactly as JSON writes the originals
    values = _manifest_values(ckpt.step_path(5))
    assert values == json.loads(json.dumps(saved[5]))
    with anyshard.open(ckpt.step_path(5)) as view:
        assert view.get_value("step") == 5 and view.get_value("config") == saved[5]["config"]

    history, config = [9.0], {"stale": True}
    fresh = {"model": Model(0.0), **_plain(1), "history": history, "config": config}
    assert Checkpointer(root).restore_latest(fresh) == 5
    assert {k: v for k, v in fresh.items() if k != "model"} == saved[5]
    assert fresh["history"] is history and fresh["config"] is config  # refilled in place
    assert torch.equal(fresh["model"].w, torch.full((2, 3), 5.0))
    assert type(fresh["ratio"]) is float and type(fresh["done"]) is bool


def test_a_tuple_comes_back_as_a_tuple_and_bools_stay_bools(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"betas": (0.9, 0.95), "flags": [True, False, None], "n": 0})
    app = {"betas": (0.0, 0.0), "flags": [], "n": 7}
    assert ckpt.restore_latest(app) == 1
    assert app == {"betas": (0.9, 0.95), "flags": [True, False, None], "n": 0}
    assert type(app["betas"]) is tuple and type(app["n"]) is int


def test_values_that_are_not_json_are_refused_naming_the_entry(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    for bad, kind in (({1, 2}, "set"), (object(), "object"), ([torch.zeros(1), {2}], "list")):
        with pytest.raises(TypeError, match=rf"JSON values.*'bad' \({kind}\)"):
            ckpt.save(1, {"step": 1, "bad": bad})
    assert not os.listdir(str(tmp_path))  # refused before anything was written


def test_a_read_only_app_state_with_plain_values_is_refused_before_reading(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"step": 1, "config": {"lr": 0.1}})
    frozen = types.MappingProxyType({"step": 0, "config": {}})
    with pytest.raises(TypeError, match=r"\['step'\].*pass a dict"):
        ckpt.restore_latest(frozen)
    assert frozen["step"] == 0 and frozen["config"] == {}
    # dicts alone are updated in place: a read-only mapping of them is fine
    config: dict = {}
    assert ckpt.restore_latest(types.MappingProxyType({"config": config}), strict=False) == 1
    assert config == {"lr": 0.1}


# --- two ranks ------------------------------------------------------------------------------


def save_and_restore_on_every_rank(root: str) -> dict:
    """Run on each rank of a pool: save steps 1..3 with JSON values (the same on every rank)
    and a per-rank tensor, restore into a fresh app state."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ckpt = Checkpointer(root, keep_last=1)
    for step in (1, 2, 3):
        ckpt.save(step, {"model": Model(float(step)), **_plain(step)})
    ckpt.wait()
    fresh = {"model": Model(-1.0), **_plain(1)}
    got = Checkpointer(root).restore_latest(fresh)
    return {
        "rank": rank,
        "step": got,
        "plain": {k: v for k, v in fresh.items() if k != "model"},
        "w": fresh["model"].w.tolist(),
    }


def test_two_ranks_save_and_restore_json_values(pool2, tmp_path):
    root = str(tmp_path / "run")
    out = pool2.run(os.path.abspath(__file__), "save_and_restore_on_every_rank", root)
    want = json.loads(json.dumps(_plain(3)))
    for r, got in enumerate(out):
        assert got["rank"] == r and got["step"] == 3
        assert json.loads(json.dumps(got["plain"])) == want
        assert got["w"] == [[3.0] * 3] * 2
    assert _manifest_values(os.path.join(root, "step-000000003")) == want
