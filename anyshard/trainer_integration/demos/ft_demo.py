"""The FT-HSDP scenario of ``anyshard demo``, and the summary of a run's logs.

Two replica groups of 2 ranks (dp_shard=2 inside each) train on torchft with a lighthouse on
127.0.0.1. Rank 1 of group 1 is SIGKILLed; only group 1 restarts (its elastic agent), under
``tp=2`` this time, and heals from group 0 over the network (`anyshard.redistribute`, nothing
pickled) while group 0 keeps stepping. `summarize` reads what the groups logged and reports
phases (each launch of each group, split where the group changed layout in the run), faults
(recovery, the healthy groups' stall, where the heal came from and into which layout),
restarts of healthy processes, lost steps (steps the healthy groups redid) and goodput.

The healthy groups' stall per fault is the time from their step at the fault to their step
after the heal, less as many steps at their pace before the fault; goodput is one less the
stalls over the healthy groups' training time.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from anyshard.trainer_integration.demos import figures
from anyshard.trainer_integration.demos.follow import Launch, Scenario, drive, last_step
from anyshard.trainer_integration.demos.follow import records as _records

__all__ = [
    "follow_ft_hsdp",
    "ft_hsdp_command",
    "plot",
    "print_summary",
    "run_ft_hsdp",
    "summarize",
]

LAUNCH = "anyshard.trainer_integration.gpt.launch"


def _stretches(losses: list[dict]) -> list[list[dict]]:
    """Loss records in runs of consecutive steps of one layout (a group that changed layout
    in the run, or was launched again, has several)."""
    runs: list[list[dict]] = []
    for x in losses:
        last = runs[-1][-1] if runs else None
        if last and x["step"] == last["step"] + 1 and x["layout"] == last["layout"]:
            runs[-1].append(x)
        else:
            runs.append([x])
    return runs


def _replicas(run_dir: str) -> list[int]:
    names = (
        [n for n in os.listdir(run_dir) if n.startswith("replica-")]
        if os.path.isdir(run_dir)
        else []
    )
    return sorted(int(n.split("-", 1)[1]) for n in names)


def run_ft_hsdp(
    run_dir: str,
    *,
    steps: int,
    kill_step: int | None = None,
    heal_layout: str | None = "tp=2",
    lose: tuple[int, float] | None = None,
    extra: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> int:
    """Run the scenario into ``run_dir``: rank 1 of group 1 killed at ``kill_step`` (ft-hsdp),
    or group 1's node lost at step ``lose[0]`` and back ``lose[1]`` seconds later (elastic);
    returns the launcher's exit code."""
    cmd = ft_hsdp_command(
        run_dir, steps=steps, kill_step=kill_step, heal_layout=heal_layout, lose=lose, extra=extra
    )
    return drive(follow_ft_hsdp(run_dir, cmd, steps, log))


