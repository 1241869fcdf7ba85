"""Goodput at scale: the simulator's profile from measured runs, its check on held-out runs, and
its figures at 1k, 10k and 100k GPUs (`anyshard.trainer_integration.planning.failures`).

    python tools/goodput_profile.py --calibrate cal.jsonl heal.jsonl --storage storage.jsonl \\
        --held-out held.jsonl held_sync.jsonl \\
        --out anyshard/trainer_integration/planning/failure_profile.json --write-docs

after the runs that write those JSON lines (`INTRO`: the trainer with one fault, the heal rate,
1 GiB saves and loads on disk and SeaweedFS, and the held-out runs; about 45 minutes). The lines
behind the shipped profile are in tests/fixtures/goodput.

The profile's per-rank rates come from bench_storage (1 GiB saves and loads, disk and S3) and
bench_goodput's heal rate; the fixed costs from the calibration runs' own events (start-up,
restart, restore, stall, a group's relaunch and heal, beyond their bytes). Held-out runs (other
fault counts, checkpoint interval, the elastic mode) are then predicted from the profile and the
calibration runs' step time alone, and compared with their measured paired medians.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import benchkit as h
from benchkit.trainer_runs import median_step, read_jsonl

from anyshard.trainer_integration.planning import failures as gp

HEADING = "## Goodput at scale: the failure simulator (`tools/goodput_profile.py`)"
INTRO = """The simulator of docs/planning.md with its costs measured here: per-rank rates from 1 GiB
saves, loads and heals; fixed costs from the calibration runs of the trainer (2 x 2 and 4 ranks,
one fault). Held-out runs (two faults, another checkpoint interval, the elastic mode) are
predicted from that profile and the calibration's step time alone. Goodput as
`tools/bench_goodput.py` measures it: steps x the fault-free step over wall time. The runs, whose
JSON lines tests/fixtures/goodput keeps (the command below reads them from there):

