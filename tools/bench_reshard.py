"""Reshard benchmark: anyshard vs torch.distributed.checkpoint (DCP) vs the physical floor.

Run (the full benchmark, a few minutes on 2 cores; writes the table into docs/benchmarks.md):

    python tools/bench_reshard.py --write-docs

The loads verify every byte by default (anyshard.load's verify=True); the cost of that:

    python tools/bench_reshard.py --regimes tmpfs --reps 3 --no-verify

Smoke test (0.1 GiB, 1 repetition, well under a minute):

    python tools/bench_reshard.py --quick

Profile one anyshard rank (tmpfs regime; py-spy if installed, else cProfile):

    python tools/bench_reshard.py --profile pyspy        # or --profile cprofile

What it does, in one run: spawns 4 gloo ranks on CPU (torch.multiprocessing), builds a
deterministic transformer-like state of ``--gib`` GiB fp32 as DTensors on a 2D mesh
("dp_shard"=2, "tp"=2) -- column-parallel weights tp Shard(0), row-parallel weights tp Shard(1),
norms replicated over tp, everything dp Shard(0) -- and, per regime (a directory on the real
disk with the page cache dropped before every operation, and /dev/shm), per repetition, with
the order of the systems rotated every repetition (on disk all saves, then all loads; on tmpfs,
where a checkpoint is memory, one system after another: save, both loads, removal):

* saves it with the floor (every rank writes its bytes to one plain file, fsync), anyshard
  (``anyshard.save``), DCP (``dcp.save`` with its default planner and ``FileSystemWriter``) and
  DCP with anyshard's storage backend (``dcp.save`` with ``anyshard.dcp.AnyshardWriter``);
* loads each checkpoint into freshly laid out targets -- a 1D mesh tp=4 (same tp dims) and a
  1D mesh dp_shard=4 (Shard(0)) -- with the floor (as many bytes as the target holds, read
  cold with plain sequential reads), ``anyshard.load`` and ``dcp.load`` (default planner,
  ``FileSystemReader``), and ``dcp.load`` with ``anyshard.dcp.AnyshardReader``; every load is checked bit-exact (BLAKE2b digests of the bytes of each
  shard) against the expected shards outside the timed region.

Times are the slowest rank's, each rank timed from a common barrier; the medians over the
repetitions are reported. Bytes read per rank are /proc/self/io deltas around the operation
(``rchar``: bytes the process asked the kernel for, on any file system; ``read_bytes``: bytes
fetched from the block device, disk regime only); the RSS sampler's own /proc reads are
subtracted. Peak RSS over target: the peak of VmRSS during the operation (VmHWM after a reset
through /proc/self/clear_refs; a 2 ms VmRSS sampler thread only where the reset is refused, as
such a thread competes for the GIL with the code it measures) minus VmRSS just before it, when
the target tensors are already allocated and touched. CPU: user + sys seconds of each rank's
process (all threads) during the operation, summed over the ranks.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from datetime import datetime, timezone
from functools import partial

from markdown_section import replace_section

MiB = 1 << 20
GiB = 1 << 30
WORLD = 4
SYSTEMS = ("floor", "anyshard", "dcp", "dcp_any")
# The label of each system in tables.
LABELS = {"floor": "floor", "anyshard": "anyshard", "dcp": "DCP", "dcp_any": "DCP+anyshard"}
TARGETS = ("tp4", "dp4")
DOCS_BEGIN = "<!-- bench_reshard:begin -->"
DOCS_END = "<!-- bench_reshard:end -->"

# Targets (ratios): time checks per regime, then the per-rank limits.
TIME_TARGETS = {
    ("disk", "save"): (("floor", 1.2), ("dcp", 1.0)),
    ("disk", "load"): (("floor", 1.15), ("dcp", 0.9)),
    ("tmpfs", "save"): (("dcp", 0.6),),
    ("tmpfs", "load"): (("dcp", 0.4),),
}
# DCP with the anyshard backend (AnyshardWriter/AnyshardReader) vs DCP with its own
# FileSystemWriter/FileSystemReader, both regimes: saves no slower, resharding loads <= 0.8x.
DCP_BACKEND_TARGETS = {"save": 1.0, "load": 0.8}
READ_RATIO_TARGET = 1.05
RSS_TARGET_MIB = 256


# --------------------------------------------------------------------------- the state


def model_spec(gib: float) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, global shape, kind)``; kind ``col`` (tp Shard(0)), ``row`` (tp Shard(1)), ``norm``
    (replicated over tp). Sized to about ``gib`` GiB of fp32."""
    h = 1024 if gib >= 0.5 else 512
    f, v = 4 * h, 8192
    per_layer = 4 * h * h + 3 * f * h + 2 * h
    fixed = 2 * v * h + h
    layers = max(1, round((gib * GiB / 4 - fixed) / per_layer))
    spec: list[tuple[str, tuple[int, ...], str]] = [("tok_embeddings.weight", (v, h), "row")]
    for i in range(layers):
        p = f"layers.{i}."
        spec += [
            (p + "attention_norm.weight", (h,), "norm"),
            (p + "attention.wq.weight", (h, h), "col"),
            (p + "attention.wk.weight", (h, h), "col"),
            (p + "attention.wv.weight", (h, h), "col"),
            (p + "attention.wo.weight", (h, h), "row"),
            (p + "ffn_norm.weight", (h,), "norm"),
            (p + "feed_forward.w1.weight", (f, h), "col"),
            (p + "feed_forward.w3.weight", (f, h), "col"),
            (p + "feed_forward.w2.weight", (h, f), "row"),
        ]
    spec += [("norm.weight", (h,), "norm"), ("output.weight", (v, h), "col")]
    return spec


