"""Verified reads at the floor: the bytes and time of verified loads of column and row splits.

    python tools/bench_verified_reads.py --write-docs            # smoke test: --quick
    python tools/bench_verified_reads.py --hidden 2048,4096 --reps 3 --write-docs

Four gloo ranks save a (dp_shard=2, tp=2) checkpoint with anyshard and with DCP; eight load it
into tp=2, tp=4, tp=8 and dp_shard=4 (each replicated over the ranks left). The method, as written
into the docs, is `METHOD` below.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from functools import partial

import benchkit as h
from benchkit import GiB, MiB, llama

SAVE_WORLD, LOAD_WORLD = 4, 8
TARGETS = {  # name: mesh shape, dim names, the tp dim's place in the mesh (None: dp_shard)
    "tp2": ((4, 2), ("dp_replicate", "tp")),
    "tp4": ((2, 4), ("dp_replicate", "tp")),
    "tp8": ((8,), ("tp",)),
    "dp4": ((2, 4), ("dp_replicate", "dp_shard")),
}
SYSTEMS = ("tiles", "blocks", "dcp", "dcp_any")
LABELS = {"tiles": "anyshard", "blocks": "anyshard, blocks only", "dcp": "DCP",
          "dcp_any": "DCP+anyshard"}  # fmt: skip
BYTES_TARGET = 1.02
METHOD = """Method: 4 gloo ranks (one torch thread each) save a Llama-shaped fp32 state as DTensors on a
(dp_shard=2, tp=2) mesh (column-parallel weights `[Shard(0), Shard(0)]`, row-parallel
`[Shard(0), Shard(1)]`, norms replicated over tp) with `anyshard.save` and with DCP
(`FileSystemWriter`), on tmpfs. A copy of the anyshard checkpoint has its data files' headers
rewritten without tile checksums (sealed again, the same length): the files as written before
tiles, which a verified load reads by whole row blocks. After an untimed load of a few tensors by each system, 8 gloo ranks load each checkpoint
into tp=2, tp=4 and tp=8 (column-parallel weights `Shard(0)`, row-parallel `Shard(1)`; ranks left
over replicate) and dp_shard=4 (`Shard(0)`): anyshard (verified), anyshard on the copy (verified,
blocks only), DCP (`FileSystemReader`) and DCP with `anyshard.dcp.AnyshardReader` (verified).
One target layout at a time, systems alternate in a rotated order within each repetition; every
load is compared bit-exact.
Bytes: `rchar` (/proc/self/io) of each rank over the load, divided by the bytes of its target
shards; the worst rank. Times: the slowest rank, median [min-max] over the repetitions. Save
checksums: one process times, over rank 0's saved shards, the block checksums alone and the
block and tile checksums as a save computes them (CPU seconds, median of 5). With `--store
seaweedfs`, the checkpoints are copied to a SeaweedFS server on 127.0.0.1 and loaded from it (DCP
through `FsspecReader`); bytes are then what the server sent per load, counted by a TCP relay in
front of it (`benchkit.Relay`), divided by the state's bytes."""


