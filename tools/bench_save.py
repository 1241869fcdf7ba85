"""Save benchmark on tmpfs: anyshard with checksum tiles vs without vs DCP, paired; and the bytes a
verified column split reads of an expert weight [experts, rows, cols] vs a 2-d weight.

    flock /tmp/anyshard-bench.lock python tools/bench_save.py --write-docs   # smoke test: --quick
    python tools/bench_save.py --shapes rows16k --reps 3

A few minutes on 2 cores. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from functools import partial

import benchkit as h
from benchkit import MiB
from benchkit.llama import MESHES, WORLD, full_tensor, model_spec, placements

SYSTEMS = ("anyshard", "notiles", "dcp")
LABELS = {"anyshard": "anyshard", "notiles": "anyshard, tiles off", "dcp": "DCP"}
TIME_TARGET = 0.75  # anyshard's save <= this x DCP's, on tmpfs
CPU_TARGET = 1.10  # anyshard's save CPU with tiles <= this x without
SPLITS = (2, 4, 8)
HEADING = "## Saves on tmpfs: checksum tiles vs none vs DCP; column splits of 3-d shards"
HEADING += " (`tools/bench_save.py`)"
METHOD = """Method: 4 gloo ranks on CPU (one torch thread each unless `--torch-threads`) hold a
state as DTensors on a (dp_shard=2, tp=2) mesh and save it to tmpfs (/dev/shm), after an untimed
warm-up round on a few small tensors. Shapes: `rows16k`, 1 GiB of fp32 in 8 tensors whose stored
shards all have rows of 16 KiB (four [8192, 4096] column-parallel `[Shard(0), Shard(0)]`, four
[4096, 8192] row-parallel `[Shard(0), Shard(1)]`): every byte tiled; `reshard`,
tools/bench_reshard.py's 1 GiB Llama-shaped state (hidden 1024: stored rows of 4 KiB, untiled,
but for the feed-forward's w2, rows of 8 KiB, tiled: a quarter of the bytes). Systems, rotated in
order each repetition, each checkpoint removed before the next save: `anyshard.save` (tiles where
a shard's rows are 8 KiB or more), the same with tiles off (`anyshard.format.datafile.tile_count`
made 1: block checksums only, as before tiles), and `dcp.save` with `FileSystemWriter`. Time: the
slowest rank from a common barrier, median [min-max] over the repetitions; CPU: user + sys
seconds of the 4 ranks together, median [min-max]; of them, the checksum jobs' (the thread CPU
of each rank's block and tile crc32c jobs, tile-major copies included: the rest is mostly the
write syscalls). Bytes of column splits: one process saves a
[16, 1024, 4096] fp32 expert weight (rows of 16 KiB) and the same bytes as a 2-d [16384, 4096]
weight to tmpfs, then loads each part of a 2, 4 and 8-way split of the last dim, verified, and
counts the bytes the read plan reads (`ReadPlan.bytes_read`) and the bytes the process read
(/proc/self/io rchar), against the bytes the part holds; "whole rows" is the same read of a
file written without tiles."""


def rows16k_spec() -> list[tuple[str, tuple[int, ...], str]]:
    """1 GiB of fp32 in 8 tensors whose stored shards under (dp_shard=2, tp=2) have 16 KiB rows."""
    col = [(f"col{i}.weight", (8192, 4096), "col") for i in range(4)]
    return col + [(f"row{i}.weight", (4096, 8192), "row") for i in range(4)]


def _source(spec) -> dict:
    """This rank's source state: DTensors on the (dp_shard=2, tp=2) mesh, seeded values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    sizes, dims = MESHES["src"]
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
    out = {}
    for name, shape, kind in spec:
        out[name] = distribute_tensor(full_tensor(name, shape), mesh, placements(kind, dims))
    return out


