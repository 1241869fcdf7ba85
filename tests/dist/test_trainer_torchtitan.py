"""torchtitan 0.3 with anyshard checkpoints: the real trainer (llama3, two layers of dim 64, on a
generated tokenizer and corpus) on 2 gloo ranks on CPU, checkpointed through
``--override.imports anyshard.dcp.torchtitan.anyshard_checkpoint`` and, as the reference, by
torchtitan's own DCP manager. Each run saves every 2 steps and stops after step 4, as a killed
job would; a restart with the same arguments resumes.

- the anyshard checkpoints (step 2 saved with ``async_mode="async"``, step 4 too, step 6 the
  last, synchronously) verify, hold no pickle of their own, and are bit-identical to the ones
  torchtitan's DCP wrote of the same run, as DCP itself loads them;
- the restart finds the newest committed step past an interrupted save's folder and a foreign
  one (warned about, on every rank) and trains steps 5 and 6 to the same losses, bit for bit,
  as the restart from torchtitan's own checkpoints;
- a restart under tp=2 (the job ran dp_shard=2) restores the saved parameters bit for bit and
  goes on to the same losses within the cross-layout noise floor;
- the step finder, on its own: what it skips, what it warns about, what it loads.

Run: python -m pytest tests/dist/test_trainer_torchtitan.py -q
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import queue
import shutil
import sys
import types
import warnings

import pytest
import torch

pytest.importorskip("torchtitan")

import torch.distributed.checkpoint as dcp  # noqa: E402
from harness import DistPool  # noqa: E402

import anyshard  # noqa: E402
from anyshard.cli import main as cli  # noqa: E402
from anyshard.dcp.torchtitan import (  # noqa: E402
    AnyshardCheckpointManager,
    anyshard_checkpoint,
    find_load_step,
    scan_steps,
    stale_steps,
)
from anyshard.errors import AnyshardError  # noqa: E402

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_torchtitan_tasks.py")
_spec = importlib.util.spec_from_file_location("_torchtitan_tasks_main", TASKS)
tasks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tasks)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two ranks of this module's own: the CPU shims patch torch and torchtitan in them."""
    p = DistPool(2, str(tmp_path_factory.mktemp("pool-torchtitan")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory):
    """Stock DCP and anyshard (async): each trains to step 4, restarts to step 6 with the same
    arguments, and restarts from its step 4 under tp=2."""
    base = tmp_path_factory.mktemp("torchtitan")
    assets = tasks.make_assets(str(base / "assets"))
    out: dict = {"base": base}
    for name, anyshard_on, extra in (
        ("dcp", False, ()),
        ("anyshard", True, ("--checkpoint.async_mode", "async")),
    ):
        root = str(base / name)
        args = tasks.args_for(root, assets, anyshard=anyshard_on, extra=extra)
        out[name] = pool.run(TASKS, "train", args, 4, timeout=300)
        ckpt = os.path.join(root, "checkpoint")
        shutil.copytree(os.path.join(ckpt, "step-4"), str(base / f"{name}_tp/checkpoint/step-4"))
        if anyshard_on:
            os.makedirs(os.path.join(ckpt, "step-5", "data"))  # a save killed before its commit
            os.makedirs(os.path.join(ckpt, "step-7"))  # a folder of another format
            with open(os.path.join(ckpt, "step-7", "model.pt"), "wb") as f:
                f.write(b"not a checkpoint")
        out[name + "_restart"] = pool.run(TASKS, "train", args, timeout=300)
        # the same restart under tp=2; torchtitan refuses the data loader's state there
        args = tasks.args_for(
            str(base / f"{name}_tp"),
            assets,
            anyshard=anyshard_on,
            dp=1,
            tp=2,
            extra=("--checkpoint.exclude_from_loading", "dataloader"),
        )
        out[name + "_tp"] = pool.run(TASKS, "train", args, timeout=300)
    return out


def _ckpt(runs, name: str, step: int) -> str:
    return str(runs["base"] / name / "checkpoint" / f"step-{step}")


def test_the_override_swaps_in_the_anyshard_manager(runs):
    assert {r["manager"] for r in runs["dcp"]} == {"CheckpointManager"}
    assert {r["manager"] for r in runs["anyshard"]} == {"AnyshardCheckpointManager"}


@pytest.mark.parametrize("step", [2, 4, 6])
def test_checkpoints_verify_and_equal_torchtitan_s_own_bit_for_bit(runs, step):
    ours, theirs = _ckpt(runs, "anyshard", step), _ckpt(runs, "dcp", step)
    assert sorted(os.listdir(ours)) == ["data", "manifest.json"]  # no .metadata pickle
    assert cli(["verify", ours]) == 0
    loaders = [f"dataloader.dp_rank_{r}" for r in range(2)]  # torchtitan's own pickles, as bytes
    with anyshard.open(ours) as view:
        names = [n for n in view.keys() if n not in loaders]
        mine = {n: view.get_tensor(n) for n in names}
        raw = {n: view.get_tensor(n).numpy().tobytes() for n in loaders}
        values = {n: view.get_value(n) for n in ("train_state.step", "lr_scheduler.last_epoch")}
    assert any(n.startswith("optimizer.state.layers.1.") for n in names), names
    assert values == {"train_state.step": step, "lr_scheduler.last_epoch": step}
    want: dict = {n: torch.empty_like(t) for n, t in mine.items()}
    want |= dict.fromkeys(loaders, b"") | dict.fromkeys(values, 0)
    dcp.load(want, checkpoint_id=theirs, no_dist=True)  # DCP's own reader, whole tensors
    for n in names:
        assert torch.equal(mine[n], want[n]), n
    assert raw == {n: want[n] for n in loaders}
    assert values == {n: want[n] for n in values}


def test_a_restart_with_the_same_arguments_resumes_as_torchtitan_s_own(runs):
    first, again = runs["anyshard"][0], runs["anyshard_restart"][0]
    ref_first, ref_again = runs["dcp"][0], runs["dcp_restart"][0]
    assert len(first["losses"]) == 4 and first["first_step"] == 1
    assert first["losses"] == ref_first["losses"]  # the same run, bit for bit
    assert again["first_step"] == ref_again["first_step"] == 5  # resumed, not afresh
    assert len(again["losses"]) == 2
    assert again["losses"] == ref_again["losses"]  # bit for bit
    assert all(math.isfinite(x) for x in again["losses"])
    # the restart skipped the uncommitted and the foreign folder, said so on every rank, and
    # left them alone
    for rank in runs["anyshard_restart"]:
        (warning,) = rank["warnings"]
        assert "step-5 (no manifest.json" in warning and "step-7 (neither" in warning, warning
        assert "resuming from step 4" in warning
    assert [
        (s.step, s.kind) for s in scan_steps(str(runs["base"] / "anyshard" / "checkpoint"))
    ] == [
        (2, "anyshard"),
        (4, "anyshard"),
        (5, "uncommitted"),
        (6, "anyshard"),
        (7, "foreign"),
    ]


def test_a_restart_under_tp2_restores_the_saved_parameters_as_torchtitan_s_own(runs):
    out, ref = runs["anyshard_tp"][0], runs["dcp_tp"][0]
    assert out["first_step"] == ref["first_step"] == 5
    with anyshard.open(_ckpt(runs, "anyshard_tp", 4)) as view:
        assert set(out["restored"]) == set(ref["restored"])
        assert any(n.startswith("layers.1.") for n in out["restored"])
        for name, got in out["restored"].items():
            assert torch.equal(got, view.get_tensor(name)), name
            assert torch.equal(got, ref["restored"][name]), name
    # steps 5 and 6 under tp=2 as torchtitan's own restart under tp=2 has them, bit for bit
    assert len(out["losses"]) == 2 and out["losses"] == ref["losses"]


# -- the step finder on its own ---------------------------------------------------------------


def _step(root, n: int, kind: str) -> None:
    path = os.path.join(root, f"step-{n}")
    if kind == "anyshard":
        anyshard.save(path, {"w": torch.full((2,), float(n))})
    elif kind == "dcp":
        os.makedirs(path)
        open(os.path.join(path, ".metadata"), "wb").close()
    elif kind == "uncommitted":
        os.makedirs(os.path.join(path, "data"))
    else:
        os.makedirs(path)
        open(os.path.join(path, "__0_0.distcp"), "wb").close()  # DCP shards, no .metadata


def test_the_finder_takes_the_newest_committed_step_and_warns_of_newer_folders(tmp_path):
    root = str(tmp_path)
    for n, kind in [(2, "anyshard"), (3, "foreign"), (4, "anyshard"), (6, "uncommitted")]:
        _step(root, n, kind)
    os.makedirs(os.path.join(root, "step-008"))  # not torchtitan's name for step 8
    with pytest.warns(UserWarning, match=r"step-6 \(no manifest.json.*resuming from step 4"):
        assert find_load_step(root) == 4
    _step(root, 9, "foreign")
    with pytest.warns(UserWarning, match=r"step-9 \(neither an anyshard checkpoint"):
        assert find_load_step(root) == 4


def test_the_finder_loads_torchtitan_s_own_steps_and_warns_of_a_fresh_start(tmp_path):
    root = str(tmp_path)
    assert find_load_step(root + "/missing") == -1
    _step(root, 5, "uncommitted")
    with pytest.warns(UserWarning, match="training starts afresh"):
        assert find_load_step(root) == -1
    _step(root, 3, "dcp")
    with pytest.warns(UserWarning, match="resuming from step 3"):
        assert find_load_step(root) == 3
    _step(root, 7, "anyshard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_load_step(root) == 7


def test_the_module_imports_and_finds_steps_without_torchtitan(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # as if not installed
    spec = importlib.util.spec_from_file_location(
        "_anyshard_torchtitan_alone",
        os.path.join(os.path.dirname(anyshard.__file__), "dcp", "torchtitan.py"),
    )
    alone = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, alone)
    spec.loader.exec_module(alone)
    _step(str(tmp_path), 1, "anyshard")
    assert alone.find_load_step(str(tmp_path)) == 1
    with pytest.raises(ImportError):
        alone.AnyshardCheckpointManager  # noqa: B018


def test_keep_latest_k_keeps_committed_steps_past_saves_in_progress_and_foreign_folders(tmp_path):
    root = str(tmp_path)
    for n, kind in [
        (2, "anyshard"),
        (3, "uncommitted"),
        (4, "dcp"),
        (6, "anyshard"),
        (8, "uncommitted"),  # a save in progress
        (9, "foreign"),
    ]:
        _step(root, n, kind)
    # torchtitan's own purge keeps the 2 newest folders of any kind (8 and 9) and removes 6
    fake = types.SimpleNamespace(
        folder=root, keep_latest_k=2, purge_queue=queue.Queue(), _should_purge=lambda: True
    )
    AnyshardCheckpointManager._purge_stale_checkpoints(fake)
    removed = [os.path.basename(p) for p in fake.purge_queue.queue]
    assert removed == ["step-2", "step-3"]
    assert stale_steps(root, 0) == []


def test_the_override_keeps_every_setting_and_refuses_other_managers():
    from torchtitan.components.checkpointer import CheckpointManager

    ours = anyshard_checkpoint(
        CheckpointManager.Config(enable=True, interval=7, async_mode="async")
    )
    assert type(ours) is AnyshardCheckpointManager.Config
    assert (ours.enable, ours.interval, ours.async_mode) == (True, 7, "async")
    assert anyshard_checkpoint(ours) is ours

    class OtherManager(CheckpointManager):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

    with pytest.raises(AnyshardError, match="OtherManager.Config"):
        anyshard_checkpoint(OtherManager.Config())


def test_loading_a_step_without_a_commit_names_it(tmp_path):
    _step(str(tmp_path), 5, "uncommitted")
    path = str(tmp_path / "step-5")
    with pytest.raises(AnyshardError, match=r"step-5 holds no committed checkpoint"):
        AnyshardCheckpointManager.dcp_load(types.SimpleNamespace(), {}, path, False, False)
