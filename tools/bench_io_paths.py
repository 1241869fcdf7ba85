"""The byte-moving paths DESIGN.md asks to measure, on one plan: anyshard's own vs tensorstore's
KvStore vs fsspec, and anyshard's data-file writer vs safetensors' own.

Run (about two minutes on 2 cores; writes its section of docs/benchmarks.md):

    python tools/bench_io_paths.py --write-docs

Smoke test: ``python tools/bench_io_paths.py --quick``.

One process, one data file that anyshard writes (safetensors layout) holding two fp32 tensors of
``--mib``/2 MiB each, 8 KiB rows. The read plan, the same for every system: the first tensor
whole, and the first half of every row of the second (4 KiB runs with 4 KiB gaps), each byte
range into its place in preallocated destinations. Systems:

* anyshard: ``storage.FileReader.read_scattered`` (locally one ``preadv`` per run, straight into
  the destination; on S3 streamed GETs, near runs sharing one);
* tensorstore: ``KvStore`` (driver ``file``, or ``s3``) ``read(key, byte_range=...)`` of every
  run in one ``ts.Batch``, each result copied into its destination;
* fsspec: ``cat_ranges`` of every run (locally ``LocalFileSystem``; on S3 s3fs, the runs merged
  as anyshard merged them before it streamed: GETs of at most 16 MiB), each result copied.

Local reads run on tmpfs (page cache warm) and on disk (page cache dropped before each read,
``drop_caches`` when permitted, else ``posix_fadvise``). S3 reads run against moto's server on
127.0.0.1, of an object uploaded once; there the second tensor is read in 8 blocks of 1/16 of it
with equal gaps (not 4 KiB runs: the KvStore path issues one GET per run, and moto reads the whole
object for every GET). Writes: ``write_datafile`` (anyshard's writer: the header, then each
tensor's memory, crc32c of every tensor included) vs ``safetensors.torch.save_file``, both fsynced.
Every read is checked bit-exact. Wall time, CPU seconds of the process (all threads) and
``rchar`` (bytes asked of the kernel) per operation; median of ``--reps`` repetitions, systems
in rotated order.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from markdown_section import replace_section

MiB = 1 << 20
ROW = 2048  # fp32 elements per row: 8 KiB rows, 4 KiB half rows
DOCS_BEGIN, DOCS_END = "<!-- io_paths:begin -->", "<!-- io_paths:end -->"


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def cold(path: str) -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(fn: Callable[[], None]) -> dict:
    r0, c0, t0 = rchar(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t1, c1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), rchar()
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    return {"wall": t1 - t0, "cpu": cpu, "rchar": r1 - r0}


class Plan:
    """The byte ranges of the read plan, their destinations, and what they must hold."""

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], blocks: int | None):
        from anyshard.format.datafile import read_header

        header = read_header(path)
        whole, rows = tensors["whole"], tensors["rows"]
        self.dest_whole = torch.empty_like(whole)
        self.spans: list[tuple[int, memoryview]] = [
            (header.shards["whole"].start, _bytes(self.dest_whole))
        ]
        base = header.shards["rows"].start
        n_rows = rows.shape[0]
        if blocks is None:  # the first half of every row
            self.expected_rows = rows[:, : ROW // 2].contiguous()
            self.dest_rows = torch.empty_like(self.expected_rows)
            out = _bytes(self.dest_rows)
            half = ROW // 2 * 4
            self.spans += [
                (base + r * ROW * 4, out[r * half : (r + 1) * half]) for r in range(n_rows)
            ]
        else:  # ``blocks`` blocks of rows, each followed by a gap as long
            per = n_rows // (2 * blocks)
            self.expected_rows = torch.cat(
                [rows[2 * k * per : (2 * k + 1) * per] for k in range(blocks)]
            )
            self.dest_rows = torch.empty_like(self.expected_rows)
            out = _bytes(self.dest_rows)
            size = per * ROW * 4
            self.spans += [
                (base + 2 * k * size, out[k * size : (k + 1) * size]) for k in range(blocks)
            ]
        self.expected_whole = whole

    def reset(self) -> None:
        self.dest_whole.fill_(-1.5)
        self.dest_rows.fill_(-1.5)

    def exact(self) -> bool:
        return torch.equal(self.dest_whole, self.expected_whole) and torch.equal(
            self.dest_rows, self.expected_rows
        )

    @property
    def needed(self) -> int:
        return sum(len(b) for _, b in self.spans)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


# --------------------------------------------------------------------------- readers


def read_anyshard(url: str, plan: Plan) -> None:
    from anyshard.format import storage

    with storage.FileReader(url) as reader:
        reader.read_scattered(plan.spans)


def read_tensorstore(kv, key: str, plan: Plan) -> None:
    import tensorstore as ts

    with ts.Batch() as batch:
        futures = [
            kv.read(key, byte_range=slice(a, a + len(b)), batch=batch) for a, b in plan.spans
        ]
    for (_, buf), fut in zip(plan.spans, futures, strict=True):
        buf[:] = fut.result().value


def read_fsspec(fs, path: str, plan: Plan, merge: bool) -> None:
    if merge:  # S3: runs merged into GETs of at most 16 MiB, as s3fs users do
        from anyshard.format import _remote

        blocks = list(_remote._blocks(plan.spans, 16 * MiB))
        datas = fs.cat_ranges([path] * len(blocks), [b[0] for b in blocks], [b[1] for b in blocks])
        for (start, _, spans), data in zip(blocks, datas, strict=True):
            view = memoryview(data)
            for offset, buf in spans:
                buf[:] = view[offset - start : offset - start + len(buf)]
        return
    starts = [a for a, _ in plan.spans]
    ends = [a + len(b) for a, b in plan.spans]
    for (_, buf), data in zip(
        plan.spans, fs.cat_ranges([path] * len(starts), starts, ends), strict=True
    ):
        buf[:] = data


# --------------------------------------------------------------------------- parts


def make_tensors(mib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = max(64, int(mib * MiB / 2 / (ROW * 4)) // 64 * 64)
    return {name: torch.randn(rows, ROW, generator=g) for name in ("whole", "rows")}


def local_reads(base: str, tensors, reps: int, regime: str) -> dict[str, list[dict]]:
    import fsspec
    import tensorstore as ts

    from anyshard.format.datafile import write_datafile

    d = tempfile.mkdtemp(prefix="bench-io-", dir=base)
    try:
        path = os.path.join(d, "data.safetensors")
        write_datafile(path, list(tensors.items()))
        plan = Plan(path, tensors, None)
        kv = ts.KvStore.open({"driver": "file", "path": d + "/"}).result()
        fs = fsspec.filesystem("file")
        systems = {
            "anyshard": lambda: read_anyshard(path, plan),
            "tensorstore": lambda: read_tensorstore(kv, "data.safetensors", plan),
            "fsspec": lambda: read_fsspec(fs, path, plan, merge=False),
        }
        return _rounds(systems, plan, reps, regime, path)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _rounds(systems, plan: Plan, reps: int, regime: str, path: str | None) -> dict[str, list[dict]]:
    names = list(systems)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            plan.reset()
            if regime == "disk" and path:
                cold(path)
            rec = measure(systems[name])
            rec["exact"] = plan.exact()
            out[name].append(rec)
            print(f"  [{regime}] read {name:11s} {rec['wall']:.3f} s", flush=True)
    return out


def local_writes(base: str, tensors, reps: int, regime: str) -> dict[str, list[dict]]:
    from safetensors.torch import save_file

    from anyshard.format.datafile import write_datafile

    def with_fsync(fn, path: str) -> Callable[[], None]:
        def run() -> None:
            fn(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        return run

    d = tempfile.mkdtemp(prefix="bench-io-", dir=base)
    try:
        systems = {
            "anyshard": with_fsync(
                lambda p: write_datafile(p, list(tensors.items())), os.path.join(d, "a")
            ),
            "safetensors": with_fsync(lambda p: save_file(tensors, p), os.path.join(d, "s")),
        }
        names = list(systems)
        out: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(reps):
            for name in names[rep % 2 :] + names[: rep % 2]:
                for f in os.listdir(d):
                    os.unlink(os.path.join(d, f))
                os.sync()
                rec = measure(systems[name])
                rec["exact"] = None
                out[name].append(rec)
                print(f"  [{regime}] write {name:11s} {rec['wall']:.3f} s", flush=True)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def s3_reads(tensors, reps: int) -> tuple[dict[str, list[dict]], str]:
    import s3fs
    import tensorstore as ts
    from bench_storage import Moto

    from anyshard.format import storage
    from anyshard.format.datafile import write_datafile
    from anyshard.loaders.zarr_store import _kvstore

    moto = Moto()
    moto.start()
    os.environ.update(moto.env())
    os.environ.setdefault("ANYSHARD_STORAGE_DEADLINE", "600")
    d = tempfile.mkdtemp(prefix="bench-io-")
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench-io")
        local = os.path.join(d, "data.safetensors")
        write_datafile(local, list(tensors.items()))
        url = "s3://bench-io/ckpt/data.safetensors"
        storage.upload(local, url)
        plan = Plan(local, tensors, blocks=8)
        kv = ts.KvStore.open(_kvstore("s3://bench-io/ckpt")).result()
        systems = {
            "anyshard": lambda: read_anyshard(url, plan),
            "tensorstore": lambda: read_tensorstore(kv, "data.safetensors", plan),
            "fsspec": lambda: read_fsspec(fs, url.removeprefix("s3://"), plan, merge=True),
        }
        return _rounds(systems, plan, reps, "s3", None), _version_of("moto")
    finally:
        moto.stop()
        shutil.rmtree(d, ignore_errors=True)


def _version_of(dist: str) -> str:
    from importlib.metadata import version

    try:
        return version(dist)
    except Exception:
        return "?"


# --------------------------------------------------------------------------- report


def summary(results: dict[str, dict[str, list[dict]]], needed: dict[str, int]) -> list[list[str]]:
    rows = [
        [
            "regime",
            "operation",
            "system",
            "wall s",
            "CPU s",
            "MiB/s",
            "MiB read (rchar)",
            "bit-exact",
        ]
    ]
    for key, systems in results.items():
        regime, op = key.split(" ", 1)
        for name, recs in systems.items():
            wall = statistics.median(r["wall"] for r in recs)
            cpu = statistics.median(r["cpu"] for r in recs)
            got = statistics.median(r["rchar"] for r in recs)
            exact = {r["exact"] for r in recs}
            rows.append(
                [
                    regime,
                    op,
                    name,
                    f"{wall:.3f}",
                    f"{cpu:.2f}",
                    f"{needed[key] / MiB / wall:.0f}",
                    "-" if regime == "s3" or op == "write" else f"{got / MiB:.0f}",
                    "-" if None in exact else ("yes" if exact == {True} else "NO"),
                ]
            )
    return rows


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def write_docs(path: str, command: str, table: str, notes: list[str]) -> None:
    section = [
        DOCS_BEGIN,
        "## Byte paths: anyshard vs tensorstore KvStore vs fsspec; writer vs safetensors (`tools/bench_io_paths.py`)",
        "",
        f"Command: `{command}` ({datetime.now(timezone.utc).strftime('%Y-%m-%d')}).",
        "",
        *notes,
        "",
        table,
        DOCS_END,
    ]
    replace_section(path, section[0], section[-1], section[1:-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="anyshard's read and write paths vs tensorstore's KvStore, fsspec and "
        "safetensors' writer, on one plan.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--mib", type=float, default=256.0, help="size of the data file, MiB")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    ap.add_argument("--quick", action="store_true", help="smoke test: --mib 16 --reps 1")
    ap.add_argument(
        "--parts", default="tmpfs,disk,s3", help="comma-separated subset of tmpfs,disk,s3"
    )
    ap.add_argument("--disk-dir", default="/tmp", help="directory on the real disk")
    ap.add_argument("--tmpfs-dir", default="/dev/shm", help="directory on tmpfs")
    ap.add_argument(
        "--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.reps = 16.0, 1
    torch.set_num_threads(1)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    tensors = make_tensors(args.mib)
    total = sum(t.numel() * 4 for t in tensors.values())
    results: dict[str, dict[str, list[dict]]] = {}
    needed: dict[str, int] = {}
    for regime, base in (("tmpfs", args.tmpfs_dir), ("disk", args.disk_dir)):
        if regime not in parts or not os.path.isdir(base):
            continue
        results[f"{regime} write"] = local_writes(base, tensors, args.reps, regime)
        needed[f"{regime} write"] = total
        results[f"{regime} read"] = local_reads(base, tensors, args.reps, regime)
        needed[f"{regime} read"] = total * 3 // 4
    moto_version = None
    if "s3" in parts:
        results["s3 read"], moto_version = s3_reads(tensors, args.reps)
        needed["s3 read"] = total * 3 // 4
    rows = summary(results, needed)
    print()
    print(render(rows, markdown=False))
    bad = any(r[-1] == "NO" for r in rows[1:])
    if args.write_docs:
        import platform

        import fsspec
        import safetensors

        notes = [
            f"Machine: {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, tensorstore "
            f"{_version_of('tensorstore')}, fsspec {fsspec.__version__}, safetensors "
            f"{safetensors.__version__}"
            + (f", moto {moto_version}" if moto_version else "")
            + f"; data file {total / MiB:.0f} MiB; median of {args.reps} repetition(s).",
            "",
            "Method: see the module docstring of the tool. Reads: the first tensor whole and the "
            "first half of every row of the second (4 KiB runs, 4 KiB gaps), 3/4 of the file, into "
            "preallocated destinations (on S3: the second tensor in 8 blocks with equal gaps). MiB/s "
            "counts the bytes the plan needs (reads) or the file's tensor bytes (writes).",
        ]
        command = "python tools/bench_io_paths.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        write_docs(args.write_docs, command.strip(), render(rows, markdown=True), notes)
        print(f"\nwrote {args.write_docs}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
