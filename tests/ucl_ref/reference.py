"""Independent plain-torch reference implementation of framework parameter layouts.

This module is the "truth" that the UCL layout descriptions are tested against, so it
deliberately imports nothing from ``anyshard``: every layout is written directly with
torch slicing / cat / flatten from the framework's documented layout.

Conventions
-----------
``cfg``    dict of model sizes: hidden, heads, kv_heads, ffn, vocab, layers (moe: experts).
           head_dim = hidden // heads.
``sizes``  dict of mesh dim sizes (e.g. ``{"pp": 2, "dp": 2, "tp": 2}``); missing dims are 1.
``coords`` dict of this rank's coordinate along each mesh dim; missing dims are 0.

Every family provides ``<family>_logical_shapes(cfg)`` and
``<family>_local(logical, cfg, sizes, coords)``; ``FAMILIES`` maps the family name to both.
Local tensors are contiguous and own their memory (never views of the logical tensors).
Padding regions are zeros.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "all_coords",
    "chunk",
    "chunk_bounds",
    "deepspeed_zero_local",
    "deepspeed_zero_logical_shapes",
    "deepspeed_zero_members",
    "gpt_local",
    "gpt_logical_shapes",
    "hf_llama_local",
    "hf_llama_logical_shapes",
    "megatron_gpt_local",
    "megatron_gpt_logical_shapes",
    "megatron_padded_vocab",
    "moe_local",
    "moe_logical_shapes",
]


# ---------------------------------------------------------------------------------------------
# generic helpers
# ---------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def chunk_bounds(extent: int, n: int, i: int) -> tuple[int, int]:
    """[start, stop) of part ``i`` of ``n`` under ``torch.chunk`` semantics.

    Part size is ceil(extent / n); trailing parts may be short or empty (torch.chunk then
    returns fewer than n chunks; the missing ones are empty here).
    """
    if n < 1:
        raise ValueError(f"chunk count must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"chunk index {i} out of range for {n} parts")
    size = _ceil_div(extent, n)
    start = min(i * size, extent)
    stop = min(start + size, extent)
    return start, stop


def chunk(t: Tensor, dim: int, n: int, i: int) -> Tensor:
    """``torch.chunk(t, n, dim)[i]``, but always defined: missing trailing parts are empty.

    Returns a view; callers copy (see ``_own``).
    """
    start, stop = chunk_bounds(t.shape[dim], n, i)
    return t.narrow(dim, start, stop - start)


def _own(t: Tensor) -> Tensor:
    """A contiguous copy in fresh memory (never a view of the input)."""
    return t.clone(memory_format=torch.contiguous_format)


def all_coords(sizes: Mapping[str, int], order: list[str] | tuple[str, ...]) -> Iterator[dict]:
    """Coordinate dicts over the dims in ``order``, row-major (last dim fastest).

    Dims missing from ``sizes`` have size 1.
    """
    ranges = [range(int(sizes.get(d, 1))) for d in order]
    for combo in itertools.product(*ranges):
        yield dict(zip(order, combo, strict=True))


def _mesh(sizes: Mapping[str, int], coords: Mapping[str, int], dims: tuple[str, ...]) -> dict:
    """Validate ``sizes``/``coords`` against the family's mesh dims; return {dim: (size, coord)}."""
    for d, n in sizes.items():
        if d not in dims and int(n) != 1:
            raise ValueError(f"mesh dim {d!r} (size {n}) is not used by this family {dims}")
    for d, c in coords.items():
        if d not in dims and int(c) != 0:
            raise ValueError(f"coordinate along {d!r} given but dim is not used by this family")
    out = {}
    for d in dims:
        n = int(sizes.get(d, 1))
        c = int(coords.get(d, 0))
        if n < 1:
            raise ValueError(f"mesh dim {d!r} has size {n}")
        if not 0 <= c < n:
            raise ValueError(f"coordinate {d}={c} out of range for size {n}")
        out[d] = (n, c)
    return out


def _layers_per_stage(cfg: Mapping, pp: int) -> int:
    layers = int(cfg["layers"])
    if layers % pp != 0:
        raise ValueError(f"layers ({layers}) must be divisible by pp ({pp})")
    return layers // pp


