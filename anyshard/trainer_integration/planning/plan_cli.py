"""``anyshard plan``: the recovery mode, checkpoint interval, tier and spare nodes for a job, from
the failure simulator (`anyshard.trainer_integration.planning.failures`); with ``--model``, the
job planned whole (`anyshard.trainer_integration.planning.joint_plan`): its layouts ranked by
the step-time model, the fastest simulated in every recovery mode at its best interval and
ranked by the tokens per second they keep after failures, and the layouts to reshard into when
nodes are lost.

    anyshard plan --gpus 100000
    anyshard plan --gpus 100000 --profile my_profile.json --json
    anyshard plan --model llama3_405b.json --gpus 98304 --global-batch 2048 --seq 8192
    anyshard plan --model gpt.json --hardware a100-80gb --gpus 64 --global-batch 512 \\
        --seq 2048 --layout tp=2,pp=2,dp_replicate=16 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from anyshard.trainer_integration.planning.failures import fmt_pct, plan
from anyshard.trainer_integration.planning.hardware import load_hardware
from anyshard.trainer_integration.planning.joint_plan import (
    COMPARE,
    MAX_TRIES,
    Planner,
    layout_json,
    plan_layouts,
    replan,
)
from anyshard.trainer_integration.planning.layout_search import search
from anyshard.trainer_integration.planning.model_shape import (
    ModelShape,
    model_shape_from_hf,
    parameter_count,
)
from anyshard.trainer_integration.planning.recovery_costs import Cluster, Profile
from anyshard.trainer_integration.planning.transformer_cost import RECOMPUTE, Batch, Layout

__all__ = ["main"]

TOP = 20  # layouts ranked and simulated, at most
# failure-plan options that --model replaces with each layout's own figures, and their defaults
_REPLACED = {"step_s": "--step-s", "state_gib": "--state-gib", "replicas": "--replicas",
             "gpus_per_node": "--gpus-per-node"}  # fmt: skip
# options of --model only
_MODEL_ONLY = {"global_batch": "--global-batch", "seq": "--seq", "micro_batch": "--micro-batch",
               "layout": "--layout", "recompute": "--recompute", "hardware": "--hardware",
               "sequence_parallel": "--sequence-parallel", "attention": "--attention",
               "top": "--top"}  # fmt: skip

_DESCRIPTION = f"""\
Simulate a training job's failures and recoveries in every mode and
recommend one: the recovery mode, checkpoint interval (against the Young/Daly
optimum), tier and spare nodes, with each alternative's expected effective training
time (ETT) and goodput. Costs per rank come from a profile measured by the project's
benchmarks (--profile; default: the one measured on its own machine); the cluster's
from the options, whose defaults and sources docs/planning.md lists.

With --model CONFIG.json (a Hugging Face config) the job is planned whole:
- layouts: every layout of --gpus (tp, pp, vpp, cp, ep, dp_shard, dp_replicate, ZeRO-1,
  micro-batch, recomputation, sequence parallelism) ranked by the step-time model on
  --hardware, fastest first (at most --top); --layout, --micro-batch, --recompute and
  --sequence-parallel pin what they state, the search choosing the rest (every dim
  pinned: that one layout predicted). --global-batch counts sequences of --seq tokens.
  Where no layout uses exactly --gpus GPUs (the data-parallel ranks must split the
  global batch, pp absorb an odd factor), the fastest of the first {COMPARE} counts below it
  that have one (in whole nodes, at most {MAX_TRIES} nodes fewer) is planned; the rest idle.
- plans: each of those layouts, and the ZeRO-0 variant of a ZeRO-1 one, simulated in
  every recovery mode at its best checkpoint interval (the failure options below
  apply; the layout's own step time and checkpoint state replace --step-s and
  --state-gib), ranked by effective tokens/s after failures = goodput x global batch
  x seq / step time. FT modes' replica groups are the layout's dp_replicate groups
  (one under ZeRO-1, which shards the optimizer over them); where a node holds ranks
  of several groups, adjacent groups are merged into whole nodes. For restart-local
  every_steps is the local tier's interval.
