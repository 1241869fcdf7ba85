"""torchtitan checkpoints, side by side: anyshard's manager vs torchtitan's own DCP manager.

    flock /tmp/anyshard-bench.lock python tools/bench_torchtitan.py --write-docs
    python tools/bench_torchtitan.py --quick      # smoke test: one repetition

A few minutes on 2 cores. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from functools import partial

import benchkit as h

SYSTEMS = ("dcp", "anyshard")
LABELS = {"dcp": "torchtitan DCP", "anyshard": "anyshard"}
OPS = ("save", "resume", "resume_tp2")
OP_LABELS = {
    "save": "save (dp_shard=2)",
    "resume": "resume (dp_shard=2)",
    "resume_tp2": "resume into tp=2",
}
WORLD = 2
TASKS = os.path.join(h.ROOT, "tests", "dist", "_torchtitan_tasks.py")
HEADING = "## torchtitan checkpoints: anyshard vs torchtitan's DCP (`tools/bench_torchtitan.py`)"
METHOD = """Method: torchtitan 0.3.0's own trainer (`--module llama3 --config llama3_debugmodel`:
6 layers, dim 256, vocabulary 2048, AdamW) on 2 gloo ranks on CPU (one torch thread each; the CPU
shims of tests/dist/_torchtitan_tasks.py), sequence length 32. Each job builds the trainer under
dp_shard=2, trains one step, saves its full state (model, AdamW moments, schedulers, data loader,
train state) with `checkpointer.save`, then resumes it in the same job with `checkpointer.load`;
a second job builds the trainer under tp=2 and resumes the same checkpoint (the data loader's
state left out: torchtitan refuses it under another data-parallel degree). torchtitan DCP is the
stock `CheckpointManager` (`FileSystemWriter`/`FileSystemReader`); anyshard is the same trainer
with `--override.imports anyshard.dcp.torchtitan.anyshard_checkpoint` (`AnyshardWriter`, every
byte read verified by its checksums). The two systems alternate, in rotated order, within each
repetition; page caches are dropped before each resume. Every operation is measured on every
rank with the same counters (tools/benchkit/) from a common barrier: time of the slowest rank,
median [min-max] over the repetitions; CPU seconds (user + sys) and bytes of both ranks
together, median repetition: `wchar` written and `rchar` read, /proc/self/io of the rank
processes. `wchar` counts what gloo sends on its sockets too (the 9 MiB written during either
resume are collectives, not files); `rchar` counts no socket reads. Bit-exactness of what is resumed is tests/dist/test_trainer_torchtitan.py's part."""