def _head_dim(cfg: Mapping) -> int:
    hidden, heads = int(cfg["hidden"]), int(cfg["heads"])
    if hidden % heads != 0:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    return hidden // heads


def _check_logical(logical: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        if name not in logical:
            raise KeyError(f"missing logical tensor {name!r}")
        if tuple(logical[name].shape) != tuple(shape):
            raise ValueError(
                f"logical tensor {name!r} has shape {tuple(logical[name].shape)}, expected {shape}"
            )


# ---------------------------------------------------------------------------------------------
# family "gpt": torchtitan-style GPT, TP then FSDP(dp) on dim 0, pp layer renumbering
# ---------------------------------------------------------------------------------------------

_GPT_LAYER_PARAMS = (
    # suffix, shape key, TP dim (None = replicated over tp)
    ("attention_norm.weight", "norm", None),
    ("attention.wq.weight", "q", 0),
    ("attention.wk.weight", "kv", 0),
    ("attention.wv.weight", "kv", 0),
    ("attention.wo.weight", "o", 1),
    ("ffn_norm.weight", "norm", None),
    ("feed_forward.w1.weight", "up", 0),
    ("feed_forward.w3.weight", "up", 0),
    ("feed_forward.w2.weight", "down", 1),
)


def _gpt_shape(cfg: Mapping, key: str) -> tuple[int, ...]:
    hd = _head_dim(cfg)
    hidden, heads, kv, ffn = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["ffn"]
    return {
        "norm": (hidden,),
        "q": (heads * hd, hidden),
        "kv": (kv * hd, hidden),
        "o": (hidden, heads * hd),
        "up": (ffn, hidden),
        "down": (hidden, ffn),
    }[key]


def gpt_logical_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg["vocab"], cfg["hidden"])}
    for layer in range(cfg["layers"]):
        for suffix, key, _ in _GPT_LAYER_PARAMS:
            out[f"layers.{layer}.{suffix}"] = _gpt_shape(cfg, key)
    out["norm.weight"] = (cfg["hidden"],)
    out["output.weight"] = (cfg["vocab"], cfg["hidden"])
    return out


def gpt_local(
    logical: Mapping[str, Tensor], cfg: Mapping, sizes: Mapping, coords: Mapping
) -> dict[str, Tensor]:
    _check_logical(logical, gpt_logical_shapes(cfg))
    m = _mesh(sizes, coords, ("pp", "dp", "tp"))
    (pp, s), (dp, d), (tp, t) = m["pp"], m["dp"], m["tp"]
    lps = _layers_per_stage(cfg, pp)

    def shard(x: Tensor, tp_dim: int | None) -> Tensor:
        if tp_dim is not None:
            x = chunk(x, tp_dim, tp, t)
        return _own(chunk(x, 0, dp, d))  # FSDP: dim 0 of the TP-local tensor

    out: dict[str, Tensor] = {}
    if s == 0:
        out["tok_embeddings.weight"] = shard(logical["tok_embeddings.weight"], 0)
    for i in range(lps):
        g = s * lps + i
        for suffix, _, tp_dim in _GPT_LAYER_PARAMS:
            out[f"layers.{i}.{suffix}"] = shard(logical[f"layers.{g}.{suffix}"], tp_dim)
    if s == pp - 1:
        out["norm.weight"] = shard(logical["norm.weight"], None)
        out["output.weight"] = shard(logical["output.weight"], 0)
    return out


# ---------------------------------------------------------------------------------------------
# HF Llama logical names (shared by megatron_gpt and hf_llama)
# ---------------------------------------------------------------------------------------------