```bash
python tools/bench_goodput.py --modes restart,ft --steps 30 --fault-every 30 --reps 3 --heal-gib 0 --jsonl cal.jsonl
python tools/bench_goodput.py --modes none --heal-gib 1 --heal-reps 3 --jsonl heal.jsonl
python tools/bench_storage.py --parts local,s3 --server seaweedfs --reps 3 --jsonl storage.jsonl
python tools/bench_goodput.py --modes restart,ft,elastic --steps 40 --fault-every 20 --every 5 --reps 3 --heal-gib 0 --jsonl held.jsonl
python tools/bench_goodput.py --modes restart --steps 40 --fault-every 20 --every 5 --sync --reps 3 --heal-gib 0 --jsonl held_sync.jsonl
```"""
MODE = {"restart": "restart-async", "ft": "ft-hsdp", "elastic": "ft-elastic"}
FAMILY = {"restart": "restart", "ft": "ft", "elastic": "ft"}  # the layout each mode runs
GPUS = (1000, 10_000, 100_000)
PUBLISHED = [(44, "synchronous"), (80, "FT-HSDP")]  # ETT at O(100K) GPUs, arXiv 2602.00277


def _runs(recs: list[dict], mode: str, kind: str) -> list[dict]:
    return [r for r in recs if r.get("mode") == mode and r.get("kind") == kind]


def _end(run: dict) -> dict:
    return next(e for e in run["events"] if e["event"] == "end")


def workload(recs: list[dict], heal_bytes: float) -> dict:
    """Per mode family, from the fault-free calibration runs: the median step, the steps, the
    ranks per group and their state per rank, and the blocking per save."""
    out = {}
    for fam, ranks in (("restart", 4), ("ft", 2)):
        clean = _runs(recs, fam, "clean")
        out[fam] = {
            "step_s": h.median([median_step(r) for r in clean]),
            "steps": len(clean[0]["losses"]),
            "ranks": ranks,
            "state_gib": heal_bytes / ranks / h.GiB,  # a group holds the whole state
            # the group that logged the most steps: in FT-HSDP perhaps one that saves nothing
            "block_s": h.median(
                [_end(r)["ckpt_blocked_s"] / _end(r)["saves"] for r in clean if _end(r)["saves"]]
                or [0.0]
            ),  # fmt: skip
            "saves": h.median([_end(r)["saves"] for r in clean]),
        }
    return out


def gather(cal: list[dict], storage: list[dict], heartbeat_s: float) -> gp.Profile:
    """The profile: rates from the 1 GiB runs, fixed costs from the calibration runs' events
    less what their bytes take at those rates."""

    def rate(system: str, regime: str | None = None, key: str = "wall_s") -> float:
        got = [r for r in storage if r.get("system") == system and r.get("regime") == regime]
        if not got:
            raise SystemExit(f"--storage: no {system} record{f' on {regime}' if regime else ''}")
        return h.median([r["gib"] / r[key] for r in got])

    faults = [x for r in _runs(cal, "ft", "faulty") for x in r["per_fault"]]
    heal_bytes = h.median([x["heal_bytes"] for x in faults])
    w = workload(cal, heal_bytes)
    heals = [r for r in cal if r.get("heal") == "dp_shard=2 -> dp_shard=2"]
    if not heals:
        raise SystemExit("--calibrate: no heal-rate record (bench_goodput --heal-gib 1)")
    heal_rate = h.median([r["wall_s"] / (r["gib"] / 2) for r in heals])  # s per GiB per rank
    restarts = [x for r in _runs(cal, "restart", "faulty") for x in r["per_fault"]]
    local_load, block_rate = rate("load", "disk"), 1 / rate("steady", "disk", "block_s")
    rs, fs = w["restart"], w["ft"]

    def fixed(fam: str) -> float:  # a fault-free job's time outside its steps and saves
        x = w[fam]
        return h.median([r["wall_s"] - x["steps"] * x["step_s"] - x["saves"] * x["block_s"]
                         for r in _runs(cal, fam, "clean")])  # fmt: skip

    absorb = []
    for r in _runs(cal, "ft", "faulty"):  # the healthy group's pace while the other is away
        t = {x["step"]: x["time"] for x in r["losses"]}
        for x in r["per_fault"]:
            k, back = x["step"], x["heal_step"]
            slow = (t[back] - t[k] - x["healthy_stall_s"]) / ((back - k) * fs["step_s"])
            absorb.append(max(0.0, slow - 1))
    return gp.Profile(
        startup_s=fixed("restart"),
        ft_startup_s=fixed("ft"),
        restart_s=h.median([x["recovery_s"] - x["restore_s"] - rs["step_s"] for x in restarts]),
        restore_fixed_s=max(
            0.0, h.median([x["restore_s"] for x in restarts]) - rs["state_gib"] / local_load
        ),  # fmt: skip
        load_gib_s=rate("anyshard_load"),
        save_gib_s=rate("anyshard_save"),
        local_load_gib_s=local_load,
        local_save_gib_s=rate("sync", "disk"),
        async_block_s_per_gib=block_rate,
        async_block_fixed_s=max(0.0, rs["block_s"] - rs["state_gib"] * block_rate),
        heal_s_per_gib=heal_rate,
        heal_fixed_s=max(
            0.0, h.median([x["heal_s"] for x in faults]) - fs["state_gib"] * heal_rate
        ),  # fmt: skip
        stall_s=h.median([x["healthy_stall_s"] for x in faults]),
        heartbeat_s=heartbeat_s,
        group_restart_s=h.median([x["recovery_s"] - x["heal_s"] - fs["step_s"] for x in faults]),
        absorb=h.median(absorb),
        source={"workload": w, "heal_bytes": heal_bytes},
    )


def predict(profile: gp.Profile, run: dict, mode: str, back_s: float) -> float:
    """The simulated wall time of a held-out run (``run``: its steps, checkpoints and faults)
    from the profile and the calibration runs' step time."""
    w = profile.source["workload"][FAMILY[mode]]
    ft = mode != "restart"
    cluster = gp.Cluster(
        gpus=w["ranks"] * (2 if ft else 1), replicas=2 if ft else 1, gpus_per_node=w["ranks"],
        state_gib=w["state_gib"], step_s=w["step_s"], every_steps=run["every"],
        mtbf_gpu_h=math.inf, detect_s=None, launch_s=None, ft_detect_s=None,
        group_launch_s=None, spare_nodes=0, repair_h=back_s / 3600 if mode == "elastic" else 0.0,
        storage_gib_s=None, network_gib_s=None, tier="local", absorb=None,
    )  # fmt: skip
    c = gp.costs(profile, cluster)
    steps = [f["step"] for f in run["faults"]]
    faults = [(k, 1) for k in steps] if ft else steps
    sim = "restart-sync" if run["sync"] else MODE[mode]
    return gp.simulate(sim, c, steps=run["steps"], faults=faults).wall_s


