"""``anyshard plan``: the recovery mode, checkpoint interval, tier and spare nodes for a job, from
the failure simulator (`anyshard.trainer_integration.planning.failures`).

    anyshard plan --gpus 100000
    anyshard plan --gpus 100000 --profile my_profile.json --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from anyshard.trainer_integration.planning.failures import fmt_pct, plan
from anyshard.trainer_integration.planning.recovery_costs import Cluster, Profile

__all__ = ["main"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _parser() -> argparse.ArgumentParser:
    d = Cluster()
    p = argparse.ArgumentParser(
        prog="anyshard plan",
        description="Simulate a training job's failures and recoveries in every mode and\n"
        "recommend one: the recovery mode, checkpoint interval (against the Young/Daly\n"
        "optimum), tier and spare nodes, with each alternative's expected effective training\n"
        "time (ETT) and goodput. Costs per rank come from a profile measured by the project's\n"
        "benchmarks (--profile; default: the one measured on its own machine); the cluster's\n"
        "from the options, whose defaults and sources docs/goodput.md lists.",
        epilog="examples:\n  anyshard plan --gpus 100000\n"
        "  anyshard plan --gpus 16384 --state-gib 2 --mtbf-hours 30000 --spares 64\n"
        "  anyshard plan --gpus 100000 --profile my_profile.json --json",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--state-gib", type=float, default=d.state_gib, help="checkpoint GiB per GPU")
    p.add_argument("--mtbf-hours", type=float, default=d.mtbf_gpu_h, help="MTBF of one GPU (h)")
    p.add_argument("--profile", help="a profile JSON written by tools/goodput_profile.py")
    p.add_argument("--step-s", type=float, default=d.step_s, help="a fault-free step (s)")
    p.add_argument("--replicas", type=int, help="replica groups (default: 12, or 1 per node)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
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
    p.add_argument("--days", type=float, default=30.0, help="simulated wall time per seed")
    p.add_argument("--seeds", type=int, default=8, help="runs per mode and interval")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _cluster(a: argparse.Namespace) -> Cluster:
    """The cluster the options state (12 replica groups, or one per node where fewer)."""
    nodes = max(1, a.gpus // a.gpus_per_node)
    return Cluster(
        gpus=a.gpus, replicas=a.replicas or min(12, nodes), gpus_per_node=a.gpus_per_node,
        state_gib=a.state_gib, step_s=a.step_s, mtbf_gpu_h=a.mtbf_hours,
        weibull_k=a.weibull_k, detect_s=a.detect_s, launch_s=a.launch_s,
        ft_detect_s=a.ft_detect_s, group_launch_s=a.group_launch_s, spare_nodes=a.spares,
        swap_s=a.swap_s, repair_h=a.repair_hours, storage_gib_s=a.storage_gib_s,
        network_gib_s=a.network_gib_s,
    )  # fmt: skip


def _print_report(a: argparse.Namespace, out: dict) -> None:
    """The plan for people: the job, a row per mode, the recommendation."""
    best, c = out["best"], out["costs"]
    job_mtbf_min = c.mtbf_gpu_s / c.gpus / 60
    print(f"{a.gpus} GPUs in {c.groups} replica group(s), {a.state_gib:g} GiB per GPU, a failure "
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


def main(argv: list[str] | None = None) -> int:
    """``anyshard plan``: the recovery mode, checkpoint interval and spares for a job."""
    a = _parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
