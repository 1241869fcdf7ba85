"""Fault tolerance under torchrun: a rank is SIGKILLed mid-run, torchrun restarts the group, the
job restores the newest committed checkpoint and goes on; its losses are bit-identical to an
uninterrupted run's, and it logs the recovery time and the steps it lost.

Run: python -m pytest tests/e2e/test_trainer_fault.py -q
"""

import json
import os
import subprocess
import sys

import pytest

from anyshard.trainer_integration.gpt.config import TINY_CONFIG

LAUNCHERS = {
    # new interpreters at every (re)start
    "torchrun": [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "4", "--max-restarts", "1",
        "-m", "anyshard.trainer_integration.gpt.train",
    ],
    # the same elastic agent, ranks forked from a process with torch imported
    "warm": [
        sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
        "--nproc-per-node", "4", "--max-restarts", "1",
    ],
}  # fmt: skip


# the kill at step 7 loses steps 5-7 (the newest commit is step 4); a wrong restore shows in the
# first steps after it (the data position and step count at the first, AdamW's moments from the
# second), and the run goes one step past the one it was killed in
STEPS = 8


def torchrun(run_dir: str, *extra: str, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    cmd = [
        *LAUNCHERS[launcher],
        "--config", TINY_CONFIG,
        "--parallel.pp", "2", "--parallel.dp_shard", "2",
        "--train.steps", str(STEPS),
        "--checkpoint.every_steps", "4",
        "--checkpoint.root", os.path.join(run_dir, "ckpt"),
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ANYSHARD_FAULT"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> str:
    """The uninterrupted run, once for both launchers, under the warm one (its ranks forked,
    not four new interpreters that import torch): the same trainer and layout, so the same
    losses bit for bit."""
    clean = str(tmp_path_factory.mktemp("clean"))
    out = torchrun(clean, launcher="warm")
    assert out.returncode == 0, out.stderr[-3000:]
    return clean


@pytest.mark.parametrize("launcher", ["torchrun", "warm"])
def test_a_killed_rank_restarts_resumes_and_matches_an_uninterrupted_run(
    tmp_path, launcher, clean_run
):
    clean, faulty = clean_run, str(tmp_path / "faulty")
    out = torchrun(faulty, "--fault.kill_rank", "3", "--fault.kill_step", "7", launcher=launcher)
    assert out.returncode == 0, out.stderr[-3000:]
    fault = records(os.path.join(faulty, "fault.json"))[0]  # written just before the kill
    assert (fault["rank"], fault["step"], fault["mode"]) == (3, 7, "sigkill")
    if launcher == "torchrun":  # its log names the first failure it saw: the killed rank
        assert "exitcode: -9" in out.stderr
    # (the warm agent may notice a survivor's broken connection first and name that one)

    want = {r["step"]: r["loss"] for r in records(os.path.join(clean, "losses.jsonl"))}
    got = records(os.path.join(faulty, "losses.jsonl"))
    attempts = {r["attempt"] for r in got}
    assert attempts == {0, 1}
    # steps 5..7 ran twice (the newest commit was step 4): both times bit-identical
    assert [r["step"] for r in got] == [*range(1, 8), *range(5, STEPS + 1)]
    assert all(r["loss"] == want[r["step"]] for r in got)

    events = [e for e in records(os.path.join(faulty, "events.jsonl")) if e["event"] == "start"]
    assert [e["attempt"] for e in events] == [0, 1]
    assert events[1]["restored_step"] == 4 and events[1]["lost_steps"] == 3
    assert 0 < events[1]["recovery_s"] < 120


def test_the_warm_launcher_reports_a_failed_group_with_exit_code_1(tmp_path, capsys):
    from anyshard.trainer_integration.gpt.launch import main

    cmd = [
        sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
        "--nproc-per-node", "2",
        "--config", TINY_CONFIG, "--parallel.tp", "4",  # a layout that cannot run here
        "--run_dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "launch: the trainer failed" in out.stderr and "parallel.tp (4)" in out.stderr
    # a usage error, found before anything starts: the launcher's main in this process
    with pytest.raises(SystemExit) as bad:
        main(["--nproc-per-node", "0"])
    assert bad.value.code == 2 and "at least 1" in capsys.readouterr().err
