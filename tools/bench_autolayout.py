"""The layout scheduler end to end (``parallel.auto = online``) against fixed layouts, on one
world size, each pair alternating in one run: a poor configured layout fixed vs online from it;
the oracle (every valid layout run fixed: the best is the target); the best layout configured,
fixed vs online; a straggler (rank 1 ``--slow-factor`` x from mid-run) on the best data-parallel
layout (where data shares can move), fixed vs online (what it loses against the oracle's run of
that layout); and the cost model's accuracy: Spearman rank correlation and mean absolute percentage
error of the step times predicted from the start-up calibration alone against the oracle's
measured ones. End to end is the trainer's run from its start (calibration, trials and
switches included) to its last step.

    python tools/bench_autolayout.py --world 2 --steps 100 --reps 3
    python tools/bench_autolayout.py --world 4 --poor pp=2,tp=2 --steps 100 --reps 3
    python tools/bench_autolayout.py --world 2 --steps 30 --poor pp=2 --memory-gib 1 \\
        --config anyshard/trainer_integration/gpt/state_heavy.toml  # a budget against replication
    python tools/bench_autolayout.py --world 4 --steps 20 --accuracy-only  # the cost model alone
    python tools/bench_autolayout.py --world 2 --steps 12 --reps 1 --config \\
        anyshard/trainer_integration/gpt/tiny.toml   # smoke test
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import benchkit as h
from benchkit.trainer_runs import step_times, train

POOR = {2: "tp=2", 4: "pp=2,tp=2"}
MEMORY_RUN_STEPS = 7  # a memory run's steps: the memory event's, then more for the step time
# the heading its sections go under in docs/benchmarks.md
UNDER = "## Autolayout: the job picks its layout (`tools/bench_autolayout.py`)"
ONLINE = ["--parallel.auto", "online"]


def _dims(layout: str) -> list[str]:
    """``tp=2,dp_shard=2`` (or ``tp=2 x dp_shard=2``) as trainer options."""
    items = [x.strip() for x in layout.replace(" x ", ",").split(",") if x.strip()]
    return [w for x in items for w in (f"--parallel.{x.split('=')[0]}", x.split("=")[1])]


def _layouts(cfg, world: int, rates=None, **kw) -> dict:
    """The cost model's table of the valid layouts (``tp=2,dp_shard=2``: its row), fastest first."""
    from anyshard.trainer_integration.gpt.layout_chooser.costmodel import rank_layouts
    from anyshard.trainer_integration.planning.step_cost import Rates

    rows = rank_layouts(cfg, world, rates or Rates.nominal(), **kw).rows
    return {r.layout.replace(" x ", ","): r for r in rows}


def end_to_end_s(run: dict) -> float:
    """From the trainer's start (before calibration) to its last step."""
    start = next(e for e in run["events"] if e["event"] == "start")
    return run["losses"][-1]["time"] - (start["time"] - start["startup_to_first_step_s"])


