"""Write the Megatron-core ``torch_dist`` fixtures of tests/unit/test_loaders_megatron_dist.py
with the real library: 2 CPU processes (gloo) save small ShardedTensors with
``megatron.core.dist_checkpointing.save(..., sharded_strategy=("torch_dist", 1))``.

Two checkpoints, each next to a ``truth.safetensors`` of the full tensors (computed here by
plain torch code, before any sharding) and a ``truth.json`` of the expected values:

- ``tp2/``: sharded over a 2-way tensor-parallel axis (row and column splits, layers stacked
  along a prepended axis, a replicated tensor saved once, bf16 and int64, a ShardedObject per
  rank, plain and non-plain entries in ``common.pt``). Written with megatron-core 0.16.1.
- ``flat/``: the distributed optimizer's flattened shards (``flattened_range``) over a 2-way
  data-parallel axis, uneven, with several chunks per rank and a prepended layer axis. Only
  megatron-core < 0.14 writes these (later versions refuse ``flattened_range``).

Run (the fixtures are committed; the tests never need megatron-core). With ``--no-deps`` it
needs only torch, numpy, packaging and psutil; no CUDA, no Transformer Engine, no Apex::

    python -m venv --system-site-packages /tmp/mcvenv
    /tmp/mcvenv/bin/pip install --no-deps megatron-core==0.16.1 psutil
    /tmp/mcvenv/bin/python tools/make_megatron_fixtures.py tp2
    python -m venv --system-site-packages /tmp/mc13venv
    /tmp/mc13venv/bin/pip install --no-deps megatron-core==0.13.1 psutil
    /tmp/mc13venv/bin/python tools/make_megatron_fixtures.py flat
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "tests",
    "fixtures",
    "megatron_torch_dist",
)
WORLD = 2


def truth_tp2() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embedding.word_embeddings.weight": torch.randn(8, 6, generator=g),
        "decoder.layers.self_attention.linear_proj.weight": torch.randn(3, 6, 8, generator=g),
        "output_layer.weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "decoder.final_layernorm.weight": torch.randn(6, generator=g),
        "embedding.position_ids": torch.arange(5, dtype=torch.int64) * 7,
    }


def truth_flat() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "embedding.word_embeddings.weight": torch.randn(8, 6, generator=g),
        "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.randn(8, 6, generator=g),
        "optimizer.state.fp32_param.decoder.layers.self_attention.linear_proj.weight": torch.randn(
            3, 6, 8, generator=g
        ),
        "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight": torch.randn(6, generator=g),
    }


COMMON = {
    "iteration": 100,
    "checkpoint_version": 3.0,
    "opt_param_scheduler": {"max_lr": 0.0003, "num_steps": 800, "decay_style": "cosine"},
    "num_floating_point_operations_so_far": 12345,
    "params_dtype": torch.bfloat16,  # loads with weights_only, but is no JSON value
}


def sharded_tp2(rank: int, truth: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    tp = WORLD
    emb = truth["embedding.word_embeddings.weight"].chunk(tp, 0)[rank].clone()
    out = truth["output_layer.weight"].chunk(tp, 0)[rank].clone()
    proj = truth["decoder.layers.self_attention.linear_proj.weight"]
    layers = {
        # Megatron's GPT: each layer's tensor is one ShardedTensor of the stacked key, its
        # layer index on a prepended axis
        f"decoder.layers.{i}.self_attention.linear_proj.weight": ShardedTensor.from_rank_offsets(
            "decoder.layers.self_attention.linear_proj.weight",
            proj[i].chunk(tp, 1)[rank].clone(),
            (0, i, proj.shape[0]),
            (2, rank, tp),
            prepend_axis_num=1,
        )
        for i in range(proj.shape[0])
    }
    return {
        "model": {
            "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
                "embedding.word_embeddings.weight", emb, (0, rank, tp)
            ),
            "output_layer.weight": ShardedTensor.from_rank_offsets(
                "output_layer.weight", out, (0, rank, tp)
            ),
            "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
                "decoder.final_layernorm.weight",
                truth["decoder.final_layernorm.weight"].clone(),
                replica_id=rank,  # replicated over tp: only rank 0's copy is saved
            ),
            "embedding.position_ids": ShardedTensor.from_rank_offsets(
                "embedding.position_ids", truth["embedding.position_ids"].clone(), replica_id=rank
            ),
            **layers,
        },
        "rng_state": ShardedObject(
            "rng_state", {"seed": 1234 + rank, "calls": [rank, 2]}, (tp,), (rank,), replica_id=0
        ),
        **COMMON,
    }


def sharded_flat(rank: int, truth: dict) -> dict:
    """The distributed optimizer's layout: each data-parallel rank holds a contiguous range of
    each (tensor-parallel) chunk, flattened; ranges are uneven."""
    from megatron.core.dist_checkpointing import ShardedTensor

    def flat(key, chunk, ranges, rank_offsets=(), **kw):
        """This rank's range of ``chunk`` (one tensor-parallel chunk), flattened."""
        lo, hi = ranges[rank]
        return ShardedTensor.from_rank_offsets_flat(
            key,
            chunk.contiguous().flatten()[lo:hi].clone(),
            tuple(chunk.shape),
            *rank_offsets,
            flattened_range=slice(lo, hi),
            **kw,
        )

    emb_key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    proj_key = "optimizer.state.fp32_param.decoder.layers.self_attention.linear_proj.weight"
    ln_key = "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"
    proj = truth[proj_key]
    state: dict = {
        "model": {
            "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
                "embedding.word_embeddings.weight",
                truth["embedding.word_embeddings.weight"].clone(),
                replica_id=rank,
            )
        },
        "optimizer": {
            # one chunk (no tp), split unevenly over the two dp ranks
            "emb": flat(emb_key, truth[emb_key], [(0, 20), (20, 48)]),
            "ln": flat(ln_key, truth[ln_key], [(0, 2), (2, 6)]),
        },
        **COMMON,
    }
    # per layer, two column chunks of [6, 4]: both ranks hold a range of each
    for i in range(proj.shape[0]):
        for c in range(2):
            ranges = [(0, 10), (10, 24)] if c == 0 else [(0, 17), (17, 24)]
            cols = slice(4 * c, 4 * c + 4)
            state["optimizer"][f"proj.{i}.{c}"] = flat(
                proj_key,
                proj[i][:, cols],
                ranges,
                ((0, i, proj.shape[0]), (2, c, 2)),
                prepend_axis_num=1,
            )
    return state