def ft_hsdp_command(
    run_dir: str,
    *,
    steps: int,
    kill_step: int | None,
    heal_layout: str | None,
    lose: tuple[int, float] | None,
    extra: Sequence[str],
) -> list[str]:
    """The launcher's command line for `run_ft_hsdp`'s arguments."""
    cmd = [sys.executable, "-m", LAUNCH, "--replicas", "2", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1"]
    if kill_step is not None:
        cmd += ["--fault", f"1:1:{kill_step}"]
    if lose is not None:
        cmd += ["--lose-group", f"1:{lose[0]}:{lose[1]}"]
    cmd += ["--parallel.dp_shard", "2", "--train.steps", str(steps)]
    cmd += ["--checkpoint.every_steps", "5", "--checkpoint.root", os.path.join(run_dir, "ckpt")]
    cmd += ["--ft.check_heals", "true", "--run_dir", run_dir]
    # both groups are in the first quorum, however far apart a loaded machine starts them: the
    # scenario's fault lands on a group that is in the run
    cmd += ["--ft.wait_all_s", "60", *extra]
    if heal_layout:
        cmd += ["--ft.heal_layout", heal_layout]
    return cmd


def follow_ft_hsdp(
    run_dir: str, cmd: list[str], steps: int, log: Callable[[str], None] = print
) -> Scenario:
    """Launch ``cmd`` (`ft_hsdp_command`) as a scenario of
    `anyshard.trainer_integration.demos.follow`: it yields while the groups train (``TRAINED``
    once both have logged step ``steps``) and returns the launcher's exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("ANYSHARD_FAULT", None)
    shown: dict[int, int] = {}

    def trained() -> bool:
        groups = [os.path.join(run_dir, f"replica-{r}") for r in _replicas(run_dir)]
        return len(groups) == 2 and all(last_step(g) >= steps for g in groups)

    launch = Launch(cmd, env, os.path.join(run_dir, "launch.log"))
    return (yield from launch.follow(lambda: _progress(run_dir, shown, log), trained))


def _progress(run_dir: str, shown: dict[int, int], log) -> None:
    for r in _replicas(run_dir):
        recs = _records(os.path.join(run_dir, f"replica-{r}", "losses.jsonl"))
        for x in recs[shown.get(r, 0) :]:
            log(
                f"  group {r}  step {x['step']:3d}  loss {x['loss']:.4f}  "
                f"[{x['layout']}, attempt {x['attempt']}]"
            )
        shown[r] = len(recs)
        events = _records(os.path.join(run_dir, f"replica-{r}", "events.jsonl"))
        key = -1 - r
        for e in events[shown.get(key, 0) :]:
            # a heal after a restart, or one after the group's first events (a returning node)
            if e["event"] == "heal" and (e["attempt"] > 0 or shown.get(key, 0) > 0):
                log(
                    f"  group {r} healed from {e['source']} at step {e['step']} into "
                    f"{e['layout']}: {e['received_bytes'] / 2**20:.1f} MiB in {e['heal_s']:.2f} s"
                )
            elif e["event"] == "start" and e["attempt"] > 0:
                log(f"  group {r} restarted (its own agent), layout {e['layout']}")
        shown[key] = len(events)


def _median_interval(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    return statistics.median(gaps) if gaps else 0.0


def _excess(times: dict[int, float], step: int, window: int = 5) -> float | None:
    """How much longer the healthy group's step after ``step`` took than its steps just
    before (the median of up to ``window`` of them), or, for a group that began at ``step``
    (it started late and healed from the other at once), than its steps just after.

    >>> _excess({4: 0.0, 5: 1.5, 6: 1.9, 7: 2.3, 8: 2.7}, 4)
    1.1
    """
    if step not in times or step + 1 not in times:
        return None
    near = [times[s] for s in range(step - window, step + 1) if s in times]
    if len(near) < 2:
        near = [times[s] for s in range(step + 1, step + 2 + window) if s in times]
    if len(near) < 2:
        return None
    return times[step + 1] - times[step] - _median_interval(near)


def summarize(run_dir: str, scenario: str = "ft-hsdp") -> dict[str, Any]:
    """The summary of an FT-HSDP run from its groups' logs (see the module docstring).
    ``scenario`` "elastic": the phases are the job's sizes (groups taking part x ranks)."""
    groups = {
        r: {
            "events": _records(os.path.join(run_dir, f"replica-{r}", "events.jsonl")),
            "losses": _records(os.path.join(run_dir, f"replica-{r}", "losses.jsonl")),
            "faults": _records(os.path.join(run_dir, f"replica-{r}", "fault.json")),
        }
        for r in _replicas(run_dir)
    }
    failed = {r for r, g in groups.items() if g["faults"]}
    healthy = [r for r in groups if r not in failed]
    if scenario == "elastic" and healthy:
        phases = _world_phases(groups[healthy[0]]["losses"], groups[healthy[0]]["events"])
    else:
        phases = [p for r, g in groups.items() for p in _launch_phases(r, g)]
    faults = [f for r in sorted(failed) for f in _faults(groups, r, healthy)]
    healthy_restarts = sum(  # every start of a healthy group after its first
        max(0, sum(1 for e in groups[r]["events"] if e["event"] == "start") - 1) for r in healthy
    )
    # a step that did not commit is lost unless the next quorum saved it ("rescued")
    rescued = sum(1 for r in healthy for e in groups[r]["events"] if e["event"] == "rescued")
    uncommitted = sum(
        1 for r in healthy for e in groups[r]["events"] if e["event"] == "uncommitted"
    )
    return {
        "scenario": scenario,
        "phases": phases,
        "faults": faults,
        "healthy_restarts": healthy_restarts,
        "lost_steps": uncommitted - rescued,
        "rescued_steps": rescued,
        "goodput": _goodput(groups, healthy, faults),
    }


def _launch_phases(r: int, g: dict) -> list[dict]:
    """Group ``r``'s phases: a phase per launch (a start event), split where the group changed
    layout in the run."""
    phases = []
    for e in g["events"]:
        if e["event"] != "start":
            continue
        mine = [x for x in g["losses"] if x["attempt"] == e["attempt"]]
        if "time" in e:  # this launch's steps only (a lost group is launched anew)
            began = e["time"] - e["startup_to_first_step_s"]
            later = [
                x["time"] - x["startup_to_first_step_s"]
                for x in g["events"]
                if x["event"] == "start" and x.get("time", 0) > e["time"]
            ]
            end = min(later, default=float("inf"))
            mine = [x for x in g["losses"] if began <= x["time"] < end]
        # a group that changed layout in the run: a phase per layout
        for run in _stretches(sorted(mine, key=lambda x: x["step"])) or [[]]:
            phases.append(
                {
                    "replica": r,
                    "attempt": e["attempt"],
                    "layout": run[0]["layout"] if run else e["layout"],
                    "world_size": e["world_size"],
                    "first_step": run[0]["step"] if run else None,
                    "last_step": run[-1]["step"] if run else None,
                }
            )
    return phases


def _faults(groups: dict, r: int, healthy: list[int]) -> list[dict]:
    """Group ``r``'s faults, each with what followed it: the group's next start and heal, and
    the healthy groups' stall."""
    g, out = groups[r], []
    for f in [x for x in g["faults"] if not x.get("recovered")]:
        restart = next(
            (e for e in g["events"] if e["event"] == "start" and e.get("time", 0) > f["time"]),
            None,
        )
        heal = next(
            (e for e in g["events"] if e["event"] == "heal" and e.get("time", 0) > f["time"]),
            None,
        )
        stalls = []
        for h in healthy:
            times = {x["step"]: x["time"] for x in groups[h]["losses"]}
            parts = [_excess(times, f["step"])]
            if heal is not None:
                parts.append(_excess(times, heal["step"]))
            known = [x for x in parts if x is not None]
            if len(known) == len(parts):
                stalls.append(sum(known))
        out.append(
            {
                "step": f["step"],
                "replica": r,
                "rank": f["rank"],
                "mode": f.get("mode", "sigkill"),
                "recovery_s": restart.get("recovery_s") if restart else None,
                "healthy_stall_s": max(stalls) if stalls else None,
                "heal_source": "peer" if heal else "storage",
                "heal_layout": restart["layout"] if restart else None,
                "heal_step": heal["step"] if heal else None,
                "heal_s": heal["heal_s"] if heal else None,
                "heal_bytes": heal["received_bytes"] if heal else None,
                "heal_bit_identical": _heal_matches(groups, heal) if heal else None,
            }
        )
    return out


def _goodput(groups: dict, healthy: list[int], faults: list[dict]) -> float | None:
    """The share of the healthy groups' training time not lost to the faults."""
    if not healthy:
        return None
    times = sorted(x["time"] for x in groups[healthy[0]]["losses"])
    lost_s = sum(f["healthy_stall_s"] or 0.0 for f in faults)
    if len(times) > 1 and times[-1] > times[0]:
        return max(0.0, 1.0 - lost_s / (times[-1] - times[0]))
    return None


def _world_phases(losses: list[dict], events: list[dict]) -> list[dict]:
    """The job's sizes over its steps: runs of steps with the same number of groups taking
    part, each as (layout, world_size, first_step, last_step), the layout per group."""
    start = next((e for e in events if e["event"] == "start"), None)
    per_group = start["world_size"] if start else 1
    phases: list[dict] = []
    for x in losses:
        n = x.get("groups", 1)
        if phases and phases[-1]["groups"] == n:
            phases[-1]["last_step"] = x["step"]
        else:
            phases.append(
                {
                    "groups": n,
                    "layout": f"{n} x ({x['layout']})",
                    "world_size": n * per_group,
                    "first_step": x["step"],
                    "last_step": x["step"],
                }
            )
    return phases


def _heal_matches(groups: dict, heal: dict) -> bool | None:
    """Whether the state the healer holds after the heal has the digest of what was sent."""
    if "digest" not in heal:
        return None
    for g in groups.values():
        for e in g["events"]:
            if e["event"] == "heal_sent" and e["step"] == heal["step"] and "digest" in e:
                return e["digest"] == heal["digest"]
    return None


def print_summary(summary: dict[str, Any], log: Callable[[str], None] = print) -> None:
    log("")
    if summary["scenario"] == "elastic":
        log(f"{'groups':>6} {'layout':22} {'ranks':>5} {'steps':>9}")
        for p in summary["phases"]:
            steps = f"{p['first_step']}-{p['last_step']}"
            log(f"{p['groups']:>6} {p['layout']:22} {p['world_size']:>5} {steps:>9}")
    else:
        log(f"{'group':>5} {'attempt':>7} {'layout':16} {'ranks':>5} {'steps':>9}")
        for p in summary["phases"]:
            steps = f"{p['first_step']}-{p['last_step']}" if p["first_step"] is not None else "-"
            log(
                f"{p['replica']:>5} {p['attempt']:>7} {p['layout']:16} {p['world_size']:>5} "
                f"{steps:>9}"
            )
    for f in summary["faults"]:
        what = (
            f"group {f['replica']} lost (its node: agent and ranks)"
            if f["mode"] == "node lost"
            else f"group {f['replica']} rank {f['rank']} killed"
        )
        log(
            f"fault: {what} at step {f['step']}; it came back alone under {f['heal_layout']} "
            f"and healed from the {f['heal_source']}"
            + (
                f" at step {f['heal_step']} ({(f['heal_bytes'] or 0) / 2**20:.1f} MiB in "
                f"{f['heal_s']:.2f} s, bit-identical: {f['heal_bit_identical']})"
                if f["heal_source"] == "peer"
                else ""
            )
        )
        rec = f"{f['recovery_s']:.1f} s" if f["recovery_s"] is not None else "-"
        stall = f"{f['healthy_stall_s']:.2f} s" if f["healthy_stall_s"] is not None else "-"
        log(f"       recovery {rec}; the healthy group's stall {stall}")
    goodput = f"{summary['goodput']:.1%}" if summary["goodput"] is not None else "-"
    log(
        f"healthy restarts {summary['healthy_restarts']}; lost steps {summary['lost_steps']}; "
        f"steps saved after losing a group {summary.get('rescued_steps', 0)}; goodput {goodput}"
    )


def plot(run_dir: str, summary: dict[str, Any]) -> str | None:
    """``RUN_DIR/loss.png``: each group's loss, the fault and the heal marked."""
    ax = figures.new_axes()
    if ax is None:
        return None
    for r in _replicas(run_dir):
        # a line per stretch of consecutive steps of one layout
        runs = _stretches(_records(os.path.join(run_dir, f"replica-{r}", "losses.jsonl")))
        color = None
        for k, mine in enumerate(runs):
            label = f"group {r}, {mine[0]['layout']}" + (
                f" (from step {mine[0]['step']})" if k else ""
            )
            line = ax.plot(
                [x["step"] for x in mine],
                [x["loss"] for x in mine],
                marker=".",
                label=label if k == 0 or mine[0]["layout"] != runs[0][0]["layout"] else None,
                color=color,
            )[0]
            color = color or line.get_color()
    for r in _replicas(run_dir):  # a group that changed layout in the run
        for e in _records(os.path.join(run_dir, f"replica-{r}", "events.jsonl")):
            if e["event"] == "relayout":
                ax.axvline(
                    e["step"], color="purple", linestyle="-.",
                    label=f"group {r} relayout to {e['to']} (no checkpoint)",
                )  # fmt: skip
    for f in summary["faults"]:
        what = "lost (node)" if f.get("mode") == "node lost" else "killed"
        ax.axvline(f["step"], color="red", linestyle="--", label=f"group {f['replica']} {what}")
        if f["heal_step"] is not None:
            ax.axvline(
                f["heal_step"],
                color="green",
                linestyle=":",
                label=f"healed from a peer into {f['heal_layout']}",
            )
    return figures.save(
        ax,
        os.path.join(run_dir, "loss.png"),
        ylabel="training loss (each group's own batch)",
        title="anyshard demo: elastic, a node leaves and returns (4 -> 2 -> 4 ranks)"
        if summary["scenario"] == "elastic"
        else "anyshard demo: FT-HSDP, one replica group fails and heals alone",
    )
