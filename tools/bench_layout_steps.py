"""Step time of the reference trainer under each 2-rank layout: why an FT-HSDP group healed into
another layout paces the job.

    python tools/bench_layout_steps.py                      # dp_shard, cp, pp, tp; 10 steps each
    python tools/bench_layout_steps.py --layouts tp,dp_shard --steps 20
    python tools/bench_layout_steps.py --model.dim 512      # other words go to the trainer

Each layout runs the default model for ``--steps`` steps on 2 ranks (the trainer's own
launcher, one torch thread per rank, no checkpoints) and reports the median and the spread of
the step times from rank 0's ``losses.jsonl`` (the first step, which builds and warms up, left
out). FT-HSDP groups average their gradients every step, so a job whose groups run different
layouts steps at the pace of the slowest: `tools/bench_goodput.py`'s mode (c) heals a group into
tp=2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_goodput import _port, _timed_run  # noqa: E402


def step_times(layout: str, steps: int, extra: list[str], tmp: str) -> list[float]:
    """Seconds between consecutive steps of a ``steps``-step run under ``layout`` = 2."""
    run_dir = os.path.join(tmp, layout)
    cmd = [
        sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
        "--nproc-per-node", "2", "--max-restarts", "0",
        "--rdzv-endpoint", f"127.0.0.1:{_port()}",
        f"--parallel.{layout}", "2",
        "--train.steps", str(steps),
        "--checkpoint.every_steps", str(10**6),
        "--checkpoint.root", os.path.join(run_dir, "ckpt"),
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    _timed_run(cmd, f"{layout}=2", {})
    with open(os.path.join(run_dir, "losses.jsonl")) as f:
        times = [json.loads(x)["time"] for x in f if x.strip()]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layouts", default="dp_shard,cp,pp,tp", help="comma-separated mesh dims")
    p.add_argument("--steps", type=int, default=10, help="steps per layout (at least 3)")
    args, extra = p.parse_known_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps: at least 3 (the first step is left out)")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            dt = step_times(layout, args.steps, extra, tmp)
            rows.append((layout, statistics.median(dt), min(dt), max(dt), len(dt)))
            print(f"{layout}=2: median {rows[-1][1] * 1000:.0f} ms", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(
        f"| layout (2 ranks) | median step | fastest - slowest | vs {layouts[0]}=2 | steps timed |"
    )
    print("| --- | --- | --- | --- | --- |")
    for layout, med, lo, hi, n in rows:
        print(
            f"| {layout}=2 | {med * 1000:.0f} ms | {lo * 1000:.0f} - {hi * 1000:.0f} ms "
            f"| {med / base:.2f}x | {n} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
