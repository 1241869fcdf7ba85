"""The Checkpointer, step listing and debris removal, and `anyshard ls` / `anyshard gc`.

Run: python -m pytest tests/unit/test_checkpointer.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch
from cli_runner import cli

import anyshard
from anyshard.cli import main
from anyshard.format import steps, storage
from anyshard.trainer_integration import Checkpointer


class Toy:
    """A Stateful: tensors of several dtypes (a non-contiguous one too) and a step counter."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(4, 6, generator=g)
        self.half = torch.randn(3, generator=g).to(torch.bfloat16)
        self.t = torch.randn(5, 2, generator=g).t()  # non-contiguous
        self.counter = 0

    def train_step(self):
        self.w.mul_(1.5).add_(0.25)
        self.half.add_(1)
        self.t.sub_(0.5)
        self.counter += 1

    def state_dict(self):
        return {"w": self.w, "half": self.half, "t": self.t, "counter": self.counter}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])
        self.half.copy_(sd["half"])
        self.t.copy_(sd["t"])
        self.counter = sd["counter"]


def _train(root: str, num_steps: int = 10) -> tuple[Toy, dict, dict]:
    """Steps 1..num_steps, saving every 2 with keep_last=2, keep_every=4; the state at each save."""
    toy, extra = Toy(0), {"lr": 0.1, "bias": torch.zeros(2)}
    ckpt = Checkpointer(root, every_steps=2, keep_last=2, keep_every=4)
    saved = {}
    for step in range(1, num_steps + 1):
        toy.train_step()
        extra["lr"] *= 0.5
        extra["bias"] += 1
        did = ckpt.save(step, {"model": toy, "extra": extra})
        assert did == (step % 2 == 0)
        if did:
            saved[step] = {
                k: v.clone() if torch.is_tensor(v) else v for k, v in toy.state_dict().items()
            }
    ckpt.wait()  # retention runs in the background after each commit
    return toy, extra, saved


def _assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _step_numbers(root: str) -> list[tuple[int, bool]]:
    return [(s.step, s.committed) for s in steps.list_steps(root)]


def _crash_debris(root: str, step: int) -> str:
    """A crashed save: the step directory with a data file, but no manifest."""
    path = storage.join(root, steps.step_dir_name(step))
    storage.makedirs(storage.join(path, "data"))
    storage.write_bytes_atomic(storage.join(path, "data", "rank-00000.safetensors"), b"x" * 100)
    return path


def test_retention_keeps_the_newest_two_and_every_multiple_of_four(tmp_path):
    _train(str(tmp_path))
    assert _step_numbers(str(tmp_path)) == [(4, True), (8, True), (10, True)]


def test_restore_latest_into_a_fresh_object_is_bit_exact_and_returns_the_step(tmp_path):
    toy, extra, saved = _train(str(tmp_path))
    fresh, fresh_extra = Toy(1), {"lr": 0.0, "bias": torch.zeros(2)}
    got = Checkpointer(str(tmp_path)).restore_latest({"model": fresh, "extra": fresh_extra})
    assert got == 10
    for name in ("w", "half", "t"):
        _assert_bit_exact(getattr(fresh, name), saved[10][name])
    assert fresh.counter == 10
    assert fresh_extra["lr"] == extra["lr"]
    _assert_bit_exact(fresh_extra["bias"], extra["bias"])


def test_restore_latest_returns_none_and_touches_nothing_when_no_step_is_committed(tmp_path):
    _crash_debris(str(tmp_path), 3)
    fresh = Toy(1)
    before = fresh.w.clone()
    assert Checkpointer(str(tmp_path)).restore_latest({"model": fresh}) is None
    assert Checkpointer(str(tmp_path / "missing")).restore_latest({"model": fresh}) is None
    assert torch.equal(fresh.w, before)


def test_an_uncommitted_step_newer_than_the_latest_commit_is_ignored_and_kept(tmp_path):
    root = str(tmp_path)
    _, _, saved = _train(root)
    crashed = _crash_debris(root, 12)
    fresh = Toy(1)
    assert (
        Checkpointer(root).restore_latest(
            {"model": fresh, "extra": {"lr": 0.0, "bias": torch.zeros(2)}}
        )
        == 10
    )
    _assert_bit_exact(fresh.w, saved[10]["w"])
    assert steps.remove_debris(root) == []
    assert storage.exists(crashed)


def test_an_uncommitted_step_older_than_the_latest_commit_is_removed_by_gc(tmp_path):
    root = str(tmp_path)
    _train(root)
    old, new = _crash_debris(root, 9), _crash_debris(root, 12)
    os.makedirs(tmp_path / "not-a-step")
    assert steps.remove_debris(root, dry_run=True) == [old]
    assert storage.exists(old)
    assert steps.remove_debris(root) == [old]
    # gone from the listing (a filer-backed store may list an empty folder for a while)
    assert old not in [s.path for s in steps.list_steps(root)] and storage.exists(new)
    assert (tmp_path / "not-a-step").is_dir()
    assert _step_numbers(root) == [(4, True), (8, True), (10, True), (12, False)]