class Runs:
    """The trainer's runs of one invocation, by name, and those that failed."""

    def __init__(self, args, opts: list[str], records: h.Records):
        self.args, self.opts, self.records, self.runs, self.failed = args, opts, records, {}, []

    def job(self, tmp: str, name: str, rep: int, layout: str, more=(), env: str = "") -> None:
        run_dir = os.path.join(tmp, f"{name}-{rep}".replace("=", "").replace(",", "-"))
        if env:
            os.environ["ANYSHARD_SLOW"] = env
        try:
            run = train(run_dir, [*_dims(layout), *self.opts, *more], nproc=self.args.world)
        finally:
            os.environ.pop("ANYSHARD_SLOW", None)
        rec = {
            "e2e_s": end_to_end_s(run),
            "step_ms": statistics.median(step_times(run["losses"])[1:]) * 1e3,
            "final_loss": run["losses"][-1]["loss"],
            "final_layout": run["losses"][-1]["layout"],
            "decisions": [e for e in run["events"] if e["event"].startswith("auto_")],
        }
        if os.path.exists(rates := os.path.join(run_dir, "rates.json")):
            rec["rates"] = open(rates).read()
        rec = self.records.add(rec, system=name, rep=rep, layout=layout)
        self.runs.setdefault(name, []).append(rec)

    def alternate(self, systems: dict[str, tuple], reps: int, strict: bool = False) -> None:
        """Each of ``systems`` (name: layout, trainer options, ANYSHARD_SLOW) ``reps`` times in
        rotated order; a failed trainer ends the run where ``strict``, else it is reported (its
        error lines and the log's tail) and not counted."""
        with tempfile.TemporaryDirectory(prefix="bench-autolayout-") as tmp:
            for rep, order in h.rotations(list(systems), reps):
                for name in order:
                    try:
                        self.job(tmp, name, rep, *systems[name])
                    except SystemExit as e:
                        if strict:
                            raise
                        self.failed.append(f"{name} (repetition {rep})")
                        print(f"{self.failed[-1]} failed:\n{e}", file=sys.stderr, flush=True)

    def med(self, name: str, key: str = "e2e_s") -> float:
        return h.median_of(self.runs[name], key) if name in self.runs else float("nan")

    def spread(self, name: str) -> str:
        return h.fmt_spread([r["e2e_s"] for r in self.runs[name]], ".1f")

    def fixed(self) -> dict[str, float]:
        """The median step seconds of each layout run fixed (``fixed LAYOUT``)."""
        return {n[6:]: self.med(n, "step_ms") / 1e3 for n in self.runs if n.startswith("fixed ")}


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=3)
    p.add_argument("--world", type=int, default=2, choices=(2, 4), help="ranks (2)")
    p.add_argument("--steps", type=int, default=100, help="steps per run (100)")
    p.add_argument("--poor", help="the poor configured layout (tp=2 on 2 ranks, pp=2,tp=2 on 4)")
    p.add_argument("--slow-factor", type=float, default=2.0, help="the straggler's factor (2)")
    p.add_argument("--oracle-reps", type=int, default=1, help="fixed runs of each layout (1)")
    p.add_argument("--global-batch", type=int, help="the trainer's train.global_batch")
    only = "instead: only the straggler pair on LAYOUT, beside the same layout without it"
    p.add_argument("--straggler-only", metavar="LAYOUT", help=only)
    only = "instead: the cost model's accuracy alone, every valid layout run fixed"
    p.add_argument("--accuracy-only", action="store_true", help=only)
    p.add_argument("--config", help="the trainer's TOML config; unknown options go to the trainer")
    only = "instead: each layout's RSS growth, then online under this budget (GiB per rank)"
    p.add_argument("--memory-gib", type=float, help=only)
    args, extra = p.parse_known_args(argv)
    if args.global_batch:
        extra += ["--train.global_batch", str(args.global_batch)]
    if args.steps < (4 if args.accuracy_only else 12):
        p.error("--steps: at least 12 (measure, two trials, settle); 4 with --accuracy-only")
    poor = args.poor or POOR[args.world]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from anyshard.trainer_integration.gpt.config import load_config

    cfg = load_config(args.config, extra, environ={})
    if args.config:
        extra += ["--config", args.config]
    records, load = h.Records(args.jsonl, "autolayout"), h.RunLoad()
    opts = ["--train.steps", str(args.steps), "--checkpoint.every_steps", str(10**6), *extra]
    if args.memory_gib is not None:
        return memory(args, argv, cfg, poor, opts, records, load)
    runs, trainer = Runs(args, opts, records), " ".join(extra) or "-"
    if args.accuracy_only:
        return accuracy_only(args, argv, cfg, runs, trainer, load)
    slow_from = args.steps // 2
    slow = f"1:{args.slow_factor:g}:{slow_from}"
    straggler = f"straggler rank 1 x{args.slow_factor:g} from step {slow_from}"
    if lay := args.straggler_only:
        pair = {"fixed": (lay, [], ""), "straggler fixed": (lay, [], slow),
                "straggler online": (lay, ONLINE, slow)}  # fmt: skip
        runs.alternate(pair, args.reps, strict=True)
        lost = runs.med("straggler fixed") - runs.med("fixed")
        back = runs.med("straggler fixed") - runs.med("straggler online")
        back = back / lost if lost > 0 else 0.0
        head = ["run", "end to end s (median, min-max)", "median step ms", "final shares"]
        rows = [[n, runs.spread(n), f"{runs.med(n, 'step_ms'):.0f}",
                 next((str(d.get("shares")) for d in reversed(runs.runs[n][-1]["decisions"])
                       if d["event"] == "auto_rebalance"), "even")] for n in pair]  # fmt: skip
        checks = [("a 2x straggler: online recovers >= 25% of what fixed loses", back >= 0.25,
                   f"{back:.0%} of {lost:.1f} s")]  # fmt: skip
        text = (f"{args.world} ranks, {lay}, {args.steps} steps a run, {args.reps} alternating "
                f"repetitions, {straggler}, trainer options {trainer}")  # fmt: skip
        blocks, name = [(head, rows), h.targets(checks)], f"autolayout_straggler_{args.world}"
        h.report(args, argv, __file__, name, text, blocks, load, under=UNDER, data=records.rows)
        return 0

    runs.alternate({f"fixed {c}": (c, []) for c in _layouts(cfg, args.world)}, args.oracle_reps)
    oracle = {n[6:]: runs.med(n) for n in runs.runs}
    best = min(oracle, key=oracle.__getitem__)
    # the straggler runs where shares can move: the best layout with data parallelism
    best_dp = min((c for c in oracle if "dp_" in c and "pp=" not in c), key=oracle.__getitem__)
    systems = {
        "poor fixed": (poor, [], ""),
        "poor online": (poor, ONLINE, ""),
        "best fixed": (best, [], ""),
        "best online": (best, ONLINE, ""),
        "straggler fixed": (best_dp, [], slow),
        "straggler online": (best_dp, ONLINE, slow),
    }
    runs.alternate(systems, args.reps)
    # accuracy: the start-up calibration's predictions (no trial refined them) against the
    # oracle's measured median steps
    calibrated = runs.runs["poor online"][0]
    predicted, measured, both, rho, mape = accuracy(cfg, args.world, calibrated, runs)
    speedup = runs.med("poor fixed") / runs.med("poor online")
    vs_oracle = runs.med("poor online") / oracle[best]
    best_cost = runs.med("best online") / runs.med("best fixed")
    # its loss against the same layout without it: paired where that is the best fixed
    lost = runs.med("straggler fixed") - (
        runs.med("best fixed") if best_dp == best else oracle[best_dp]
    )
    recovered = runs.med("straggler fixed") - runs.med("straggler online")
    recovered = recovered / lost if lost > 0 else float("nan")
    loss = runs.med("best fixed", "final_loss")
    loss_gap = abs(runs.med("poor online", "final_loss") - loss) / loss
    head = ["run", "end to end s (median, min-max)", "median step ms", "final layout", "final loss"]
    rows = [[n, runs.spread(n), f"{runs.med(n, 'step_ms'):.0f}", runs.runs[n][-1]["final_layout"],
             f"{runs.med(n, 'final_loss'):.4f}"] for n in systems if n in runs.runs]  # fmt: skip
    oracle_head = ["layout (fixed)", "end to end s", "measured step ms", "predicted step ms"]
    oracle_rows = [[c, f"{oracle[c]:.1f}", f"{measured[c] * 1e3:.0f}",
                    f"{predicted[c] * 1e3:.0f}" if c in predicted else "-"]
                   for c in sorted(oracle, key=oracle.__getitem__)]  # fmt: skip
    checks = [
        ("online from the poor layout >= 1.18x its fixed run", speedup >= 1.18, f"{speedup:.2f}x"),
        ("within 10% of the oracle's best fixed layout", vs_oracle <= 1.10,
         f"{vs_oracle:.2f}x the oracle ({best}, {oracle[best]:.1f} s)"),
        ("<= 5% slower than fixed when configured best", best_cost <= 1.05, f"{best_cost:.2f}x"),
        *accuracy_checks(rho, mape, both),
        ("a 2x straggler: online recovers >= 25% of what fixed loses", recovered >= 0.25,
         f"{recovered:.0%} of {lost:.1f} s"),
        ("final loss within 1% of the fixed run's", loss_gap <= 0.01, f"{loss_gap:.2%}"),
        ("runs that failed (not counted)", None, ", ".join(runs.failed) or "none"),
    ]  # fmt: skip
    run = (
        f"{args.world} ranks, {args.steps} steps a run, {args.reps} alternating repetitions, "
        f"oracle {args.oracle_reps} run(s) per layout, {straggler}, trainer options {trainer}"
    )
    blocks = [(head, rows), (oracle_head, oracle_rows), h.targets(checks)]
    name = f"autolayout_{args.world}"
    h.report(args, argv, __file__, name, run, blocks, load, under=UNDER, data=records.rows)
    return 0