def _llama_logical_shapes(cfg: Mapping, with_lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    hd = _head_dim(cfg)
    hidden, heads, kv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
    ffn, vocab = cfg["ffn"], cfg["vocab"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(cfg["layers"]):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = (hidden,)
        out[f"{p}.self_attn.q_proj.weight"] = (heads * hd, hidden)
        out[f"{p}.self_attn.k_proj.weight"] = (kv * hd, hidden)
        out[f"{p}.self_attn.v_proj.weight"] = (kv * hd, hidden)
        out[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * hd)
        out[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        out[f"{p}.mlp.gate_proj.weight"] = (ffn, hidden)
        out[f"{p}.mlp.up_proj.weight"] = (ffn, hidden)
        out[f"{p}.mlp.down_proj.weight"] = (hidden, ffn)
    out["model.norm.weight"] = (hidden,)
    if with_lm_head:
        out["lm_head.weight"] = (vocab, hidden)
    return out


# ---------------------------------------------------------------------------------------------
# family "megatron_gpt": Megatron-core GPT local names, HF Llama logical names
# ---------------------------------------------------------------------------------------------


def megatron_gpt_logical_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    return _llama_logical_shapes(cfg)


def megatron_padded_vocab(cfg: Mapping, tp: int) -> int:
    """Megatron's padded vocab: a multiple of vocab_divisor (default 128) * tp."""
    mult = int(cfg.get("vocab_divisor", 128)) * tp
    return _round_up(int(cfg["vocab"]), mult)


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if rows == x.shape[0]:
        return x
    out = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def megatron_gpt_local(
    logical: Mapping[str, Tensor], cfg: Mapping, sizes: Mapping, coords: Mapping
) -> dict[str, Tensor]:
    _check_logical(logical, megatron_gpt_logical_shapes(cfg))
    m = _mesh(sizes, coords, ("pp", "dp", "tp"))
    (pp, s), (tp, t) = m["pp"], m["tp"]  # dp replicates everything
    lps = _layers_per_stage(cfg, pp)
    hd = _head_dim(cfg)
    heads, kv = int(cfg["heads"]), int(cfg["kv_heads"])
    if heads % kv != 0:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv})")
    r = heads // kv
    g0, g1 = chunk_bounds(kv, tp, t)  # this TP rank's query groups [g0, g1)
    vpad = megatron_padded_vocab(cfg, tp)

    out: dict[str, Tensor] = {}
    if s == 0:
        emb = _pad_rows(logical["model.embed_tokens.weight"], vpad)
        out["embedding.word_embeddings.weight"] = _own(chunk(emb, 0, tp, t))
    for i in range(lps):
        p = f"model.layers.{s * lps + i}"
        q = logical[f"{p}.self_attn.q_proj.weight"]
        k = logical[f"{p}.self_attn.k_proj.weight"]
        v = logical[f"{p}.self_attn.v_proj.weight"]
        parts = []
        for g in range(g0, g1):
            parts.append(q[g * r * hd : (g + 1) * r * hd])
            parts.append(k[g * hd : (g + 1) * hd])
            parts.append(v[g * hd : (g + 1) * hd])
        if parts:
            qkv = torch.cat(parts, dim=0)
        else:  # more TP ranks than groups: this rank holds none
            qkv = q.new_zeros((0, q.shape[1]))
        o = logical[f"{p}.self_attn.o_proj.weight"]
        gate = logical[f"{p}.mlp.gate_proj.weight"]
        up = logical[f"{p}.mlp.up_proj.weight"]
        down = logical[f"{p}.mlp.down_proj.weight"]
        ln = f"decoder.layers.{i}"
        out[f"{ln}.self_attention.linear_qkv.weight"] = _own(qkv)
        out[f"{ln}.self_attention.linear_qkv.layer_norm_weight"] = _own(
            logical[f"{p}.input_layernorm.weight"]
        )
        out[f"{ln}.self_attention.linear_proj.weight"] = _own(o[:, g0 * r * hd : g1 * r * hd])
        out[f"{ln}.mlp.linear_fc1.weight"] = _own(
            torch.cat([chunk(gate, 0, tp, t), chunk(up, 0, tp, t)], dim=0)
        )
        out[f"{ln}.mlp.linear_fc1.layer_norm_weight"] = _own(
            logical[f"{p}.post_attention_layernorm.weight"]
        )
        out[f"{ln}.mlp.linear_fc2.weight"] = _own(chunk(down, 1, tp, t))
    if s == pp - 1:
        out["decoder.final_layernorm.weight"] = _own(logical["model.norm.weight"])
        head = _pad_rows(logical["lm_head.weight"], vpad)
        out["output_layer.weight"] = _own(chunk(head, 0, tp, t))
    return out


# ---------------------------------------------------------------------------------------------
# family "hf_llama": HF Llama names, TP-sharded like HF's tp_plan
# ---------------------------------------------------------------------------------------------

_HF_TP_DIM = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
}