def _age(path: str, seconds: float) -> None:
    """Make everything under ``path`` look last written ``seconds`` ago."""
    then = time.time() - seconds
    for d, _, names in os.walk(path):
        for n in [*names, "."]:
            os.utime(os.path.join(d, n), (then, then))


def test_newer_debris_untouched_for_stale_after_is_removed_and_a_fresh_one_kept(tmp_path):
    root = str(tmp_path)
    _train(root)
    killed, in_progress = _crash_debris(root, 12), _crash_debris(root, 14)
    _age(killed, 7200)
    assert steps.remove_debris(root) == []  # newer than the newest commit: left by default
    assert steps.remove_debris(root, stale_after_s=3600, dry_run=True) == [killed]
    r = _cli("gc", root, "--stale-after", "3600")
    assert r.returncode == 0, r.stderr
    assert f"removed {killed}" in r.stdout and "untouched for 3600 s" in r.stdout
    assert not os.path.exists(killed) and os.path.isdir(in_progress)
    # a root with no commit at all: only the stale step goes
    bare = str(tmp_path / "bare")
    old, fresh = _crash_debris(bare, 3), _crash_debris(bare, 5)
    _age(old, 7200)
    assert steps.remove_debris(bare, stale_after_s=3600) == [old]
    assert storage.exists(fresh)


def test_anyshard_gc_stale_after_takes_seconds_only(tmp_path, capsys):
    for bad in ("soon", "-5", "nan"):
        with pytest.raises(SystemExit) as e:
            main(["gc", str(tmp_path), "--stale-after", bad])
        assert e.value.code == 2
        assert "--stale-after" in capsys.readouterr().err


def test_the_next_save_removes_older_debris_but_never_newer(tmp_path):
    root = str(tmp_path)
    ckpt = Checkpointer(root, every_steps=1)
    state = {"m": {"w": torch.ones(3)}}
    ckpt.save(1, state)
    _crash_debris(root, 2)
    _crash_debris(root, 5)
    ckpt.save(3, state)
    ckpt.wait()
    assert _step_numbers(root) == [(1, True), (3, True), (5, False)]


def test_a_save_at_a_step_with_debris_of_a_crashed_attempt_replaces_it(tmp_path):
    root = str(tmp_path)
    path = _crash_debris(root, 4)
    storage.write_bytes_atomic(storage.join(path, "data", "rank-00007.safetensors"), b"junk")
    ckpt = Checkpointer(root)
    ckpt.save(4, {"m": {"w": torch.arange(3.0)}})
    assert storage.listdir(storage.join(path, "data")) == ["rank-00000.safetensors"]
    state = {"m": {"w": torch.zeros(3)}}
    assert ckpt.restore_latest(state) == 4
    assert torch.equal(state["m"]["w"], torch.arange(3.0))


def test_list_steps_reports_sizes_and_ignores_other_names(tmp_path):
    root = str(tmp_path)
    anyshard.save(storage.join(root, "step-000000007"), {"w": torch.zeros(256)})
    _crash_debris(root, 9)
    (tmp_path / "notes.txt").write_text("hi")
    for other in ("step-7b", "step-", "checkpoint-8", "step-+8"):  # not step-<digits>
        (tmp_path / other).mkdir()
    listed = steps.list_steps(root)
    assert [(s.step, s.committed) for s in listed] == [(7, True), (9, False)]
    assert listed[0].bytes > 1024 and listed[1].bytes == 100
    assert steps.latest_committed(root).step == 7
    assert steps.list_steps(str(tmp_path / "missing")) == []


