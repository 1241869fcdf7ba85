"""The FT-HSDP launcher's event logs (RUN_DIR/replica-N/events.jsonl), the checks of a peer
heal that the FT-HSDP and demo tests share, and a deadline for the jobs they launch from the
test's own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise TimeoutError in this (the main) thread after ``seconds``: the launcher's own
    cleanup then kills its groups and the lighthouse."""

    def expire(signum, frame):
        raise TimeoutError(f"the job did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def events(run_dir: str, replica: int) -> list[dict]:
    with open(os.path.join(run_dir, f"replica-{replica}", "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_peer_heal(
    run_dir: str, *, steps: int, kill_step: int, layout: str
) -> tuple[list[dict], list[dict]]:
    """Group 1 lost a rank at ``kill_step``: only it restarted, under ``layout``, and healed
    from group 0 bit-identical; both reached ``steps``. Returns both groups' events."""
    healthy, failed = events(run_dir, 0), events(run_dir, 1)
    # the healthy group was never restarted: one start, attempt 0, and it reached the end
    assert [e["attempt"] for e in healthy if e["event"] == "start"] == [0]
    assert [e["step"] for e in healthy if e["event"] == "end"] == [steps]
    # the failed group restarted once, under the heal layout, and healed from the peer
    starts = [e for e in failed if e["event"] == "start"]
    # a group that joins late heals at once and may die at its first step, before its start
    # event (written once the step is done): attempt 0 may have none
    assert [e["attempt"] for e in starts] in ([0, 1], [1]), starts
    assert {e["attempt"] for e in failed if "attempt" in e} <= {0, 1}
    assert starts[-1]["layout"] == layout
    heals = [e for e in failed if e["event"] == "heal" and e["attempt"] == 1]
    assert len(heals) == 1 and heals[0]["source"] == "replica_0", failed
    heal = heals[0]
    assert heal["received_bytes"] > 0 and heal["step"] > kill_step
    # bit-identical: the digest of the whole logical state (parameters, AdamW moments, step,
    # data position) the source sent equals the one the healer holds after the heal
    sent = [e for e in healthy if e["event"] == "heal_sent" and e["step"] == heal["step"]]
    assert len(sent) == 1 and sent[0]["digest"] == heal["digest"]
    assert [e["step"] for e in healthy + failed if e["event"] == "end"] == [steps, steps]
    return healthy, failed