def hf_llama_logical_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    return _llama_logical_shapes(cfg, with_lm_head=not cfg.get("tied"))


def hf_llama_local(
    logical: Mapping[str, Tensor], cfg: Mapping, sizes: Mapping, coords: Mapping
) -> dict[str, Tensor]:
    shapes = hf_llama_logical_shapes(cfg)
    _check_logical(logical, shapes)
    (tp, t) = _mesh(sizes, coords, ("tp",))["tp"]
    out: dict[str, Tensor] = {}
    for name in shapes:
        x = logical[name]
        tp_dim = None
        if name == "lm_head.weight":
            tp_dim = 0
        elif name.startswith("model.layers."):
            suffix = name.split(".", 3)[3]  # strip "model.layers.L."
            tp_dim = _HF_TP_DIM.get(suffix)
        out[name] = _own(x if tp_dim is None else chunk(x, tp_dim, tp, t))
    if cfg.get("tied"):
        out["lm_head.weight"] = _own(chunk(logical["model.embed_tokens.weight"], 0, tp, t))
    return out


# ---------------------------------------------------------------------------------------------
# family "deepspeed_zero": ZeRO-1/2 flat fp32 partitions with Megatron-style TP
# ---------------------------------------------------------------------------------------------

_DS_OPT_STATES = ("exp_avg", "exp_avg_sq")


def _ds_params(cfg: Mapping) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """All model params in flattening order (per stage): name -> (shape, TP dim or None)."""
    hidden, ffn, vocab = cfg["hidden"], cfg["ffn"], cfg["vocab"]
    out: dict[str, tuple[tuple[int, ...], int | None]] = {"embed.weight": ((vocab, hidden), 0)}
    for layer in range(cfg["layers"]):
        out[f"layers.{layer}.attn.weight"] = ((hidden, hidden), 0)
        out[f"layers.{layer}.attn.bias"] = ((hidden,), 0)
        out[f"layers.{layer}.mlp.weight"] = ((hidden, ffn), 1)
        out[f"layers.{layer}.norm.weight"] = ((hidden,), None)
    out["final_norm.weight"] = ((hidden,), None)
    return out


def deepspeed_zero_logical_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for name, (shape, _) in _ds_params(cfg).items():
        out[name] = shape
        for st in _DS_OPT_STATES:
            out[f"{name}.{st}"] = shape
    return out


def _ds_stage_params(cfg: Mapping, pp: int, s: int) -> list[tuple[str, int | None]]:
    """(logical param name, TP dim) for stage ``s``, in flattening order."""
    lps = _layers_per_stage(cfg, pp)
    params = _ds_params(cfg)
    names = ["embed.weight"] if s == 0 else []
    for i in range(lps):
        g = s * lps + i
        names += [f"layers.{g}.{x}" for x in ("attn.weight", "attn.bias", "mlp.weight")]
        names.append(f"layers.{g}.norm.weight")
    if s == pp - 1:
        names.append("final_norm.weight")
    return [(n, params[n][1]) for n in names]


def deepspeed_zero_members(cfg: Mapping, sizes: Mapping, coords: Mapping) -> tuple[list, int]:
    """Layout of the (pp, tp) rank's flat buffer.

    Returns ([(param name, TP dim, TP-local shape, start offset, numel), ...], padded_total).
    The dp coordinate is irrelevant here (the buffer is the same; dp only partitions it).
    """
    m = _mesh(sizes, coords, ("pp", "dp", "tp"))
    (pp, s), (dp, _), (tp, t) = m["pp"], m["dp"], m["tp"]
    align = int(cfg.get("align", 1))
    shapes = _ds_params(cfg)
    members = []
    off = 0
    for name, tp_dim in _ds_stage_params(cfg, pp, s):
        shape = list(shapes[name][0])
        if tp_dim is not None:
            a, b = chunk_bounds(shape[tp_dim], tp, t)
            shape[tp_dim] = b - a
        numel = 1
        for x in shape:
            numel *= x
        if align > 1:
            off = _round_up(off, align)
        members.append((name, tp_dim, tuple(shape), off, numel))
        off += numel
    total = _round_up(off, 2 * dp)  # nccl_start_alignment_factor (2) * dp world size
    return members, total


