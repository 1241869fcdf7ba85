"""Save under one parallel layout, load under every other: bit-exact against torch's own gather."""

import os

import pytest
import torch
from safetensors.torch import load_file

import anyshard
from anyshard.reshard.verify import verify_checkpoint

TASKS = os.path.join(os.path.dirname(__file__), "_layouts.py")
LAYOUTS4 = ["fsdp4", "fsdp2_tp2", "ddp2_tp2", "tp4"]


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for i, layout in enumerate(LAYOUTS4):
        ckpt, truth = str(root / layout), str(root / f"{layout}-truth")
        counts = pool4.run(TASKS, "save_task", layout, ckpt, truth, 100 + i)
        assert counts[0] > 10
        out[layout] = (ckpt, truth)
    return out


@pytest.mark.parametrize("src", LAYOUTS4)
def test_checkpoint_loads_bit_exact_under_every_4_rank_layout(pool4, saved, src):
    ckpt, truth = saved[src]
    for dst in LAYOUTS4:
        if dst != src:
            checked = pool4.run(TASKS, "load_check_task", dst, ckpt, truth, 7)
            assert min(checked) == max(checked) > 10


@pytest.mark.parametrize("src", LAYOUTS4)
def test_checkpoint_loads_bit_exact_under_tp2_on_2_processes(pool2, saved, src):
    ckpt, truth = saved[src]
    checked = pool2.run(TASKS, "load_check_task", "tp2", ckpt, truth, 7)
    assert checked[0] > 10


@pytest.mark.parametrize("src", LAYOUTS4)
def test_checkpoint_loads_in_one_process_as_plain_tensors(saved, src):
    ckpt, truth_dir = saved[src]
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    with anyshard.open(ckpt) as view:
        values = {k: None for k in view.value_keys()}
    state = {k: torch.full_like(v, -1) for k, v in truth.items()} | values
    anyshard.load(ckpt, state)
    for k, v in truth.items():
        assert torch.equal(state[k], v), k
    assert state["meta"] == {"step": 1, "layout": src}


@pytest.mark.parametrize("src", LAYOUTS4)
def test_save_stores_every_logical_element_exactly_once(saved, src):
    from safetensors import safe_open

    from anyshard.reshard.verify import verify_checkpoint

    ckpt, truth_dir = saved[src]
    report = verify_checkpoint(ckpt)
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    logical = sum(v.numel() * v.element_size() for v in truth.values())
    stored = 0
    data = os.path.join(ckpt, "data")
    for name in os.listdir(data):
        with safe_open(os.path.join(data, name), "pt") as f:
            stored += sum(
                f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
            )
    assert stored == logical == report.bytes_checked
    assert report.tensors == len(truth)


def test_replicated_tensors_are_written_by_several_ranks(saved):
    ckpt, _ = saved["ddp2_tp2"]
    data = os.path.join(ckpt, "data")
    assert len(os.listdir(data)) == 4  # replicas over dp_replicate share the writing


def test_partial_placement_is_refused_on_every_rank(pool4, tmp_path):
    out = pool4.run(TASKS, "partial_save_task", str(tmp_path / "p"))
    assert all(o.startswith("LayoutError") and "Partial" in o for o in out), out
    assert not (tmp_path / "p" / "manifest.json").exists()


def test_a_failure_on_one_rank_commits_nothing(pool4, tmp_path):
    out = pool4.run(TASKS, "one_rank_fails_task", str(tmp_path / "f"))
    assert out[1] == "AnyshardError" and {out[0], out[2], out[3]} == {"SaveError"}, out
    assert not (tmp_path / "f" / "manifest.json").exists()


def test_the_checkpointer_keeps_the_newest_steps_and_restores_under_another_layout(pool4, tmp_path):
    out = pool4.run(TASKS, "checkpointer_task", str(tmp_path / "run"), "fsdp2_tp2", "tp4")
    assert all(o == [6, ["step-000000004", "step-000000006"]] for o in out), out


def test_an_async_save_holds_the_state_as_it_was_when_save_returned(pool4, tmp_path):
    out = pool4.run(TASKS, "async_save_task", str(tmp_path / "a"), str(tmp_path / "truth"))
    assert min(out) == max(out) > 10


def test_plain_tensors_held_by_some_ranks_are_saved_once_by_a_holder(pool4, tmp_path):
    path = str(tmp_path / "stages")
    out = pool4.run(TASKS, "stage_plain_tensors_task", path)
    assert [sorted(x) for x in out] == [
        ["shared", f"stage{r // 2}.step", f"stage{r // 2}.vec"] for r in range(4)
    ]
    view = anyshard.open(path)
    assert sorted(view.keys()) == [
        "shared",
        "stage0.step",
        "stage0.vec",
        "stage1.step",
        "stage1.vec",
    ]
    assert torch.equal(view.get_tensor("stage1.vec"), torch.arange(5.0) + 1)
    assert verify_checkpoint(path).tensors == 5


def test_plain_tensors_that_differ_between_ranks_fail_the_save_naming_them(pool4, tmp_path):
    path = str(tmp_path / "d")
    out = pool4.run(TASKS, "divergent_replicas_task", path, True)
    assert len(set(out)) == 1, out  # every rank raises the same error
    message = out[0]
    assert "rng: 2 different values (ranks [0, 1]; ranks [2, 3] agree)" in message
    assert "seen: 4 different values" in message
    listed = [line.strip().split(":")[0] for line in message.splitlines() if line.startswith("  ")]
    assert listed == ["rng", "seen"], message  # the tensors that agree are not named
    assert "check_replicas=False" in message
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    path = str(tmp_path / "opt-in")
    assert pool4.run(TASKS, "divergent_replicas_task", path, False) == ["saved"] * 4
    with anyshard.open(path) as view:
        assert view.get_tensor("same").tolist() == list(range(6))
        assert view.get_tensor("rng").item() in (0, 1)