def strip_tiles(path: str) -> int:
    """Rewrite the data files under ``path`` without tile checksums; the headers rewritten."""
    from anyshard.format.checksum import seal
    from anyshard.format.datafile import _SEAL_PREFIX

    done = 0
    for name in os.listdir(os.path.join(path, "data")):
        with open(os.path.join(path, "data", name), "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            meta = json.loads(header["__metadata__"]["anyshard"])
            for b in meta["blocks"].values():
                b.pop("tiles", None), b.pop("tile_crc32c", None)
            header["__metadata__"]["anyshard"] = json.dumps(meta, separators=(",", ":"))
            header["__metadata__"]["anyshard_crc32c"] = "00000000"
            raw = seal(json.dumps(header, separators=(",", ":")).encode(), _SEAL_PREFIX)
            f.seek(8)
            f.write(raw + b" " * (n - len(raw)))
            done += 1
    return done


def saver(rank: int, world: int, cfg: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import anyshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    state = {}
    for name, shape, kind in llama.model_spec(cfg["gib"], cfg["hidden"]):
        full = llama.full_tensor(name, shape)
        pl = llama.placements(kind, llama.MESHES["src"][1])
        local = distribute_tensor(full, mesh, pl, src_data_rank=None).to_local()
        kw = {"run_check": False, "shape": full.shape, "stride": full.stride()}
        state[name] = DTensor.from_local(local.clone(), mesh, pl, **kw)
    anyshard.save(cfg["paths"]["tiles"], state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(cfg["paths"]["dcp"]))


def _dcp_load(state, path: str, ours: bool) -> None:
    """DCP's load of ``path``: anyshard's reader, or DCP's own (fsspec's for a URL)."""
    import torch.distributed.checkpoint as dcp

    from anyshard._compat import fsspec_reader
    from anyshard.dcp import AnyshardReader

    own = fsspec_reader() if "://" in path else dcp.FileSystemReader
    dcp.load(state, storage_reader=(AnyshardReader if ours else own)(path))


def loader(rank: int, world: int, cfg: dict, sent=None) -> list[dict]:
    """Every system's load into every target, timed; on object storage ``sent`` counts the
    bytes the server sends (a `benchkit.Relay`'s counter)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import anyshard
    from anyshard.reshard import planner

    if cfg["tile_skip"] is not None:  # the local rule for reading tiles, as given
        planner.TILE_SKIP_LOCAL = cfg["tile_skip"]
    spec, paths, out = llama.model_spec(cfg["gib"], cfg["hidden"]), cfg["paths"], []
    systems = {
        "tiles": lambda s: anyshard.load(paths["tiles"], s, strict=len(s) == len(spec)),
        "blocks": lambda s: anyshard.load(paths["blocks"], s, strict=len(s) == len(spec)),
        "dcp": partial(_dcp_load, path=paths["dcp"], ours=False),
        "dcp_any": partial(_dcp_load, path=paths["tiles"], ours=True),
    }
    for t, (shape, dims) in TARGETS.items():  # one target's tensors at a time: less memory
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        state, expected = {}, {}
        for name, gshape, kind in spec:
            full, pl = llama.full_tensor(name, gshape), llama.placements(kind, dims)
            local = distribute_tensor(full, mesh, pl, src_data_rank=None).to_local()
            expected[name] = llama.digest(local)
            kw = {"run_check": False, "shape": full.shape, "stride": full.stride()}
            state[name] = DTensor.from_local(torch.zeros_like(local), mesh, pl, **kw)
        needed = sum(v.to_local().numel() * 4 for v in state.values())
        if t == next(iter(TARGETS)):  # untimed: imports, caches, thread pools, DCP's setup
            for system in SYSTEMS:
                systems[system]({n: v for n, v in list(state.items())[:4]})
        for rep, order in h.rotations(SYSTEMS, cfg["reps"]):
            for system in order:
                for v in state.values():
                    v.to_local().fill_(-7.25)
                zero = None if sent is None else (lambda: setattr(sent, "value", 0))
                recs = h.measure_ranks(partial(systems[system], state), before=zero)
                bad = llama.mismatched({n: v.to_local() for n, v in state.items()}, expected)
                got: list = [None] * world
                dist.all_gather_object(got, (needed, bad[:3]))
                if rank == 0:
                    ratio = max(r["rchar"] / n for r, (n, _) in zip(recs, got, strict=True))
                    if sent is not None:  # the job's: what the server sent / the state
                        ratio = sent.value / cfg["state_bytes"]
                    wall = max(r["wall_s"] for r in recs)
                    bad = sorted({b for _, x in got for b in x})
                    out.append(dict(rep=rep, target=t, system=system, ratio=ratio, wall_s=wall,
                                    needed=max(n for n, _ in got), bad=bad,
                                    width=spec[0][1][1]))  # fmt: skip
                    print(f"  rep {rep + 1} {t} {system:8s} {wall:6.3f} s  bytes {ratio:.3f}x"
                          + ("  MISMATCH" if bad else ""), flush=True)  # fmt: skip
        del state, expected
    return out


def upload(paths: dict[str, str], bucket: str) -> dict[str, str]:
    """Copy each checkpoint directory of ``paths`` into ``bucket``; their URLs."""
    import fsspec

    fs, urls = fsspec.filesystem("s3"), {}
    for name, local in paths.items():
        urls[name] = f"s3://{bucket}/{name}"
        for d, _, files in os.walk(local):
            for f in files:
                rel = os.path.relpath(os.path.join(d, f), local)
                fs.put_file(os.path.join(d, f), f"{bucket}/{name}/{rel}")
    return urls


def checksum_costs(path: str) -> tuple[float, float, int]:
    """CPU seconds of the checksums a save computes for the shards in rank 0's data file of
    ``path`` (median of 5): block checksums alone (as before tiles), and block and tile
    checksums (one pass for a tiled shard, as now); and their bytes."""
    import torch

    from anyshard.format.datafile import block_crcs, read_header, shard_tile_crcs
    from anyshard.format.dtypes import ST_TO_DTYPE

    file = os.path.join(path, "data", "rank-00000.safetensors")
    shards, data = read_header(file).shards.values(), open(file, "rb").read()
    views = [(s, memoryview(bytearray(data[s.start : s.stop]))) for s in shards]
    torch.set_num_threads(1)

    def cpu(fn) -> float:
        times = []
        for _ in range(5):
            t0 = time.process_time()
            for s, mv in views:
                fn(s, mv)
            times.append(time.process_time() - t0)
        return h.median(times)

    def both(s, mv) -> None:
        if s.tiles > 1:
            shard_tile_crcs(mv, s.shape, ST_TO_DTYPE[s.dtype].itemsize, s.block, [])
        else:
            block_crcs(mv, s.block)

    blocks = cpu(lambda s, mv: block_crcs(mv, s.block))
    return blocks, cpu(both), sum(mv.nbytes for _, mv in views)


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=3, quick={"gib": 0.05, "reps": 1})
    p.add_argument("--gib", type=float, default=0.5, help="total fp32 state size in GiB (0.5)")
    p.add_argument("--hidden", default="0",
                   help="model widths, comma-separated, one checkpoint each (default 0: "
                   "bench_reshard's model); a width makes at least one layer")  # fmt: skip
    p.add_argument("--dir", default="/dev/shm", help="parent directory of the checkpoints")
    p.add_argument("--store", choices=("local", "seaweedfs"), default="local",
                   help="where the loads read: --dir, or a SeaweedFS server on 127.0.0.1 that "
                   "the checkpoints are copied to (bytes: what the server sends per load)")  # fmt: skip
    p.add_argument("--tile-skip", type=int, default=None,
                   help="bytes a row's tiles must skip beyond those they read, on a local file "
                   "(default: the library's TILE_SKIP_LOCAL; 0: tiles for every column split)")  # fmt: skip
    args = p.parse_args(argv)
    widths = h.words(p, "--hidden", args.hidden)
    if not all(w.isdigit() for w in widths):
        p.error(f"--hidden: widths are whole numbers, not {args.hidden!r}")
    load, recs, costs, sizes = h.RunLoad(), [], {}, []
    s3 = args.store == "seaweedfs"
    with contextlib.ExitStack() as stack:
        if s3:
            server, _ = stack.enter_context(h.s3_server("seaweedfs"))
            relay = h.Relay(server.ports["s3"])
            stack.callback(relay.sock.close)
            os.environ["AWS_ENDPOINT_URL"] = relay.endpoint
        for hidden in widths:
            spec = llama.model_spec(args.gib, int(hidden))
            width, total = spec[0][1][1], sum(4 * math.prod(s) for _, s, _ in spec)
            sizes.append(f"width {width}: {total / GiB:.2f} GiB fp32 in {len(spec)} tensors")
            print(f"{sizes[-1]}; {args.reps} repetition(s)", flush=True)
            root = tempfile.mkdtemp(prefix="bench-verified-", dir=args.dir)
            paths = {s: os.path.join(root, s) for s in ("tiles", "blocks", "dcp")}
            cfg = {"gib": args.gib, "hidden": int(hidden), "paths": paths, "reps": args.reps}
            cfg.update(tile_skip=args.tile_skip, state_bytes=total)
            try:
                h.run_ranks(saver, SAVE_WORLD, cfg)
                shutil.copytree(paths["tiles"], paths["blocks"])
                strip_tiles(paths["blocks"])
                costs[width] = checksum_costs(paths["tiles"])
                if s3:
                    cfg["paths"] = upload(paths, server.create_bucket("verified"))
                recs += h.run_ranks(loader, LOAD_WORLD, cfg, relay.sent if s3 else None)[0]
            finally:
                shutil.rmtree(root, ignore_errors=True)
    records = h.Records(args.jsonl, "verified_reads")
    for r in recs:
        records.add(r)
    head = ["load", "width", "MiB needed / rank"]
    measure = "bytes the server sent / state" if s3 else "bytes read / needed"
    head += [*(f"{measure}: {LABELS[s]}" for s in SYSTEMS)]
    head += [*(f"{LABELS[s]} s" for s in SYSTEMS), "anyshard / blocks only (time)", "bit-exact"]
    rows, checks, cost = [], [], []
    for width in costs:
        for t in TARGETS:
            got = {s: [r for r in recs if (r["target"], r["system"], r["width"]) == (t, s, width)]
                   for s in SYSTEMS}  # fmt: skip
            ratio = {s: max(r["ratio"] for r in got[s]) for s in SYSTEMS}
            wall = {s: [r["wall_s"] for r in got[s]] for s in SYSTEMS}
            bad = sorted({b for s in SYSTEMS for r in got[s] for b in r["bad"]})
            rel = h.median(wall["tiles"]) / h.median(wall["blocks"])
            rows.append([f"dp2xtp2 -> {t}", width, f"{got['tiles'][0]['needed'] / MiB:.1f}",
                         *(f"{ratio[s]:.3f}" for s in SYSTEMS),
                         *(h.fmt_spread(wall[s], ".3f") for s in SYSTEMS), f"{rel:.2f}",
                         "yes" if not bad else f"NO: {bad[:2]}"])  # fmt: skip
            at = f"{t}, width {width}"
            for s in ("tiles", "dcp_any"):
                checks.append((f"{at}: {LABELS[s]} {measure} <= {BYTES_TARGET}",
                               ratio[s] <= BYTES_TARGET, f"{ratio[s]:.3f}"))  # fmt: skip
            checks.append((f"{at}: verified load no slower than blocks only", rel <= 1.0,
                           f"{rel:.2f}"))  # fmt: skip
            checks.append((f"{at}: bit-exact", not bad, ", ".join(bad[:3]) or "all"))
        blocks_s, tiles_s, nbytes = costs[width]
        cost.append(f"- width {width}: over rank 0's {nbytes / MiB:.0f} MiB of shards, block "
                    f"checksums alone {blocks_s:.3f} CPU s; block and tile checksums, as the save "
                    f"computes them, {tiles_s:.3f} CPU s ({tiles_s / blocks_s:.2f}x)")  # fmt: skip
    run = (f"{'; '.join(sizes)}; {args.reps} repetitions, median [min-max] of the slowest "
           f"rank")  # fmt: skip
    blocks = [METHOD, (head, rows), "Save checksums, one core:\n\n" + "\n".join(cost)]
    blocks.append(h.targets(checks))
    name, heading = "verified_reads", "## Verified reads: column splits at the floor"
    if s3:
        name, heading = f"{name}_seaweedfs", f"{heading}, on SeaweedFS"
    if args.tile_skip is not None:
        name, heading = (
            f"{name}_tile_skip",
            f"{heading}, with --tile-skip {args.tile_skip}",
        )
    h.report(args, argv, __file__, name, run, blocks, load,
             heading=f"{heading} (`tools/bench_verified_reads.py`)", dirs={"tmpfs": args.dir},
             data={"records": recs, "checks": checks, "costs": costs})  # fmt: skip
    return 1 if any(not ok for name, ok, _ in checks if name.endswith("bit-exact")) else 0


if __name__ == "__main__":
    sys.exit(main())
