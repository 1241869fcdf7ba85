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

import math
import os
import pickle  # only to measure the size of DCP's own (pickled) metadata
import random
import sys
import time
from collections import namedtuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from anyshard._compat import dcp_storage_info, strided_shard_type  # noqa: E402
from anyshard.api.tensor_layout import hold_mapping, stored_mapping  # noqa: E402
from anyshard.format.datafile import block_size  # noqa: E402
from anyshard.format.manifest import Manifest, MeshEntry, TensorEntry  # noqa: E402
from anyshard.geometry.boxes import box_numel  # noqa: E402
from anyshard.geometry.runs import piece_offsets, unit_length_dim  # noqa: E402
from anyshard.reshard.planner import StoredShardInfo, match_shards, plan_reads  # noqa: E402
from anyshard.ucl.lowering import compile_mapping, enumerate_shards  # noqa: E402

ITEMSIZE = 2  # bf16
# N -> (save layout, load layout), each (pp, dp_shard, tp)
LAYOUTS = {
    8: ((2, 2, 2), (1, 4, 2)),
    128: ((4, 4, 8), (2, 16, 4)),
    1024: ((8, 16, 8), (4, 64, 4)),
    16384: ((16, 128, 8), (8, 512, 4)),
}
DIMS = ("pp", "dp_shard", "tp")
# kind: col (tp rows), row (tp cols), norm (replicated over tp), expert_col, expert_row; layer:
# None for the first stage's (embedding) and, ``last``, the last stage's (final norm, output)
Tensor = namedtuple("Tensor", "name shape kind layer last", defaults=(False,))
RankStats = namedtuple(
    "RankStats", "headers plan_s runs reads bytes_read bytes_needed target_bytes"
)
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


def _transformer(h: int, kv: int, vocab: int, layers: int, ffn: list[tuple]) -> list[Tensor]:
    """Embedding, ``layers`` layers of attention then ``ffn`` ((name, shape, kind) each), norm
    and output, in the order a save writes them."""
    attn = [("attention_norm.weight", (h,), "norm"), ("attention.wq.weight", (h, h), "col")]
    attn += [(f"attention.{w}.weight", (kv, h), "col") for w in ("wk", "wv")]
    attn += [("attention.wo.weight", (h, h), "row"), ("ffn_norm.weight", (h,), "norm")]
    out = [Tensor("tok_embeddings.weight", (vocab, h), "col", None)]
    out += [Tensor(f"layers.{i}.{n}", s, k, i) for i in range(layers) for n, s, k in attn + ffn]
    last = [Tensor("norm.weight", (h,), "norm", None, True)]
    return out + last + [Tensor("output.weight", (vocab, h), "col", None, True)]


def dense_70b(h=8192, f=28672, kv=1024, vocab=128256, layers=80) -> list[Tensor]:
    """A Llama-70B-shaped dense transformer (the defaults); smaller sizes give a toy of it."""
    ffn = [(f"feed_forward.{w}.weight", (f, h), "col") for w in ("w1", "w3")]
    return _transformer(h, kv, vocab, layers, ffn + [("feed_forward.w2.weight", (h, f), "row")])


def moe_16(h=6144, f=16384, kv=1024, vocab=32768, layers=56, experts=16) -> list[Tensor]:
    """Experts stored as grouped [experts, ...] tensors (as torchtitan holds them), sharded over
    dp_shard (expert parallelism folded into data-parallel sharding)."""
    ffn = [("moe.router.weight", (experts, h), "norm")]
    ffn += [(f"moe.experts.{w}", (experts, f, h), "expert_col") for w in ("w1", "w3")]
    ffn += [("moe.experts.w2", (experts, h, f), "expert_row")]
    return _transformer(h, kv, vocab, layers, ffn)


def num_layers(model: list[Tensor]) -> int:
    return 1 + max(t.layer for t in model if t.layer is not None)


def stage_of(t: Tensor, pp: int, layers: int) -> int:
    if t.layer is None:
        return pp - 1 if t.last else 0
    return t.layer * pp // layers


def placements(kind: str, tp: int):
    """FSDP2 (dp_shard) over TP on the (dp_shard, tp) sub-mesh of a stage, as torch builds them;
    grouped experts: TP over the expert's output (col) or input (row) dim, FSDP over experts."""
    return {
        "col": (strided_shard_type()(0, split_factor=tp), Shard(0)),
        "row": (Shard(0), Shard(1)),
        "norm": (Shard(0), Replicate()),
        "expert_col": (Shard(0), Shard(1)),
        "expert_row": (Shard(0), Shard(2)),
    }[kind]


