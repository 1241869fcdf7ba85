"""The scaling study of docs/planning.md: for dense and MoE models on H100 clusters from 1,024
to ~100,000 GPUs at a fixed token batch, what the cost model says is the best layout at each
size, its MFU, and its effective throughput after failures in every recovery mode; the best
layout of each layout family, plotted against GPU count; where the best family changes.

Layout families (by where the data-parallel ranks go and whether the model is pipelined):
``FSDP``: weights sharded over the data-parallel ranks (dp_shard > 1; with tp/cp/ep), no
pipeline; ``FSDP+PP``: the same, pipelined; ``3D (ZeRO-1)``: Megatron's tp x pp x dp with the
optimizer sharded over replicas (dp_shard = 1, pp > 1); ``TP+DP (ZeRO-1)``: the same without a
pipeline. The failure simulation is ``anyshard plan``'s (`planning.joint_plan`), at its defaults
(Llama 3's failure rate, 30-day runs shortened to ``--days``), for the fastest layouts of each
size and each family's best (and their ZeRO-0 variants): per recovery mode, the best of them.

    python tools/plan_scaling.py --write-docs          # tables into docs/planning.md, the plot
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchkit.report import rerun_command, write_section  # noqa: E402

from anyshard.trainer_integration.planning.hardware import load_hardware  # noqa: E402
from anyshard.trainer_integration.planning.joint_plan import Planner, plan_layouts  # noqa: E402
from anyshard.trainer_integration.planning.model_shape import model_shape_from_hf  # noqa: E402
from anyshard.trainer_integration.planning.recovery_costs import Cluster, Profile  # noqa: E402
from anyshard.trainer_integration.planning.transformer_cost import (  # noqa: E402
    Batch,
    Estimate,
    Layout,
)

ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "planning.md")
PLOT = os.path.join(ROOT, "docs", "planning_scaling.png")
MODELS = {  # name: (config, global batch in sequences, sequence length): 16M tokens a step
    "Llama 3 70B": ("examples/models/llama3-70b.json", 2048, 8192),
    "Llama 3 405B": ("examples/models/llama3-405b.json", 2048, 8192),
    "Mixtral 8x22B": ("examples/models/mixtral-8x22b.json", 4096, 4096),
}
GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 98304)
FAMILIES = ("FSDP", "FSDP+PP", "3D (ZeRO-1)", "TP+DP (ZeRO-1)")
TOP = 5  # the fastest layouts planned through the failure simulator, with each family's best


def family(e: Estimate) -> str:
    lay = e.layout
    if lay.dp_shard > 1:
        return "FSDP+PP" if lay.pp > 1 else "FSDP"
    return "3D (ZeRO-1)" if lay.pp > 1 else "TP+DP (ZeRO-1)"


def short(e: Estimate) -> str:
    return short_layout(dataclasses.asdict(e.layout))


def short_layout(d: dict[str, Any]) -> str:
    lay = Layout(**d)
    dims = [f"{d}{getattr(lay, d)}" for d in ("tp", "cp", "ep", "pp", "vpp") if getattr(lay, d) > 1]
    if lay.dp_shard > 1:
        dims.append(f"fsdp{lay.dp_shard}")
    if lay.dp_replicate > 1:
        dims.append(f"{'zero1-' if lay.zero else ''}dp{lay.dp_replicate}")
    rc = {"none": "", "selective": " sel-rc", "full": " full-rc"}[lay.recompute]
    return " ".join(dims) + f" mb{lay.micro_batch}{rc}"


def study(name: str, days: float, seeds: int) -> list[dict[str, Any]]:
    """Per GPU count: the best layout overall and per family, and the best's plans."""
    path, gb, seq = MODELS[name]
    with open(os.path.join(ROOT, path)) as f:
        shape = model_shape_from_hf(json.load(f))
    hw = load_hardware("h100-sxm")
    planner = Planner(shape, hw, Batch(gb, seq))
    out = []
    for gpus in GPUS:
        t0 = time.perf_counter()
        found = planner.layouts(gpus, {})
        if not found:
            out.append({"gpus": gpus, "best": None})
            continue
        best_of = {}
        for e in found:  # fastest first
            best_of.setdefault(family(e), e)
        cands = list({id(e): e for e in [*found[:TOP], *best_of.values()]}.values())
        plans = plan_layouts(planner, cands, {}, Profile.load(None), Cluster(gpus=gpus),
                             days=days, seeds=seeds)  # fmt: skip
        by_mode: dict[str, dict] = {}
        for p in plans:  # best first: each mode's best layout (or ZeRO-0 variant)
            by_mode.setdefault(p["mode"], p)
        out.append({"gpus": gpus, "best": found[0], "families": best_of, "modes": by_mode,
                    "seconds": time.perf_counter() - t0})  # fmt: skip
        print(f"{name} {gpus}: {short(found[0])} MFU {found[0].mfu:.1%} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    return out


def crossovers(rows: list[dict[str, Any]]) -> list[str]:
    """Where the best family changes with GPU count."""
    notes, last = [], None
    for r in rows:
        if r["best"] is None:
            continue
        fam = family(r["best"])
        if last is not None and fam != last:
            notes.append(f"from {r['gpus']:,} GPUs {fam} overtakes {last}")
        last = fam
    return notes


def effective_mfu(e: Estimate, plan: dict[str, Any]) -> float:
    """MFU after failures of a plan of ``e`` or of its ZeRO-0 variant (its own step time)."""
    return e.mfu * e.step_s / plan["step_s"] * plan["goodput"]


def markdown(name: str, rows: list[dict[str, Any]]) -> list[str]:
    modes = ("restart-sync", "restart-async", "restart-local", "ft-hsdp", "ft-elastic")
    head = ["GPUs", "best layout", "family", "MFU", "step s",
            *[f"{m} eff. MFU" for m in modes], "best after failures"]  # fmt: skip
    lines = [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["best"] is None:
            lines.append(f"| {r['gpus']:,} | none fits | | | |" + " |" * (len(modes) + 1))
            continue
        e = r["best"]
        eff = []
        for m in modes:
            p = r["modes"].get(m)
            eff.append(f"{effective_mfu(e, p):.1%}" if p else "-")
        top = max(r["modes"].values(), key=lambda p: p["effective_tokens_per_s"])
        eff.append(f"{top['mode']}, `{short_layout(top['layout'])}`")
        lines.append(f"| {r['gpus']:,} | `{short(e)}` | {family(e)} | {e.mfu:.1%} | "
                     f"{e.step_s:.2f} | " + " | ".join(eff) + " |")  # fmt: skip
    fams = ["| GPUs | " + " | ".join(FAMILIES) + " |", "|" + "---|" * (len(FAMILIES) + 1)]
    for r in rows:
        if r["best"] is None:
            continue
        cells = [f"{r['families'][f].mfu:.1%}" if f in r["families"] else "-" for f in FAMILIES]
        fams.append(f"| {r['gpus']:,} | " + " | ".join(cells) + " |")
    cross = crossovers(rows) or ["the same family is best at every size"]
    return [*lines, "", "Best MFU per layout family:", "", *fams, "", "Crossovers: "
            + "; ".join(cross) + ".", ""]  # fmt: skip


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for col, (name, rows) in enumerate(results.items()):
        for fam in FAMILIES:
            pts = [(r["gpus"], r["families"][fam]) for r in rows
                   if r["best"] is not None and fam in r["families"]]  # fmt: skip
            if not pts:
                continue
            xs = [g for g, _ in pts]
            axes[0][col].plot(xs, [100 * e.mfu for _, e in pts], marker="o", label=fam)
        for mode in ("restart-sync", "restart-async", "ft-hsdp", "ft-elastic"):
            pts = [(r["gpus"], effective_mfu(r["best"], r["modes"][mode])) for r in rows
                   if r["best"] is not None and mode in r["modes"]]  # fmt: skip
            axes[1][col].plot([g for g, _ in pts], [100 * y for _, y in pts], marker="s",
                              label=mode)  # fmt: skip
        axes[0][col].set_title(f"{name}: predicted MFU, best layout per family")
        axes[1][col].set_title(f"{name}: MFU x goodput after failures, best plan per mode")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("H100 GPUs")
            ax.set_ylabel("%")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--days", type=float, default=10.0, help="simulated days per seed")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per mode and interval")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="of: " + ", ".join(MODELS))
    ap.add_argument("--write-docs", nargs="?", const=DOC, default=None, metavar="PATH")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = {name: study(name, a.days, a.seeds) for name in a.models}
    lines = [
        f"Command: `{rerun_command(__file__)}` ({datetime.date.today()}; "
        f"{time.perf_counter() - t0:.0f} s; H100-SXM nodes of 8 (`h100-sxm`), 16M tokens a "
        f"step; failures: `anyshard plan`'s defaults, {a.seeds} seeds x {a.days:g} days).",
        "",
    ]
    for name, rows in results.items():
        lines += markdown(name, rows)
    print("\n".join(lines))
    if a.write_docs:
        plot(results, os.path.join(os.path.dirname(a.write_docs), os.path.basename(PLOT)))
        write_section(a.write_docs, "plan_scaling", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