- replan: for 1, 2, 4 and 8 nodes lost, the layout to reshard into (global batch
  kept, --recompute and --sequence-parallel kept, the rest chosen anew) and its
  throughput (tokens/s, total and per GPU used): the fastest of the first {COMPARE} GPU
  counts, from the healthy GPUs down in whole nodes, that have a layout (fewer GPUs
  can be faster than an odd count's long pipeline); GPUs left out sit idle.
Fewer simulated seeds and days than without --model keep 100,000 GPUs within a
minute; raise --seeds and --days for tighter intervals."""

_EPILOG = """\
examples:
  anyshard plan --gpus 100000
  anyshard plan --gpus 16384 --state-gib 2 --mtbf-hours 30000 --spares 64
  anyshard plan --gpus 100000 --profile my_profile.json --json
  anyshard plan --model llama3_405b.json --gpus 98304 --global-batch 2048 --seq 8192
  anyshard plan --model gpt.json --hardware a100-80gb --gpus 64 --global-batch 512 \\
      --seq 2048 --layout tp=2,pp=2,dp_replicate=16 --recompute selective --json"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help  # no "(default: None)": the help says what happens
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    d = Cluster()
    p = argparse.ArgumentParser(prog="anyshard plan", description=_DESCRIPTION,
                                epilog=_EPILOG, formatter_class=_HelpFormatter)  # fmt: skip
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument(
        "--state-gib",
        type=float,
        help=f"checkpoint GiB per GPU (default: {d.state_gib:g}; --model: each layout's)",
    )
    p.add_argument("--mtbf-hours", type=float, default=d.mtbf_gpu_h, help="MTBF of one GPU (h)")
    p.add_argument("--profile", help="a profile JSON written by tools/goodput_profile.py")
    p.add_argument(
        "--step-s",
        type=float,
        help=f"a fault-free step, s (default: {d.step_s:g}; --model: each layout's)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="replica groups (default: 12, or 1 per node; --model: each layout's)",
    )
    help = f"GPUs per node (default: {d.gpus_per_node}; --model: the hardware's)"
    p.add_argument("--gpus-per-node", type=int, help=help)
    help = "spare nodes (default: every node in repair covered 99%% of the time)"
    p.add_argument("--spares", type=int, help=help)
    p.add_argument("--repair-hours", type=float, default=d.repair_h, help="a node's repair")
    p.add_argument("--swap-s", type=float, default=d.swap_s, help="a spare node swapped in")
    p.add_argument("--weibull-k", type=float, default=d.weibull_k, help="failure clock shape")
    p.add_argument("--detect-s", type=float, default=d.detect_s, help="whole job: detection")
    p.add_argument("--launch-s", type=float, default=d.launch_s, help="whole job: relaunch")
    p.add_argument("--ft-detect-s", type=float, default=d.ft_detect_s, help="FT: detection")
    p.add_argument("--group-launch-s", type=float, default=d.group_launch_s, help="FT: relaunch")
    p.add_argument("--storage-gib-s", type=float, default=d.storage_gib_s, help="object store")
    p.add_argument("--network-gib-s", type=float, default=d.network_gib_s, help="per GPU")
    help = "simulated wall time per seed (default: 30; --model: 10)"
    p.add_argument("--days", type=float, help=help)
    p.add_argument("--seeds", type=int, help="runs per mode and interval (default: 8; --model: 2)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _model_options(p.add_argument_group("the job planned whole (--model)"))
    return p


def _model_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", metavar="CONFIG.json", help="a Hugging Face config.json")
    help = "a100-80gb, h100-sxm or a hardware JSON file (default: h100-sxm)"
    g.add_argument("--hardware", metavar="NAME|FILE", help=help)
    g.add_argument("--global-batch", type=int, help="sequences per step (required)")
    g.add_argument("--seq", type=int, help="tokens per sequence (required)")
    g.add_argument("--micro-batch", type=int, help="pin the micro-batch (sequences)")
    help = "pin dims, e.g. tp=8,pp=16,vpp=2,cp=1,ep=1,dp_shard=64,dp_replicate=1,zero=1"
    g.add_argument("--layout", help=help)
    g.add_argument("--recompute", choices=RECOMPUTE, help="pin activation recomputation")
    g.add_argument("--sequence-parallel", action="store_true", help="pin sequence parallelism")
    g.add_argument(
        "--attention", choices=("flash", "unfused"), help="attention kernel (default: flash)"
    )
    g.add_argument(
        "--top", type=int, help=f"layouts ranked and simulated (default and at most: {TOP})"
    )


def _failure_options(a: argparse.Namespace) -> dict[str, Any]:
    """The cluster's failure and recovery figures the options state."""
    return dict(
        mtbf_gpu_h=a.mtbf_hours, weibull_k=a.weibull_k, detect_s=a.detect_s,
        launch_s=a.launch_s, ft_detect_s=a.ft_detect_s, group_launch_s=a.group_launch_s,
        spare_nodes=a.spares, swap_s=a.swap_s, repair_h=a.repair_hours,
        storage_gib_s=a.storage_gib_s, network_gib_s=a.network_gib_s,
    )  # fmt: skip


def _cluster(a: argparse.Namespace) -> Cluster:
    """The cluster the options state (12 replica groups, or one per node where fewer)."""
    d = Cluster()
    per_node = d.gpus_per_node if a.gpus_per_node is None else a.gpus_per_node
    nodes = max(1, a.gpus // per_node)
    return Cluster(
        gpus=a.gpus, replicas=a.replicas or min(12, nodes), gpus_per_node=per_node,
        state_gib=d.state_gib if a.state_gib is None else a.state_gib,
        step_s=d.step_s if a.step_s is None else a.step_s, **_failure_options(a),
    )  # fmt: skip


def _print_report(a: argparse.Namespace, out: dict) -> None:
    """The plan for people: the job, a row per mode, the recommendation."""
    best, c = out["best"], out["costs"]
    job_mtbf_min = c.mtbf_gpu_s / c.gpus / 60
    gib = Cluster().state_gib if a.state_gib is None else a.state_gib
    print(f"{a.gpus} GPUs in {c.groups} replica group(s), {gib:g} GiB per GPU, a failure "
          f"every {job_mtbf_min:.1f} min on average; {a.seeds} x {a.days:g} days per row")  # fmt: skip
    head = f"{'mode':<14} {'interval':>9} {'ETT':>16} {'goodput':>16} {'stall/failure':>14}"
    print(head)
    for m, r in out["rows"].items():
        stall = f"{r.stall_s[0]:.0f} s"
        print(
            f"{m:<14} {r.every_steps:>6} st {fmt_pct(r.ett):>16} {fmt_pct(r.goodput):>16} {stall:>14}"
        )
    where = "to every node's local disk" if best.mode == "restart-local" else "to the object store"
    print(f"recommended: {best.mode}, checkpoints {where} every {best.every_steps} steps "
          f"(Young/Daly: {out['young_daly_steps']:.0f}), {out['spares']} spare node(s)")  # fmt: skip


def _main_failures(a: argparse.Namespace) -> int:
    """Without --model: the failure plan of a job whose step time and state are given."""
    a.days = 30.0 if a.days is None else a.days
    a.seeds = 8 if a.seeds is None else a.seeds
    try:
        out = plan(Profile.load(a.profile), _cluster(a), days=a.days, seeds=a.seeds)
    except ValueError as e:
        print(f"anyshard plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        rows = {m: dataclasses.asdict(r) for m, r in out["rows"].items()}
        json.dump({"recommended": out["best"].mode, "spare_nodes": out["spares"], "modes": rows,
                   "young_daly_steps": out["young_daly_steps"]}, sys.stdout, indent=1)  # fmt: skip
        print()
        return 0
    _print_report(a, out)
    return 0


def _read_model(path: str) -> ModelShape:
    """The shape in the config.json at ``path`` (ValueError naming the file)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path}: cannot read a JSON config: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: a JSON object is expected")
    try:
        return model_shape_from_hf(config)
    except ValueError as e:
        raise ValueError(f"--model {path}: {e}") from None


def _pins(a: argparse.Namespace) -> dict[str, Any]:
    """What the user stated: the --layout dims and the options given."""
    pins: dict[str, Any] = dict(Layout.parse(a.layout)) if a.layout else {}
    if a.micro_batch is not None:
        if a.micro_batch < 1:
            raise ValueError(f"--micro-batch {a.micro_batch} (expected >= 1)")
        pins["micro_batch"] = a.micro_batch
    if a.recompute is not None:
        pins["recompute"] = a.recompute
    if a.sequence_parallel:
        pins["sequence_parallel"] = True
    return pins


def _check_options(a: argparse.Namespace) -> None:
    """Options that belong to the other mode, and what --model requires (ValueError)."""
    if a.model is None:
        given = [flag for k, flag in _MODEL_ONLY.items() if getattr(a, k) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --model CONFIG.json")
        return
    given = [flag for k, flag in _REPLACED.items() if getattr(a, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: with --model each layout's own figures are used")
    missing = [f for f, v in (("--global-batch", a.global_batch), ("--seq", a.seq)) if v is None]
    if missing:
        raise ValueError(f"--model needs {' and '.join(missing)}")
    for flag, v in (("--global-batch", a.global_batch), ("--seq", a.seq), ("--gpus", a.gpus)):
        if v < 1:
            raise ValueError(f"{flag} {v} (expected >= 1)")
    if a.top is not None and not 1 <= a.top <= TOP:
        raise ValueError(f"--top {a.top} (expected 1 to {TOP})")


def _plan_model(a: argparse.Namespace) -> dict[str, Any]:
    """The job planned whole, as the JSON output holds it (ValueError on a bad input)."""
    shape = _read_model(a.model)
    hw = load_hardware(a.hardware or "h100-sxm")
    pins = _pins(a)
    dpn = hw.devices_per_node
    if a.gpus % dpn:
        raise ValueError(
            f"--gpus {a.gpus} is not a whole number of {dpn}-GPU nodes of "
            f"{a.hardware or 'h100-sxm'} (the failure simulation takes whole nodes)"
        )
    days = 10.0 if a.days is None else a.days
    seeds = 2 if a.seeds is None else a.seeds
    batch = Batch(a.global_batch, a.seq)
    planner = Planner(shape, hw, batch, flash_attention=(a.attention or "flash") == "flash")
    used, found, compared = _fit(a, planner, pins)
    shown = found[: 1 if a.layout else a.top or TOP]
    base = Cluster(gpus=used, replicas=1, gpus_per_node=dpn, **_failure_options(a))
    plans = plan_layouts(planner, shown, pins, Profile.load(a.profile), base,
                         days=days, seeds=seeds)  # fmt: skip
    return {
        "model": {"config": a.model, "parameters": parameter_count(shape),
                  "shape": dataclasses.asdict(shape)},
        "hardware": a.hardware or "h100-sxm", "gpus": a.gpus, "gpus_used": used,
        "idle_gpus": a.gpus - used, "counts_compared": compared,
        "global_batch": batch.global_batch, "seq": batch.seq,
        "attention": a.attention or "flash", "pins": pins,
        "layouts_considered": len(found), "layouts": [layout_json(e) for e in shown],
        "plans": plans, "recommended": plans[0],
        "replan": replan(planner, a.gpus, pins),
        "simulation": {"days": days, "seeds": seeds, "mtbf_hours": a.mtbf_hours,
                       "layouts": len({json.dumps(p["layout"]) for p in plans})},
    }  # fmt: skip


def _fit(a: argparse.Namespace, planner: Planner, pins: dict[str, Any]) -> tuple:
    """`Planner.fit`; with ``--layout``, where the model says nothing fits in memory, the
    layout at its leanest options all the same, ``fits`` false, with a warning."""
    try:
        return planner.fit(a.gpus, pins)
    except ValueError as why:
        if not a.layout:
            raise
        try:
            found = search(planner.shape, planner.hw, planner.batch, a.gpus, pins,
                           flash_attention=planner.flash_attention, require_fit=False)  # fmt: skip
        except ValueError:
            raise why from None
    e = found[0]
    print(f"anyshard plan: warning: {e.layout.name()} needs {e.memory_bytes / 2**30:.1f} GiB "
          f"per GPU, over the {e.budget_bytes / 2**30:.1f} GiB the model allows; predicted "
          "anyway (\"fits\": false)", file=sys.stderr)  # fmt: skip
    return a.gpus, found, [{"gpus": a.gpus, "tokens_per_s": planner.batch.tokens / e.step_s}]


def _width(names: list[str]) -> int:
    return max([len("layout"), *map(len, names)])


def _print_layouts(out: dict[str, Any], rows: int = 10) -> None:
    """The fastest layouts: step time, MFU, model TFLOP/s and memory per GPU, dominant term."""
    print(f"{out['model']['parameters'] / 1e9:.1f}B parameters on {out['gpus_used']} GPUs "
          f"({out['hardware']}), global batch {out['global_batch']} x {out['seq']} tokens; "
          f"{out['layouts_considered']} layout(s) fit")  # fmt: skip
    if out["idle_gpus"]:
        print(f"no layout uses all {out['gpus']} GPUs: {out['idle_gpus']} sit idle")
    shown = out["layouts"][:rows]
    w = _width([e["name"] for e in shown])
    print(f"{'layout':<{w}} {'step s':>8} {'MFU':>6} {'TFLOP/s':>8} {'GiB':>6}  dominant")
    for e in shown:
        print(f"{e['name']:<{w}} {e['step_s']:>8.3f} {100 * e['mfu']:>5.1f}% "
              f"{e['model_tflops_per_gpu']:>8.1f} {e['memory_gib_per_gpu']:>6.1f}  "
              f"{e['dominant']}")  # fmt: skip


def _print_plans(out: dict[str, Any], rows: int = 10) -> None:
    """The best (layout, mode, interval) by effective tokens per second after failures."""
    sim = out["simulation"]
    print(f"\nafter failures ({sim['seeds']} seeds x {sim['days']:g} days each; "
          f"{sim['layouts']} layout(s) x 5 modes, each at its best interval):")  # fmt: skip
    shown = out["plans"][:rows]
    names = [p["name"] + (" (zero=0)" if p["zero0_variant"] else "") for p in shown]
    w = _width(names)
    print(
        f"{'layout':<{w}} {'mode':<13} {'every':>6} {'goodput':>8} {'tokens/s':>10} {'groups':>6}"
    )
    for name, p in zip(names, shown, strict=True):
        print(f"{name:<{w}} {p['mode']:<13} {p['every_steps']:>6} {100 * p['goodput']:>7.1f}% "
              f"{p['effective_tokens_per_s']:>10.4g} {p['replicas']:>6}")  # fmt: skip
    best = out["recommended"]
    print(f"recommended: {best['name']}{' (zero=0)' if best['zero0_variant'] else ''}, "
          f"{best['mode']}, a checkpoint every {best['every_steps']} steps")  # fmt: skip


def _print_replan(out: dict[str, Any]) -> None:
    """Per nodes lost, the layout to reshard into and its throughput."""
    print("\nnodes lost: the layout to reshard into (global batch kept)")
    w = _width([r["name"] for r in out["replan"] if r["layout"]])
    print(f"{'lost':>4} {'GPUs':>7} {'idle':>5} {'layout':<{w}} {'tokens/s':>10} {'per GPU':>8}")
    for r in out["replan"]:
        if r["layout"] is None:
            print(f"{r['nodes_lost']:>4} {r['gpus_healthy']:>7}  none: {r['error']}")
            continue
        print(f"{r['nodes_lost']:>4} {r['gpus_used']:>7} {r['idle_gpus']:>5} {r['name']:<{w}} "
              f"{r['tokens_per_s']:>10.4g} {r['tokens_per_s_per_gpu']:>8.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``anyshard plan``: the recovery mode, checkpoint interval and spares for a job; with
    ``--model``, its layouts too, and the layouts to reshard into when nodes are lost."""
    a = _parser().parse_args(argv)
    try:
        _check_options(a)
        if a.model is None:
            return _main_failures(a)
        out = _plan_model(a)
    except ValueError as e:
        print(f"anyshard plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    _print_layouts(out)
    _print_plans(out)
    _print_replan(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
