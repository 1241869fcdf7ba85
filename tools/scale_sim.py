"""Checkpoint planning at scale: N simulated ranks, no processes, the library's own planning code.

    python tools/scale_sim.py --write-docs          # dense 70B-like and 16-expert MoE, N = 8 .. 16,384
    python tools/scale_sim.py --n 8 --model dense --samples 2   # smallest

For each N the model is saved under one layout (pp x dp_shard x tp, FSDP2 over TP, layers split
over pipeline stages) and loaded under another. The save derives every tensor's mapping as
``anyshard.save`` does (``hold_mapping``, ``stored_mapping``) into the real manifest; for a
sample of target ranks the load plans as ``anyshard.load`` does (``match_shards``,
``plan_reads``) against data-file headers laid out as the saving ranks write them; against what
PyTorch DCP's metadata would hold for the same save (`HEAD`: the figures reported per N).
"""

from __future__ import annotations

import os
import pickle  # only to measure the size of DCP's own (pickled) metadata
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import benchkit as h  # noqa: E402
from benchkit.llama import Tensor, dense_70b, moe_16  # noqa: E402
from benchkit.simulated_ranks import (  # noqa: E402
    ITEMSIZE,
    Layout,
    build_manifest,
    num_layers,
    plan_rank,
)

from anyshard.format.manifest import Manifest  # noqa: E402
from anyshard.geometry.boxes import box_numel  # noqa: E402
from anyshard.ucl.lowering import enumerate_shards  # noqa: E402

# N -> (save layout, load layout), each (pp, dp_shard, tp)
LAYOUTS = {
    8: ((2, 2, 2), (1, 4, 2)),
    128: ((4, 4, 8), (2, 16, 4)),
    1024: ((8, 16, 8), (4, 64, 4)),
    16384: ((16, 128, 8), (8, 512, 4)),
}
HEAD = ["model", "N", "save (pp, dp_shard, tp)", "load", "tensors", "manifest", "DCP chunk entries"]
HEAD += ["DCP .metadata (pickled)", "headers read / rank (max)", "planning s / rank (max)"]
HEAD += ["byte runs -> read calls / rank (max)", "bytes read / needed", "commit check s"]
HEADING = "## Scale: metadata and planning from 8 to 16,384 ranks (`tools/scale_sim.py`)"
INTRO = """No processes: the library's planning code for sampled loading ranks (rank 0, the last rank
and random others, one core) of a dense 70B model and a 16-expert MoE (experts grouped, sharded
over `dp_shard`; a separate `ep` dim is not simulated) saved and loaded under other layouts,
against DCP's metadata (one chunk entry per distinct chunk, pickled as torch's `Metadata`)."""
NOTES = """One timing per sampled rank, the worst shown. Headers: data files whose header a rank reads;
runs -> reads: byte runs needed, read calls after coalescing (runs over 64 MiB split for parallel
reads). Commit check: rank 0's check that every rank's shards are listed."""


