"""`anyshard demo`, run as a user runs it (shortened, on the tiny model): the fault, the restart,
the relayout and the continued loss show in its output, with the summary table and the loss plot.

Run: python -m pytest tests/e2e/test_demo.py -q
"""

import doctest
import json
import os
import subprocess

import pytest
from cli_runner import cli
from ft_events import check_peer_heal, deadline

TINY = os.path.join(
    os.path.dirname(__file__), "..", "..", "anyshard", "trainer_integration", "gpt", "tiny.toml"
)
SHORT = ["--scenario", "restart", "--steps-a", "8", "--steps-b", "12", "--kill-step", "5"]
SHORT += ["--config", TINY]


def demo(run_dir: str, *extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["anyshard", "demo", "--run-dir", run_dir, *SHORT, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def losses(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "losses.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check_restart_scenario(run_dir: str, out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "rank 3 will be killed at step 5" in text
    assert "restart" in text and "tp=2" in text and "pp=2 x dp_shard=2" in text
    recs = losses(run_dir)
    assert [r["step"] for r in recs] == [*range(1, 6), *range(5, 13)]  # resumed from step 4
    assert {r["layout"] for r in recs if r["step"] > 8} == {"tp=2"}
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["scenario"] == "restart" and summary["faults"][0]["step"] == 5
    assert summary["faults"][0]["heal_source"] == "storage"
    assert summary["healthy_restarts"] == 3  # the whole group restarted with the failed rank
    assert [p["layout"] for p in summary["phases"]] == ["pp=2 dp_shard=2"] * 2 + ["tp=2"]


def test_demo_recovers_from_s3_when_local_copies_are_gone(tmp_path, s3_server):
    """The restart scenario (the README's first command's, on fewer steps) with checkpoints in
    a SeaweedFS bucket: the fault, the restart, the relaunch under tp=2, which recovers from S3
    (the local copies are deleted first); every check of the scenario on local disk too."""
    env = {**os.environ, **s3_server.env()}
    run_dir = str(tmp_path / "demo-s3")
    out = demo(run_dir, "--storage", "s3", env=env)
    _check_restart_scenario(run_dir, out)
    assert "recovering from S3" in out.stdout


SMALL = """
# the tiny model (tiny.toml), with tied embeddings (one weight under dp_shard, then under tp)
[model]
dim = 64
ffn_dim = 128
max_seq_len = 64
tie_embeddings = true

[train]
seq_len = 32
global_batch = 8
min_step_s = 0.4  # paced: the healthy group still trains when the restarted one joins
"""


def test_demo_ft_hsdp_heals_a_group_from_its_peer_into_tp2(tmp_path):
    """The ft-hsdp scenario on a small model: group 1 loses a rank at step 4 and only it
    restarts, under tp=2, healing from group 0 over the network, bit-identical (the digest of
    the whole logical state: parameters, AdamW moments, step, data position)."""
    config = tmp_path / "small.toml"
    config.write_text(SMALL)
    run_dir = str(tmp_path / "demo-ft")
    # `anyshard demo` through the console script's function in this process (the restart
    # scenario above runs the installed script); the launch it starts is a process of its own
    with deadline(600):
        out = cli(
            "demo", "--run-dir", run_dir, "--scenario", "ft-hsdp",
            "--ft-steps", "30", "--ft-kill-step", "4", "--config", str(config),
        )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "healed from the peer" in out.stdout
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["scenario"] == "ft-hsdp"
    assert summary["healthy_restarts"] == 0
    (fault,) = summary["faults"]
    assert fault["step"] == 4 and fault["replica"] == 1
    assert fault["heal_source"] == "peer" and fault["heal_layout"] == "tp=2"
    assert fault["heal_bit_identical"] is True
    assert fault["recovery_s"] > 0 and fault["healthy_stall_s"] is not None
    for phase in summary["phases"]:
        assert {"layout", "world_size", "first_step", "last_step"} <= set(phase)
    assert max(p["last_step"] for p in summary["phases"]) == 30
    # goodput: the healthy group's training time less its stall, from its own loss log; it
    # never waits for the restart (it stalls less than the failed group takes to come back),
    # so it keeps more than a restart of the whole job would (which loses the recovery too),
    # and the step the fault broke off is saved, not redone
    times = [
        json.loads(x)["time"] for x in open(os.path.join(run_dir, "replica-0", "losses.jsonl"))
    ]
    span, stall = max(times) - min(times), fault["healthy_stall_s"]
    assert 0 < stall < fault["recovery_s"], fault
    assert summary["goodput"] == pytest.approx(1 - stall / span)
    assert 1 - fault["recovery_s"] / span < summary["goodput"] < 1
    assert summary["lost_steps"] == 0, summary
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000

    # the events behind the summary
    check_peer_heal(run_dir, steps=30, kill_step=4, layout="tp=2")


def test_demo_autolayout_leaves_the_poor_layout_and_rebalances_a_straggler(tmp_path):
    """The autolayout scenario on the tiny model: from tp=2 the job trials and switches live,
    and once rank 1 slows 3x it re-plans for the straggler."""
    run_dir = str(tmp_path / "demo")
    args = ["--scenario", "autolayout", "--auto-steps", "60", "--slow-step", "24"]
    # in this process, which has imported anyshard already, like the ft-hsdp scenario's test
    with deadline(600):
        out = cli("demo", "--run-dir", run_dir, *args, "--slow-factor", "3", "--config", TINY)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["configured_layout"] == "tp=2" and summary["steps"] == 60
    kinds = [d["event"] for d in summary["decisions"]]
    assert "auto_trial" in kinds, kinds
    assert [s["from"] for s in summary["switches"]][0] == "tp=2"
    assert all(s["switch_s"] > 0 for s in summary["switches"])
    # the straggler is seen as one rank's skew (a re-plan for the whole machine's drift may
    # come too: the suite's other worker loads the same cores); where the job then runs
    # data-parallel, rank 1 takes fewer samples (on a machine where a pipeline stays faster
    # even so, it stays there)
    replans = [d for d in summary["decisions"] if "re-plan" in d["reason"]]
    skewed = [d for d in replans if "skew" in d["reason"]]
    assert all(d["step"] >= 24 for d in skewed), replans
    rebalanced = [d for d in summary["decisions"] if d["event"] == "auto_rebalance"]
    assert all(d["step"] >= 24 for d in rebalanced)
    assert skewed or rebalanced, kinds  # the straggler was acted on
    if summary["final_layout"].startswith("dp_"):
        # rank 1 gets the smaller share; a move whose next window measured slower goes back (on
        # the tiny model a sample more or less barely changes a step's time), and says so
        assert rebalanced and rebalanced[0]["shares"][1] < rebalanced[0]["shares"][0], kinds
        last = rebalanced[-1]
        assert last["shares"][1] < last["shares"][0] or "back" in last["reason"], rebalanced
    assert all(c["predicted_s"] > 0 for d in summary["decisions"] for c in d["candidates"])
    recs = losses(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 61))
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert os.path.getsize(os.path.join(run_dir, "step_time.png")) > 1000
    assert "median step" in out.stdout


def test_a_missing_config_is_a_usage_error_before_any_launch(tmp_path, capsys):
    from anyshard.trainer_integration.demos.demo import main

    run_dir = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(run_dir), "--config", str(tmp_path / "missing.toml")])
    assert e.value.code == 2
    assert "missing.toml: no such file" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing emptied or launched


def test_the_demo_modules_examples_run():
    """The scenarios' driver (one on screen at a time, the next launched once the one before
    has trained), the plots' helpers and the FT summary's arithmetic, by their examples."""
    from anyshard.trainer_integration.demos import figures, follow, ft_demo

    for module in (follow, figures, ft_demo):
        assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_a_failed_scenario_stops_the_one_launched_after_it():
    """The next scenario is launched once the one on screen has trained; where that one then
    fails, the next is stopped (its launches with it) and its lines never show."""
    from anyshard.trainer_integration.demos.follow import TRAINED, run_in_turn

    stopped = []

    def failing(log):
        log("first")
        yield TRAINED
        return None

    def launched_after(log):
        try:
            log("second")
            while True:
                yield None
        finally:
            stopped.append(True)

    shown: list[str] = []
    runs = list(run_in_turn([failing, launched_after], shown.append, poll_s=0))
    assert [summary for summary, _ in runs] == [None]
    assert shown == ["first"] and stopped == [True]
