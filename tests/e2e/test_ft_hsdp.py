"""FT-HSDP end to end: two replica groups on torchft, one SIGKILLed; only it restarts, and it
heals from the healthy group (same layout, or tp=2 instead of dp_shard=2), bit-identical.

Run: python -m pytest tests/e2e/test_ft_hsdp.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchft")

TINY = os.path.join(
    os.path.dirname(__file__), "..", "..", "anyshard", "trainer_integration", "gpt", "tiny.toml"
)


def _events(run_dir, replica: int) -> list[dict]:
    path = os.path.join(run_dir, f"replica-{replica}", "events.jsonl")
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("heal_layout", [None, "tp=2"])
def test_a_killed_group_heals_from_the_healthy_one(tmp_path, heal_layout):
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "anyshard.trainer_integration.gpt.launch"]
    cmd += ["--replicas", "2", "--nproc-per-node", "2", "--max-restarts", "1"]
    # the healthy group has 36 steps left when the other dies: it is still training when the
    # restarted group (about 3 s later) asks to join
    cmd += ["--fault", "1:1:4", "--config", TINY, "--parallel.dp_shard", "2"]
    cmd += ["--train.steps", "40", "--checkpoint.every_steps", "4", "--ft.check_heals", "true"]
    cmd += ["--run_dir", run, "--checkpoint.root", str(tmp_path / "ckpt")]
    if heal_layout:
        cmd += ["--ft.heal_layout", heal_layout]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]

    healthy, failed = _events(run, 0), _events(run, 1)
    # the healthy group was never restarted: one start, attempt 0, and it reached the end
    assert [e["attempt"] for e in healthy if e["event"] == "start"] == [0]
    assert [e["step"] for e in healthy if e["event"] == "end"] == [40]
    # the failed group restarted once, under the heal layout, and healed from the peer
    starts = [e for e in failed if e["event"] == "start"]
    assert [e["attempt"] for e in starts] == [0, 1]
    assert starts[1]["layout"] == (heal_layout or "dp_shard=2")
    heals = [e for e in failed if e["event"] == "heal" and e["attempt"] == 1]
    assert len(heals) == 1 and heals[0]["source"] == "replica_0", failed
    heal = heals[0]
    assert heal["received_bytes"] > 0
    # bit-identical: the digest of the whole logical state (parameters, AdamW moments, step,
    # data position) the source sent equals the one the healer holds after the heal
    sent = [e for e in healthy if e["event"] == "heal_sent" and e["step"] == heal["step"]]
    assert len(sent) == 1 and sent[0]["digest"] == heal["digest"]
    assert heal["step"] > 4
    ends = [e for e in healthy + failed if e["event"] == "end"]
    assert [e["step"] for e in ends] == [40, 40]
    if heal_layout is None:
        # one layout: the same averaged gradients, the same steps, the same final state; under
        # two layouts the gradient norm (for clipping) is summed in another order
        assert ends[0]["digest"] == ends[1]["digest"]
