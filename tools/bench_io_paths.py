"""Byte paths: anyshard's reads vs tensorstore's KvStore vs fsspec, and anyshard's data-file
writer vs safetensors' own, on one plan.

    python tools/bench_io_paths.py --write-docs        # about 2 minutes; smoke test: --quick

Method: one process, one data file that anyshard writes holding two fp32 tensors of half the size
each, 8 KiB rows. The read plan, the same for every system: the first tensor whole and the first
half of every row of the second (4 KiB runs, 4 KiB gaps; 3/4 of the file), each run into its place
in preallocated destinations. anyshard: `storage.FileReader.read_scattered`; tensorstore:
`KvStore.read(key, byte_range=...)` of every run in one `ts.Batch`; fsspec: `cat_ranges` (on S3
the runs merged into GETs of at most 16 MiB, as anyshard merges them), each result copied into
place. Local reads run on tmpfs (page cache warm) and on disk (page cache dropped before each
read); S3 reads against moto's server on 127.0.0.1, where the second tensor is read in 8 blocks of
1/16 of it with equal gaps (the KvStore path issues one GET per run). Writes: `write_datafile` vs
`safetensors.torch.save_file`, both fsynced. Every read is checked bit-exact. MiB/s counts the
bytes the plan needs (reads) or the file's tensor bytes (writes). CPU s: user + sys of the
process, all threads; bytes: /proc/self/io deltas; the same counters (tools/benchkit/) for every
system. Median [min-max] of the repetitions, systems in rotated order.
"""

from __future__ import annotations

import os
import sys
import tempfile

import benchkit as h
import torch

ROW = 2048  # fp32 elements per row: 8 KiB rows, 4 KiB half rows
HEADING = "## Byte paths: anyshard vs tensorstore KvStore vs fsspec; writer vs safetensors (`tools/bench_io_paths.py`)"


class Plan:
    """The byte ranges of the read plan, their destinations, and what they must hold."""

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], blocks: int | None):
        from anyshard.format.datafile import read_header

        shards, rows = read_header(path).shards, tensors["rows"]
        if blocks is None:  # the first half of every row
            kept, size, runs = rows[:, : ROW // 2].contiguous(), ROW // 2 * 4, rows.shape[0]
        else:  # ``blocks`` blocks of rows, each followed by a gap as long
            per = rows.shape[0] // (2 * blocks)
            kept = torch.cat([rows[2 * k * per : (2 * k + 1) * per] for k in range(blocks)])
            size, runs = per * ROW * 4, blocks
        self.expected = [tensors["whole"], kept]
        self.dest = [torch.empty_like(t) for t in self.expected]
        out, base = h.as_bytes(self.dest[1]), shards["rows"].start
        self.spans = [(shards["whole"].start, h.as_bytes(self.dest[0]))]
        self.spans += [(base + 2 * i * size, out[i * size : (i + 1) * size]) for i in range(runs)]

    def reset(self) -> None:
        for t in self.dest:
            t.fill_(-1.5)

    def exact(self) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.dest, self.expected, strict=True))


def readers(url: str, plan: Plan, kv, fs, merge: bool) -> dict:
    """Each system's read of ``plan`` from ``url``: anyshard's, tensorstore's through ``kv``,
    fsspec's through ``fs`` (``merge``: the runs merged into GETs, as on S3)."""
    import tensorstore as ts

    from anyshard.format import ranged_reads, storage

    key = url.rsplit("/", 1)[1]

    def anyshard() -> None:
        with storage.FileReader(url) as reader:
            reader.read_scattered(plan.spans)

    def tensorstore() -> None:
        with ts.Batch() as batch:
            ranges = [slice(a, a + len(b)) for a, b in plan.spans]
            futures = [kv.read(key, byte_range=r, batch=batch) for r in ranges]
        for (_, buf), fut in zip(plan.spans, futures, strict=True):
            buf[:] = fut.result().value

    def fsspec() -> None:
        path = url.removeprefix("s3://")
        if merge:  # S3: runs merged into GETs of at most 16 MiB
            blocks = list(ranged_reads._blocks(plan.spans, 16 * h.MiB))
            starts, ends = [b[0] for b in blocks], [b[1] for b in blocks]
            datas = fs.cat_ranges([path] * len(blocks), starts, ends)
            for (start, _, spans), data in zip(blocks, datas, strict=True):
                view = memoryview(data)
                for offset, buf in spans:
                    buf[:] = view[offset - start : offset - start + len(buf)]
            return
        starts, ends = [a for a, _ in plan.spans], [a + len(b) for a, b in plan.spans]
        datas = fs.cat_ranges([path] * len(starts), starts, ends)
        for (_, buf), data in zip(plan.spans, datas, strict=True):
            buf[:] = data

    return {"anyshard": anyshard, "tensorstore": tensorstore, "fsspec": fsspec}


