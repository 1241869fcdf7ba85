"""Task functions run on every rank by the harness: plain local tensors described by a UCL spec,
saved by every rank and loaded under other layouts, as spec locals and as DTensors."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import anyshard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucl_ref.reference import FAMILIES, all_coords  # noqa: E402

CFG = dict(hidden=12, heads=6, kv_heads=3, ffn=10, vocab=7, layers=4, vocab_divisor=4)
ORDER = ("pp", "dp", "tp")


def logical(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = FAMILIES["megatron_gpt"][0](CFG)
    return {k: torch.randn(s, generator=g) for k, s in sorted(shapes.items())}


def _locals(seed: int, sizes: dict, rank: int) -> dict[str, torch.Tensor]:
    full = {d: sizes.get(d, 1) for d in ORDER}
    coords = list(all_coords(full, ORDER))[rank]
    return FAMILIES["megatron_gpt"][1](logical(seed), CFG, full, coords)


def save_megatron(path: str, seed: int, sizes: dict) -> int:
    state = _locals(seed, sizes, dist.get_rank())
    state["iteration"] = 12
    anyshard.save(path, state, spec="megatron_gpt", layout={**sizes, **CFG})
    return len(state)


def load_megatron(path: str, seed: int, sizes: dict, read_once: bool = False) -> int:
    """Load the spec locals of ``sizes`` bit-exact; the bytes this rank read from storage
    (``read_once``: the regions other ranks also need are read by one of them)."""
    from anyshard.api.load import load_reporting

    want = _locals(seed, sizes, dist.get_rank())
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    got["iteration"] = 0
    report = load_reporting(
        path, got, spec="megatron_gpt", layout={**sizes, **CFG}, read_once=read_once
    )
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert got["iteration"] == 12
    return report.bytes_read


# Hugging Face names as DTensors on a (dp, tp) mesh: column- and row-parallel, replicated norms
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
_ROW = ("o_proj", "down_proj")


def load_as_dtensors(path: str, seed: int) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = logical(seed)
    state = {}
    for name, t in full.items():
        if any(c in name for c in _COLUMN):
            tp = Shard(0)
        elif any(r in name for r in _ROW):
            tp = Shard(1)
        else:
            tp = Replicate()
        state[name] = distribute_tensor(torch.zeros_like(t), mesh, [Replicate(), tp])
    anyshard.load(path, state, strict=False)
    for name, t in full.items():
        assert torch.equal(state[name].full_tensor(), t), name
    return len(state)


def save_averaged(path: str) -> None:
    r = dist.get_rank()
    # mesh dp x tp = 2 x 2: the statistic differs over dp and is averaged there; tp shards it
    stat = torch.arange(4.0) + 10 * r
    anyshard.save(
        path,
        {"stat": stat[:2] if r % 2 == 0 else stat[2:]},
        spec='mesh dp, tp;\n"stat" -> "stat" [4] : chunk(0, tp) | average(dp);\n',
        layout={"dp": 2, "tp": 2},
    )