def deepspeed_zero_local(
    logical: Mapping[str, Tensor], cfg: Mapping, sizes: Mapping, coords: Mapping
) -> dict[str, Tensor]:
    _check_logical(logical, deepspeed_zero_logical_shapes(cfg))
    m = _mesh(sizes, coords, ("pp", "dp", "tp"))
    (dp, d), (tp, t) = m["dp"], m["tp"]
    members, total = deepspeed_zero_members(cfg, sizes, coords)
    part = total // dp
    out: dict[str, Tensor] = {}
    for local_name, suffix in (
        ("fp32_flat_groups.0", ""),
        ("exp_avg.0", ".exp_avg"),
        ("exp_avg_sq.0", ".exp_avg_sq"),
    ):
        ref = logical[members[0][0] + suffix]
        flat = torch.zeros(total, dtype=ref.dtype, device=ref.device)
        for name, tp_dim, shape, off, numel in members:
            x = logical[name + suffix]
            if tp_dim is not None:
                x = chunk(x, tp_dim, tp, t)
            assert tuple(x.shape) == shape
            flat[off : off + numel] = x.reshape(-1)
        out[local_name] = _own(flat[d * part : (d + 1) * part])
    return out


# ---------------------------------------------------------------------------------------------
# family "moe": experts over expert parallelism with local expert numbering
# ---------------------------------------------------------------------------------------------


def moe_logical_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    hidden, ffn, experts = cfg["hidden"], cfg["ffn"], cfg["experts"]
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg["layers"]):
        out[f"layers.{layer}.router.weight"] = (experts, hidden)
        for e in range(experts):
            out[f"layers.{layer}.experts.{e}.w1.weight"] = (ffn, hidden)
            out[f"layers.{layer}.experts.{e}.w2.weight"] = (hidden, ffn)
    return out


def moe_local(
    logical: Mapping[str, Tensor], cfg: Mapping, sizes: Mapping, coords: Mapping
) -> dict[str, Tensor]:
    _check_logical(logical, moe_logical_shapes(cfg))
    m = _mesh(sizes, coords, ("pp", "ep", "tp"))
    (pp, s), (ep, c), (tp, t) = m["pp"], m["ep"], m["tp"]
    lps = _layers_per_stage(cfg, pp)
    experts = int(cfg["experts"])
    if experts % ep != 0:
        raise ValueError(f"experts ({experts}) must be divisible by ep ({ep})")
    epr = experts // ep
    out: dict[str, Tensor] = {}
    for i in range(lps):
        g = s * lps + i
        out[f"layers.{i}.moe.router.weight"] = _own(logical[f"layers.{g}.router.weight"])
        for e in range(epr):
            ge = c * epr + e
            w1 = logical[f"layers.{g}.experts.{ge}.w1.weight"]
            w2 = logical[f"layers.{g}.experts.{ge}.w2.weight"]
            out[f"layers.{i}.moe.experts.{e}.w1.weight"] = _own(chunk(w1, 0, tp, t))
            out[f"layers.{i}.moe.experts.{e}.w2.weight"] = _own(chunk(w2, 1, tp, t))
    return out


FAMILIES = {
    "gpt": (gpt_logical_shapes, gpt_local),
    "megatron_gpt": (megatron_gpt_logical_shapes, megatron_gpt_local),
    "hf_llama": (hf_llama_logical_shapes, hf_llama_local),
    "deepspeed_zero": (deepspeed_zero_logical_shapes, deepspeed_zero_local),
    "moe": (moe_logical_shapes, moe_local),
}