def _worker(rank: int, kind: str, store_dir: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        # Two CUDA calls of the torch_dist writer, made whatever the tensors' device: it always
        # calls torch.cuda.synchronize() after its non-blocking copies to the CPU (nothing to
        # wait for here), and it broadcasts its failure flag from a tensor on
        # torch.cuda.current_device() (gloo broadcasts it from the CPU).
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    import numpy as np

    if not hasattr(np, "product"):  # megatron-core < 0.14 validates with np.product (NumPy < 2)
        np.product = np.prod
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        from megatron.core import dist_checkpointing

        truth = truth_tp2() if kind == "tp2" else truth_flat()
        state = sharded_tp2(rank, truth) if kind == "tp2" else sharded_flat(rank, truth)
        dist_checkpointing.save(state, out_dir, sharded_strategy=("torch_dist", 1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_truth(kind: str, out_dir: str) -> None:
    from safetensors.torch import save_file

    truth = truth_tp2() if kind == "tp2" else truth_flat()
    save_file(
        {k: v.contiguous() for k, v in truth.items()}, os.path.join(out_dir, "truth.safetensors")
    )
    values = {k: v for k, v in COMMON.items() if not isinstance(v, torch.dtype)}
    if kind == "tp2":
        for r in range(WORLD):
            values[f"rng_state/shard_{r}_{WORLD}"] = {"seed": 1234 + r, "calls": [r, 2]}
    with open(os.path.join(out_dir, "truth.json"), "w") as f:
        json.dump({"values": values}, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["tp2", "flat"])
    p.add_argument("--out", default=ROOT)
    args = p.parse_args(argv)
    import megatron.core

    out_dir = os.path.join(args.out, args.kind)
    with tempfile.TemporaryDirectory() as tmp:
        # written under a neutral path: DCP records the checkpoint's path in its metadata
        work = os.path.join(tmp, "ckpt")
        os.makedirs(work)
        mp.spawn(_worker, args=(args.kind, tmp, work), nprocs=WORLD, join=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.copytree(work, out_dir)
    _write_truth(args.kind, out_dir)
    with open(os.path.join(out_dir, "WRITER.txt"), "w") as f:
        f.write(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}\n")
    size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir))
    print(f"{out_dir}: {sorted(os.listdir(out_dir))}, {size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
