"""Step time of the reference trainer under each 2-rank layout (no checkpoints, the trainer's
launcher), ``--reps`` runs per layout in rotated order, step times from rank 0's ``losses.jsonl``
pooled: FT-HSDP groups of different layouts step at the pace of the slowest.

    python tools/bench_layout_steps.py                      # dp_shard, cp, pp, tp; 10 steps each
    python tools/bench_layout_steps.py --layouts tp,dp_shard --steps 3 --config \\
        anyshard/trainer_integration/gpt/tiny.toml          # smoke test; other words: the trainer
"""

from __future__ import annotations

import os
import sys
import tempfile

import benchkit as h
from benchkit.trainer_runs import step_times, train

UNDER = "## Step time of each 2-rank layout (`tools/bench_layout_steps.py`)"


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--layouts", default="dp_shard,cp,pp,tp", help="comma-separated mesh dims")
    p.add_argument("--steps", type=int, default=10, help="steps per run (at least 3)")
    p.add_argument("--reps", type=int, default=1, help="runs of each layout (1)")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (initialisation, data)")
    args, extra = p.parse_known_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3 (the first step is left out)")
    layouts = h.words(p, "--layouts", args.layouts)
    records, load, times = h.Records(args.jsonl, "layout_steps"), h.RunLoad(), {}
    opts = ["--train.steps", str(args.steps), "--checkpoint.every_steps", str(10**6)]
    opts += ["--train.seed", str(args.seed), *extra]
    with tempfile.TemporaryDirectory(prefix="bench-layout-") as tmp:
        for rep, order in h.rotations(layouts, args.reps):
            for layout in order:
                run_dir = os.path.join(tmp, f"{layout}-{rep}")
                run = train(run_dir, [f"--parallel.{layout}", "2", *opts], nproc=2)
                dt = records.add({"steps_s": step_times(run["losses"])}, layout=layout)
                times.setdefault(layout, []).extend(dt["steps_s"])
    base = h.median(times[layouts[0]])
    head = ["layout (2 ranks)", "median step ms", "fastest - slowest ms", f"vs {layouts[0]}=2"]
    rows = [[f"{x}=2", f"{h.median(t) * 1e3:.0f}", f"{min(t) * 1e3:.0f} - {max(t) * 1e3:.0f}",
             f"{h.median(t) / base:.2f}x", len(t)] for x, t in times.items()]  # fmt: skip
    run = f"{args.steps} steps per run, {args.reps} run(s) per layout, trainer seed {args.seed}"
    run += f", trainer options {' '.join(extra) or '-'}"
    h.report(args, argv, __file__, "layout_steps", run, [([*head, "steps timed"], rows)], load,
             under=UNDER, data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