def accuracy(cfg, world: int, calibrated: dict, runs: Runs):
    """The step times the cost model predicts from ``calibrated``'s start-up rates, against the
    median steps of the layouts run fixed: predicted and measured (s, by layout), the layouts in
    both, Spearman's rho and the mean absolute percentage error."""
    from anyshard.trainer_integration.planning.step_cost import Rates

    rates = Rates.from_json(calibrated["rates"])
    predicted = {c: r.step_s for c, r in _layouts(cfg, world, rates).items()}
    measured = runs.fixed()
    both = [c for c in measured if c in predicted]
    rho = h.spearman([predicted[c] for c in both], [measured[c] for c in both])
    mape = statistics.mean(abs(predicted[c] - measured[c]) / measured[c] for c in both)
    return predicted, measured, both, rho, mape


def accuracy_checks(rho: float, mape: float, both: list) -> list[tuple]:
    return [
        ("rank correlation >= 0.8 (start-up calibration alone)", rho >= 0.8,
         f"Spearman {rho:.2f} over {len(both)} layouts"),
        ("mean absolute percentage error <= 15%", mape <= 0.15, f"{mape:.0%}"),
    ]  # fmt: skip


def accuracy_only(args, argv, cfg, runs: Runs, trainer: str, load) -> int:
    """The cost model's accuracy alone: every valid layout run fixed, the first calibrating at its
    start (``auto = start`` with no trial keeps the layout); its calibration predicts all of
    them, against the measured median steps. A layout whose run fails is reported, not counted."""
    from anyshard.trainer_integration.gpt.layout_chooser.costmodel import Refiner, predict
    from anyshard.trainer_integration.planning.step_cost import Rates

    calibrating = ["--parallel.auto", "start", "--parallel.auto_trials", "0"]
    candidates = list(_layouts(cfg, args.world))
    systems = {f"fixed {c}": (c, calibrating if i == 0 else []) for i, c in enumerate(candidates)}
    runs.alternate(systems, args.oracle_reps)
    lead = candidates[0]
    if f"fixed {lead}" not in runs.runs:
        raise SystemExit(f"the calibrating run ({lead}) failed: no predictions to compare")
    first = runs.runs[f"fixed {lead}"][0]
    predicted, measured, both, rho, mape = accuracy(cfg, args.world, first, runs)
    # what the scheduler predicts before its first trial: the model refined by the running
    # layout's measured steps (one scale for every term)
    rates = Rates.from_json(first["rates"])
    par = {c: r.parallel for c, r in _layouts(cfg, args.world, rates).items()}
    refiner = Refiner(cfg, rates)
    refiner.add(par[lead], measured[lead])
    refined = {c: predict(cfg, par[c], rates, refiner.scales()).step_s for c in both}
    mape1 = statistics.mean(abs(refined[c] - measured[c]) / measured[c] for c in both)
    head = ["layout (fixed)", "measured step ms (median)", "predicted step ms", "error",
            f"refined by {lead}'s steps", "error"]  # fmt: skip
    rows = [[c, f"{measured[c] * 1e3:.0f}"] for c in sorted(both, key=measured.__getitem__)]
    for row in rows:
        for x in (predicted, refined):
            c = row[0]
            row += [f"{x[c] * 1e3:.0f}", f"{(x[c] - measured[c]) / measured[c]:+.0%}"]
    checks = [
        *accuracy_checks(rho, mape, both),
        ("after the first layout's steps (the model the first trial is chosen by): MAPE", None,
         f"{mape1:.0%}; Spearman unchanged (one scale for all)"),
        ("contention measured at calibration (ranks sharing cores)", None,
         f"{rates.contention:.2f}"),
        ("runs that failed (not counted)", None, ", ".join(runs.failed) or "none"),
    ]  # fmt: skip
    text = (f"{args.world} ranks, every valid layout fixed for {args.steps} steps "
            f"({args.oracle_reps} run(s) each, alternating), predictions from the calibration at "
            f"the start of the first run ({lead}); trainer options {trainer}")  # fmt: skip
    blocks, name = [(head, rows), h.targets(checks)], f"autolayout_accuracy_{args.world}"
    h.report(args, argv, __file__, name, text, blocks, load, under=UNDER, data=runs.records.rows)
    return 0 if not runs.failed else 1


