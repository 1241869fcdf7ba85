"""Reshard benchmark: anyshard vs torch.distributed.checkpoint (DCP) vs the physical floor.

    python tools/bench_reshard.py --write-docs                    # smoke test: --quick
    python tools/bench_reshard.py --regimes tmpfs --reps 3 --no-verify   # loads without checks

A few minutes on 2 cores. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial

import benchkit as h
from benchkit import GiB, MiB
from benchkit.llama import TARGETS, WORLD, mismatched, model_spec, states

SYSTEMS = ("floor", "anyshard", "dcp", "dcp_any")
LABELS = {"floor": "floor", "anyshard": "anyshard", "dcp": "DCP", "dcp_any": "DCP+anyshard"}
TIME_TARGETS = {  # anyshard's time <= ratio x the other's
    ("disk", "save"): (("floor", 1.2), ("dcp", 1.0)),
    ("disk", "load"): (("floor", 1.15), ("dcp", 0.9)),
    ("tmpfs", "save"): (("dcp", 0.6),),
    ("tmpfs", "load"): (("dcp", 0.4),),
}
DCP_BACKEND_TARGETS = {"save": 1.0, "load": 0.8}  # DCP with anyshard's backend vs its own
READ_RATIO_TARGET, RSS_TARGET_MIB = 1.05, 256
HEADING = "## Reshard benchmark: anyshard vs DCP (with its own and with anyshard's storage backend)"
HEADING += " vs the physical floor (`tools/bench_reshard.py`)"
METHOD = """Method: after an untimed warm-up round on a few small tensors, 4 gloo ranks on CPU (one torch
thread each) hold a transformer-like state as DTensors on a (dp_shard=2, tp=2) mesh:
column-parallel weights `[Shard(0), Shard(0)]`, row-parallel weights `[Shard(0), Shard(1)]`,
norms `[Shard(0), Replicate()]`. Each system saves it, then loads it into a tp=4 mesh (same tp
dims, norms replicated) and a dp_shard=4 mesh (`Shard(0)`). The floor writes each rank's bytes to
one plain file with fsync, and reads as many bytes as the target holds back cold with plain
sequential reads. DCP is `dcp.save`/`dcp.load` with the default planners and
`FileSystemWriter`/`FileSystemReader`; DCP+anyshard is the same calls with anyshard's DCP storage
backend, `anyshard.dcp.AnyshardWriter`/`AnyshardReader` (an anyshard checkpoint, every byte read
verified). Systems alternate within each repetition (rotated order). On disk, all four save, then
each loads into tp=4, then each into dp_shard=4 (no system reads back what it has just read: the
VM host's cache survives drop_caches). On tmpfs each system saves, loads twice and removes its
checkpoint before the next begins, so that tmpfs holds one checkpoint at a time. Every load is
compared bit-exact (BLAKE2b digest of each shard's bytes against the expected shard's) outside the
timed region. Every operation is measured on every rank with the same counters
(tools/benchkit/), from a common barrier. Times: the slowest rank, median [min-max] over the
repetitions. Bytes are per-rank /proc/self/io deltas (worst rank): `rchar` (bytes requested from
the kernel), and for the disk regime `read_bytes` from the block device in parentheses; save rows
show `wchar` (bytes written). RSS+ is the peak VmRSS during the operation minus VmRSS just before
it (target tensors already allocated), worst rank and repetition: the kernel's VmHWM, reset before
each operation (a 2 ms sampler thread only where the reset is refused). CPU: user + sys seconds of
the 4 ranks together, median repetition."""


def floor_save(path: str, tensors) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb", buffering=0) as f:
        for mv in map(h.as_bytes, tensors):
            done = 0
            while done < mv.nbytes:
                done += f.write(mv[done:])
        os.fsync(f.fileno())


def floor_load(path: str, tensors) -> None:
    """Read as many bytes as ``tensors`` hold, sequentially, into them (wrapping at EOF)."""
    with open(path, "rb", buffering=0) as f:
        for mv in map(h.as_bytes, tensors):
            done = 0
            while done < mv.nbytes:
                got = f.readinto(mv[done:])
                done += got or 0
                if not got:
                    f.seek(0)


def _dcp(op: str, backend: str, state, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from anyshard.dcp import AnyshardReader, AnyshardWriter

    ours = backend == "anyshard"
    if op == "save":
        dcp.save(state, storage_writer=(AnyshardWriter if ours else dcp.FileSystemWriter)(path))
    else:
        dcp.load(state, storage_reader=(AnyshardReader if ours else dcp.FileSystemReader)(path))


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch.distributed as dist

    import anyshard

    spec = model_spec(cfg["gib"])
    _, source, targets, expected = states(spec)
    src_locals, records = [source[n].to_local() for n, _, _ in spec], []

    def measure(regime: str, root: str, t: str | None, system: str, fn) -> None:
        """``fn``, the save (``t`` None) or a load into ``t``, measured on every rank."""
        for v in targets[t].values() if t else ():
            v.to_local().fill_(-7.25)
        recs = h.measure_ranks(fn, before=partial(h.drop_cache, root) if regime == "disk" else None)
        bad: list = [None] * world  # the floor reads bytes, not tensors: nothing to check
        got = {n: v.to_local() for n, v in targets[t].items()} if t and system != "floor" else {}
        dist.all_gather_object(bad, mismatched(got, expected.get(t))[:5])
        if rank == 0:
            op, bad = "save" if t is None else f"load->{t}", sorted({b for x in bad for b in x})
            records.append(dict(regime=regime, op=op, system=system, ranks=recs, bad=bad))
            worst, mark = max(r["wall_s"] for r in recs), "  MISMATCH" if bad else ""
            print(f"  [{regime}] {op:9s} {system:8s} {worst:7.2f} s{mark}", flush=True)

    def systems(root: str, t: str | None, names=None) -> dict:
        """Every system's save (``t`` None) or load into ``t``, of ``names`` or everything."""
        state = {n: (source if t is None else targets[t])[n] for n in names or source}
        path = partial(os.path.join, root)
        floor_file = path("floor", f"rank-{rank:05d}.bin")
        if t is None:
            floor, ours, op = partial(floor_save, floor_file, src_locals), anyshard.save, "save"
        else:
            floor = partial(floor_load, floor_file, [v.to_local() for v in state.values()])
            ours, op = partial(anyshard.load, verify=cfg["verify"]), "load"
        both = (("dcp", "dcp"), ("dcp_any", "anyshard"))  # DCP with its own backend, with ours
        dcps = {s: partial(_dcp, op, backend, state, path(s)) for s, backend in both}
        return {"floor": floor, "anyshard": partial(ours, path("anyshard"), state), **dcps}

    def remove(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    if cfg["warmup"]:  # untimed: imports, caches, thread pools, DCP's first-call setup
        few = [next(n for n, _, k in spec if k == kind) for kind in ("norm", "col", "row")]
        wroot = os.path.join(cfg["regimes"][-1][1], "warmup")
        for t in (None, *TARGETS):
            for s in SYSTEMS[1:]:  # the floor has nothing to warm up
                systems(wroot, t, few)[s]()
        remove(wroot)

    for regime, base in cfg["regimes"]:
        for rep, order in h.rotations(SYSTEMS, cfg["reps"]):
            root = os.path.join(base, f"rep{rep}")
            if rank == 0:
                print(f"[{regime}] repetition {rep + 1}/{cfg['reps']}, order {', '.join(order)}")
            ops = {t: systems(root, t) for t in (None, *TARGETS)}
            if regime == "tmpfs":  # a checkpoint on tmpfs is memory: one system's at a time
                steps = [(t, s) for s in order for t in (None, *TARGETS, "rm")]
            else:  # all saves, then every load: no system reads back what it has just read
                steps = [(t, s) for t in (None, *TARGETS) for s in order]
            for t, s in steps:
                if t == "rm":
                    remove(os.path.join(root, s))
                else:
                    measure(regime, root, t, s, ops[t][s])
            remove(root)
    if rank != 0:
        return None
    target_bytes = {t: sum(4 * math.prod(s) for s, _ in expected[t].values()) for t in TARGETS}
    source_bytes = sum(t.numel() * 4 for t in src_locals)
    return {"records": records, "source_bytes": source_bytes, "target_bytes": target_bytes}


def summarize(data: dict) -> list[dict]:
    """One row per (regime, op); per system the slowest rank's times, the worst rank's bytes
    (median repetition) and RSS+ (worst repetition), all ranks' CPU seconds (median)."""
    rows: dict[tuple[str, str], dict] = {}
    for rec in data["records"]:
        regime, op = rec["regime"], rec["op"]
        row = rows.setdefault((regime, op), {"regime": regime, "op": op})
        row["target_bytes"] = data["target_bytes"][op[6:]] if op != "save" else data["source_bytes"]
        row.setdefault(rec["system"], []).append(rec)
    for row in rows.values():
        for s in SYSTEMS:
            reps = row[s]
            worst = h.worst_ranks([x["ranks"] for x in reps], (*h.IO_KEYS, "wall_s", "rss_over"))
            row[s] = {k: h.median(v) for k, v in worst.items()}
            row[s]["times"] = [round(t, 3) for t in worst["wall_s"]]
            row[s]["time"], row[s]["rss_over"] = row[s].pop("wall_s"), max(worst["rss_over"])
            row[s]["cpu"] = h.median([sum(r["cpu_s"] for r in x["ranks"]) for x in reps])
            row[s]["bad"] = sorted({b for x in reps for b in x["bad"]})
    return list(rows.values())


def _moved(x: dict, row: dict) -> str:
    """MiB per rank: read (device reads in brackets on disk), or written (``w``)."""
    if not row["op"].startswith("load"):
        return f"w {x['wchar'] / MiB:.0f}"
    disk = f" ({x['read_bytes'] / MiB:.0f})" if row["regime"] == "disk" else ""
    return f"{x['rchar'] / MiB:.0f}{disk}"


def table(rows: list[dict]) -> tuple[list, list]:
    head = ["regime", "operation", *(f"{LABELS[s]} s" for s in SYSTEMS), "any/floor", "any/DCP"]
    head += ["(DCP+any)/DCP", "MiB/rank anyshard", "MiB/rank DCP", "MiB/rank target"]
    head += ["RSS+ MiB anyshard", "RSS+ MiB DCP", "bit-exact"]
    body = []
    for r in rows:
        f, a, d, da = (r[s] for s in SYSTEMS)
        bad = {s: r[s]["bad"][:2] for s in SYSTEMS if r[s]["bad"]}
        exact = "-" if not r["op"].startswith("load") else f"NO: {bad}" if bad else "yes"
        pairs = ((a, f), (a, d), (da, d))
        ratios = [f"{x['time'] / y['time']:.2f}" if y["time"] else "-" for x, y in pairs]
        times = (h.fmt_spread(x["times"]) for x in (f, a, d, da))
        body.append([r["regime"], r["op"], *times, *ratios])
        body[-1] += [_moved(a, r), _moved(d, r), f"{r['target_bytes'] / MiB:.0f}"]
        body[-1] += [f"{a['rss_over'] / MiB:.0f}", f"{d['rss_over'] / MiB:.0f}", exact]
    return head, body


def check_targets(rows: list[dict]) -> list[h.Check]:
    out = []
    for r in rows:
        kind, a, d, da = r["op"][:4], r["anyshard"], r["dcp"], r["dcp_any"]
        name = f"{r['regime']} {r['op']}: "
        for other, lim in TIME_TARGETS.get((r["regime"], kind), ()):
            out.append(
                h.at_most(f"{name}anyshard <= {lim}x {other}", a["time"], lim, r[other]["time"])
            )
        if kind == "load":
            lim, text = READ_RATIO_TARGET * r["target_bytes"], f"{READ_RATIO_TARGET}x target"
            detail = f"{a['rchar'] / MiB:.1f} MiB vs {lim / MiB:.1f} MiB"
            out.append((f"{name}anyshard bytes read (rchar) <= {text}", a["rchar"] <= lim, detail))
        if kind == "load" and r["regime"] == "disk":  # informational: readahead, code pages
            detail = f"{a['read_bytes'] / MiB:.1f} MiB vs {r['target_bytes'] / MiB:.1f} MiB"
            detail += f" (DCP {d['read_bytes'] / MiB:.1f} MiB)"
            what = "anyshard device bytes (read_bytes; readahead and code pages included)"
            out.append((f"{name}{what} vs target", None, detail))
        what, rss = f"anyshard peak RSS over target <= {RSS_TARGET_MIB} MiB", a["rss_over"]
        out.append((name + what, rss <= RSS_TARGET_MIB * MiB, f"{rss / MiB:.0f} MiB"))
        lim = DCP_BACKEND_TARGETS[kind]
        what = f"DCP with AnyshardWriter/Reader <= {lim}x DCP with FileSystemWriter/Reader"
        out.append(h.at_most(name + what, da["time"], lim, d["time"]))
        if kind == "load" and any(r[s]["bad"] for s in SYSTEMS):
            detail = " ".join(f"{LABELS[s]} {r[s]['bad']}" for s in SYSTEMS[1:])
            out.append((f"{name}bit-exact", False, detail))
    return out


def block_devices() -> list[str]:
    """lsblk's disks; a virtio disk is a VM's, its host's cache included in disk figures."""
    cmd = ["lsblk", "-d", "-o", "NAME,SIZE,ROTA,TYPE,MODEL"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    disks = [" ".join(ln.split()) for ln in out.splitlines()[1:] if not ln.startswith("zram")]
    line = "- block devices (lsblk NAME SIZE ROTA TYPE MODEL): "
    line += "; ".join(f"`{d}`" for d in disks)
    if any(d.startswith("vd") for d in disks):
        line += " -- a virtio disk of a VM (ROTA is what the guest is told; the host's backing "
        line += "store and its cache are unknown, so disk numbers include the host's behaviour)"
    return [line]


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=5, quick={"gib": 0.1, "reps": 1}, dirs=True)
    p.add_argument("--gib", type=float, default=1.0, help="total fp32 state size in GiB (1.0)")
    p.add_argument("--regimes", default="disk,tmpfs", help="a subset of disk,tmpfs")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="no warm-up round")
    p.add_argument("--no-verify", action="store_true", help="anyshard.load(verify=False)")
    args = p.parse_args(argv)
    parents = h.regime_dirs(args, h.words(p, "--regimes", args.regimes, ("disk", "tmpfs")))
    dirs = {r: tempfile.mkdtemp(prefix=f"bench-reshard-{r}-", dir=d) for r, d in parents.items()}
    drop = h.drop_cache(dirs["disk"]) if "disk" in dirs else "n/a"
    spec = model_spec(args.gib)
    total = sum(4 * math.prod(s) for _, s, _ in spec)
    print(f"state: {total / GiB:.3f} GiB fp32 in {len(spec)} tensors; {WORLD} gloo ranks; "
          f"{args.reps} repetition(s)")  # fmt: skip
    print("\n".join(f"{r}: {d} on {h.fs_type(d)}" for r, d in dirs.items()))
    cfg = vars(args) | {"regimes": list(dirs.items()), "verify": not args.no_verify}
    load = h.RunLoad()
    try:
        data = h.run_ranks(worker, WORLD, cfg)[0] | {"total_bytes": total, "tensors": len(spec)}
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    records = h.Records(args.jsonl, "reshard")
    for rec in data["records"]:
        for rank, r in enumerate(rec["ranks"]):
            records.add(r, regime=rec["regime"], op=rec["op"], system=rec["system"], rank=rank)
    rows = summarize(data)
    checks = check_targets(rows)
    per_op = lambda f: "; ".join(f"{r['regime']} {r['op']} {f(r)}" for r in rows)  # noqa: E731
    times = per_op(lambda r: " ".join(f"{s}={r[s]['times']}" for s in SYSTEMS))
    cpu = per_op(lambda r: " ".join(f"{LABELS[s]}={r[s]['cpu']:.2f}" for s in SYSTEMS))
    how = {"drop_caches": " (`sync; echo 3 > /proc/sys/vm/drop_caches`)",
           "fadvise": " (fsync + `posix_fadvise(POSIX_FADV_DONTNEED)` on every file)"}  # fmt: skip
    run = (f"{data['total_bytes'] / GiB:.2f} GiB fp32 in {data['tensors']} tensors, "
           f"{args.reps} repetitions, median [min-max] of the slowest rank")  # fmt: skip
    blocks = [METHOD, table(rows), f"Per-repetition times (slowest rank): {times}."]
    blocks += [f"CPU seconds, all ranks together (user + sys, median repetition): {cpu}."]
    blocks += [h.targets(checks)]
    drop = f"- page cache before each disk-regime operation: {drop}{how.get(drop, '')}"
    data = {"rows": rows, "checks": checks, "data": data}
    h.report(args, argv, __file__, "bench_reshard", run, blocks, load, heading=HEADING, dirs=dirs,
             machine=[*block_devices(), drop], data=data)  # fmt: skip
    return 1 if any(r[s]["bad"] for r in rows for s in SYSTEMS) else 0


if __name__ == "__main__":
    sys.exit(main())