def test_bad_arguments_are_refused_with_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match="every_steps"):
        Checkpointer(str(tmp_path), every_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(TypeError, match="'model'"):
        Checkpointer(str(tmp_path)).save(0, {"model": {1, 2}})  # neither Stateful nor JSON


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli(*args)  # in this process (tests/cli_runner.py)


def test_anyshard_ls_and_gc_on_the_command_line(tmp_path):
    root = str(tmp_path)
    _train(root)
    old, new = _crash_debris(root, 9), _crash_debris(root, 12)

    r = _cli("ls", root)
    assert r.returncode == 0, r.stderr
    assert "uncommitted" in r.stdout and "5 steps (3 committed, 2 uncommitted)" in r.stdout
    r = _cli("ls", root, "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["steps"]
    assert [(s["step"], s["committed"]) for s in listed] == [
        (4, True),
        (8, True),
        (9, False),
        (10, True),
        (12, False),
    ]

    r = _cli("gc", root, "--dry-run")
    assert r.returncode == 0 and f"would remove {old}" in r.stdout and os.path.isdir(old)
    r = _cli("gc", root)
    assert r.returncode == 0, r.stderr
    assert f"removed {old}" in r.stdout and new not in r.stdout
    assert not os.path.exists(old) and os.path.isdir(new)

    r = _cli("ls", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "missing" in r.stderr


def test_anyshard_gc_refuses_bad_input_and_shows_examples_in_help(tmp_path, capsys):
    # In-process (main(argv) is what the console script runs), to spare a torch import each.
    assert main(["gc", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "missing" in err
    with pytest.raises(SystemExit) as e:
        main(["gc"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["gc", "--help"])
    assert e.value.code == 0 and "anyshard gc /ckpt --dry-run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["ls", "--help"])
    assert e.value.code == 0 and "anyshard ls /ckpt" in capsys.readouterr().out


def test_save_retention_restore_and_gc_on_s3(s3):
    root = s3 + "/run"
    _, extra, saved = _train(root)
    assert _step_numbers(root) == [(4, True), (8, True), (10, True)]
    old, new = _crash_debris(root, 9), _crash_debris(root, 12)
    fresh, fresh_extra = Toy(1), {"lr": 0.0, "bias": torch.zeros(2)}
    assert Checkpointer(root).restore_latest({"model": fresh, "extra": fresh_extra}) == 10
    for name in ("w", "half", "t"):
        _assert_bit_exact(getattr(fresh, name), saved[10][name])
    _assert_bit_exact(fresh_extra["bias"], extra["bias"])
    assert steps.remove_debris(root) == [old]
    # gone from the listing (a filer-backed store may list an empty folder for a while)
    assert old not in [s.path for s in steps.list_steps(root)] and storage.exists(new)
    assert _step_numbers(root) == [(4, True), (8, True), (10, True), (12, False)]
    assert steps.list_steps(root)[-1].bytes == 100
    # newer debris goes once nothing was written in it for stale_after_s (the store's times)
    assert steps.remove_debris(root, stale_after_s=3600) == []
    assert steps.remove_debris(root, stale_after_s=0) == [new]
    assert _step_numbers(root) == [(4, True), (8, True), (10, True)]


@pytest.mark.parametrize(
    "module",
    [
        "anyshard.format.steps",
        "anyshard.trainer_integration.checkpointer",
        "anyshard.trainer_integration.retention",
    ],
)
def test_docstring_examples_of_steps_and_checkpointer_run(module):
    import doctest
    import importlib

    result = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0


def test_an_async_checkpointer_stages_then_commits_and_keeps_the_newest(tmp_path):
    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, every_steps=1, keep_last=2, async_=True)
    w = torch.zeros(1 << 16)
    for step in range(1, 5):
        w.fill_(step)
        assert ckpt.save(step, {"model": {"w": w}})
        w.fill_(-1)  # changed while the save is in flight
    ckpt.wait()
    assert [s.step for s in steps.list_steps(root) if s.committed] == [3, 4]
    fresh = {"model": {"w": torch.empty(1 << 16)}}
    assert Checkpointer(root).restore_latest(fresh) == 4
    assert (fresh["model"]["w"] == 4).all()


def test_ls_and_gc_take_step_directories_of_any_width_and_say_when_there_are_none(tmp_path, capsys):
    root = tmp_path / "root"
    for name in ("step-001000", "step-5"):  # as the README names them, and unpadded
        anyshard.save(str(root / name), {"w": torch.ones(2)})
    (root / "step-000000003").mkdir()  # interrupted: older than the newest commit
    assert [(s.step, s.committed) for s in steps.list_steps(str(root))] == [
        (3, False),
        (5, True),
        (1000, True),
    ]
    assert main(["gc", str(root)]) == 0
    assert not (root / "step-000000003").exists() and (root / "step-5").is_dir()
    capsys.readouterr()
    empty = tmp_path / "empty"
    (empty / "checkpoint-7").mkdir(parents=True)
    assert main(["ls", str(empty)]) == 0
    out = capsys.readouterr()
    assert "0 steps" in out.out and "no step directories here" in out.err


def test_a_guarded_async_save_over_a_crashed_attempt_at_its_step_clears_it_first(tmp_path):
    root = str(tmp_path)
    crashed = _crash_debris(root, 5)  # a data file from a crashed attempt, garbage bytes
    stray = os.path.join(crashed, "data", "rank-00007.safetensors")  # another world size's
    open(stray, "wb").write(b"x" * 10)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, async_=True)
    ckpt.guard(opt)  # saves return at once; the clear runs on the save thread
    ckpt.save(5, {"model": model.state_dict()})
    ckpt.wait()
    assert _step_numbers(root) == [(5, True)]
    assert not os.path.exists(stray)
    got = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    ckpt.restore_latest({"model": got})
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