def memory(args, argv, cfg, poor: str, opts: list[str], records, load) -> int:
    """The memory budget: each layout (fitting or not) run fixed for `MEMORY_RUN_STEPS`, with
    the ranks' allocator lean (what the trainer runs under a budget, `gpt.malloc`) and as it
    is, alternating: its ranks' RSS growth (peak over the memory event's steps less the RSS
    before the model was built) against `memory.memory_per_rank`, and the median step time;
    then ``auto = online`` from ``poor`` under the budget: the layouts it ran and its ranks'
    largest RSS growth over the whole run."""
    from anyshard.trainer_integration.gpt.relayout import MEMORY_STEPS

    budget = int(args.memory_gib * 2**30)
    fits = set(_layouts(cfg, args.world, memory_bytes=budget))
    short = [*opts, "--train.steps", str(MEMORY_RUN_STEPS)]  # the later --train.steps wins
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory(prefix="bench-autolayout-memory-") as tmp:
        for n, layout in enumerate(_layouts(cfg, args.world, memory_bytes=1 << 50)):
            got = {}
            for mode in ("lean", "default")[:: 1 if n % 2 == 0 else -1]:
                name = f"{layout.replace('=', '').replace(',', '-')}-{mode}"
                run = train(os.path.join(tmp, name), [*_dims(layout), *short, "--train.malloc",
                            mode], nproc=args.world)  # fmt: skip
                (ev,) = [e for e in run["events"] if e["event"] == "memory"]
                growth = [p - s for p, s in zip(ev["rss_peak"], ev["rss_start"], strict=True)]
                err = max(abs(ev["counted_bytes"] - g) / g for g in growth)
                step_s = statistics.median(step_times(run["losses"])[1:])
                got[mode] = (growth, err, step_s, ev["malloc"])
                rec = {"layout": layout, "counted": ev["counted_bytes"], "growth": growth,
                       "err": err, "step_s": step_s, "malloc": ev["malloc"]}  # fmt: skip
                records.add(rec, system=f"fixed {mode}", fits=layout in fits)
            if layout in fits:
                worst = max(worst, got["lean"][1])
            mib = lambda g: " / ".join(f"{x / 2**20:.0f}" for x in g)  # noqa: E731
            rows.append([layout, "yes" if layout in fits else "no",
                         f"{ev['counted_bytes'] / 2**20:.0f}",
                         *(f"{mib(got[m][0])} ({got[m][1]:.0%})" for m in ("lean", "default")),
                         f"{got['lean'][2]:.2f} / {got['default'][2]:.2f}",
                         f"{got['lean'][2] / got['default'][2]:.2f}"])  # fmt: skip
            if got["lean"][3] != "lean":
                raise SystemExit(f"{layout}: the trainer did not run lean (not glibc?)")
        more = [*ONLINE, "--parallel.auto_memory_gib", str(args.memory_gib)]
        run = train(os.path.join(tmp, "online"), [*_dims(poor), *opts, *more], nproc=args.world)
    ran = [poor] + [e["to"].replace(" x ", ",") for e in run["events"] if e["event"] == "relayout"]
    (end,) = [e for e in run["events"] if e["event"] == "end"]
    decisions = [e for e in run["events"] if e["event"].startswith("auto_")]
    rec = {"ran": ran, "rss_growth_max": end["rss_growth_max"], "decisions": decisions}
    records.add(rec, system="online")
    said = "; ".join(
        f"step {e['step']} {e['event'][5:]}" + (f" {e['to']}" if e.get("to") else "")
        + f" ({e['reason']})"
        for e in decisions
    )  # fmt: skip
    outside = [x for x in ran if x not in fits]
    head = ["layout", "fits the budget", "counted MiB", "RSS growth MiB per rank, lean (error)",
            "as it is (error)", "step s: lean / as it is", "ratio"]  # fmt: skip
    checks = [
        ("no layout outside the budget is run", not outside,
         f"online ran {', '.join(dict.fromkeys(ran))}" + (f"; outside: {outside}" if outside else "")),
        ("no run exceeds the budget", end["rss_growth_max"] <= budget,
         f"online: largest RSS growth of a rank {end['rss_growth_max'] / 2**30:.2f} GiB, budget "
         f"{args.memory_gib:g} GiB"),
        ("the count within 25% of the measured RSS growth (layouts that fit, lean)", worst <= 0.25,
         f"worst {worst:.0%}"),
        ("the online run's decisions", None, said or "none"),
    ]  # fmt: skip
    run_text = (
        f"{args.world} ranks, budget {args.memory_gib:g} GiB per rank, each layout fixed for "
        f"{MEMORY_RUN_STEPS} steps with the allocator lean and as it is, alternating (growth: "
        f"peak RSS over {MEMORY_STEPS} steps less the RSS before the model was built; step s: "
        f"median from the second step), then online (lean) from {poor} for {args.steps} steps; "
        "trainer options "
        f"{' '.join(opts[4:]) or '-'}"
    )
    blocks, name = [(head, rows), h.targets(checks)], f"autolayout_memory_{args.world}"
    h.report(args, argv, __file__, name, run_text, blocks, load, under=UNDER, data=records.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
