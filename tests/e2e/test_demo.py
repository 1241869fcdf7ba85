"""`anyshard demo`, run as a user runs it (shortened): the fault, the restart, the relayout and
the continued loss show in its output, with the summary table and the loss plot.

Run: python -m pytest tests/e2e/test_demo.py -q
"""

import json
import os
import subprocess

SHORT = ["--steps-a", "8", "--steps-b", "12", "--kill-step", "5"]


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


def test_demo_shows_fault_restart_relayout_and_continued_loss(tmp_path):
    run_dir = str(tmp_path / "demo")
    out = demo(run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "rank 3 will be killed at step 5" in text
    assert "restart" in text and "tp=2" in text and "pp=2 x dp_shard=2" in text
    recs = losses(run_dir)
    assert [r["step"] for r in recs] == [*range(1, 6), *range(5, 13)]  # resumed from step 4
    assert {r["layout"] for r in recs if r["step"] > 8} == {"tp=2"}
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000


def test_demo_recovers_from_s3_when_local_copies_are_gone(tmp_path, s3_server, monkeypatch):
    env = {**os.environ, **s3_server.env()}
    run_dir = str(tmp_path / "demo-s3")
    out = demo(run_dir, "--storage", "s3", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "recovering from S3" in out.stdout
    recs = losses(run_dir)
    assert [r["step"] for r in recs][-4:] == [9, 10, 11, 12]