def validate(profile: gp.Profile, held: list[dict], args) -> list[list[str]]:
    """Per held-out mode (and steps, interval, sync or async saves), measured (median [min-max]
    of the runs) and predicted: the paired goodput (a fault-free run's wall time over the
    paired faulty run's) and the goodput with faults (steps x the fault-free step over wall
    time: the pair's measured step; for the prediction, the calibration's)."""
    for r in held:  # what bench_goodput records (and the flags, for runs that did not)
        r.update({k: r.get(k, v) for k, v in
                  (("steps", args.held_steps), ("every", args.held_every), ("sync", False))})  # fmt: skip
    kinds = dict.fromkeys((r["mode"], r["steps"], r["every"], r["sync"]) for r in held
                          if r.get("kind") == "faulty")  # fmt: skip
    rows = []
    for mode, steps, every, sync in kinds:
        same = [r for r in held if (r.get("mode"), r["steps"], r["every"], r["sync"])
                == (mode, steps, every, sync)]  # fmt: skip
        clean, faulty = _runs(same, mode, "clean"), _runs(same, mode, "faulty")
        step = profile.source["workload"][FAMILY[mode]]["step_s"]
        wall = [predict(profile, r, mode, args.back_s) for r in faulty]
        base = predict(profile, {**clean[0], "faults": []}, mode, args.back_s)
        paired = [c["wall_s"] / f["wall_s"] for c, f in zip(clean, faulty, strict=True)]
        got = [steps * median_step(c) / f["wall_s"] for c, f in zip(clean, faulty, strict=True)]
        pred_paired, pred = base / h.median(wall), steps * step / h.median(wall)
        err = lambda p, m: f"{100 * (p - h.median(m)) / h.median(m):+.1f}%"  # noqa: E731
        what = f"{mode}, {'sync' if sync else 'async'} saves every {every}, faults at steps "
        rows.append([what + str([x["step"] for x in faulty[0]["faults"]]),
                     h.fmt_spread(paired, ".3f"), f"{pred_paired:.3f}", err(pred_paired, paired),
                     h.fmt_spread(got, ".3f"), f"{pred:.3f}", err(pred, got)])  # fmt: skip
    return rows


def scale(profile: gp.Profile, seeds: int) -> tuple[list[list[str]], dict, float]:
    """Each mode at 1k, 10k, 100k GPUs (the default cluster), at its best checkpoint interval:
    ETT, goodput and stall per failure with 95% intervals; the most CPU seconds one 30-day
    100k-GPU run took."""
    rows, curves, slowest = [], {m: [] for m in gp.MODES}, 0.0
    for n in GPUS:
        c = gp.costs(profile, gp.Cluster(gpus=n))
        for m in gp.MODES:
            s = gp.best_interval(m, c, 30.0, seeds)
            curves[m].append(s.ett[0])
            rows.append([f"{n:,}", m, str(s.every_steps), gp.fmt_pct(s.ett), gp.fmt_pct(s.goodput),
                         f"{s.stall_s[0] / 60:.1f} +- {s.stall_s[1] / 60:.1f} min", f"{s.failures:.0f}"])  # fmt: skip
            if n == GPUS[-1]:
                t0 = time.process_time()
                gp.simulate(m, dataclasses.replace(c, every_steps=s.every_steps), days=30)
                slowest = max(slowest, time.process_time() - t0)
    return rows, curves, slowest


SENSITIVITY = [  # (label, Cluster field, low, high) around the 100k-GPU default
    ("GPU MTBF (h)", "mtbf_gpu_h", 25340.0, 101360.0),
    ("state per GPU (GiB)", "state_gib", 1.0, 16.0),
    ("whole-job detection (s)", "detect_s", 60.0, 600.0),
    ("whole-job relaunch (s)", "launch_s", 60.0, 900.0),
    ("FT detection (s)", "ft_detect_s", 5.0, 120.0),
    ("group relaunch (s)", "group_launch_s", 15.0, 300.0),
    ("replica groups", "replicas", 4, 50),
    ("object store (GiB/s)", "storage_gib_s", 465.0, 7450.0),
    ("node repair (h)", "repair_h", 4.0, 72.0),
    ("spare nodes (default 64)", "spare_nodes", 0, 256),
    ("spare swapped in (s)", "swap_s", 60.0, 1800.0),
    ("failure clock shape (Weibull k)", "weibull_k", 0.7, 1.5),
]