def _tasks():
    spec = importlib.util.spec_from_file_location("_torchtitan_tasks", TASKS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_torchtitan_tasks"] = module
    spec.loader.exec_module(module)
    return module


def job(rank: int, world: int, cfg: dict) -> dict | None:
    """One rank: build torchtitan's trainer, then save and resume (``cfg["mode"] == "save"``)
    or resume under tp=2; every rank's records of each operation."""
    _tasks().cpu_shims()
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    from torchtitan.config import ConfigManager

    tok_dir, data_dir = cfg["assets"]
    tp = 2 if cfg["mode"] == "resume_tp2" else 1
    args = [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--dump_folder", cfg["root"],
        "--hf_assets_path", tok_dir,
        "--dataloader.dataset_path", data_dir,
        "--training.seq_len", "32",
        "--training.local_batch_size", "2" if tp == 1 else "4",
        "--parallelism.data_parallel_shard_degree", str(world // tp),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.spmd_backend", "partial_dtensor",
        "--debug.seed", "0",
        "--checkpoint.enable",
        "--checkpoint.interval", "1",
        "--checkpoint.keep_latest_k", "0",
        "--metrics.log_freq", "1000",
    ]  # fmt: skip
    if tp > 1:
        args += ["--checkpoint.exclude_from_loading", "dataloader"]
    if cfg["system"] == "anyshard":
        args += ["--override.imports", "anyshard.dcp.torchtitan.anyshard_checkpoint"]
    trainer = ConfigManager().parse_args(args).build()
    ck, path = trainer.checkpointer, os.path.join(cfg["root"], "checkpoint", "step-1")
    cold = partial(h.drop_cache, path)
    out = {}
    try:
        if cfg["mode"] == "save":
            trainer.step = 1
            trainer.train_step(trainer.batch_generator(trainer.dataloader))
            out["save"] = h.measure_ranks(lambda: ck.save(1))
            out["size"] = h.du(path)  # every rank has written: measure_ranks gathered after
            out["resume"] = h.measure_ranks(lambda: ck.load(step=1), before=cold)
        else:
            out["resume_tp2"] = h.measure_ranks(lambda: ck.load(step=1), before=cold)
    finally:
        trainer.close()
    return out if rank == 0 else None


def summarize(runs: dict[str, dict[str, list[list[dict]]]]) -> list[dict]:
    """Per operation and system: times of the slowest rank, CPU and bytes of all ranks."""
    rows = []
    for op in OPS:
        row: dict = {"op": op}
        for s in SYSTEMS:
            reps = runs[s][op]
            walls = [max(r["wall_s"] for r in ranks) for ranks in reps]
            total = lambda key, reps=reps: h.median([sum(r[key] for r in rk) for rk in reps])  # noqa: E731
            row[s] = {
                "walls": walls,
                "times": h.fmt_spread(walls, ".3f"),
                "cpu": total("cpu_s"),
                "wchar": total("wchar"),
                "rchar": total("rchar"),
            }
        row["ratio"] = h.median(row["anyshard"]["walls"]) / h.median(row["dcp"]["walls"])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["operation", "system", "time s", "CPU s", "written MiB", "read MiB", "anyshard/DCP"]
    body = []
    for row in rows:
        for s in SYSTEMS:
            r = row[s]
            body.append(
                [
                    OP_LABELS[row["op"]],
                    LABELS[s],
                    r["times"],
                    f"{r['cpu']:.2f}",
                    f"{r['wchar'] / h.MiB:.1f}",
                    f"{r['rchar'] / h.MiB:.1f}",
                    f"{row['ratio']:.2f}x" if s == "anyshard" else "",
                ]
            )
    return head, body


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=3, quick={"reps": 1})
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go (/tmp)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-torchtitan-", dir=args.dir)
    load = h.RunLoad()
    runs: dict = {s: {op: [] for op in OPS} for s in SYSTEMS}
    sizes: dict[str, list[int]] = {s: [] for s in SYSTEMS}
    records = h.Records(args.jsonl, "torchtitan")
    try:
        assets = _tasks().make_assets(os.path.join(work, "assets"))
        for rep, order in h.rotations(list(SYSTEMS), args.reps):
            for s in order:
                root = os.path.join(work, f"{s}-{rep}")
                cfg = {"system": s, "root": root, "assets": assets}
                got = h.run_ranks(job, WORLD, cfg | {"mode": "save"})[0]
                got |= h.run_ranks(job, WORLD, cfg | {"mode": "resume_tp2"})[0]
                sizes[s].append(got["size"])
                for op in OPS:
                    runs[s][op].append(got[op])
                    for rank, rec in enumerate(got[op]):
                        records.add(rec, system=s, op=op, rep=rep, rank=rank)
                print(f"rep {rep} {s}: " + " ".join(
                    f"{op}={max(r['wall_s'] for r in got[op]):.3f}s" for op in OPS), flush=True)  # fmt: skip
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(runs)
    run = (
        f"llama3 debugmodel, {WORLD} gloo ranks, {args.reps} repetitions, "
        "median [min-max] of the slowest rank"
    )
    versions = f"- torchtitan {h.version('torchtitan')}, torch {h.version('torch')}"
    size = ", ".join(f"{LABELS[s]} {h.median(sizes[s]) / h.MiB:.1f} MiB" for s in SYSTEMS)
    blocks = [METHOD, table(rows), f"The checkpoint on disk (all files, median): {size}."]
    h.report(args, argv, __file__, "bench_torchtitan", run, blocks, load,
             heading=HEADING, dirs={"checkpoints": args.dir}, machine=[versions],
             data={"rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
