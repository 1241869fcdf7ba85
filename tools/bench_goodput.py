"""Goodput of the reference trainer with injected faults: recovery time, lost steps, goodput.

Runs the demo configuration (4 CPU ranks, pp=2 x dp_shard=2, the default model, an asynchronous
checkpoint every 2 steps, launched as ``anyshard demo`` launches it: ``--launcher warm``, or
``--launcher torchrun`` for new interpreters at every restart) twice, in one invocation: once
without faults, once with rank 3 SIGKILLed once per ``--fault-every`` steps (the elastic agent
restarts the group each time). Goodput is useful step time
(steps x the median step time of the fault-free run) over the wall time of the whole job,
launch included.

    python tools/bench_goodput.py                    # 100 steps, a fault every 50
    python tools/bench_goodput.py --write-docs       # also replace the section in docs/benchmarks.md
    python tools/bench_goodput.py --config anyshard/trainer_integration/gpt/tiny.toml  # other sizes

Other words (``--config FILE``, ``--model.dim 128``, ...) go to the trainer as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- goodput:begin -->", "<!-- goodput:end -->"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    run_dir: str, steps: int, faults: list[tuple[int, int]], extra: list[str], launcher: str
) -> float:
    if launcher == "torchrun":
        head = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", str(len(faults)),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
            "-m", "anyshard.trainer_integration.gpt.train",
        ]  # fmt: skip
    else:
        head = [
            sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
            "--nproc-per-node", "4", "--max-restarts", str(len(faults)),
            "--rdzv-endpoint", f"127.0.0.1:{_port()}",
        ]  # fmt: skip
    cmd = [
        *head,
        "--parallel.pp", "2", "--parallel.dp_shard", "2",
        "--train.steps", str(steps),
        "--checkpoint.keep_last", "2",
        "--checkpoint.root", os.path.join(run_dir, "ckpt"),
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("ANYSHARD_FAULT", "ANYSHARD_FAULTS")}
    env["OMP_NUM_THREADS"] = "1"
    if faults:
        env["ANYSHARD_FAULTS"] = ",".join(f"{r}:{s}" for r, s in faults)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"training failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return wall


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_times(losses: list[dict]) -> list[float]:
    out = []
    for a, b in zip(losses, losses[1:], strict=False):
        if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1:
            out.append(b["time"] - a["time"])
    return out


def _phases(event: dict) -> str:
    p = event.get("process_to_run_s")
    head = f"{p:.1f}" if p is not None else "?"
    return f"{head} / {event['build_s']:.1f} / {event['restore_s']:.1f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fault-every", type=int, default=50)
    p.add_argument(
        "--sync",
        dest="async_",
        action="store_false",
        help="synchronous checkpoints (default: async)",
    )
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps (default 2)")
    p.add_argument(
        "--launcher",
        choices=["warm", "torchrun"],
        default="warm",
        help="warm: anyshard.trainer_integration.gpt.launch (torch's elastic agent, ranks forked "
        "from a process with torch imported), as the demo runs; torchrun: new interpreters",
    )
    p.add_argument("--write-docs", action="store_true")
    args, trainer_args = p.parse_known_args()
    extra = ["--checkpoint.every_steps", str(args.every), *trainer_args]
    extra += ["--checkpoint.async_", "true"] if args.async_ else []
    faults = [(3, s) for s in range(args.fault_every // 2, args.steps, args.fault_every)]
    with tempfile.TemporaryDirectory() as tmp:
        clean_dir, faulty_dir = os.path.join(tmp, "clean"), os.path.join(tmp, "faulty")
        clean_wall = launch(clean_dir, args.steps, [], extra, args.launcher)
        faulty_wall = launch(faulty_dir, args.steps, faults, extra, args.launcher)
        clean = records(os.path.join(clean_dir, "losses.jsonl"))
        faulty = records(os.path.join(faulty_dir, "losses.jsonl"))
        events = records(os.path.join(faulty_dir, "events.jsonl"))
        clean_events = records(os.path.join(clean_dir, "events.jsonl"))
    step = statistics.median(step_times(clean))
    useful = args.steps * step
    recoveries = [e for e in events if "recovery_s" in e]
    rows = [
        ("steps", f"{args.steps}", f"{args.steps}"),
        ("faults (rank 3, SIGKILL)", "0", f"{len(faults)} (at steps {', '.join(str(s) for _, s in faults)})"),
        ("wall time, launch to exit", f"{clean_wall:.1f} s", f"{faulty_wall:.1f} s"),
        ("median step time", f"{step * 1000:.0f} ms", f"{statistics.median(step_times(faulty)) * 1000:.0f} ms"),
        ("start-up to first step", f"{clean_events[0]['startup_to_first_step_s']:.1f} s", f"{events[0]['startup_to_first_step_s']:.1f} s"),
        (
            "recovery time (fault -> first step after restart)",
            "-",
            ", ".join(f"{e['recovery_s']:.1f} s" for e in recoveries) or "-",
        ),
        (
            "restart: process start -> run, build, restore",
            "-",
            ", ".join(_phases(e) for e in recoveries) or "-",
        ),
        ("lost steps per fault", "-", ", ".join(str(e["lost_steps"]) for e in recoveries) or "-"),
        ("steps run in all", f"{len(clean)}", f"{len(faulty)}"),
        ("goodput (useful step time / wall time)", f"{useful / clean_wall:.0%}", f"{useful / faulty_wall:.0%}"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'no fault':>14}  with faults")
    for name, a, b in rows:
        print(f"{name:{width}}  {a:>14}  {b}")
    if args.write_docs:
        cmd = "python tools/bench_goodput.py " + " ".join(sys.argv[1:])
        table = ["| | no fault | with faults |", "| --- | --- | --- |"]
        table += [f"| {n} | {a} | {b} |" for n, a, b in rows]
        section = "\n".join(
            [
                BEGIN,
                f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, gloo)",
                "",
                *table,
                END,
            ]
        )
        text = open(DOC).read()
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
        else:
            text += (
                "\n\n## Goodput of the reference trainer with faults (`tools/bench_goodput.py`)\n\n"
                + section
                + "\n"
            )
        with open(DOC, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
