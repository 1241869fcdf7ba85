"""Simulate checkpoint planning at scale: N ranks, no processes, the library's own planning code.

    python tools/scale_sim.py                       # dense 70B-like and 16-expert MoE, N = 8 .. 16,384
    python tools/scale_sim.py --n 1024 --model moe --samples 4
    python tools/scale_sim.py --write-docs          # also write the table into docs/benchmarks.md

For each N, the model is "saved" under one layout (pp x dp_shard x tp, FSDP2 over TP, layers
split over pipeline stages) and "loaded" under another. The save side derives every tensor's
mapping with the same functions ``anyshard.save`` uses (``hold_mapping``, ``stored_mapping``)
and builds the real manifest. For a sample of target ranks, the load side runs the same
planning as ``anyshard.load``: it compiles the target pieces, matches them to stored shards
(``match_shards``), and plans coalesced reads (``plan_reads``) against data-file headers
laid out as the saving ranks would write them. Reported per N: manifest bytes; what PyTorch
DCP's metadata would hold for the same save (chunk entries; pickled bytes where building it is
feasible); data-file headers each loading rank reads; planning time per rank (one core);
byte-range runs before and read calls after coalescing; bytes read over bytes needed.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle  # only to measure the size of DCP's own (pickled) metadata
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from anyshard.api.tensor_layout import hold_mapping, stored_mapping  # noqa: E402
from anyshard.format.datafile import block_size  # noqa: E402
from anyshard.format.manifest import Manifest, MeshEntry, TensorEntry  # noqa: E402
from anyshard.geometry.boxes import box_numel  # noqa: E402
from anyshard.geometry.runs import piece_offsets, unit_length_dim  # noqa: E402
from anyshard.reshard.planner import StoredShardInfo, match_shards, plan_reads  # noqa: E402
from anyshard.ucl.lowering import compile_mapping  # noqa: E402

ITEMSIZE = 2  # bf16

# N -> (save layout, load layout), each (pp, dp_shard, tp)
LAYOUTS = {
    8: ((2, 2, 2), (1, 4, 2)),
    128: ((4, 4, 8), (2, 16, 4)),
    1024: ((8, 16, 8), (4, 64, 4)),
    16384: ((16, 128, 8), (8, 512, 4)),
}
DIMS = ("pp", "dp_shard", "tp")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    kind: str  # col (tp rows), row (tp cols), norm (replicated over tp), expert_col, expert_row
    layer: int | None  # None: first stage (embedding) or last stage (final norm, output)
    last: bool = False


def dense_70b(
    h: int = 8192, f: int = 28672, kv: int = 1024, vocab: int = 128256, layers: int = 80
) -> list[Tensor]:
    """A Llama-70B-shaped dense transformer (the defaults); smaller sizes give a toy of the same shape."""
    out = [Tensor("tok_embeddings.weight", (vocab, h), "col", None)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Tensor(p + "attention_norm.weight", (h,), "norm", i),
            Tensor(p + "attention.wq.weight", (h, h), "col", i),
            Tensor(p + "attention.wk.weight", (kv, h), "col", i),
            Tensor(p + "attention.wv.weight", (kv, h), "col", i),
            Tensor(p + "attention.wo.weight", (h, h), "row", i),
            Tensor(p + "ffn_norm.weight", (h,), "norm", i),
            Tensor(p + "feed_forward.w1.weight", (f, h), "col", i),
            Tensor(p + "feed_forward.w3.weight", (f, h), "col", i),
            Tensor(p + "feed_forward.w2.weight", (h, f), "row", i),
        ]
    out += [
        Tensor("norm.weight", (h,), "norm", None, True),
        Tensor("output.weight", (vocab, h), "col", None, True),
    ]
    return out


def moe_16(
    h: int = 6144, f: int = 16384, kv: int = 1024, vocab: int = 32768, layers: int = 56
) -> list[Tensor]:
    """16 experts per layer, stored as grouped [experts, ...] tensors (as torchtitan holds them);
    experts are sharded over dp_shard (expert parallelism folded into data-parallel sharding)."""
    experts = 16
    out = [Tensor("tok_embeddings.weight", (vocab, h), "col", None)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Tensor(p + "attention_norm.weight", (h,), "norm", i),
            Tensor(p + "attention.wq.weight", (h, h), "col", i),
            Tensor(p + "attention.wk.weight", (kv, h), "col", i),
            Tensor(p + "attention.wv.weight", (kv, h), "col", i),
            Tensor(p + "attention.wo.weight", (h, h), "row", i),
            Tensor(p + "ffn_norm.weight", (h,), "norm", i),
            Tensor(p + "moe.router.weight", (experts, h), "norm", i),
            Tensor(p + "moe.experts.w1", (experts, f, h), "expert_col", i),
            Tensor(p + "moe.experts.w3", (experts, f, h), "expert_col", i),
            Tensor(p + "moe.experts.w2", (experts, h, f), "expert_row", i),
        ]
    out += [
        Tensor("norm.weight", (h,), "norm", None, True),
        Tensor("output.weight", (vocab, h), "col", None, True),
    ]
    return out


def num_layers(model: list[Tensor]) -> int:
    return 1 + max(t.layer for t in model if t.layer is not None)


def stage_of(t: Tensor, pp: int, layers: int) -> int:
    if t.layer is None:
        return pp - 1 if t.last else 0
    return t.layer * pp // layers


def placements(kind: str, tp: int):
    """FSDP2 (dp_shard) over TP on the (dp_shard, tp) sub-mesh of a stage, as torch builds them."""
    return {
        "col": (_StridedShard(0, split_factor=tp), Shard(0)),
        "row": (Shard(0), Shard(1)),
        "norm": (Shard(0), Replicate()),
        # grouped experts: TP over the expert's output (col) or input (row) dim, FSDP over experts
        "expert_col": (Shard(0), Shard(1)),
        "expert_row": (Shard(0), Shard(2)),
    }[kind]


class Layout:
    def __init__(self, pp: int, dp: int, tp: int):
        self.sizes = (pp, dp, tp)
        self.axis_sizes = dict(zip(DIMS, self.sizes, strict=True))
        self.mesh = MeshEntry(dims=DIMS, sizes=self.sizes, offset=0, strides=(dp * tp, tp, 1))
        self.world = pp * dp * tp

    def coords(self, rank: int) -> dict[str, int]:
        pp, dp, tp = self.sizes
        return {"pp": rank // (dp * tp), "dp_shard": rank // tp % dp, "tp": rank % tp}

    def hold(self, t: Tensor, stage: int):
        _, dp, tp = self.sizes
        return hold_mapping(
            t.name, placements(t.kind, tp), ("dp_shard", "tp"), (dp, tp), DIMS, {"pp": stage}
        )


def build_manifest(model: list[Tensor], lay: Layout) -> tuple[Manifest, float]:
    """The manifest of a save under ``lay``, and the per-rank save planning time (one rank's
    tensors through hold_mapping + stored_mapping + compile)."""
    layers = num_layers(model)
    tensors: dict[str, TensorEntry] = {}
    t0 = time.perf_counter()
    for t in model:
        stage = stage_of(t, lay.sizes[0], layers)
        hold = lay.hold(t, stage)
        coords = {"pp": stage, "dp_shard": 0, "tp": 0}
        local = compile_mapping(hold, t.shape, lay.axis_sizes, coords)
        nbytes = math.prod(local.shape) * ITEMSIZE
        stored = stored_mapping(t.name, hold, lay.axis_sizes, nbytes, len(t.shape))
        tensors[t.name] = TensorEntry(dtype="BF16", shape=t.shape, mesh=0, mapping=str(stored))
    per_rank = (time.perf_counter() - t0) / lay.sizes[0]  # a rank plans only its stage's tensors
    files = {r: f"data/rank-{r:05d}.safetensors" for r in range(lay.world)}
    return Manifest(
        world_size=lay.world, meshes=(lay.mesh,), files=files, tensors=tensors, library="sim"
    ), per_rank


def file_layout(
    manifest: Manifest, model: list[Tensor], lay: Layout, rank: int
) -> dict[str, StoredShardInfo]:
    """Where each stored shard of ``rank``'s data file lies, as the save writes them (model order)."""
    coords = lay.coords(rank)
    offset, out = 4096, {}
    for t in model:
        entry = manifest.tensors[t.name]
        shard = compile_mapping(entry.parsed, t.shape, lay.axis_sizes, coords)
        if shard is None:
            continue
        n = math.prod(shard.shape) * ITEMSIZE
        block = block_size(tuple(shard.shape), ITEMSIZE)  # the checksum blocks a save writes
        out[t.name] = StoredShardInfo(
            offset, offset + n, ITEMSIZE, block=block, crcs=(0,) * max(1, -(-n // block))
        )
        offset += n
    return out


@dataclass
class RankStats:
    headers: int
    plan_s: float
    runs: int
    reads: int
    bytes_read: int
    bytes_needed: int
    target_bytes: int


def plan_rank(
    manifest: Manifest, model: list[Tensor], save: Layout, load: Layout, rank: int, layers: int
) -> RankStats:
    coords = load.coords(rank)
    mine = [t for t in model if stage_of(t, load.sizes[0], layers) == coords["pp"]]
    t0 = time.perf_counter()
    transfers, target_bytes = [], 0
    for i, t in enumerate(mine):
        target = compile_mapping(load.hold(t, coords["pp"]), t.shape, load.axis_sizes, coords)
        target_bytes += sum(box_numel(p.logical_box) for p in target.pieces) * ITEMSIZE
        entry = manifest.tensors[t.name]
        transfers += match_shards(
            t.name, i, target.pieces, entry.parsed, t.shape, save.axis_sizes, save.mesh.rank
        )
    match_s = time.perf_counter() - t0
    files = sorted({tr.rank for tr in transfers})
    info = {}
    for r in files:  # stands for reading these files' headers: not planning time
        for name, s in file_layout(manifest, model, save, r).items():
            info[(r, name)] = s
    t1 = time.perf_counter()
    plan = plan_reads(transfers, info, [True] * len(mine))
    plan_s = match_s + time.perf_counter() - t1
    reads = sum(r.count for r in plan.requests)
    # before coalescing: one read per stretch contiguous in both the file and the destination
    runs = sum(len(piece_offsets(tr.src, unit_length_dim(tr.src, tr.dst))) for tr in transfers)
    return RankStats(
        len(files), plan_s, runs, reads, plan.bytes_read, plan.bytes_needed, target_bytes
    )


def dcp_metadata(
    manifest: Manifest, model: list[Tensor], lay: Layout, build: bool
) -> tuple[int, int | None]:
    """Chunk entries DCP's .metadata would list for this save (one per distinct saved chunk, after
    its replica de-duplication), and its pickled size when ``build`` (torch's own classes)."""
    entries = int(manifest.shards_per_rank().sum())
    if not build:
        return entries, None
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from anyshard.ucl.lowering import enumerate_shards

    md, storage = {}, {}
    for t in model:
        entry = manifest.tensors[t.name]
        chunks = []
        for coords, shard in enumerate_shards(entry.parsed, t.shape, lay.axis_sizes):
            (p,) = shard.pieces if shard.pieces else (None,)
            if p is None:
                continue
            offsets = torch.Size(lo for lo, _ in p.logical_box)
            sizes = torch.Size(hi - lo for lo, hi in p.logical_box)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            rank = lay.mesh.rank(coords)
            storage[MetadataIndex(t.name, offsets, len(chunks) - 1)] = _StorageInfo(
                relative_path=f"__{rank}_0.distcp",
                offset=0,
                length=box_numel(p.logical_box) * ITEMSIZE,
            )
        md[t.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size(t.shape),
            chunks=chunks,
        )
    meta = Metadata(state_dict_metadata=md, storage_data=storage)
    return entries, len(pickle.dumps(meta))


def simulate(name: str, model: list[Tensor], n: int, samples: int, build_dcp: bool) -> dict:
    save, load = (Layout(*LAYOUTS[n][0]), Layout(*LAYOUTS[n][1]))
    manifest, save_plan_s = build_manifest(model, save)
    manifest_bytes = len(manifest.dumps())
    t0 = time.perf_counter()
    manifest.shards_per_rank()  # rank 0's commit check
    commit_s = time.perf_counter() - t0
    entries, dcp_bytes = dcp_metadata(manifest, model, save, build_dcp)
    rng = random.Random(n)
    ranks = sorted({0, load.world - 1, *rng.sample(range(load.world), min(samples, load.world))})
    layers = num_layers(model)
    stats = [plan_rank(manifest, model, save, load, r, layers) for r in ranks]
    return {
        "model": name,
        "n": n,
        "save": LAYOUTS[n][0],
        "load": LAYOUTS[n][1],
        "tensors": len(model),
        "manifest_bytes": manifest_bytes,
        "dcp_entries": entries,
        "dcp_bytes": dcp_bytes,
        "save_plan_s": save_plan_s,
        "commit_check_s": commit_s,
        "sampled": len(ranks),
        "headers_max": max(s.headers for s in stats),
        "plan_s_max": max(s.plan_s for s in stats),
        "runs_max": max(s.runs for s in stats),
        "reads_max": max(s.reads for s in stats),
        "read_over_needed": max(s.bytes_read / s.bytes_needed for s in stats if s.bytes_needed),
        "needed_is_target": all(s.bytes_needed == s.target_bytes for s in stats),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def table(rows: list[dict]) -> str:
    head = (
        "| model | N | save (pp, dp_shard, tp) | load | tensors | manifest | DCP chunk entries | DCP .metadata (pickled) "
        "| headers read / rank (max) | planning s / rank (max) | byte runs -> read calls / rank (max) | bytes read / needed |"
    )
    out = [head, "|" + "---|" * 12]
    per_entry = {r["model"]: r["dcp_bytes"] / r["dcp_entries"] for r in rows if r["dcp_bytes"]}
    for r in rows:
        if r["dcp_bytes"]:
            dcp = _mib(r["dcp_bytes"])
        elif r["model"] in per_entry:
            dcp = f"~{_mib(per_entry[r['model']] * r['dcp_entries'])} (extrapolated)"
        else:
            dcp = "not built"
        out.append(
            f"| {r['model']} | {r['n']:,} | {r['save']} | {r['load']} | {r['tensors']} | {_mib(r['manifest_bytes'])} "
            f"| {r['dcp_entries']:,} | {dcp} | {r['headers_max']} | {r['plan_s_max']:.3f} "
            f"| {r['runs_max']:,} -> {r['reads_max']:,} | {r['read_over_needed']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--n", default="8,128,1024,16384", help="comma-separated world sizes (default: %(default)s)"
    )
    p.add_argument("--model", choices=("dense", "moe", "both"), default="both")
    p.add_argument(
        "--samples",
        type=int,
        default=6,
        help="loading ranks sampled per N besides the first and last",
    )
    p.add_argument(
        "--dcp-max-n", type=int, default=1024, help="build DCP's Metadata objects up to this N"
    )
    p.add_argument(
        "--write-docs", nargs="?", const="docs/benchmarks.md", help="write the table into this file"
    )
    args = p.parse_args(argv)
    models = {"dense": [("dense 70B", dense_70b())], "moe": [("MoE 16 experts", moe_16())]}
    chosen = models["dense"] + models["moe"] if args.model == "both" else models[args.model]
    rows = []
    for name, model in chosen:
        for n in (int(x) for x in args.n.split(",")):
            row = simulate(name, model, n, args.samples, n <= args.dcp_max_n)
            rows.append(row)
            print(
                f"{name:15s} N={n:6d}: manifest {_mib(row['manifest_bytes'])}, DCP entries {row['dcp_entries']:,}, "
                f"headers/rank <= {row['headers_max']}, planning <= {row['plan_s_max']:.3f} s, "
                f"runs {row['runs_max']:,} -> reads {row['reads_max']:,}, read/needed {row['read_over_needed']:.3f}, "
                f"commit check {row['commit_check_s']:.3f} s",
                flush=True,
            )
    text = table(rows)
    print("\n" + text)
    if args.write_docs:
        _write_docs(
            args.write_docs,
            text,
            " ".join(
                ["python", "tools/scale_sim.py"] + (argv if argv is not None else sys.argv[1:])
            ),
        )
    return 0


def _write_docs(path: str, text: str, command: str) -> None:
    begin, end = "<!-- scale_sim:begin -->", "<!-- scale_sim:end -->"
    section = (
        f"{begin}\n## Scale: metadata and planning from 8 to 16,384 ranks (`tools/scale_sim.py`)\n\n"
        f"Command: `{command.replace(' --write-docs', '')}`. No processes: the library's own planning code, "
        "run for the sampled loading ranks (rank 0, the last rank and random others) on one core.\n\n"
        f"{text}\n\n"
        "Manifest: anyshard's `manifest.json` for the save. DCP: one chunk entry per distinct saved chunk "
        "(what its pickled `.metadata` lists, plus one storage entry each), pickled size measured by "
        "building torch's `Metadata` objects. Headers: data files whose header a loading rank must "
        "read (the files holding shards it overlaps). Runs: contiguous byte runs the rank needs; reads: "
        "read calls after coalescing (runs larger than 64 MiB are cut into parts that threads read in "
        "parallel, so a few rows show more calls than runs). Bytes read / needed: worst sampled rank.\n"
        "The MoE variant holds experts as grouped `[16, ...]` tensors sharded over `dp_shard` (expert "
        "parallelism folded into data-parallel sharding); a separate `ep` mesh dim is not simulated yet.\n"
        f"{end}\n"
    )
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in old:
        old = old[: old.index(begin)] + old[old.index(end) + len(end) + 1 :]
    with open(path, "w") as f:
        f.write(old.rstrip("\n") + "\n\n" + section)


if __name__ == "__main__":
    sys.exit(main())
