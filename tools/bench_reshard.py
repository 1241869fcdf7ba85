"""Reshard benchmark: anyshard vs torch.distributed.checkpoint (DCP) vs the physical floor.

    python tools/bench_reshard.py --write-docs                    # smoke test: --quick
    python tools/bench_reshard.py --regimes tmpfs --reps 3 --no-verify   # loads without checks
    python tools/bench_reshard.py --profile pyspy                 # or cprofile: one anyshard rank

A few minutes on 2 cores. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from functools import partial

import benchkit as h
from benchkit import GiB, MiB

WORLD, TARGETS = 4, ("tp4", "dp4")
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
HEADING = (
    "## Reshard benchmark: anyshard vs DCP (with its own and with anyshard's storage backend) "
    "vs the physical floor (`tools/bench_reshard.py`)"
)
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
(tools/benchkit.py), from a common barrier. Times: the slowest rank, median [min-max] over the
repetitions. Bytes are per-rank /proc/self/io deltas (worst rank): `rchar` (bytes requested from
the kernel), and for the disk regime `read_bytes` from the block device in parentheses; save rows
show `wchar` (bytes written). RSS+ is the peak VmRSS during the operation minus VmRSS just before
it (target tensors already allocated), worst rank and repetition: the kernel's VmHWM, reset before
each operation (a 2 ms sampler thread only where the reset is refused). CPU: user + sys seconds of
the 4 ranks together, median repetition."""


def model_spec(gib: float) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, global shape, kind)``; kind ``col`` (tp Shard(0)), ``row`` (tp Shard(1)),
    ``norm`` (replicated over tp). About ``gib`` GiB of fp32."""
    d = 1024 if gib >= 0.5 else 512
    f, v = 4 * d, 8192
    layers = max(1, round((gib * GiB / 4 - 2 * v * d - d) / (4 * d * d + 3 * f * d + 2 * d)))
    spec: list[tuple[str, tuple[int, ...], str]] = [("tok_embeddings.weight", (v, d), "row")]
    for p in (f"layers.{i}." for i in range(layers)):
        spec += [(p + "attention_norm.weight", (d,), "norm")]
        spec += [(p + f"attention.w{x}.weight", (d, d), "col") for x in "qkv"]
        spec += [(p + "attention.wo.weight", (d, d), "row"), (p + "ffn_norm.weight", (d,), "norm")]
        spec += [(p + f"feed_forward.w{x}.weight", (f, d), "col") for x in "13"]
        spec += [(p + "feed_forward.w2.weight", (d, f), "row")]
    return spec + [("norm.weight", (d,), "norm"), ("output.weight", (v, d), "col")]


def placements_for(layout: str, kind: str):
    from torch.distributed.tensor import Replicate, Shard

    tp = {"col": Shard(0), "row": Shard(1), "norm": Replicate()}[kind]
    return {"src": [Shard(0), tp], "tp4": [tp], "dp4": [Shard(0)]}[layout]


def digest(t) -> bytes:
    """BLAKE2b of a tensor's bytes: two shards are bit-identical iff their digests match."""
    return hashlib.blake2b(h.as_bytes(t.detach().contiguous()), digest_size=20).digest()