class Layout:
    def __init__(self, pp: int, dp: int, tp: int):
        self.sizes, self.world = (pp, dp, tp), pp * dp * tp
        self.axis_sizes = dict(zip(DIMS, self.sizes, strict=True))
        self.mesh = MeshEntry(dims=DIMS, sizes=self.sizes, offset=0, strides=(dp * tp, tp, 1))

    def coords(self, rank: int) -> dict[str, int]:
        _, dp, tp = self.sizes
        return {"pp": rank // (dp * tp), "dp_shard": rank // tp % dp, "tp": rank % tp}

    def hold(self, t: Tensor, stage: int):
        _, dp, tp = self.sizes
        return hold_mapping(t.name, placements(t.kind, tp), DIMS[1:], (dp, tp), DIMS, {"pp": stage})


def build_manifest(model: list[Tensor], lay: Layout) -> tuple[Manifest, float]:
    """The manifest of a save under ``lay``, and the per-rank save planning time (one rank's
    tensors through hold_mapping + stored_mapping + compile)."""
    layers, tensors, t0 = num_layers(model), {}, time.perf_counter()
    for t in model:
        stage = stage_of(t, lay.sizes[0], layers)
        hold, at = lay.hold(t, stage), {"pp": stage, "dp_shard": 0, "tp": 0}
        nbytes = math.prod(compile_mapping(hold, t.shape, lay.axis_sizes, at).shape) * ITEMSIZE
        stored = stored_mapping(t.name, hold, lay.axis_sizes, nbytes, len(t.shape))
        tensors[t.name] = TensorEntry(dtype="BF16", shape=t.shape, mesh=0, mapping=str(stored))
    per_rank = (time.perf_counter() - t0) / lay.sizes[0]  # a rank plans only its stage's tensors
    files = {r: f"data/rank-{r:05d}.safetensors" for r in range(lay.world)}
    kw = {"world_size": lay.world, "meshes": (lay.mesh,), "files": files, "tensors": tensors}
    return Manifest(**kw, library="sim"), per_rank


def file_layout(manifest: Manifest, model: list[Tensor], lay: Layout, rank: int) -> dict:
    """Where each stored shard of ``rank``'s data file lies (`StoredShardInfo`), as the save
    writes them (model order)."""
    offset, out = 4096, {}
    for t in model:
        entry = manifest.tensors[t.name].parsed
        if (shard := compile_mapping(entry, t.shape, lay.axis_sizes, lay.coords(rank))) is None:
            continue
        n = math.prod(shard.shape) * ITEMSIZE
        block = block_size(tuple(shard.shape), ITEMSIZE)  # the checksum blocks a save writes
        crcs = (0,) * max(1, -(-n // block))
        out[t.name] = StoredShardInfo(offset, offset + n, ITEMSIZE, block=block, crcs=crcs)
        offset += n
    return out


def plan_rank(manifest: Manifest, model, save: Layout, load: Layout, rank: int, layers: int):
    coords = load.coords(rank)
    mine = [t for t in model if stage_of(t, load.sizes[0], layers) == coords["pp"]]
    t0, transfers, target_bytes = time.perf_counter(), [], 0
    for i, t in enumerate(mine):
        target = compile_mapping(load.hold(t, coords["pp"]), t.shape, load.axis_sizes, coords)
        target_bytes += sum(box_numel(p.logical_box) for p in target.pieces) * ITEMSIZE
        entry, sizes = manifest.tensors[t.name].parsed, save.axis_sizes
        transfers += match_shards(t.name, i, target.pieces, entry, t.shape, sizes, save.mesh.rank)
    match_s, files = time.perf_counter() - t0, sorted({tr.rank for tr in transfers})
    # stands for reading these files' headers: not planning time
    info = {(r, k): s for r in files for k, s in file_layout(manifest, model, save, r).items()}
    t1 = time.perf_counter()
    plan = plan_reads(transfers, info, [True] * len(mine))
    plan_s, reads = match_s + time.perf_counter() - t1, sum(r.count for r in plan.requests)
    # before coalescing: one read per stretch contiguous in both the file and the destination
    runs = sum(len(piece_offsets(tr.src, unit_length_dim(tr.src, tr.dst))) for tr in transfers)
    needed = (plan.bytes_read, plan.bytes_needed, target_bytes)
    return RankStats(len(files), plan_s, runs, reads, *needed)


def dcp_metadata(manifest: Manifest, model, lay: Layout, build: bool) -> tuple[int, int | None]:
    """Chunk entries DCP's .metadata would list for this save (one per distinct saved chunk, after
    its replica de-duplication), and its pickled size when ``build`` (torch's own classes)."""
    entries = int(manifest.shards_per_rank().sum())
    if not build:
        return entries, None
    import torch
    from torch.distributed.checkpoint import metadata as m

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
    import benchkit as h

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
