"""Stragglers of every kind against the online scheduler: 2 ranks of the reference trainer
(dp_shard=2), each pinned to a core of its own (``train.pin_cores``), where from step
``--slow-from`` until ``--slow-until`` rank 1's own work per step takes ``--factor`` x as long:
a noisy neighbour (a busy process pinned to rank 1's core: it waits for the CPU), more compute
(real extra multiplies in its transformer blocks and after loading its batch, ``--factor - 1``
x its work), a sleep in the same places (``ANYSHARD_SLOW``'s default), and none. Each kind runs
fixed (even data shares) and online (``parallel.auto online``, no layout trials), paired and
alternating. Over the straggler phase (from 3 steps after it starts to its end): the online run's
throughput over the fixed run's, and the share of what fixed loses (against the fixed run
without a straggler, same steps) that online recovers; whether the scheduler named rank 1 and
whether its shares went back to even after the phase; with no straggler, whether the shares
stayed even.

    python tools/bench_straggler.py --reps 3                  # the figures (about 12 min)
    python tools/bench_straggler.py --quick                   # smoke test (about 2 min)

The model is tiny.toml made larger per sample (``--model.dim 128 --model.ffn_dim 512
--train.seq_len 64``: a step of about 0.25 s on 2 cores, most of it per sample, which is
what a data share can move); trainer options after the tool's own replace these.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import benchkit as h
from benchkit.trainer_runs import train

# each kind: ANYSHARD_SLOW's mode (None: no straggler)
KINDS = {"neighbour": "neighbour", "compute": "compute", "sleep": "sleep", "none": None}
PHASE_LAG = 3  # the phase measured starts this many steps after the straggler
# tiny.toml with more work per sample (a step's fixed part, the optimizer and the collectives'
# latency, is not what data shares move)
MODEL = ["--model.dim", "128", "--model.ffn_dim", "512", "--train.seq_len", "64"]


def phase_s(losses: list[dict], first: int, last: int) -> float:
    """Seconds from the end of step ``first`` to the end of step ``last`` (one attempt)."""
    at = {r["step"]: r["time"] for r in losses}
    return at[last] - at[first]


def summary(run: dict, first: int, last: int, even: list[int]) -> dict:
    rebalances = [e for e in run["events"] if e["event"] == "auto_rebalance"]
    during = [e for e in rebalances if e["step"] <= last]
    final = rebalances[-1]["shares"] if rebalances else even
    return {
        "phase_s": phase_s(run["losses"], first, last),
        "rebalances": len(rebalances),
        "named_1": bool(during) and "data rank 1 " in during[0]["reason"],
        "phase_shares": during[-1]["shares"] if during else even,
        "final_shares": final,
        "back": max(abs(a - b) for a, b in zip(final, even, strict=True)) <= 1,
        "wall_s": run["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    quick = {"reps": 1, "steps": 30, "slow_from": 6, "slow_until": 20, "kinds": "neighbour,none"}
    p = h.parser(__doc__, reps=3, quick=quick)
    p.add_argument("--steps", type=int, default=96, help="steps per run (96)")
    p.add_argument("--slow-from", type=int, default=8, help="the straggler's first step (8)")
    p.add_argument("--slow-until", type=int, default=66, help="its first step back (66)")
    p.add_argument("--factor", type=int, default=2, help="how much slower rank 1 runs (2)")
    p.add_argument("--global-batch", type=int, default=24, help="train.global_batch (24)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)} (all)")
    p.add_argument("--config", default=None, help="the trainer's TOML (tiny.toml)")
    args, extra = p.parse_known_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not set(kinds) <= set(KINDS) or "none" not in kinds:
        p.error(f"--kinds: of {', '.join(KINDS)}, with none (the baseline)")
    first, last = args.slow_from + PHASE_LAG, args.slow_until
    if not 0 < first < last <= args.steps:
        p.error("--slow-from + 3 < --slow-until <= --steps")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from anyshard.trainer_integration.gpt.config import TINY_CONFIG

    config = args.config or TINY_CONFIG
    gb = args.global_batch
    even = [gb // 2, gb // 2]
    opts = [
        "--config", config, "--parallel.dp_shard", "2", "--train.pin_cores", "true",
        "--train.steps", str(args.steps), "--train.global_batch", str(gb),
        "--checkpoint.every_steps", str(10**6), *MODEL, *extra,
    ]  # fmt: skip
    online = ["--parallel.auto", "online", "--parallel.auto_trials", "0"]
    records, load = h.Records(args.jsonl, "straggler"), h.RunLoad()
    systems = [f"{k} {m}" for k in kinds for m in ("fixed", "online")]
    out: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        for rep, order in h.rotations(systems, args.reps):
            for name in order:
                kind, mode = name.split()
                slow = KINDS[kind]
                env = f"1:{args.factor}:{args.slow_from}:{args.slow_until}:{slow}" if slow else ""
                os.environ["ANYSHARD_SLOW"] = env
                run_dir = os.path.join(tmp, f"{kind}-{mode}-{rep}")
                try:
                    run = train(run_dir, [*opts, *(online if mode == "online" else [])],
                                nproc=2, launcher="torchrun")  # fmt: skip
                finally:
                    os.environ.pop("ANYSHARD_SLOW", None)
                rec = summary(run, first, last, even)
                out[name].append(records.add(rec, system=name, rep=rep))
                print(f"rep {rep} {name}: phase {rec['phase_s']:.2f} s, {rec['rebalances']} "
                      f"rebalances, shares {rec['phase_shares']} -> {rec['final_shares']}",
                      flush=True)  # fmt: skip
    base = [r["phase_s"] for r in out["none fixed"]]
    rows, checks = [], []
    for kind in kinds:
        fixed, onl = out[f"{kind} fixed"], out[f"{kind} online"]
        speed = [f["phase_s"] / o["phase_s"] for f, o in zip(fixed, onl, strict=True)]
        lost = [x["phase_s"] - b for x, b in zip(fixed, base, strict=True)]
        rec_ = [
            (f["phase_s"] - o["phase_s"]) / lo if lo > 0 else float("nan")
            for f, o, lo in zip(fixed, onl, lost, strict=True)
        ]
        shares = statistics.mode(tuple(o["phase_shares"]) for o in onl)
        named = sum(o["named_1"] for o in onl)
        back = sum(o["back"] for o in onl)
        rebal = sum(o["rebalances"] for o in onl)
        rows.append([
            kind,
            h.fmt_spread([x["phase_s"] for x in fixed]),
            h.fmt_spread([x["phase_s"] for x in onl]),
            h.fmt_spread(speed) + "x",
            "-" if kind == "none" else h.fmt_spread([100 * r for r in rec_], ".0f") + "%",
            f"{list(shares)}",
            f"{named}/{len(onl)}" if kind != "none" else "-",
            f"{back}/{len(onl)}",
        ])  # fmt: skip
        if kind == "none":
            checks.append(("shares unchanged with no straggler", rebal == 0,
                           f"{rebal} rebalances in {len(onl)} online runs"))  # fmt: skip
            continue
        med_speed, med_rec = h.median(speed), h.median(rec_)
        checks.append((f"{kind}: online >= 1.15x fixed", med_speed >= 1.15, f"{med_speed:.2f}x"))
        checks.append((f"{kind}: >= 25% of the loss recovered", med_rec >= 0.25,
                       f"{100 * med_rec:.0f}%"))  # fmt: skip
        checks.append((f"{kind}: rank 1 named, shares back after", named == back == len(onl),
                       f"named in {named}, back in {back} of {len(onl)}"))  # fmt: skip
    head = ["straggler", "fixed s", "online s", "online speed", "loss recovered",
            "shares in phase", "rank 1 named", "shares back (+-1)"]  # fmt: skip
    run_text = (
        f"2 ranks (dp_shard=2, pinned a core each), {args.steps} steps of global batch {gb} "
        f"({os.path.basename(config)}); rank 1 {args.factor}x slower from step {args.slow_from} "
        f"until {args.slow_until}; phase: steps {first}-{last}; {args.reps} reps, "
        f"median [min-max]"
    )
    blocks = [(head, rows), h.targets(checks)]
    heading = "## Stragglers of every kind, rebalanced online (`tools/bench_straggler.py`)"
    h.report(args, argv, __file__, "straggler", run_text, blocks, load, heading=heading,
             data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