def dcp_metadata(manifest: Manifest, model, lay: Layout, build: bool) -> tuple[int, int | None]:
    """Chunk entries DCP's .metadata would list for this save (one per distinct saved chunk, after
    its replica de-duplication), and its pickled size when ``build`` (torch's own classes)."""
    entries = int(manifest.shards_per_rank().sum())
    if not build:
        return entries, None
    import torch
    from torch.distributed.checkpoint import metadata as m

    from anyshard._compat import dcp_storage_info

    md, storage = {}, {}
    for t in model:
        chunks, entry = [], manifest.tensors[t.name].parsed
        for coords, shard in enumerate_shards(entry, t.shape, lay.axis_sizes):
            (p,) = shard.pieces or (None,)
            if p is None:
                continue
            box, file = p.logical_box, f"__{lay.mesh.rank(coords)}_0.distcp"
            offsets, sizes = torch.Size(lo for lo, _ in box), torch.Size(hi - lo for lo, hi in box)
            chunks.append(m.ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            where = dcp_storage_info(file, 0, box_numel(box) * ITEMSIZE)
            storage[m.MetadataIndex(t.name, offsets, len(chunks) - 1)] = where
        props, size = m.TensorProperties(dtype=torch.bfloat16), torch.Size(t.shape)
        md[t.name] = m.TensorStorageMetadata(properties=props, size=size, chunks=chunks)
    return entries, len(pickle.dumps(m.Metadata(state_dict_metadata=md, storage_data=storage)))


def simulate(name: str, model: list[Tensor], n: int, samples: int, build_dcp: bool) -> dict:
    """One row of the table: ``cells`` (but DCP's pickled size), ``dcp_entries``, ``dcp_bytes``."""
    save, load = (Layout(*LAYOUTS[n][0]), Layout(*LAYOUTS[n][1]))
    manifest, _ = build_manifest(model, save)
    t0 = time.perf_counter()
    manifest.shards_per_rank()  # rank 0's commit check
    commit_s = time.perf_counter() - t0
    entries, dcp_bytes = dcp_metadata(manifest, model, save, build_dcp)
    sample = random.Random(n).sample(range(load.world), min(samples, load.world))
    ranks = sorted({0, load.world - 1, *sample})
    stats = [plan_rank(manifest, model, save, load, r, num_layers(model)) for r in ranks]
    worst = {k: max(getattr(s, k) for s in stats) for k in ("headers", "plan_s", "runs", "reads")}
    over = max(s.bytes_read / s.bytes_needed for s in stats if s.bytes_needed)
    cells = [name, f"{n:,}", *LAYOUTS[n], len(model), _mib(len(manifest.dumps())), f"{entries:,}"]
    runs = f"{worst['runs']:,} -> {worst['reads']:,}"
    cells += [worst["headers"], f"{worst['plan_s']:.3f}", runs, f"{over:.3f}", f"{commit_s:.3f}"]
    return {"model": name, "cells": cells, "dcp_entries": entries, "dcp_bytes": dcp_bytes}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def table_rows(rows: list[dict]) -> list[list]:
    """The table's rows: DCP's pickled size, measured, or extrapolated per chunk entry."""
    per_entry = {r["model"]: r["dcp_bytes"] / r["dcp_entries"] for r in rows if r["dcp_bytes"]}
    out = []
    for r in rows:
        dcp = _mib(r["dcp_bytes"]) if r["dcp_bytes"] else "not built"
        if not r["dcp_bytes"] and r["model"] in per_entry:
            dcp = f"~{_mib(per_entry[r['model']] * r['dcp_entries'])} (extrapolated)"
        out.append([*r["cells"][:7], dcp, *r["cells"][7:]])
    return out


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, records=False)
    p.add_argument("--n", default="8,128,1024,16384", help="world sizes (%(default)s)")
    p.add_argument("--model", choices=("dense", "moe", "both"), default="both")
    p.add_argument("--samples", type=int, default=6, help="loading ranks sampled besides 0, N-1")
    p.add_argument("--dcp-max-n", type=int, default=1024, help="build DCP's Metadata up to N")
    args = p.parse_args(argv)
    models = {"dense": ("dense 70B", dense_70b), "moe": ("MoE 16 experts", moe_16)}
    rows, load = [], h.RunLoad()
    for key, (name, make) in models.items():
        model = make() if args.model in (key, "both") else None
        for n in (int(x) for x in args.n.split(",")) if model else ():
            rows.append(simulate(name, model, n, args.samples, n <= args.dcp_max_n))
            cells = zip(HEAD, table_rows(rows)[-1], strict=True)
            print(", ".join(f"{k} {v}" for k, v in cells), flush=True)
    run = f"{args.samples} loading ranks sampled besides 0 and N - 1"
    blocks = [NOTES, (HEAD, table_rows(rows))]
    h.report(args, argv, __file__, "scale_sim", run, blocks, load, heading=HEADING, intro=INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