def sensitivity(profile: gp.Profile, seeds: int) -> list[list[str]]:
    """ETT at 100k GPUs of the best restart mode and of ft-hsdp (and ft-hsdp's goodput), with
    one parameter at a time at its low and high value."""
    rows = []
    for label, key, lo, hi in SENSITIVITY:
        cells = []
        for v in (lo, hi):
            c = gp.costs(profile, dataclasses.replace(gp.Cluster(), **{key: v}))
            best = max(gp.best_interval(m, c, 30.0, seeds).ett[0] for m in gp.MODES[:3])
            ft = gp.best_interval("ft-hsdp", c, 30.0, seeds)
            cells.append(f"{100 * best:.0f}% / {100 * ft.ett[0]:.0f}% ({100 * ft.goodput[0]:.0f}%)")
        rows.append([label, f"{lo:g}", cells[0], f"{hi:g}", cells[1]])
    return rows


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "goodput"  # the same file for the same figures
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, ys in curves.items():
        ax.plot(GPUS, [100 * y for y in ys], marker="o", label=m)
    for y, what in PUBLISHED:
        ax.scatter([1e5], [y], marker="x", s=60, zorder=3, label=f"published: {what}")
    ax.set(xscale="log", xlabel="GPUs", ylabel="effective training time (%)", ylim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, records=False)
    p.add_argument("--calibrate", nargs="+", required=True, help="bench_goodput JSON lines")
    p.add_argument("--storage", required=True, help="bench_storage JSON lines")
    p.add_argument("--held-out", nargs="+", help="bench_goodput JSON lines of runs to predict")
    p.add_argument("--held-steps", type=int, default=40, help="their --steps where unrecorded")
    p.add_argument("--held-every", type=int, default=5, help="their --every where unrecorded")
    p.add_argument("--back-s", type=float, default=5.0, help="their --back-s (5)")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="the runs' --heartbeat-ms")
    p.add_argument("--out", help="write the profile here (JSON)")
    p.add_argument("--seeds", type=int, default=10, help="seeds per simulated figure (10)")
    p.add_argument("--plot", default="docs/goodput_ett.svg", help="ETT against GPUs per mode")
    args, load = p.parse_args(argv), h.RunLoad()
    cal = [x for f in args.calibrate for x in read_jsonl(f)]
    profile = gather(cal, read_jsonl(args.storage), args.heartbeat_ms / 1000)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    about = {"command": h.rerun_command(__file__, argv), "date": when, "machine": h.machine_lines()}
    profile = dataclasses.replace(profile, source={**about, **profile.source})
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}")
    blocks: list = ["Profile (per rank; fixed costs beyond the bytes):",
                    (["cost", "value"], [[k, f"{v:.4g}"] for k, v in dataclasses.asdict(
                        profile).items() if k != "source"])]  # fmt: skip
    if args.held_out:
        head = ["held-out runs", "faults / no fault, paired: measured", "predicted", "error",
                "goodput with faults: measured", "predicted", "error"]  # fmt: skip
        blocks += ["Held-out runs, predicted from the profile (median [min-max] of the runs):",
                   (head, validate(profile, [x for f in args.held_out for x in read_jsonl(f)],
                                   args))]  # fmt: skip
    rows, curves, slowest = scale(profile, args.seeds)
    head = ["GPUs", "mode", "interval (steps)", "ETT", "goodput", "stall per failure", "failures"]
    blocks += [f"The default cluster (docs/planning.md), 30 days, mean +- 95% over {args.seeds} "
               "seeds:", (head, rows),
               f"One 100k-GPU, 30-day run: at most {slowest:.3f} CPU s (one core)."]  # fmt: skip
    head = ["parameter at 100k GPUs", "low", "ETT: best restart / ft-hsdp (goodput)", "high",
            "ETT (goodput)"]  # fmt: skip
    blocks += ["Sensitivity:", (head, sensitivity(profile, max(2, args.seeds // 2)))]
    if args.plot:
        plot(curves, args.plot)
    run = f"profile from {', '.join(args.calibrate)} and {args.storage}"
    h.report(args, argv, __file__, "goodput_sim", run, blocks, load, heading=HEADING, intro=INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