def full_tensor(name: str, shape: tuple[int, ...], seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


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


class Profiler:
    """py-spy (a sampling subprocess, raw output) around a block, or cProfile around the
    calls of the functions it `wrap`s."""

    def __init__(self, kind: str | None, out_dir: str, label: str):
        self.kind, self.file = kind, kind and os.path.join(out_dir, f"{kind}-{label}.out")

    def __enter__(self) -> Profiler:
        if self.kind == "pyspy":
            cmd = f"py-spy record --pid {os.getpid()} --rate 250 --format raw --nonblocking -o"
            out = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            self._proc = subprocess.Popen([*cmd.split(), self.file], **out)
            time.sleep(1.5)  # let it attach
        return self

    def wrap(self, fn):
        if self.kind != "cprofile":
            return fn

        def profiled() -> None:
            import cProfile

            with cProfile.Profile() as prof:
                fn()
            prof.dump_stats(self.file)

        return profiled

    def __exit__(self, *exc) -> None:
        if self.kind == "pyspy":
            self._proc.send_signal(signal.SIGINT)
            self._proc.wait(timeout=60)


def summarize_profile(path: str, top: int = 18) -> str:
    """cProfile's top functions, or py-spy's samples as self and inclusive shares per function
    (inclusive leaves out the benchmark's and the thread/process plumbing's frames)."""
    import io
    import pstats
    import re

    if "cprofile-" in path:
        s = io.StringIO()
        st = pstats.Stats(path, stream=s)
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(top)
        return f"cProfile {os.path.basename(path)} (main thread only):\n" + s.getvalue()
    plumbing = re.compile(r"multiprocessing/|bench_reshard|benchkit|<string>|threading|futures/")
    own, incl = Counter(), Counter()
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", x) for x in stack.split(";")]
        frames = [x for x in frames if x and not x.startswith(("process ", "thread "))]
        own.update({x: int(n) for x in frames[-1:]})
        incl.update({x: int(n) for x in set(frames) if not plumbing.search(x)})
    total = sum(own.values()) or 1
    out = [f"py-spy {os.path.basename(path)}: {total} samples (250 Hz, active threads only)"]
    for name, counts in (("self", own), ("inclusive", incl)):
        out += [f"  {name}:"]
        out += [f"    {100 * n / total:5.1f}%  {x}" for x, n in counts.most_common(top)]
    return "\n".join(out)


def _dcp(op: str, backend: str, state, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from anyshard.dcp import AnyshardReader, AnyshardWriter

    if op == "save":
        writer = AnyshardWriter if backend == "anyshard" else dcp.FileSystemWriter
        dcp.save(state, storage_writer=writer(path))
    else:
        reader = AnyshardReader if backend == "anyshard" else dcp.FileSystemReader
        dcp.load(state, storage_reader=reader(path))


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import anyshard

    meshes = {"src": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))}
    meshes |= {t: init_device_mesh("cpu", (world,), mesh_dim_names=(t[:2],)) for t in TARGETS}
    spec = model_spec(cfg["gib"])
    # the source state; the target states (zeros) and the digests of their expected shards
    # (holding the shards themselves would double each rank's memory)
    source, targets, expected = {}, {t: {} for t in TARGETS}, {t: {} for t in TARGETS}
    for name, shape, kind in spec:
        full = full_tensor(name, shape)
        for layout in ("src", *TARGETS):
            pl = placements_for(layout, kind)
            local = distribute_tensor(full, meshes[layout], pl, src_data_rank=None).to_local()
            if layout != "src":
                expected[layout][name] = (tuple(local.shape), digest(local))
            local = local.clone() if layout == "src" else torch.zeros_like(local)
            kw = {"run_check": False, "shape": full.shape, "stride": full.stride()}
            dt = DTensor.from_local(local, meshes[layout], pl, **kw)
            (source if layout == "src" else targets[layout])[name] = dt
    src_locals, records = [source[n].to_local() for n, _, _ in spec], []

    def bad_shards(t: str) -> list[str]:
        got = {n: targets[t][n].to_local() for n in expected[t]}
        bad = (tuple(got[n].shape) != s or digest(got[n]) != d for n, (s, d) in expected[t].items())
        return [n for n, b in zip(expected[t], bad, strict=True) if b]

    def measure(regime: str, root: str, op: str, system: str, fn, label: str) -> None:
        target = op.split("->")[1] if op.startswith("load") else None
        for v in targets[target].values() if target else ():
            v.to_local().fill_(-7.25)
        prof = cfg["profile"] if system == "anyshard" and rank == 0 else None
        cold = partial(h.drop_cache, root) if regime == "disk" else None
        with Profiler(prof, cfg["profile_dir"], f"{regime}-{label}") as p:
            recs = h.measure_ranks(p.wrap(fn), before=cold)
        bad: list = [None] * world  # the floor reads bytes, not tensors: nothing to verify
        dist.all_gather_object(bad, bad_shards(target)[:5] if target and system != "floor" else [])
        if rank == 0:
            bad = sorted({b for x in bad for b in x})
            rec = {"regime": regime, "op": op, "system": system, "ranks": recs, "bad": bad}
            records.append({**rec, "profile": p.file})
            worst, mark = max(r["wall_s"] for r in recs), "  MISMATCH" if bad else ""
            print(f"  [{regime}] {op:9s} {system:8s} {worst:7.2f} s{mark}", flush=True)

    def systems(root: str, t: str | None, names=None) -> dict:
        """Every system's save (``t`` None) or load into ``t``, of ``names`` or everything."""
        names = names or [n for n, _, _ in spec]
        state = {n: (source if t is None else targets[t])[n] for n in names}
        path = {s: os.path.join(root, s) for s in SYSTEMS}
        floor_file = os.path.join(path["floor"], f"rank-{rank:05d}.bin")
        if t is None:
            floor, ours = partial(floor_save, floor_file, src_locals), anyshard.save
        else:
            floor = partial(floor_load, floor_file, [v.to_local() for v in state.values()])
            ours = partial(anyshard.load, verify=cfg["verify"])
        op = "save" if t is None else "load"
        both = (("dcp", "dcp"), ("dcp_any", "anyshard"))  # DCP with its own backend, with ours
        dcps = {s: partial(_dcp, op, backend, state, path[s]) for s, backend in both}
        return {"floor": floor, "anyshard": partial(ours, path["anyshard"], state), **dcps}

    def remove(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    if cfg["warmup"]:  # untimed: imports, caches, thread pools, DCP's first-call setup
        few = [next(n for n, _, k in spec if k == kind) for kind in ("norm", "col", "row")]
        wroot = os.path.join(cfg["regimes"][-1][1], "warmup")
        for t in (None, *TARGETS):
            for s, fn in systems(wroot, t, few).items():
                if s != "floor":
                    fn()
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
                op = "save" if t is None else f"load->{t}"
                if t == "rm":
                    remove(os.path.join(root, s))
                else:
                    measure(regime, root, op, s, ops[t][s], f"{op.replace('->', '-')}-rep{rep}")
            remove(root)
    if rank != 0:
        return None
    target_bytes = {t: sum(4 * math.prod(s) for s, _ in expected[t].values()) for t in TARGETS}
    return {
        "records": records,
        "source_bytes": sum(t.numel() * 4 for t in src_locals),
        "target_bytes": target_bytes,
        "total_bytes": sum(4 * math.prod(s) for _, s, _ in spec),
        "tensors": len(spec),
    }


def summarize(data: dict) -> list[dict]:
    """One row per (regime, op); per system the slowest rank's times, the worst rank's bytes
    (median repetition) and RSS+ (worst repetition), all ranks' CPU seconds (median)."""
    rows: dict[tuple[str, str], dict] = {}
    for rec in data["records"]:
        key = (rec["regime"], rec["op"])
        load = key[1].startswith("load")
        row = rows.setdefault(key, {"regime": key[0], "op": key[1]})
        row["target_bytes"] = data["target_bytes"][key[1][6:]] if load else data["source_bytes"]
        row.setdefault(rec["system"], []).append(rec)
    for row in rows.values():
        for s in SYSTEMS:
            reps = row[s]
            keys = (*h.IO_KEYS, "wall_s", "rss_over")
            worst = {k: [max(r[k] for r in x["ranks"]) for x in reps] for k in keys}
            row[s] = {k: h.spread(v)["median"] for k, v in worst.items()}
            row[s]["times"] = [round(t, 3) for t in worst["wall_s"]]
            row[s]["time"], row[s]["rss_over"] = row[s].pop("wall_s"), max(worst["rss_over"])
            row[s]["cpu"] = h.spread([sum(r["cpu_s"] for r in x["ranks"]) for x in reps])["median"]
            row[s]["bad"] = sorted({b for x in reps for b in x["bad"]})
            row[s]["profiles"] = [x["profile"] for x in reps if x["profile"]]
    return list(rows.values())


def cpu_line(rows: list[dict]) -> str:
    cpu = lambda r: " ".join(f"{LABELS[s]}={r[s]['cpu']:.2f}" for s in SYSTEMS)  # noqa: E731
    per_op = (f"{r['regime']} {r['op']} {cpu(r)}" for r in rows)
    return "CPU seconds, all ranks together (user + sys, median repetition): " + "; ".join(per_op)


def _moved(x: dict, row: dict) -> str:
    """MiB per rank: read (device reads in brackets on disk), or written (``w``)."""
    if not row["op"].startswith("load"):
        return f"w {x['wchar'] / MiB:.0f}"
    disk = f" ({x['read_bytes'] / MiB:.0f})" if row["regime"] == "disk" else ""
    return f"{x['rchar'] / MiB:.0f}{disk}"


def table(rows: list[dict], markdown: bool) -> str:
    head = ["regime", "operation", *(f"{LABELS[s]} s" for s in SYSTEMS), "any/floor", "any/DCP"]
    head += ["(DCP+any)/DCP", "MiB/rank anyshard", "MiB/rank DCP", "MiB/rank target"]
    head += ["RSS+ MiB anyshard", "RSS+ MiB DCP", "bit-exact"]
    body = []
    for r in rows:
        f, a, d, da = (r[s] for s in SYSTEMS)
        bad = {s: r[s]["bad"][:2] for s in SYSTEMS if r[s]["bad"]}
        exact = "yes" if not bad else f"NO: {bad}"
        pairs = ((a, f), (a, d), (da, d))
        ratios = [f"{x['time'] / y['time']:.2f}" if y["time"] else "-" for x, y in pairs]
        times = (h.fmt_spread(x["times"]) for x in (f, a, d, da))
        body.append([r["regime"], r["op"], *times, *ratios])
        body[-1] += [_moved(a, r), _moved(d, r), f"{r['target_bytes'] / MiB:.0f}"]
        body[-1] += [f"{a['rss_over'] / MiB:.0f}", f"{d['rss_over'] / MiB:.0f}"]
        body[-1] += [exact if r["op"].startswith("load") else "-"]
    return h.table(head, body, markdown)


def check_targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    out = []
    for r in rows:
        kind, a, d, da = r["op"][:4], r["anyshard"], r["dcp"], r["dcp_any"]
        name = f"{r['regime']} {r['op']}: "
        for other, lim in TIME_TARGETS.get((r["regime"], kind), ()):
            ref = r[other]["time"]
            detail = f"{a['time']:.2f} s vs {lim} x {ref:.2f} s = {lim * ref:.2f} s"
            out.append((f"{name}anyshard <= {lim}x {other}", a["time"] <= lim * ref, detail))
        if kind == "load":
            lim, text = READ_RATIO_TARGET * r["target_bytes"], f"{READ_RATIO_TARGET}x target"
            detail = f"{a['rchar'] / MiB:.1f} MiB vs {lim / MiB:.1f} MiB"
            out.append((f"{name}anyshard bytes read (rchar) <= {text}", a["rchar"] <= lim, detail))
        if kind == "load" and r["regime"] == "disk":  # informational: readahead, code pages
            detail = f"{a['read_bytes'] / MiB:.1f} MiB vs {r['target_bytes'] / MiB:.1f} MiB"
            detail += f" (DCP {d['read_bytes'] / MiB:.1f} MiB)"
            what = "anyshard device bytes (read_bytes; readahead and code pages included)"
            out.append((f"{name}{what} vs target", None, detail))
        ok = a["rss_over"] <= RSS_TARGET_MIB * MiB
        rss = f"{a['rss_over'] / MiB:.0f} MiB"
        out.append((f"{name}anyshard peak RSS over target <= {RSS_TARGET_MIB} MiB", ok, rss))
        lim = DCP_BACKEND_TARGETS[kind]
        what = f"DCP with AnyshardWriter/Reader <= {lim}x DCP with FileSystemWriter/Reader"
        detail = f"{da['time']:.2f} s vs {lim} x {d['time']:.2f} s = {lim * d['time']:.2f} s"
        out.append((name + what, da["time"] <= lim * d["time"], detail))
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
    line = "- block devices (lsblk NAME SIZE ROTA TYPE MODEL): " + "; ".join(
        f"`{d}`" for d in disks
    )
    if any(d.startswith("vd") for d in disks):
        line += (
            " -- a virtio disk of a VM (ROTA is what the guest is told; the host's backing "
            "store and its cache are unknown, so disk numbers include the host's behaviour)"
        )
    return [line]


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=5, quick="--gib 0.1 --reps 1", dirs=True)
    p.add_argument("--gib", type=float, default=1.0, help="total fp32 state size in GiB (1.0)")
    p.add_argument("--regimes", default="disk,tmpfs", help="a subset of disk,tmpfs")
    p.add_argument("--profile", choices=("pyspy", "cprofile"), help="anyshard on rank 0, tmpfs")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="no warm-up round")
    p.add_argument("--no-verify", action="store_true", help="anyshard.load(verify=False)")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.reps = 0.1, 1
    if args.profile:
        args.regimes, args.reps = "tmpfs", 1
        if args.profile == "pyspy" and shutil.which("py-spy") is None:
            print("py-spy not found; falling back to cProfile (main thread only)")
            args.profile = "cprofile"
    regimes = h.words(p, "--regimes", args.regimes, ("disk", "tmpfs"))
    parent = {"disk": args.disk_dir, "tmpfs": args.tmpfs_dir}
    dirs = {r: tempfile.mkdtemp(prefix=f"bench-reshard-{r}-", dir=parent[r]) for r in regimes}
    drop = h.drop_cache(dirs["disk"]) if "disk" in dirs else "n/a"
    spec = model_spec(args.gib)
    total = sum(4 * math.prod(s) for _, s, _ in spec)
    print(f"state: {total / GiB:.3f} GiB fp32 in {len(spec)} tensors; {WORLD} gloo ranks; "
          f"{args.reps} repetition(s)")  # fmt: skip
    print("\n".join(f"{r}: {d} on {h.fs_type(d)}" for r, d in dirs.items()))
    if "disk" in dirs:
        print(f"page cache: dropped before every disk-regime operation with {drop}")
    cfg = vars(args) | {"regimes": list(dirs.items()), "verify": not args.no_verify}
    cfg["profile_dir"] = tempfile.mkdtemp(prefix="bench-reshard-profile-") if args.profile else None
    load = h.RunLoad()
    try:
        data = h.run_ranks(worker, WORLD, cfg)[0]
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    note, records = load.note(), h.Records(args.jsonl, "reshard")
    for rec in data["records"]:
        for rank, r in enumerate(rec["ranks"]):
            records.add(r, regime=rec["regime"], op=rec["op"], system=rec["system"], rank=rank)
    rows = summarize(data)
    checks = check_targets(rows)
    each = lambda r: " ".join(f"{s}={r[s]['times']}" for s in SYSTEMS)  # noqa: E731
    times = (f"{r['regime']} {r['op']} {each(r)}" for r in rows)
    print(f"\n{note}\n\n{table(rows, markdown=False)}\n")
    print("MiB/rank: loads: rchar (read_bytes from the device, disk regime); saves: wchar. Worst "
          "rank, median rep.\nRSS+: peak VmRSS during the operation minus VmRSS before it "
          "(targets allocated), worst rank and rep.")  # fmt: skip
    print("per-repetition times (slowest rank): " + "; ".join(times))
    print(cpu_line(rows) + "\n\ntargets:\n" + "\n".join(h.check_lines(checks, "  ")))
    h.dump_json(args.json, {"rows": rows, "checks": checks, "data": data})
    for r in rows if args.profile else ():
        for path in r["anyshard"]["profiles"]:
            print(f"\n== {r['regime']} {r['op']} anyshard (rank 0) ==\n{summarize_profile(path)}")
    if args.write_docs:
        how = {
            "drop_caches": " (`sync; echo 3 > /proc/sys/vm/drop_caches`)",
            "fadvise": " (fsync + `posix_fadvise(POSIX_FADV_DONTNEED)` on every file)",
        }
        run = (f"{data['total_bytes'] / GiB:.2f} GiB fp32 in {data['tensors']} tensors, "
               f"{args.reps} repetitions, median [min-max] of the slowest rank")  # fmt: skip
        section = [HEADING, "", *h.docs_header(__file__, argv, run, dirs, note), *block_devices()]
        section += [f"- page cache before each disk-regime operation: {drop}{how.get(drop, '')}"]
        section += ["", METHOD, "", table(rows, markdown=True), "", cpu_line(rows) + "."]
        section += ["", "Targets:", "", *h.check_lines(checks)]
        h.write_section(args.write_docs, "bench_reshard", section)
    return 1 if any(r[s]["bad"] for r in rows for s in SYSTEMS) else 0


if __name__ == "__main__":
    sys.exit(main())