def local_part(base: str, tensors: dict, reps: int, regime: str, records: h.Records) -> dict:
    """Writes, then reads, in a fresh directory under ``base``."""
    import fsspec
    import tensorstore as ts
    from safetensors.torch import save_file

    from anyshard.format.datafile import write_datafile

    def fsynced(write, path: str):
        def run() -> None:
            write(path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        return run

    def clear(_: str) -> None:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.sync()

    def cold(_: str) -> None:
        plan.reset()
        if regime == "disk":
            h.drop_cache(path)

    items, labels = list(tensors.items()), {"records": records, "regime": regime}
    with tempfile.TemporaryDirectory(prefix="bench-io-", dir=base, ignore_cleanup_errors=True) as d:
        writers = {"anyshard": fsynced(lambda p: write_datafile(p, items), os.path.join(d, "a"))}
        writers["safetensors"] = fsynced(lambda p: save_file(tensors, p), os.path.join(d, "s"))
        out = {"write": h.paired(writers, reps, before=clear, op="write", **labels)}
        path = os.path.join(d, "data.safetensors")
        write_datafile(path, items)
        plan = Plan(path, tensors, None)
        kv = ts.KvStore.open({"driver": "file", "path": d + "/"}).result()
        systems = readers(path, plan, kv, fsspec.filesystem("file"), merge=False)
        check = lambda _: plan.exact()  # noqa: E731
        out["read"] = h.paired(systems, reps, before=cold, check=check, op="read", **labels)
        return out


def s3_part(tensors: dict, reps: int, records: h.Records) -> dict:
    import s3fs
    import tensorstore as ts

    from anyshard.format import storage
    from anyshard.format.datafile import write_datafile
    from anyshard.loaders.zarr_store import _kvstore

    with h.s3_server("moto") as (_, pids), tempfile.TemporaryDirectory(prefix="bench-io-") as d:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench-io")
        local, url = os.path.join(d, "data.safetensors"), "s3://bench-io/ckpt/data.safetensors"
        write_datafile(local, list(tensors.items()))
        storage.upload(local, url)
        plan = Plan(local, tensors, blocks=8)
        kv = ts.KvStore.open(_kvstore("s3://bench-io/ckpt")).result()
        systems = readers(url, plan, kv, fs, merge=True)
        read = h.paired(systems, reps, before=lambda _: plan.reset(), check=lambda _: plan.exact(),
                        other_pids=pids, records=records, op="read", regime="s3")  # fmt: skip
        return {"read": read}


def table(results: dict, total: int) -> tuple[list, list]:
    head = ["regime", "operation", "system", "wall s", "CPU s", "MiB/s"]
    rows = []
    for regime, ops in results.items():
        for op, systems in ops.items():
            needed = total if op == "write" else total * 3 // 4
            for name, recs in systems.items():
                m = {k: h.median_of(recs, k) for k in ("wall_s", "cpu_s", *h.IO_KEYS)}
                moved = f"{m['rchar'] / h.MiB:.0f}"
                moved = f"w {m['wchar'] / h.MiB:.0f}" if op == "write" else moved
                exact = {r.get("exact") for r in recs}
                exact = "-" if None in exact else ("yes" if exact == {True} else "NO")
                rows.append([regime, op, name, h.fmt_spread([r["wall_s"] for r in recs], ".3f"),
                             f"{m['cpu_s']:.2f}", f"{needed / h.MiB / m['wall_s']:.0f}",
                             "-" if regime == "s3" else moved, exact])  # fmt: skip
    return [*head, "MiB read (rchar) / w written (wchar)", "bit-exact"], rows


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__, reps=3, quick={"mib": 16.0, "reps": 1}, dirs=True)
    ap.add_argument("--mib", type=float, default=256.0, help="size of the data file (256 MiB)")
    ap.add_argument("--parts", default="tmpfs,disk,s3", help="a subset of tmpfs,disk,s3")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    parts = h.words(ap, "--parts", args.parts, ("tmpfs", "disk", "s3"))
    g = torch.Generator().manual_seed(7)
    n_rows = max(64, int(args.mib * h.MiB / 2 / (ROW * 4)) // 64 * 64)
    tensors = {name: torch.randn(n_rows, ROW, generator=g) for name in ("whole", "rows")}
    total = sum(t.numel() * 4 for t in tensors.values())
    records, load = h.Records(args.jsonl, "io_paths"), h.RunLoad()
    dirs = h.regime_dirs(args, [r for r in ("tmpfs", "disk") if r in parts])
    results = {r: local_part(d, tensors, args.reps, r, records) for r, d in dirs.items()}
    if "s3" in parts:
        results["s3"] = s3_part(tensors, args.reps, records)
    head, rows = table(results, total)
    run = f"data file {total / h.MiB:.0f} MiB; median [min-max] of {args.reps} repetition(s)"
    names = ["tensorstore", "fsspec", "safetensors", *(["moto"] if "s3" in results else [])]
    versions = "- " + ", ".join(f"{x} {h.version(x)}" for x in names)
    method = __doc__[__doc__.index("Method:") :].strip()
    data = {"total_bytes": total, "results": results}
    h.report(args, argv, __file__, "io_paths", run, [method, (head, rows)], load, heading=HEADING,
             dirs=dirs, machine=[versions], data=data)  # fmt: skip
    return 1 if any(r[-1] == "NO" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
