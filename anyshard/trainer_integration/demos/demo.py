"""``anyshard demo``: training through faults and a straggler, in four scenarios (``--scenario``,
default all).

**restart** (`anyshard.trainer_integration.demos.restart_demo`): 4 ranks under pp=2 x dp_shard=2;
rank 3 is SIGKILLed, torch's elastic agent restarts the group, which restores the newest
committed step; the job is then relaunched on 2 ranks under tp=2, the checkpoint resharded on
load (with ``--storage s3``, from an S3 bucket).

**ft-hsdp** (`anyshard.trainer_integration.demos.ft_demo`): two replica groups on torchft; one
loses a rank, restarts alone under another layout and heals from the other over the network.

**elastic**: two nodes (a torchft replica group each); one is lost and the job goes on at half
its size, the survivors taking over its share of every batch; the node comes back, heals from
the survivors' memory and the job grows back.

**autolayout** (`anyshard.trainer_integration.demos.auto_demo`): the job starts under a poor
layout, measures, trials and switches to the fastest live, then rebalances around a straggler.

The scenarios run in turn (`anyshard.trainer_integration.demos.follow.run_in_turn`): each one is
launched as soon as the one before has logged its last step, so that its start-up overlaps the
other's shutdown and plot, not its steps. Each prints a summary and writes
``RUN_DIR/<scenario>/summary.json`` and a plot; the last line gives the wall time of each.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import time

from anyshard.trainer_integration.demos.follow import (
    Phase,
    Scenario,
    follow_phase,
    launch_phase,
    run_in_turn,
)

__all__ = ["main"]


def _restart(args, run_dir: str, log) -> Scenario:
    from anyshard.trainer_integration.demos.restart_demo import run_restart

    return run_restart(args, run_dir, _config_args(args), log)


def _ft_hsdp(args, run_dir: str, log) -> Scenario:
    log(
        f"FT-HSDP: 2 replica groups x 2 ranks (dp_shard=2) on torchft, to step {args.ft_steps}; "
        f"group 1 loses rank 1 at step {args.ft_kill_step}, restarts alone under tp=2 and heals "
        "from group 0"
    )
    faults = {"kill_step": args.ft_kill_step, "heal_layout": "tp=2", "lose": None}
    return (yield from _replica_groups(args, run_dir, "ft-hsdp", faults, log, args.ft_steps))


def _elastic(args, run_dir: str, log) -> Scenario:
    log(
        f"elastic: 2 nodes x 2 ranks (a torchft replica group each, dp_shard=2), to step "
        f"{args.elastic_steps}; node 1 is lost at step {args.ft_kill_step} (agent and ranks) and "
        f"comes back {args.back_s:g} s later: the job goes on at 2 ranks, then 4"
    )
    faults = {"kill_step": None, "heal_layout": None, "lose": (args.ft_kill_step, args.back_s)}
    return (yield from _replica_groups(args, run_dir, "elastic", faults, log, args.elastic_steps))


def _replica_groups(args, run_dir: str, scenario: str, faults: dict, log, steps: int) -> Scenario:
    """The ft-hsdp or elastic scenario to step ``steps``, the fault as ``faults``
    (`ft_demo.ft_hsdp_command`'s arguments) say: its run, its summary printed and its loss
    plot."""
    from anyshard.trainer_integration.demos import ft_demo

    extra = _config_args(args)
    cmd = ft_demo.ft_hsdp_command(run_dir, steps=steps, extra=extra, **faults)
    rc = yield from ft_demo.follow_ft_hsdp(run_dir, cmd, steps, log)
    if rc != 0:
        name = {"ft-hsdp": "FT-HSDP"}.get(scenario, scenario)
        log(f"{name} failed (exit {rc}); see {run_dir}/launch.log")
        return None
    summary = ft_demo.summarize(run_dir, scenario)
    ft_demo.print_summary(summary, log)
    png = ft_demo.plot(run_dir, summary)
    log(f"loss curve: {png}" if png else "loss curve: install matplotlib for loss.png")
    return summary


def _autolayout(args, run_dir: str, log) -> Scenario:
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
    launch = launch_phase(phase, steps, run_dir, [*_config_args(args), *storage, "10"])
    rc = yield from follow_phase(launch, run_dir, steps, log)
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


def _scenario(name: str, args, where: str, heading: bool, log) -> Scenario:
    """Scenario ``name`` into ``where``, its summary written there."""
    os.makedirs(where, exist_ok=True)
    if heading:
        log(f"== scenario {name} ({where})")
    summary = yield from RUNNERS[name](args, where, log)
    if summary is not None:
        with open(os.path.join(where, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        log("")
    return summary


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument("--steps-a", type=int, default=10, help="restart: steps of phase A (4 ranks)")
    p.add_argument(
        "--steps-b", type=int, default=16, help="restart: total steps after phase B (2 ranks)"
    )
    p.add_argument("--kill-step", type=int, default=6, help="restart: step rank 3 is killed at")
    p.add_argument("--ft-steps", type=int, default=16, help="ft-hsdp: steps of the run")
    # the lost node's return starts a launcher afresh (its imports, while the survivors train):
    # the run is long enough that it rejoins with steps to spare on a loaded machine too
    p.add_argument("--elastic-steps", type=int, default=18, help="elastic: steps of the run")
    p.add_argument(
        "--ft-kill-step",
        type=int,
        default=5,
        help="ft-hsdp: step group 1 loses a rank at; elastic: step node 1 is lost at",
    )
    p.add_argument(
        "--back-s", type=float, default=3.0, help="elastic: seconds until the lost node returns"
    )
    p.add_argument("--auto-steps", type=int, default=34, help="autolayout: steps of the run")
    p.add_argument(
        "--slow-step", type=int, default=18, help="autolayout: step rank 1 becomes a straggler at"
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
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.config and not os.path.isfile(args.config):
        p.error(f"--config {args.config}: no such file")

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.time()
    run_dir = os.path.abspath(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    many = len(names) > 1
    scenarios = [
        functools.partial(_scenario, n, args, os.path.join(run_dir, n) if many else run_dir, many)
        for n in names
    ]
    summaries, took = [], []
    with contextlib.closing(run_in_turn(scenarios, log)) as runs:
        for summary, seconds in runs:
            if summary is None:
                return 1
            summaries.append(summary)
            took.append(seconds)
    if many:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"scenarios": summaries}, f, indent=1)
        each = ", ".join(f"{n} {s:.0f} s" for n, s in zip(names, took, strict=True))
        wall = round(time.time() - started)
        log(
            f"wall time {wall // 60} min {wall % 60:02d} s ({each}: each from its launch, "
            "which overlaps the shutdown of the one before, to its summary)"
        )
    log(f"summary: {os.path.join(run_dir, 'summary.json')}")
    return 0


def _config_args(args) -> list[str]:
    return ["--config", os.path.abspath(args.config)] if args.config else []


if __name__ == "__main__":
    sys.exit(main())