def placements_for(layout: str, kind: str):
    from torch.distributed.tensor import Replicate, Shard

    if layout == "src":  # (dp_shard, tp)
        tp = {"col": Shard(0), "row": Shard(1), "norm": Replicate()}[kind]
        return [Shard(0), tp]
    if layout == "tp4":
        return [{"col": Shard(0), "row": Shard(1), "norm": Replicate()}[kind]]
    if layout == "dp4":
        return [Shard(0)]
    raise ValueError(layout)


def digest(t) -> bytes:
    """BLAKE2b of a tensor's bytes: two shards are bit-identical iff their digests match."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(memoryview(flat.numpy()), digest_size=20).digest()


def full_tensor(name: str, shape: tuple[int, ...]):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


# --------------------------------------------------------------------------- measuring


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines() if line)}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class RssSampler:
    """Samples VmRSS every ``period`` s in a thread; counts its own /proc reads (rchar)."""

    def __init__(self, period: float = 0.002, *, enabled: bool = True):
        self.period = period
        self.enabled = enabled
        self.peak_kib = 0
        self.own_rchar = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            while True:
                data = os.pread(fd, 4096, 0)
                self.own_rchar += len(data)
                m = re.search(rb"VmRSS:\s+(\d+)", data)
                if m:
                    self.peak_kib = max(self.peak_kib, int(m.group(1)))
                if self._stop.wait(self.period):
                    break
        finally:
            os.close(fd)

    def __enter__(self) -> RssSampler:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    return kind


def drop_caches_method() -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        return "fadvise"


def drop_cache(method: str, root: str) -> None:
    """Rank 0 only: make every file under ``root`` cold."""
    os.sync()
    if method == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------- the floor


def tensor_view(t) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def floor_save(path: str, tensors) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            mv = tensor_view(t)
            done = 0
            while done < mv.nbytes:
                done += f.write(mv[done:])
        os.fsync(f.fileno())


def floor_load(path: str, tensors) -> None:
    """Read as many bytes as ``tensors`` hold, sequentially, into them (wrapping at EOF)."""
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            mv = tensor_view(t)
            done = 0
            while done < mv.nbytes:
                got = f.readinto(mv[done:])
                if not got:
                    f.seek(0)
                    continue
                done += got


# --------------------------------------------------------------------------- profiling


class Profiler:
    def __init__(self, kind: str | None, out_dir: str, label: str):
        self.kind, self.out_dir, self.label = kind, out_dir, label
        self._proc = None
        self._prof = None
        self.file: str | None = None

    def __enter__(self) -> Profiler:
        if self.kind == "pyspy":
            self.file = os.path.join(self.out_dir, f"pyspy-{self.label}.txt")
            self._proc = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(os.getpid()),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--output",
                    self.file,
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.5)  # let it attach
        elif self.kind == "cprofile":
            import cProfile

            self.file = os.path.join(self.out_dir, f"cprofile-{self.label}.prof")
            self._prof = cProfile.Profile()
            self._prof.enable()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)
            self._proc.wait(timeout=60)
        if self._prof is not None:
            self._prof.disable()
            self._prof.dump_stats(self.file)


# --------------------------------------------------------------------------- the ranks


def worker(rank: int, cfg: dict, store_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import anyshard

    # The environment torchrun gives each of its workers: the library sizes its thread pools to
    # the process's share of the host's CPUs from it.
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    meshes = {
        "src": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")),
        "tp4": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)),
        "dp4": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",)),
    }
    spec = model_spec(cfg["gib"])

    # Source state, digests of the expected target shards (for verification: holding the
    # shards themselves would double each rank's memory), target states (zeros).
    source: dict[str, DTensor] = {}
    expected: dict[str, dict[str, tuple[tuple[int, ...], bytes]]] = {t: {} for t in TARGETS}
    targets: dict[str, dict[str, DTensor]] = {t: {} for t in TARGETS}
    for name, shape, kind in spec:
        full = full_tensor(name, shape)
        local = distribute_tensor(
            full, meshes["src"], placements_for("src", kind), src_data_rank=None
        ).to_local()
        source[name] = DTensor.from_local(
            local.clone(),
            meshes["src"],
            placements_for("src", kind),
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
        for t in TARGETS:
            exp = distribute_tensor(
                full, meshes[t], placements_for(t, kind), src_data_rank=None
            ).to_local()
            expected[t][name] = (tuple(exp.shape), digest(exp))
            targets[t][name] = DTensor.from_local(
                torch.zeros_like(exp),
                meshes[t],
                placements_for(t, kind),
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            del exp
        del full, local
    gc.collect()
    src_locals = [source[n].to_local() for n, _, _ in spec]
    source_bytes = sum(t.numel() * 4 for t in src_locals)
    target_bytes = {t: sum(4 * _numel(shape) for shape, _ in expected[t].values()) for t in TARGETS}

    def sentinel(t: str) -> None:
        for v in targets[t].values():
            v.to_local().fill_(-7.25)

    def verify(t: str) -> list[str]:
        bad = []
        for name, (shape, want) in expected[t].items():
            got = targets[t][name].to_local()
            if tuple(got.shape) != shape or digest(got) != want:
                bad.append(name)
        return bad

    records: list[dict] = []
    drop_method = cfg["drop_method"]

    def measure(regime: str, root: str, op: str, system: str, fn, label: str) -> None:
        is_load = op.startswith("load")
        if is_load:
            sentinel(op.split("->")[1])
        gc.collect()
        dist.barrier()
        if regime == "disk" and rank == 0:
            drop_cache(drop_method, root)
        dist.barrier()
        prof_kind = (
            cfg["profile"]
            if (system == cfg["profile_system"] and rank == cfg["profile_rank"])
            else None
        )
        with Profiler(prof_kind, cfg["profile_dir"], f"{regime}-{label}") as prof:
            rss0 = status_kib("VmRSS")
            hwm_ok = reset_hwm()
            # The kernel's peak (VmHWM, reset above) is exact; a sampler thread, which would
            # compete for the GIL with the threads it measures, only where it cannot be reset.
            with RssSampler(enabled=not hwm_ok) as sampler:
                io0 = proc_io()
                cpu0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                cpu1 = resource.getrusage(resource.RUSAGE_SELF)
                io1 = proc_io()
            hwm = status_kib("VmHWM") if hwm_ok else 0
        peak = max(hwm, sampler.peak_kib)
        rec = {
            "time": t1 - t0,
            "rchar": io1["rchar"] - io0["rchar"] - sampler.own_rchar,
            "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "wchar": io1["wchar"] - io0["wchar"],
            "write_bytes": io1["write_bytes"] - io0["write_bytes"],
            "rss_over": (peak - rss0) * 1024,
            "cpu": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
            "profile": prof.file,
        }
        # The floor reads bytes, not tensors: nothing to verify.
        bad = verify(op.split("->")[1]) if is_load and system != "floor" else []
        rec["bad"] = bad[:5]
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            records.append({"regime": regime, "op": op, "system": system, "ranks": gathered})
            worst = max(r["time"] for r in gathered)
            ok = "" if not any(r["bad"] for r in gathered) else "  MISMATCH"
            print(f"  [{regime}] {op:9s} {system:8s} {worst:7.2f} s{ok}", flush=True)

    if cfg["warmup"]:
        # One untimed round on a few small tensors of every kind: imports, parser and planner
        # caches, thread pools, DCP's first-call setup; none of it is measured.
        base = cfg["regimes"][-1][1]
        names = [
            next(
                n
                for n, shape, k in spec
                if k == kind and len(shape) == (1 if kind == "norm" else 2)
            )
            for kind in ("norm", "col", "row")
        ]
        wroot = os.path.join(base, "warmup")
        anyshard.save(os.path.join(wroot, "anyshard"), {n: source[n] for n in names})
        _dcp_save(dcp, {n: source[n] for n in names}, os.path.join(wroot, "dcp"))
        _dcp_any_save(dcp, {n: source[n] for n in names}, os.path.join(wroot, "dcp_any"))
        for t in TARGETS:
            anyshard.load(os.path.join(wroot, "anyshard"), {n: targets[t][n] for n in names})
            _dcp_load(dcp, {n: targets[t][n] for n in names}, os.path.join(wroot, "dcp"))
            _dcp_any_load(dcp, {n: targets[t][n] for n in names}, os.path.join(wroot, "dcp_any"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(wroot, ignore_errors=True)

    for regime, base in cfg["regimes"]:
        for rep in range(cfg["reps"]):
            root = os.path.join(base, f"rep{rep}")
            paths = {s: os.path.join(root, s) for s in SYSTEMS}
            k = rep % len(SYSTEMS)
            order = SYSTEMS[k:] + SYSTEMS[:k]
            if rank == 0:
                print(
                    f"[{regime}] repetition {rep + 1}/{cfg['reps']}, order {', '.join(order)}",
                    flush=True,
                )
            floor_file = os.path.join(paths["floor"], f"rank-{rank:05d}.bin")
            save_fns = {
                "floor": partial(floor_save, floor_file, src_locals),
                "anyshard": partial(anyshard.save, paths["anyshard"], source),
                "dcp": partial(_dcp_save, dcp, source, paths["dcp"]),
                "dcp_any": partial(_dcp_any_save, dcp, source, paths["dcp_any"]),
            }
            load_fns = {
                t: {
                    "floor": partial(
                        floor_load, floor_file, [targets[t][n].to_local() for n, _, _ in spec]
                    ),
                    "anyshard": partial(
                        anyshard.load, paths["anyshard"], targets[t], verify=cfg["verify"]
                    ),
                    "dcp": partial(_dcp_load, dcp, targets[t], paths["dcp"]),
                    "dcp_any": partial(_dcp_any_load, dcp, targets[t], paths["dcp_any"]),
                }
                for t in TARGETS
            }

            def remove(path: str) -> None:
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                dist.barrier()

            if regime == "tmpfs":
                # A checkpoint on tmpfs is memory: one system's at a time (save, both loads,
                # removal), so that each save writes into memory the previous one freed.
                for s in order:
                    measure(regime, root, "save", s, save_fns[s], f"save-rep{rep}")
                    for t in TARGETS:
                        measure(regime, root, f"load->{t}", s, load_fns[t][s], f"load-{t}-rep{rep}")
                    remove(paths[s])
            else:
                # On disk, all saves, then every system's load into each target: no system
                # reads back what it has just read (the VM host's cache survives drop_caches).
                for s in order:
                    measure(regime, root, "save", s, save_fns[s], f"save-rep{rep}")
                for t in TARGETS:
                    for s in order:
                        measure(regime, root, f"load->{t}", s, load_fns[t][s], f"load-{t}-rep{rep}")
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "records": records,
                    "source_bytes": source_bytes,
                    "target_bytes": target_bytes,
                    "total_bytes": sum(4 * _numel(s) for _, s, _ in spec),
                    "tensors": len(spec),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


def _dcp_save(dcp, state, path: str) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def _dcp_load(dcp, state, path: str) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def _dcp_any_save(dcp, state, path: str) -> None:
    from anyshard.dcp import AnyshardWriter

    dcp.save(state, storage_writer=AnyshardWriter(path))


def _dcp_any_load(dcp, state, path: str) -> None:
    from anyshard.dcp import AnyshardReader

    dcp.load(state, storage_reader=AnyshardReader(path))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------- reporting


def summarize(data: dict) -> list[dict]:
    """One row per (regime, op): medians over repetitions of the slowest rank."""
    rows: dict[tuple[str, str], dict] = {}
    for rec in data["records"]:
        row = rows.setdefault(
            (rec["regime"], rec["op"]), {"regime": rec["regime"], "op": rec["op"], "raw": {}}
        )
        row["raw"].setdefault(rec["system"], []).append(rec["ranks"])
    out = []
    for (_, op), row in rows.items():
        is_load = op.startswith("load")
        target = data["target_bytes"][op.split("->")[1]] if is_load else data["source_bytes"]
        row["target_bytes"] = target
        for s, reps in row["raw"].items():
            med = partial(_median_of_worst, reps)
            row[s] = {
                "time": med("time"),
                "times": [round(max(r["time"] for r in ranks), 3) for ranks in reps],
                "rchar": med("rchar"),
                "read_bytes": med("read_bytes"),
                "wchar": med("wchar"),
                "write_bytes": med("write_bytes"),
                "rss_over": max(max(r["rss_over"] for r in ranks) for ranks in reps),
                "cpu": statistics.median(sum(r.get("cpu", 0.0) for r in ranks) for ranks in reps),
                "bad": sorted({b for ranks in reps for r in ranks for b in r["bad"]}),
                "profiles": [r["profile"] for ranks in reps for r in ranks if r["profile"]],
            }
        out.append(row)
    return out


def cpu_line(rows: list[dict]) -> str:
    """CPU seconds (user + sys, every thread) of all ranks together, median repetition: with 4
    ranks on few cores, what an operation costs in CPU bounds its wall time from below."""
    return "CPU seconds, all ranks together (user + sys, median repetition): " + "; ".join(
        f"{r['regime']} {r['op']} " + " ".join(f"{LABELS[s]}={r[s]['cpu']:.2f}" for s in SYSTEMS)
        for r in rows
    )


def _median_of_worst(reps: list[list[dict]], key: str) -> float:
    return statistics.median(max(r[key] for r in ranks) for ranks in reps)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def table(rows: list[dict], markdown: bool) -> str:
    head = [
        "regime",
        "operation",
        "floor s",
        "anyshard s",
        "DCP s",
        "DCP+anyshard s",
        "any/floor",
        "any/DCP",
        "(DCP+any)/DCP",
        "MiB/rank anyshard",
        "MiB/rank DCP",
        "MiB/rank target",
        "RSS+ MiB anyshard",
        "RSS+ MiB DCP",
        "bit-exact",
    ]
    body = []
    for r in rows:
        f, a, d, da = r["floor"], r["anyshard"], r["dcp"], r["dcp_any"]
        is_load = r["op"].startswith("load")
        if is_load:
            if r["regime"] == "disk":
                bytes_a = f"{a['rchar'] / MiB:.0f} ({a['read_bytes'] / MiB:.0f})"
                bytes_d = f"{d['rchar'] / MiB:.0f} ({d['read_bytes'] / MiB:.0f})"
            else:
                bytes_a, bytes_d = f"{a['rchar'] / MiB:.0f}", f"{d['rchar'] / MiB:.0f}"
        else:
            bytes_a, bytes_d = f"w {a['wchar'] / MiB:.0f}", f"w {d['wchar'] / MiB:.0f}"
        exact = (
            "-"
            if not is_load
            else (
                "yes"
                if not (a["bad"] or d["bad"] or da["bad"])
                else f"NO: any {a['bad'][:2]} dcp {d['bad'][:2]} dcp+any {da['bad'][:2]}"
            )
        )
        body.append(
            [
                r["regime"],
                r["op"],
                f"{f['time']:.2f}",
                f"{a['time']:.2f}",
                f"{d['time']:.2f}",
                f"{da['time']:.2f}",
                _ratio(a["time"], f["time"]),
                _ratio(a["time"], d["time"]),
                _ratio(da["time"], d["time"]),
                bytes_a,
                bytes_d,
                f"{r['target_bytes'] / MiB:.0f}",
                f"{a['rss_over'] / MiB:.0f}",
                f"{d['rss_over'] / MiB:.0f}",
                exact,
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


def check_targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    out = []
    for r in rows:
        kind = "load" if r["op"].startswith("load") else "save"
        a = r["anyshard"]
        for other, limit in TIME_TARGETS.get((r["regime"], kind), ()):
            ref = r[other]["time"]
            ok = a["time"] <= limit * ref
            out.append(
                (
                    f"{r['regime']} {r['op']}: anyshard <= {limit}x {other}",
                    ok,
                    f"{a['time']:.2f} s vs {limit} x {ref:.2f} s = {limit * ref:.2f} s",
                )
            )
        if kind == "load":
            lim = READ_RATIO_TARGET * r["target_bytes"]
            ok = a["rchar"] <= lim
            out.append(
                (
                    f"{r['regime']} {r['op']}: anyshard bytes read (rchar) <= {READ_RATIO_TARGET}x target",
                    ok,
                    f"{a['rchar'] / MiB:.1f} MiB vs {lim / MiB:.1f} MiB",
                )
            )
            if (
                r["regime"] == "disk"
            ):  # informational: includes readahead and code pages faulted in after the drop
                out.append(
                    (
                        f"{r['regime']} {r['op']}: anyshard device bytes (read_bytes; readahead and code pages "
                        f"included) vs target",
                        None,
                        f"{a['read_bytes'] / MiB:.1f} MiB vs {r['target_bytes'] / MiB:.1f} MiB "
                        f"(DCP {r['dcp']['read_bytes'] / MiB:.1f} MiB)",
                    )
                )
        ok = a["rss_over"] <= RSS_TARGET_MIB * MiB
        out.append(
            (
                f"{r['regime']} {r['op']}: anyshard peak RSS over target <= {RSS_TARGET_MIB} MiB",
                ok,
                f"{a['rss_over'] / MiB:.0f} MiB",
            )
        )
        da, d = r["dcp_any"], r["dcp"]
        limit = DCP_BACKEND_TARGETS[kind]
        out.append(
            (
                f"{r['regime']} {r['op']}: DCP with AnyshardWriter/Reader <= {limit}x DCP with "
                f"FileSystemWriter/Reader",
                da["time"] <= limit * d["time"],
                f"{da['time']:.2f} s vs {limit} x {d['time']:.2f} s = {limit * d['time']:.2f} s",
            )
        )
        if kind == "load" and (a["bad"] or d["bad"] or da["bad"]):
            out.append(
                (
                    f"{r['regime']} {r['op']}: bit-exact",
                    False,
                    f"anyshard {a['bad']} dcp {d['bad']} dcp+anyshard {da['bad']}",
                )
            )
    return out


def _verdict(ok: bool | None) -> str:
    return "INFO" if ok is None else "PASS" if ok else "FAIL"


def machine_note(dirs: dict[str, str]) -> list[str]:
    lines = [
        f"- CPU: {os.cpu_count()} cores ({_cpu_model()}), {_mem_gib():.0f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}, torch {_torch_version()}"
    ]
    for regime, d in dirs.items():
        lines.append(f"- {regime}: `{d}` on {fs_type(d)}")
    try:
        lsblk = subprocess.run(
            ["lsblk", "-d", "-o", "NAME,SIZE,ROTA,TYPE,MODEL"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        disks = [
            " ".join(ln.split())
            for ln in lsblk.splitlines()[1:]
            if ln.strip() and not ln.startswith("zram")
        ]
        virtio = any(d.startswith("vd") for d in disks)
        lines.append(
            "- block devices (lsblk NAME SIZE ROTA TYPE MODEL): "
            + "; ".join(f"`{d}`" for d in disks)
            + (
                " -- a virtio disk of a VM (ROTA is what the guest is told; the host's backing store"
                " and its cache are unknown, so disk numbers include the host's behaviour)"
                if virtio
                else ""
            )
        )
    except (OSError, subprocess.SubprocessError):
        pass
    lines.append(f"- anyshard: {_git_state()}")
    return lines


def _git_state() -> str:
    """The commit of the library measured, and whether its files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "anyshard"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    if head.returncode != 0:
        return "commit unknown"
    state = (
        "library files modified in the work tree"
        if dirty.stdout.strip()
        else "library files as committed"
    )
    return f"commit {head.stdout.strip()} ({state})"


