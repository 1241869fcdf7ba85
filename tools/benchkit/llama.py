"""The Llama-shaped workload of the benchmarks: a model's tensors in save order, their placements
on a device mesh, seeded values, and the states that bench_reshard and bench_redistribute move
between meshes.

A tensor's kind says how tensor parallelism splits it: ``col`` (column-parallel: tp `Shard(0)`),
``row`` (`Shard(1)`), ``norm`` (replicated over tp), and the grouped experts' ``expert_col`` and
``expert_row`` (tp over the expert's output or input dim).
"""

from __future__ import annotations

import hashlib
import zlib
from collections import namedtuple
from collections.abc import Sequence

from .measure import GiB, as_bytes

# layer: None for the embedding and, ``last``, the final norm and output
Tensor = namedtuple("Tensor", "name shape kind layer last", defaults=(False,))
TP_DIM = {"col": 0, "row": 1, "norm": None, "expert_col": 1, "expert_row": 2}
# bench_reshard's meshes on 4 ranks: the source and the two targets, (sizes, dim names)
MESHES = {"src": ((2, 2), ("dp_shard", "tp")), "tp4": ((4,), ("tp",)), "dp4": ((4,), ("dp_shard",))}
WORLD, TARGETS = 4, ("tp4", "dp4")


def transformer(h: int, kv: int, vocab: int, layers: int, ffn: list[tuple], embedding="col"):
    """Embedding (of kind ``embedding``), ``layers`` layers of attention then ``ffn`` ((name,
    shape, kind) each), norm and output, in the order a save writes them; `Tensor` each."""
    attn = [("attention_norm.weight", (h,), "norm"), ("attention.wq.weight", (h, h), "col")]
    attn += [(f"attention.{w}.weight", (kv, h), "col") for w in ("wk", "wv")]
    attn += [("attention.wo.weight", (h, h), "row"), ("ffn_norm.weight", (h,), "norm")]
    out = [Tensor("tok_embeddings.weight", (vocab, h), embedding, None)]
    out += [Tensor(f"layers.{i}.{n}", s, k, i) for i in range(layers) for n, s, k in attn + ffn]
    last = [Tensor("norm.weight", (h,), "norm", None, True)]
    return out + last + [Tensor("output.weight", (vocab, h), "col", None, True)]


def _dense_ffn(h: int, f: int) -> list[tuple]:
    ffn = [(f"feed_forward.{w}.weight", (f, h), "col") for w in ("w1", "w3")]
    return ffn + [("feed_forward.w2.weight", (h, f), "row")]


def gpt_shapes(hidden: int, ffn: int, vocab: int, layers: int, kv: int = 0, embedding="row"):
    """``(name, global shape, kind)`` of a Llama-shaped model in save order: ``kv`` rows of wk and
    wv (``hidden`` without); the embedding's kind ``embedding``."""
    model = transformer(hidden, kv or hidden, vocab, layers, _dense_ffn(hidden, ffn), embedding)
    return [(t.name, t.shape, t.kind) for t in model]


def model_spec(gib: float, hidden: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    """`gpt_shapes` of about ``gib`` GiB of fp32, of width ``hidden`` if given (at least one
    layer; else 1024 from 0.5 GiB on, 512 below)."""
    d = hidden or (1024 if gib >= 0.5 else 512)
    f, v = 4 * d, 8192
    layers = max(1, round((gib * GiB / 4 - 2 * v * d - d) / (4 * d * d + 3 * f * d + 2 * d)))
    return gpt_shapes(d, f, v, layers)


def dense_70b(h=8192, f=28672, kv=1024, vocab=128256, layers=80) -> list[Tensor]:
    """A Llama-70B-shaped dense transformer (the defaults); smaller sizes give a toy of it."""
    return transformer(h, kv, vocab, layers, _dense_ffn(h, f))


def moe_16(h=6144, f=16384, kv=1024, vocab=32768, layers=56, experts=16) -> list[Tensor]:
    """Experts stored as grouped [experts, ...] tensors (as torchtitan holds them), sharded over
    dp_shard (expert parallelism folded into data-parallel sharding)."""
    ffn = [("moe.router.weight", (experts, h), "norm")]
    ffn += [(f"moe.experts.{w}", (experts, f, h), "expert_col") for w in ("w1", "w3")]
    ffn += [("moe.experts.w2", (experts, h, f), "expert_row")]
    return transformer(h, kv, vocab, layers, ffn)


def placements(kind: str, dims: Sequence[str], fsdp_over_tp: int | None = None) -> list:
    """The placements of a tensor of ``kind`` on a mesh of ``dims``: ``tp`` as the kind says,
    ``dp_shard`` `Shard(0)`, any other dim (``dp_replicate``) replicated. ``fsdp_over_tp``: the tp
    size, for FSDP2 over TP as torch builds it (dp_shard's split of a column-parallel weight's
    rows strided over tp's)."""
    from torch.distributed.tensor import Replicate, Shard

    from anyshard._compat import strided_shard_type

    tp, out = TP_DIM[kind], []
    for dim in dims:
        if dim == "tp":
            out.append(Replicate() if tp is None else Shard(tp))
        elif dim == "dp_shard" and fsdp_over_tp is not None and tp == 0:
            out.append(strided_shard_type()(0, split_factor=fsdp_over_tp))
        else:
            out.append(Shard(0) if dim == "dp_shard" else Replicate())
    return out


def full_tensor(name: str, shape: tuple[int, ...], seed: int = 0):
    """The fp32 values of tensor ``name``, the same wherever they are made (the name's CRC-32
    and ``seed`` seed them)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def digest(t) -> tuple:
    """Shape and BLAKE2b of a tensor's bytes: two shards are bit-identical iff these match."""
    data = as_bytes(t.detach().contiguous())
    return tuple(t.shape), hashlib.blake2b(data, digest_size=20).digest()


def mismatched(got: dict, want: dict) -> list[str]:
    """The names of the tensors of ``got`` whose `digest` is not ``want``'s."""
    return [n for n, t in got.items() if digest(t) != want[n]]


def states(spec: list, seed: int = 0):
    """On a rank of 4: the `MESHES`; the source state (DTensors on the (dp_shard=2, tp=2) mesh);
    the targets (zeros, on the tp=4 and dp_shard=4 meshes) and the `digest` of each expected
    target shard (holding the shards themselves would double each rank's memory)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    meshes = {k: init_device_mesh("cpu", s, mesh_dim_names=d) for k, (s, d) in MESHES.items()}
    source, targets, expected = {}, {t: {} for t in TARGETS}, {t: {} for t in TARGETS}
    for name, shape, kind in spec:
        full = full_tensor(name, shape, seed)
        kw = {"run_check": False, "shape": full.shape, "stride": full.stride()}
        for layout, mesh in meshes.items():
            pl = placements(kind, MESHES[layout][1])
            local = distribute_tensor(full, mesh, pl, src_data_rank=None).to_local()
            if layout == "src":
                source[name] = DTensor.from_local(local.clone(), mesh, pl, **kw)
            else:
                expected[layout][name] = digest(local)
                targets[layout][name] = DTensor.from_local(torch.zeros_like(local), mesh, pl, **kw)
    return meshes, source, targets, expected
