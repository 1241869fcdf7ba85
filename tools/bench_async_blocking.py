"""How long checkpointing holds the reference trainer's steps up: sync saves, async saves whose
staging copy blocks the step, async saves staged during forward and backward.

The trainer as ``anyshard demo`` runs it (4 ranks, pp=2 x dp_shard=2, warm launcher), ``--steps``
steps saving every ``--every``, per save mode and ``--roots`` storage, and once without saves;
``--reps`` times, each repetition's runs in rotated order. Blocking: `Checkpointer.blocked_s` of
the slowest rank per save (first save included); goodput: the repetition's checkpoint-free median
step x steps over the run's training time; every run's losses equal the checkpoint-free run's.

    python tools/bench_async_blocking.py --reps 3 --write-docs
    python tools/bench_async_blocking.py --roots tmpfs --steps 4 --every 2 \\
        --config anyshard/trainer_integration/gpt/tiny.toml      # smoke test; other words: trainer
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import benchkit as h
from benchkit.trainer_runs import step_times, train

HEADING = "## Async saves that do not stall a step (`tools/bench_async_blocking.py`)"

BACKGROUND = "--checkpoint.stage_in_background"
MODES = {
    "sync": ["--checkpoint.async_", "false"],
    "async, staging blocks the step": ["--checkpoint.async_", "true", BACKGROUND, "false"],
    "async, staged during the step": ["--checkpoint.async_", "true", BACKGROUND, "true"],
}


def run(args, root: str, mode: str, rep: int) -> dict:
    every = str(args.every if root != "-" else 10**6)
    opts = ["--parallel.pp", "2", "--parallel.dp_shard", "2", "--train.steps", str(args.steps)]
    opts += ["--checkpoint.every_steps", every, "--checkpoint.keep_last", "2"]
    opts += ["--train.seed", str(args.seed), *MODES.get(mode, []), *args.trainer]
    with tempfile.TemporaryDirectory(
        prefix="bench-async-", dir=h.BASES.get(root, h.BASES["disk"]), ignore_cleanup_errors=True
    ) as d:
        r = train(os.path.join(d, "run"), opts, nproc=4)
        ckpt = os.path.join(d, "run", "ckpt")
        last = max(os.listdir(ckpt) if os.path.isdir(ckpt) else [], default=None)
        size = h.du(os.path.join(ckpt, last) if last else d)
    (end,) = [e for e in r["events"] if e["event"] == "end"]
    losses, saves = r["losses"], end["saves"]
    return {"root": root, "mode": mode, "rep": rep, "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
            "steps": step_times(losses), "train_s": losses[-1]["time"] - losses[0]["time"],
            "losses": [x["loss"] for x in losses], "saves": saves,
            "per_save_s": end["ckpt_blocked_s"] / max(1, saves), "ckpt_bytes": size}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=3, help="save every this many steps")
    ap.add_argument("--roots", default="tmpfs,disk", help="comma-separated: tmpfs, disk (/tmp)")
    ap.add_argument("--reps", type=int, default=1, help="runs per storage and save mode")
    ap.add_argument("--seed", type=int, default=0, help="the trainer's seed (initialisation, data)")
    args, args.trainer = ap.parse_known_args(argv)
    roots = h.words(ap, "--roots", args.roots)
    systems = [("-", "no checkpoints"), *((r, m) for r in roots for m in MODES)]
    records, load = h.Records(args.jsonl, "async_blocking"), h.RunLoad()
    for rep, order in h.rotations(systems, args.reps):
        for root, mode in order:
            r = records.add(run(args, root, mode, rep))
            print(f"{root:6} {mode:32} {r['per_save_s'] * 1e3:8.1f} ms blocked per save "
                  f"({r['saves']} saves), training {r['train_s']:.1f} s", flush=True)  # fmt: skip
    runs = {(r["root"], r["mode"], r["rep"]): r for r in records.rows}
    base = {rep: runs[("-", "no checkpoints", rep)] for rep in range(args.reps)}
    for r in records.rows:
        if r["losses"] != base[r["rep"]]["losses"]:
            raise SystemExit(f"{r['root']} {r['mode']}: losses differ from the checkpoint-free run")
    rows = []
    for root, mode in systems:
        rs = [runs[(root, mode, rep)] for rep in range(args.reps)]
        step = h.fmt_spread([1e3 * statistics.median(r["steps"]) for r in rs], ".0f")
        good = h.fmt_spread([100 * (statistics.median(base[r["rep"]]["steps"]) * (args.steps - 1)
                                    / r["train_s"]) for r in rs], ".0f")  # fmt: skip
        if root == "-":
            rows.append([root, mode, 0, "-", "-", step, good, "-"])
            continue
        blocked = [1e3 * r["per_save_s"] for r in rs]
        sync = [100 * r["per_save_s"] / runs[(root, "sync", r["rep"])]["per_save_s"] for r in rs]
        each = ", ".join(f"{x:.1f}" for x in blocked)
        rows.append([root, mode, rs[0]["saves"], h.fmt_spread(blocked, ".1f"),
                     h.fmt_spread(sync, ".2f"), step, good, each])  # fmt: skip
    head = ["storage", "save mode", "saves per run", "blocking per save ms", "/ sync save %"]
    head += ["median step ms", "goodput %", "blocking per save, each run (ms)"]
    size = max(r["ckpt_bytes"] for r in records.rows if r["root"] != "-") / h.MiB
    text = (f"{args.steps} steps, a save every {args.every}, checkpoints of {size:.1f} MiB; "
            f"median [min-max] of {args.reps} run(s); trainer seed {args.seed}, options "
            f"{' '.join(args.trainer) or '-'}")  # fmt: skip
    h.report(args, argv, __file__, "async_blocking", text, [(head, rows)], load, heading=HEADING,
             dirs={r: h.BASES[r] for r in roots if r in h.BASES}, data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