def _busy_cpu_s() -> float:
    """Machine-wide non-idle CPU seconds so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (
        v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    )  # user nice system irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / (1 << 20)


def _torch_version() -> str:
    import torch

    return torch.__version__


_WRAPPERS = (
    "multiprocessing/",
    "bench_reshard.py",
    "(<string>)",
    "threading.py)",
    "concurrent/futures/thread.py)",
)


def summarize_pyspy(path: str, top: int = 18) -> str:
    """Self and inclusive sample counts per function from py-spy's raw (collapsed) output."""
    selfc: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n)
            frames = [re.sub(r":\d+\)$", ")", fr) for fr in stack.split(";")]
            frames = [fr for fr in frames if not fr.startswith(("process ", "thread "))]
            if not frames:
                continue
            total += n
            selfc[frames[-1]] = selfc.get(frames[-1], 0) + n
            for fr in {fr for fr in frames if not any(w in fr for w in _WRAPPERS)}:
                incl[fr] = incl.get(fr, 0) + n
    out = [
        f"py-spy {os.path.basename(path)}: {total} samples (250 Hz, active threads only; "
        "inclusive leaves out the benchmark's and the thread/process plumbing's frames)",
        "  self:",
    ]
    for fr, n in sorted(selfc.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {100 * n / total:5.1f}%  {fr}")
    out.append("  inclusive:")
    for fr, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {100 * n / total:5.1f}%  {fr}")
    return "\n".join(out)


def summarize_cprofile(path: str, top: int = 18) -> str:
    import io
    import pstats

    s = io.StringIO()
    st = pstats.Stats(path, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return f"cProfile {os.path.basename(path)} (main thread only):\n" + s.getvalue()


def write_docs(
    path: str, command: str, text_table: str, checks, notes: list[str], data: dict, cfg: dict
) -> None:
    section = [
        DOCS_BEGIN,
        "## Reshard benchmark: anyshard vs DCP (with its own and with anyshard's storage backend) vs the physical floor (`tools/bench_reshard.py`)",
        "",
        f"Command: `{command}` ({datetime.now(timezone.utc).strftime('%Y-%m-%d')}, "
        f"{data['total_bytes'] / GiB:.2f} GiB fp32 in {data['tensors']} tensors, {cfg['reps']} repetitions, "
        f"median of the slowest rank).",
        "",
        "Machine:",
        "",
        *notes,
        f"- page cache before each disk-regime operation: {cfg['drop_method']}"
        + (
            " (`sync; echo 3 > /proc/sys/vm/drop_caches`)"
            if cfg["drop_method"] == "drop_caches"
            else " (fsync + `posix_fadvise(POSIX_FADV_DONTNEED)` on every file)"
        ),
        "",
        "Method: after an untimed warm-up round on a few small tensors, 4 gloo ranks on CPU (one torch",
        "thread each) hold a transformer-like state as DTensors on a (dp_shard=2, tp=2) mesh:",
        "column-parallel weights `[Shard(0), Shard(0)]`, row-parallel weights `[Shard(0), Shard(1)]`,",
        "norms `[Shard(0), Replicate()]`. Each system saves it, then loads it into a tp=4 mesh (same tp",
        "dims, norms replicated) and a dp_shard=4 mesh (`Shard(0)`). The floor writes",
        "each rank's bytes to one plain file with fsync, and reads as many bytes as the target holds back",
        "cold with plain sequential reads. DCP is `dcp.save`/`dcp.load` with the default planners and",
        "`FileSystemWriter`/`FileSystemReader`; DCP+anyshard is the same calls with anyshard's DCP",
        "storage backend, `anyshard.dcp.AnyshardWriter`/`AnyshardReader` (an anyshard checkpoint,",
        "every byte read verified). Systems alternate within each repetition (rotated order).",
        "On disk, all four save, then each loads into tp=4, then each into dp_shard=4 (no system reads",
        "back what it has just read: the VM host's cache survives drop_caches). On tmpfs each system",
        "saves, loads twice and removes its checkpoint before the next begins, so that tmpfs holds one",
        "checkpoint at a time (this VM's host backs guest memory lazily: once several GiB are in use,",
        "new tmpfs pages cost several times as much, a cost that fell on whichever system saved",
        "last). Every load is compared bit-exact (BLAKE2b digest of each shard's bytes against the",
        "expected shard's) outside the timed region. Bytes are",
        "per-rank /proc/self/io deltas (worst rank): `rchar` (bytes requested from the kernel), and for",
        "the disk regime `read_bytes` from the block device in parentheses; save rows show `wchar`",
        "(bytes written). RSS+ is the peak VmRSS during the operation minus VmRSS just before it (target",
        "tensors already allocated), worst rank and repetition: the kernel's VmHWM, reset before each",
        "operation (a 2 ms sampler thread only where the reset is refused).",
        "",
        text_table,
        "",
        "Targets:",
        "",
        *[f"- {_verdict(ok)} {name}: {detail}" for name, ok, detail in checks],
        DOCS_END,
    ]
    replace_section(path, section[0], section[-1], section[1:-1])


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Compare anyshard, torch.distributed.checkpoint and the physical floor: save, and load "
        "with reshard from (dp_shard=2, tp=2) to tp=4 and to dp_shard=4, with 4 gloo ranks on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gib", type=float, default=1.0, help="total fp32 state size in GiB")
    p.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    p.add_argument("--quick", action="store_true", help="smoke test: --gib 0.1 --reps 1")
    p.add_argument("--regimes", default="disk,tmpfs", help="comma-separated subset of disk,tmpfs")
    p.add_argument(
        "--disk-dir", default="/tmp", help="parent directory on the real disk for the disk regime"
    )
    p.add_argument("--tmpfs-dir", default="/dev/shm", help="parent directory on tmpfs")
    p.add_argument(
        "--profile",
        choices=("pyspy", "cprofile"),
        default=None,
        help="profile anyshard's save and loads on one rank; implies --regimes tmpfs --reps 1",
    )
    p.add_argument("--profile-rank", type=int, default=0)
    p.add_argument(
        "--profile-system",
        choices=SYSTEMS,
        default="anyshard",
        help="the system --profile profiles",
    )
    p.add_argument(
        "--profile-dir", default=None, help="where profiles go (default: a new temp dir)"
    )
    p.add_argument(
        "--write-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="PATH",
        help="write the table and method into this markdown file (section replaced in place)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed warm-up round (small tensors, every system) before measuring",
    )
    p.add_argument("--json", default=None, help="also write the raw measurements to this JSON file")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="load with anyshard.load(verify=False): only the needed bytes, unchecked",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.reps = 0.1, 1
    if args.profile:
        args.regimes, args.reps = "tmpfs", 1
        if args.profile == "pyspy" and shutil.which("py-spy") is None:
            print("py-spy not found; falling back to cProfile (main thread only)")
            args.profile = "cprofile"
        args.profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="bench-reshard-profile-")
        os.makedirs(args.profile_dir, exist_ok=True)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    for r in regimes:
        if r not in ("disk", "tmpfs"):
            p.error(f"unknown regime {r!r}")
    dirs = {}
    for r in regimes:
        parent = args.disk_dir if r == "disk" else args.tmpfs_dir
        dirs[r] = tempfile.mkdtemp(prefix=f"bench-reshard-{r}-", dir=parent)
    drop_method = drop_caches_method() if "disk" in regimes else "n/a"

    spec = model_spec(args.gib)
    total = sum(4 * _numel(s) for _, s, _ in spec)
    print(
        f"state: {total / GiB:.3f} GiB fp32 in {len(spec)} tensors; {WORLD} gloo ranks; {args.reps} repetition(s)"
    )
    for r, d in dirs.items():
        print(f"{r}: {d} on {fs_type(d)}")
    if "disk" in regimes:
        print(f"page cache: dropped before every disk-regime operation with {drop_method}")
    print(
        "bytes read: /proc/self/io rchar deltas (and read_bytes, from the device, in the disk regime)"
    )

    import torch.multiprocessing as tmp

    work = tempfile.mkdtemp(prefix="bench-reshard-")
    out_path = os.path.join(work, "results.json")
    cfg = {
        "gib": args.gib,
        "reps": args.reps,
        "regimes": [(r, dirs[r]) for r in regimes],
        "drop_method": drop_method,
        "profile": args.profile,
        "profile_rank": args.profile_rank,
        "profile_system": args.profile_system,
        "profile_dir": args.profile_dir,
        "warmup": args.warmup,
        "verify": not args.no_verify,
    }
    t0 = time.time()
    cpu0 = _busy_cpu_s()
    try:
        tmp.spawn(
            worker, args=(cfg, os.path.join(work, "store"), out_path), nprocs=WORLD, join=True
        )
        with open(out_path) as f:
            data = json.load(f)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    wall = time.time() - t0
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    foreign = max(0.0, _busy_cpu_s() - cpu0 - ours.ru_utime - ours.ru_stime)
    load_note = (
        f"run took {wall:.0f} s; CPU busy time of other processes on the machine during it: "
        f"{foreign:.0f} s of {wall * (os.cpu_count() or 1):.0f} core-seconds; load average after: "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"\n{load_note}\n")

    rows = summarize(data)
    text = table(rows, markdown=False)
    print(text)
    print(
        "\nMiB/rank: loads: rchar (read_bytes from the device, disk regime); saves: wchar. Worst rank, median rep."
    )
    print(
        "RSS+: peak VmRSS during the operation minus VmRSS before it (targets allocated), worst rank and rep."
    )
    print(
        "per-repetition times (slowest rank): "
        + "; ".join(
            f"{r['regime']} {r['op']} " + " ".join(f"{s}={r[s]['times']}" for s in SYSTEMS)
            for r in rows
        )
    )
    print(cpu_line(rows))
    checks = check_targets(rows)
    print("\ntargets:")
    for name, ok, detail in checks:
        print(f"  {_verdict(ok)}  {name}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "checks": checks, "data": data}, f, indent=1)
    if args.profile:
        print(f"\nprofiles of rank {args.profile_rank} (in {args.profile_dir}):")
        for r in rows:
            for path in r[args.profile_system]["profiles"]:
                print(f"\n== {r['regime']} {r['op']} {args.profile_system} ==")
                if path.endswith(".txt") and os.path.exists(path):
                    print(summarize_pyspy(path))
                elif os.path.exists(path):
                    print(summarize_cprofile(path))
    if args.write_docs:
        command = "python tools/bench_reshard.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        notes = machine_note(dirs) + [f"- {load_note}"]
        text = table(rows, markdown=True) + "\n\n" + cpu_line(rows) + "."
        write_docs(args.write_docs, command.strip(), text, checks, notes, data, cfg)
        print(f"\nwrote {args.write_docs}")
    bad = any(r[s]["bad"] for r in rows for s in SYSTEMS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
