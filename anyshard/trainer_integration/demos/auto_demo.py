"""``anyshard demo --scenario autolayout``: the job picks its own layout, then rebalances around
a straggler.

Two CPU ranks start under a poor configured layout (tp=2) with ``parallel.auto = "online"``: the
job measures its step, trials the layouts the cost model predicts faster through the live
relayout path (no checkpoint written or read), settles on the fastest measured, and when rank 1
becomes a straggler (``ANYSHARD_SLOW``, from mid-run) gives it a smaller share of each global
batch. ``summary.json`` holds every decision (candidates with predicted and measured step times,
the chosen layout, switch seconds, the reason) and ``step_time.png`` shows the step time over
the run with the trials, switches, straggler and rebalance marked.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from anyshard.trainer_integration.demos import figures
from anyshard.trainer_integration.demos.follow import records as _records

__all__ = ["print_summary", "plot", "summarize"]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(run_dir: str, configured: str, slow_from: int, factor: float) -> dict[str, Any]:
    """The scenario's summary from ``run_dir``'s losses.jsonl and events.jsonl."""
    losses = _records(os.path.join(run_dir, "losses.jsonl"))
    events = _records(os.path.join(run_dir, "events.jsonl"))
    steps = [
        {"step": b["step"], "layout": b["layout"], "step_s": b["time"] - a["time"]}
        for a, b in zip(losses, losses[1:], strict=False)
    ]
    decisions = [e for e in events if e["event"].startswith("auto_")]
    switches = [e for e in events if e["event"] == "relayout"]
    rebalance = next((d["step"] for d in decisions if d["event"] == "auto_rebalance"), None)
    changed = max([0, *(e["step"] + 2 for e in switches)])  # a step after the last switch
    final = losses[-1]["layout"] if losses else None

    def window(lo: int, hi: int) -> float | None:
        return _median([s["step_s"] for s in steps if lo < s["step"] <= hi])

    end = losses[-1]["step"] if losses else 0
    return {
        "scenario": "autolayout",
        "configured_layout": configured,
        "final_layout": final,
        "steps": end,
        "straggler": {"rank": 1, "factor": factor, "from_step": slow_from},
        "decisions": decisions,
        "switches": [
            {
                "step": e["step"],
                "from": e["from"],
                "to": e["to"],
                "switch_s": e["build_s"] + e["redistribute_s"],
            }
            for e in switches
        ],
        "median_step_s": {
            "configured": _median([s["step_s"] for s in steps if s["layout"] == configured][1:]),
            "settled": window(changed, slow_from),
            "straggler": window(slow_from + 1, rebalance if rebalance is not None else end),
            "rebalanced": window(rebalance + 1, end) if rebalance is not None else None,
        },
        "rebalanced_at": rebalance,
        "final_loss": losses[-1]["loss"] if losses else None,
        "step_times": steps,
    }


def print_summary(summary: dict[str, Any], log) -> None:
    """The decisions and the median step of each stretch, one line each."""
    for d in summary["decisions"]:
        what = d.get("to") or (f"shares {d['shares']}" if "shares" in d else "")
        log(f"  step {d['step']:>3}  {d['event'][5:]:<9} {what:<18} {d['reason']}")
    m = summary["median_step_s"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f} ms"

    log(
        f"median step: configured {summary['configured_layout']} {ms(m['configured'])}, settled "
        f"{summary['final_layout']} {ms(m['settled'])}, straggler {ms(m['straggler'])}, "
        f"rebalanced {ms(m['rebalanced'])}; final loss {summary['final_loss']:.3f}"
    )


def plot(run_dir: str, summary: dict[str, Any]) -> str | None:
    """``RUN_DIR/step_time.png``: the step time, with trials, switches, straggler and
    rebalance marked; None without matplotlib."""
    ax = figures.new_axes()
    if ax is None:
        return None
    by_layout: dict[str, list[dict]] = {}
    for s in summary["step_times"]:
        by_layout.setdefault(s["layout"], []).append(s)
    for layout, rows in by_layout.items():
        ax.plot([r["step"] for r in rows], [r["step_s"] * 1e3 for r in rows], ".", label=layout)
    for d in summary["decisions"]:
        kind = d["event"][5:]
        style = {"trial": ("orange", ":"), "switch": ("purple", "-."), "rebalance": ("green", "--")}
        if kind in style:
            color, line = style[kind]
            what = d.get("to") or "data shares " + "/".join(map(str, d.get("shares", [])))
            ax.axvline(d["step"], color=color, linestyle=line, label=f"{kind}: {what}")
    ax.axvline(
        summary["straggler"]["from_step"],
        color="red",
        linestyle="--",
        label=f"rank 1 slows {summary['straggler']['factor']:g}x",
    )
    return figures.save(
        ax,
        os.path.join(run_dir, "step_time.png"),
        ylabel="step time (ms)",
        title="anyshard demo: the job chooses its layout and rebalances a straggler",
        legend_fontsize=7,
    )
