"""Loads of a data-parallel replicated target from an object store: each stored byte fetched
once per job and forwarded between ranks, against every rank fetching what it needs, and
against PyTorch DCP through fsspec. One run, SeaweedFS on loopback.

For each world size in ``--ranks``, N gloo ranks on a 1-D mesh save a state of ``--mib`` MiB
(float32 tensors sharded on dim 0) to SeaweedFS with anyshard and with DCP (``FsspecWriter``),
then load it into DTensors replicated on every rank (what each data-parallel replica holds):

- anyshard, read once (the default for an object store): each rank fetches 1/N and forwards;
- anyshard, ``read_once=False``: every rank fetches everything;
- DCP through fsspec (``FsspecReader``): every rank fetches everything.

Reported per load: wall time (the slowest rank, between barriers; median of ``--reps``) and the
bytes fetched from the store by all ranks together (anyshard: `load_reporting`; DCP: the bytes
s3fs's ranged GETs returned in each rank), against the state's bytes. Every load is checked
bit-exact.

    python tools/bench_read_once.py                       # 4 and 8 ranks, 256 MiB
    python tools/bench_read_once.py --write-docs          # also replace the section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from markdown_section import replace_section, rerun_command  # noqa: E402

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- read_once:begin -->", "<!-- read_once:end -->"
TENSOR_MIB = 32


def _count_s3fs_bytes() -> list[int]:
    """Patch s3fs in this process to count the bytes its ranged GETs return."""
    import s3fs.core

    counted = [0]
    real = s3fs.core.S3File._fetch_range

    def fetch(self, start, end):
        data = real(self, start, end)
        counted[0] += len(data)
        return data

    s3fs.core.S3File._fetch_range = fetch
    return counted


def _worker(rank: int, world: int, store: str, env: dict, url: str, mib: int, reps: int, q):
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import anyshard
    from anyshard.api.load import load_reporting

    counted = _count_s3fs_bytes()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    n = max(1, mib // TENSOR_MIB)
    rows = TENSOR_MIB * 2**20 // 4 // 1024
    g = torch.Generator().manual_seed(0)
    full = {f"w{i}": torch.randn(rows, 1024, generator=g) for i in range(n)}
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    anyshard.save(f"{url}/anyshard", sharded)
    dcp.save(sharded, storage_writer=FsspecWriter(f"{url}/dcp"))
    dist.barrier()
    out: dict[str, dict] = {}
    for _ in range(reps):
        for system in ("anyshard, read once", "anyshard, every rank reads", "DCP (fsspec)"):
            target = {
                k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()])
                for k, v in full.items()
            }
            dist.barrier()
            counted[0] = 0
            t = time.perf_counter()
            if system == "DCP (fsspec)":
                dcp.load(target, storage_reader=FsspecReader(f"{url}/dcp"))
                fetched = counted[0]
            else:
                report = load_reporting(
                    f"{url}/anyshard", target, read_once=system == "anyshard, read once"
                )
                fetched = report.bytes_read
            took = time.perf_counter() - t
            dist.barrier()
            for k, v in full.items():
                if not torch.equal(target[k].to_local(), v):
                    raise SystemExit(f"{system}: {k} differs on rank {rank}")
            times = [None] * world
            dist.all_gather_object(times, (took, fetched))
            rec = out.setdefault(system, {"s": [], "bytes": []})
            rec["s"].append(max(x for x, _ in times))
            rec["bytes"].append(sum(b for _, b in times))
    if rank == 0:
        q.put({"state_bytes": sum(v.numel() * 4 for v in full.values()), "systems": out})
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, env: dict, url: str, mib: int, reps: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, os.path.join(tmp, "store"), env, url, mib, reps, q),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        result = q.get(timeout=3600)
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank of the {world}-rank run failed (exit {p.exitcode})")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", default="4,8", help="comma-separated world sizes")
    ap.add_argument("--mib", type=int, default=256, help="state size, MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    from anyshard.trainer_integration.seaweed import SeaweedServer

    started = time.time()
    rows = []
    with SeaweedServer() as server:
        env = {**server.env(), "ANYSHARD_STORAGE_DEADLINE": "600"}
        for world in (int(x) for x in args.ranks.split(",")):
            url = "s3://" + server.create_bucket("readonce")
            r = run(world, env, url, args.mib, args.reps)
            base = statistics.median(r["systems"]["anyshard, every rank reads"]["s"])
            for system, rec in r["systems"].items():
                s, b = statistics.median(rec["s"]), statistics.median(rec["bytes"])
                rows.append((world, system, s, s / base, b / r["state_bytes"]))
                print(
                    f"{world} ranks  {system:28} {s:7.2f} s  ({s / base:.2f}x of every rank "
                    f"reading)  fetched {b / r['state_bytes']:.2f}x the state",
                    flush=True,
                )
    took = time.time() - started
    lines = [
        "| ranks | system | load s | / every rank reads | bytes fetched per job / state |",
        "| --- | --- | --- | --- | --- |",
    ]
    for world, system, s, rel, fetched in rows:
        lines.append(f"| {world} | {system} | {s:.2f} | {rel:.2f}x | {fetched:.2f}x |")
    print("\n".join(lines))
    if args.write_docs:
        cmd = rerun_command(__file__)
        body = [
            "## Read once per job: a replicated load from an object store (`tools/bench_read_once.py`)",
            "",
            f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {took:.0f} s, 2 CPU cores, gloo, "
            f"SeaweedFS on loopback). A {args.mib} MiB state (float32, {TENSOR_MIB} MiB tensors "
            "sharded on dim 0) saved by N ranks, loaded into DTensors replicated on every rank. "
            f"Load: the slowest rank, median of {args.reps}; bytes fetched: all ranks together "
            "(anyshard: `load_reporting`, whole checksum blocks; DCP: the bytes of s3fs's ranged "
            "GETs). Every load is checked bit-exact.",
            "",
            *lines,
        ]
        replace_section(DOC, BEGIN, END, body)
        print(f"wrote {os.path.relpath(DOC, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