def _save(system: str, state: dict, path: str) -> dict | None:
    """One save of ``state`` to ``path`` by ``system``; for anyshard, the CPU seconds of this
    rank's checksum jobs (``crc_cpu_s``: the thread CPU of each job, block and tile crc32c and
    the tile-major copies; the rest of its CPU is mostly the write syscalls)."""
    import torch.distributed.checkpoint as dcp

    import anyshard
    from anyshard.format import datafile

    if system == "dcp":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        return None
    saved = {k: getattr(datafile, k) for k in ("tile_count", "block_crcs", "shard_tile_crcs")}
    spent: list[float] = []  # one item a job: the jobs run on a pool's threads at once

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.thread_time() - t0)

        return run

    for k in ("block_crcs", "shard_tile_crcs"):  # looked up by write_datafile at each call
        setattr(datafile, k, timed(saved[k]))
    if system == "notiles":
        datafile.tile_count = lambda shape, itemsize: 1  # block checksums only
    try:
        anyshard.save(path, state)
    finally:
        for k, fn in saved.items():
            setattr(datafile, k, fn)
    return {"crc_cpu_s": sum(spent)}


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch.distributed as dist

    records = []

    def remove(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    root = cfg["root"]
    if cfg["warmup"]:  # untimed: imports, thread pools, DCP's first-call setup
        few = _source([("col.weight", (256, 4096), "col"), ("row.weight", (128, 8192), "row")])
        for s in SYSTEMS:
            _save(s, few, os.path.join(root, "warmup", s))
        remove(os.path.join(root, "warmup"))
    for shape in cfg["shapes"]:
        spec = rows16k_spec() if shape == "rows16k" else model_spec(1.0)
        state = _source(spec)
        for rep, order in h.rotations(SYSTEMS, cfg["reps"]):
            if rank == 0:
                print(f"[{shape}] repetition {rep + 1}/{cfg['reps']}, order {', '.join(order)}")
            for s in order:
                path = os.path.join(root, f"{shape}-{s}-{rep}")
                recs = h.measure_ranks(partial(_save, s, state, path))
                remove(path)
                if rank == 0:
                    records.append({"shape": shape, "system": s, "rep": rep, "ranks": recs})
                    worst = max(r["wall_s"] for r in recs)
                    cpu = sum(r["cpu_s"] for r in recs)
                    crc = _crc_cpu(recs)
                    sums = "" if crc is None else f"  (checksums {crc:5.3f})"
                    print(f"  {s:9s} {worst:6.3f} s  cpu {cpu:6.3f} s{sums}", flush=True)
        del state
    return {"records": records} if rank == 0 else None


def split_bytes(root: str) -> list[dict]:
    """The bytes a verified load of each part of a column split reads: a 3-d expert weight and
    the 2-d weight of the same bytes, with tiles, and the 3-d one written without tiles."""
    import torch

    import anyshard
    from anyshard.format import datafile
    from anyshard.format.manifest import read_manifest
    from anyshard.geometry.boxes import Piece
    from anyshard.reshard.fill import Fill, fill_regions

    experts = torch.randn(16, 1024, 4096, generator=torch.Generator().manual_seed(0))
    state = {"experts": experts, "flat": experts.reshape(-1, 4096).clone()}
    tiled, plain = os.path.join(root, "tiled"), os.path.join(root, "plain")
    anyshard.save(tiled, state)
    tiles = datafile.tile_count
    datafile.tile_count = lambda shape, itemsize: 1
    try:
        anyshard.save(plain, {"experts": experts})
    finally:
        datafile.tile_count = tiles
    manifests = {p: read_manifest(p) for p in (tiled, plain)}
    out = []
    for ways in SPLITS:
        for case, path, name in (
            ("3-d, tiles", tiled, "experts"),
            ("2-d, tiles", tiled, "flat"),
            ("3-d, whole rows", plain, "experts"),
        ):
            t = state[name]
            width = t.shape[-1] // ways
            got = {"case": case, "ways": ways, "planned": 0, "rchar": 0, "needed": 0}
            for k in range(ways):
                box = tuple((0, n) for n in t.shape[:-1]) + ((k * width, (k + 1) * width),)
                shape = tuple(hi - lo for lo, hi in box)
                dest = torch.empty(shape)
                piece = Piece(0, shape, tuple((0, n) for n in shape), box)
                before = h.proc_io()["rchar"]
                plan = fill_regions(path, manifests[path], [Fill(name, dest, (piece,))])
                got["rchar"] += h.proc_io()["rchar"] - before
                got["planned"] += plan.bytes_read
                got["needed"] += dest.numel() * 4
                assert torch.equal(dest, t[..., k * width : (k + 1) * width]), (case, ways, k)
            out.append(got)
    return out


def _crc_cpu(recs: list[dict]) -> float | None:
    """The checksum jobs' CPU seconds of every rank together (None: DCP, which has none)."""
    got = [r["result"]["crc_cpu_s"] for r in recs if "result" in r]
    return sum(got) if got else None


def summarize(records: list[dict]) -> dict:
    rows: dict = {}
    for rec in records:
        row = rows.setdefault(
            rec["shape"], {s: {"time": [], "cpu": [], "crc": []} for s in SYSTEMS}
        )
        row[rec["system"]]["time"].append(max(r["wall_s"] for r in rec["ranks"]))
        row[rec["system"]]["cpu"].append(sum(r["cpu_s"] for r in rec["ranks"]))
        crc = _crc_cpu(rec["ranks"])
        if crc is not None:
            row[rec["system"]]["crc"].append(crc)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=5, quick={"reps": 1, "shapes": "rows16k"}, dirs=True)
    p.add_argument("--shapes", default="rows16k,reshard", help="a subset of rows16k,reshard")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="no warm-up round")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads a rank (1)")
    args = p.parse_args(argv)
    shapes = h.words(p, "--shapes", args.shapes, ("rows16k", "reshard"))
    root = tempfile.mkdtemp(prefix="bench-save-", dir=args.tmpfs_dir)
    print(f"{WORLD} gloo ranks; {args.reps} repetition(s); {root} on {h.fs_type(root)}")
    load = h.RunLoad()
    try:
        cfg = {"root": root, "shapes": shapes, "reps": args.reps, "warmup": args.warmup}
        data = h.run_ranks(worker, WORLD, cfg, threads=args.torch_threads)[0]
        splits = split_bytes(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(data["records"])
    head = ["shape", *(f"{LABELS[s]} s" for s in SYSTEMS), "anyshard / DCP"]
    head += [*(f"{LABELS[s]} CPU s" for s in SYSTEMS), "CPU tiles / tiles off"]
    body, checks = [], []
    for shape, row in rows.items():
        med = {s: {k: h.median(v) for k, v in row[s].items() if v} for s in SYSTEMS}
        a, n, d = (med[s] for s in SYSTEMS)
        body.append([shape, *(h.fmt_spread(row[s]["time"], ".3f") for s in SYSTEMS)])
        body[-1] += [f"{a['time'] / d['time']:.2f}"]
        body[-1] += [*(h.fmt_spread(row[s]["cpu"], ".2f") for s in SYSTEMS)]
        body[-1] += [f"{a['cpu'] / n['cpu']:.3f}"]
        name = f"{shape}: anyshard's save <= {TIME_TARGET}x DCP's (tmpfs)"
        checks.append(h.at_most(name, a["time"], TIME_TARGET, d["time"]))
        name = f"{shape}: CPU of the save with tiles <= {CPU_TARGET}x without"
        checks.append(h.at_most(name, a["cpu"], CPU_TARGET, n["cpu"], "CPU s"))
    split_head = ["split", "shard", "planned / needed", "rchar / needed", "MiB needed"]
    split_body = [
        [f"{s['ways']}-way", s["case"], f"{s['planned'] / s['needed']:.4f}"]
        + [f"{s['rchar'] / s['needed']:.4f}", f"{s['needed'] / MiB:.0f}"]
        for s in splits
    ]
    for s in splits:
        if s["case"] != "3-d, whole rows":
            name = f"{s['ways']}-way column split, {s['case']}: bytes read = bytes needed"
            checks.append((name, s["planned"] == s["needed"], f"{s['planned']} vs {s['needed']}"))
    times = "; ".join(
        f"{shape} " + " ".join(f"{s}={[round(x, 3) for x in row[s]['time']]}" for s in SYSTEMS)
        for shape, row in rows.items()
    )
    run = f"{args.reps} repetitions, shapes {', '.join(shapes)}, {args.torch_threads} torch "
    run += "thread(s) a rank, median [min-max]"
    crcs = "; ".join(
        f"{shape} "
        + ", ".join(
            f"{LABELS[s]} {h.fmt_spread(row[s]['crc'], '.3f')} of {h.median(row[s]['cpu']):.3f}"
            for s in ("anyshard", "notiles")
        )
        for shape, row in rows.items()
    )
    blocks = [METHOD, (head, body), f"Per-repetition times (slowest rank): {times}."]
    blocks += [f"CPU seconds of the checksum jobs, of the save's CPU seconds (median): {crcs}."]
    blocks += ["Bytes a verified load of each part of a column split reads, all parts together:"]
    blocks += [(split_head, split_body), h.targets(checks)]
    data |= {"rows": rows, "splits": splits, "total_gib": 1.0}
    h.report(args, argv, __file__, "bench_save", run, blocks, load, heading=HEADING,
             dirs={"tmpfs": args.tmpfs_dir}, data=data)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
