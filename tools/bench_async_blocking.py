"""How long checkpointing holds the reference trainer's steps up: sync saves, async saves whose
staging copy blocks the step, and async saves staged during forward and backward.

Runs the trainer as ``anyshard demo`` does (4 CPU ranks, pp=2 x dp_shard=2, the default model,
the warm launcher) once per mode and storage root, each run ``--steps`` steps with a checkpoint
every ``--every`` steps, plus one run without checkpoints (all of it ``--reps`` times,
interleaved). A run's blocking is `Checkpointer.blocked_s` on its slowest rank (the trainer's
``end`` event): the time spent in ``save`` calls (a sync save's whole write and commit), in
optimizer steps waiting for a staging copy, and reserving the staging buffers at startup. The
first save is included. Goodput is the median step time of the same repetition's
no-checkpoint run x steps over the run's training time (first step to last).

    python tools/bench_async_blocking.py                  # tmpfs and disk, 30 steps, save every 3
    python tools/bench_async_blocking.py --write-docs     # also replace the section in docs/benchmarks.md
    python tools/bench_async_blocking.py --reps 3         # three runs of each, the median shown

Other words (``--config FILE``, ``--model.dim 128``, ...) go to the trainer as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from markdown_section import replace_section, rerun_command  # noqa: E402

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- async_blocking:begin -->", "<!-- async_blocking:end -->"

MODES = {
    "sync": ["--checkpoint.async_", "false"],
    "async, staging blocks the step": [
        "--checkpoint.async_", "true", "--checkpoint.stage_in_background", "false",
    ],
    "async, staged during the step": [
        "--checkpoint.async_", "true", "--checkpoint.stage_in_background", "true",
    ],
}  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def run(run_dir: str, ckpt_root: str, steps: int, every: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
        "--nproc-per-node", "4", "--max-restarts", "0",
        "--rdzv-endpoint", f"127.0.0.1:{_port()}",
        "--parallel.pp", "2", "--parallel.dp_shard", "2",
        "--train.steps", str(steps),
        "--checkpoint.every_steps", str(every),
        "--checkpoint.keep_last", "2",
        "--checkpoint.root", ckpt_root,
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("ANYSHARD_FAULT", "ANYSHARD_FAULTS")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"training failed ({out.returncode}):\n{out.stderr[-4000:]}")
    losses = _records(os.path.join(run_dir, "losses.jsonl"))
    (end,) = [e for e in _records(os.path.join(run_dir, "events.jsonl")) if e["event"] == "end"]
    times = [r["time"] for r in losses]
    return {
        "steps": [b - a for a, b in zip(times, times[1:], strict=False)],
        "train_s": times[-1] - times[0],
        "blocked_s": end["ckpt_blocked_s"],
        "saves": end["saves"],
        "losses": [r["loss"] for r in losses],
    }


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=3, help="save every this many steps")
    ap.add_argument(
        "--roots",
        default="tmpfs,disk",
        help="comma-separated: tmpfs (/dev/shm), disk (a temporary directory on /tmp's disk)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=1,
        help="runs per storage and save mode (interleaved); the table shows the median run",
    )
    ap.add_argument("--write-docs", action="store_true")
    args, extra = ap.parse_known_args()
    started = time.time()
    bases = {"tmpfs": "/dev/shm", "disk": tempfile.gettempdir()}
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[tuple[str, str], list[dict]] = {}
        ckpt_bytes = 0
        runs = [
            (rep, root, mode, flags)
            for rep in range(args.reps)
            for root in ["-", *args.roots.split(",")]
            for mode, flags in (MODES.items() if root != "-" else [("none", [])])
        ]
        base_runs: list[dict] = []
        for n, (rep, root, mode, flags) in enumerate(runs):
            if root == "-":  # each repetition's checkpoint-free run, its goodput's reference
                base_runs.append(run(os.path.join(tmp, f"none-{rep}"),
                                     os.path.join(tmp, f"none-{rep}", "ckpt"),
                                     args.steps, 10**6, extra))  # fmt: skip
                continue
            where = tempfile.mkdtemp(prefix="bench-async-", dir=bases[root])
            try:
                name = f"{root}-{n}"
                r = run(os.path.join(tmp, name), os.path.join(where, "ckpt"),
                        args.steps, args.every, [*flags, *extra])  # fmt: skip
                steps = sorted(os.listdir(os.path.join(where, "ckpt")))
                ckpt_bytes = _size(os.path.join(where, "ckpt", steps[-1]))
            finally:
                shutil.rmtree(where, ignore_errors=True)
            if r["losses"] != base_runs[rep]["losses"]:
                raise SystemExit(f"{root} {mode}: the losses differ from the run without saves")
            r["base_step"] = statistics.median(base_runs[rep]["steps"])
            results.setdefault((root, mode), []).append(r)
            print(f"{root:6} {mode:32} {r['blocked_s'] / r['saves'] * 1000:8.1f} ms blocked "
                  f"per save ({r['saves']} saves), training {r['train_s']:.1f} s", flush=True)  # fmt: skip

    def per_save(r: dict) -> float:
        return r["blocked_s"] / r["saves"]

    rows = []
    for root in args.roots.split(","):
        per_sync = statistics.median(per_save(r) for r in results[(root, "sync")])
        for mode in MODES:
            rs = results[(root, mode)]
            per = statistics.median(per_save(r) for r in rs)
            goodput = statistics.median(
                r["base_step"] * (args.steps - 1) / r["train_s"] for r in rs
            )
            spread = ", ".join(f"{per_save(r) * 1000:.1f}" for r in rs)
            rows.append((root, mode, rs[0]["saves"], per * 1000, per / per_sync,
                         statistics.median(statistics.median(r["steps"]) for r in rs) * 1000,
                         goodput, spread))  # fmt: skip
    took = time.time() - started
    head = ("| storage | save mode | saves per run | blocking per save | / sync save | "
            "median step | goodput | blocking per save, each run (ms) |")  # fmt: skip
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for root, mode, n, ms, ratio, med, gp, spread in rows:
        lines.append(
            f"| {root} | {mode} | {n} | {ms:.1f} ms | {ratio:.2%} | {med:.0f} ms | {gp:.0%} "
            f"| {spread} |"
        )
    step = statistics.median(statistics.median(r["steps"]) for r in base_runs)
    lines.append(f"| - | no checkpoints | 0 | - | - | {step * 1000:.0f} ms | 100% | - |")
    print("\n".join(lines))
    if args.write_docs:
        cmd = rerun_command(__file__)
        body = [
            "## Async saves that do not stall a step (`tools/bench_async_blocking.py`)",
            "",
            f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {took:.0f} s, 2 CPU cores, gloo). "
            f"The reference trainer (4 ranks, pp=2 x dp_shard=2, default model; checkpoints of "
            f"{ckpt_bytes / 2**20:.1f} MiB) runs {args.steps} steps, saving every {args.every}. "
            "Blocking: `Checkpointer.blocked_s` of the slowest rank over the run (save calls, "
            "optimizer steps waiting for a staging copy, faulting in the staging buffers), the "
            "first save included, divided by the saves. Goodput: the median step time of the "
            "same repetition's checkpoint-free run x steps over the run's training time. Every "
            "run's losses equal the checkpoint-free run's. "
            f"{args.reps} run(s) per storage and mode, interleaved with a checkpoint-free run "
            "each; "
            "the table shows medians over the runs ('/ sync save': the median blocking over the "
            "median sync save's).",
            "",
            *lines,
        ]
        replace_section(DOC, BEGIN, END, body)
        print(f"wrote {os.path.relpath(DOC, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
