"""Self-consistency tests of the plain-torch layout reference in tests/ucl_ref.

The reference is the independent truth for the UCL layout tests, so these tests check it
against hand-written expectations and against hand-written inverses (reassembling every
logical tensor from all ranks' local tensors), using logical tensors filled with unique values.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucl_ref.reference import (  # noqa: E402
    FAMILIES,
    all_coords,
    chunk,
    deepspeed_zero_local,
    deepspeed_zero_logical_shapes,
    gpt_local,
    hf_llama_local,
    megatron_gpt_local,
    megatron_padded_vocab,
    moe_local,
)

ORDERS = {
    "gpt": ("pp", "dp", "tp"),
    "megatron_gpt": ("pp", "dp", "tp"),
    "hf_llama": ("tp",),
    "deepspeed_zero": ("pp", "dp", "tp"),
    "moe": ("pp", "ep", "tp"),
}

GPT_CFG = dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=4)
MEG_CFG = dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=2)
MEG_CFG_KV3 = dict(hidden=12, heads=6, kv_heads=3, ffn=10, vocab=7, layers=2, vocab_divisor=4)
HF_CFG = dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=2)
DS_CFG = dict(hidden=4, ffn=6, vocab=5, layers=2)
MOE_CFG = dict(hidden=4, ffn=6, vocab=5, layers=2, experts=4)

# (family, cfg, sizes); uneven and empty chunks included on purpose
CASES = [
    ("gpt", GPT_CFG, {}),
    ("gpt", GPT_CFG, {"tp": 2}),
    ("gpt", GPT_CFG, {"pp": 2, "dp": 2, "tp": 2}),
    ("gpt", GPT_CFG, {"dp": 3, "tp": 3}),
    ("gpt", GPT_CFG, {"pp": 4, "dp": 5}),
    ("megatron_gpt", MEG_CFG, {}),
    ("megatron_gpt", MEG_CFG, {"tp": 2}),
    ("megatron_gpt", dict(MEG_CFG, vocab_divisor=4), {"pp": 2, "dp": 2, "tp": 2}),
    ("megatron_gpt", dict(MEG_CFG, vocab_divisor=1), {"tp": 3}),
    ("megatron_gpt", MEG_CFG_KV3, {"dp": 2, "tp": 2}),
    ("megatron_gpt", MEG_CFG_KV3, {"pp": 2, "tp": 4}),
    ("hf_llama", HF_CFG, {}),
    ("hf_llama", HF_CFG, {"tp": 2}),
    ("hf_llama", HF_CFG, {"tp": 3}),
    ("hf_llama", dict(HF_CFG, tied=True), {"tp": 2}),
    ("hf_llama", dict(HF_CFG, tied=True), {"tp": 5}),
    ("deepspeed_zero", DS_CFG, {}),
    ("deepspeed_zero", DS_CFG, {"dp": 2}),
    ("deepspeed_zero", DS_CFG, {"pp": 2, "dp": 3, "tp": 2}),
    ("deepspeed_zero", dict(DS_CFG, align=4), {"dp": 3, "tp": 3}),
    ("deepspeed_zero", dict(DS_CFG, align=3), {"pp": 2, "dp": 4}),
    ("moe", MOE_CFG, {}),
    ("moe", MOE_CFG, {"pp": 2, "ep": 2, "tp": 2}),
    ("moe", MOE_CFG, {"ep": 4, "tp": 4}),
]


def _ids(case):
    fam, cfg, sizes = case
    extra = "".join(f"-{k}{v}" for k, v in cfg.items() if k in ("tied", "align", "vocab_divisor"))
    return fam + extra + "-" + ("_".join(f"{k}{v}" for k, v in sizes.items()) or "single")


def unique_logical(shapes, dtype=torch.float64):
    """Logical tensors filled with globally unique values 1, 2, 3, ... (0 means padding)."""
    out, base = {}, 1
    for name, shape in shapes.items():
        n = 1
        for x in shape:
            n *= x
        out[name] = torch.arange(base, base + n, dtype=dtype).reshape(shape)
        base += n
    return out


def _dtype(fam):
    return torch.float32 if fam == "deepspeed_zero" else torch.float64


def all_locals(fam, cfg, sizes, logical):
    local_fn = FAMILIES[fam][1]
    return {
        tuple(c[d] for d in ORDERS[fam]): local_fn(logical, cfg, sizes, c)
        for c in all_coords(sizes, ORDERS[fam])
    }


def _n(sizes, d):
    return sizes.get(d, 1)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extent", range(0, 10))
@pytest.mark.parametrize("n", range(1, 6))
def test_chunk_matches_torch_chunk(extent, n):
    t = torch.arange(extent * 3).reshape(extent, 3)
    ref = torch.chunk(t, n, 0)
    parts = [chunk(t, 0, n, i) for i in range(n)]
    for i, p in enumerate(parts):
        if i < len(ref):
            assert torch.equal(p, ref[i])
        else:
            assert p.shape == (0, 3)
    assert torch.equal(torch.cat(parts, 0), t)
    # along a non-leading dim too
    tt = t.T
    assert torch.equal(torch.cat([chunk(tt, 1, n, i) for i in range(n)], 1), tt)


def test_chunk_uneven_sizes():
    t = torch.zeros(5, 2)
    assert [chunk(t, 0, 4, i).shape[0] for i in range(4)] == [2, 2, 1, 0]
    assert [chunk(t, 0, 3, i).shape[0] for i in range(3)] == [2, 2, 1]
    assert [chunk(torch.zeros(2), 0, 3, i).shape[0] for i in range(3)] == [1, 1, 0]
    with pytest.raises(ValueError):
        chunk(t, 0, 3, 3)


def test_all_coords_row_major():
    got = list(all_coords({"pp": 2, "tp": 3}, ("pp", "dp", "tp")))
    assert len(got) == 6
    assert got[0] == {"pp": 0, "dp": 0, "tp": 0}
    assert got[1] == {"pp": 0, "dp": 0, "tp": 1}
    assert got[3] == {"pp": 1, "dp": 0, "tp": 0}
    assert [(c["pp"], c["tp"]) for c in got] == [(p, t) for p in range(2) for t in range(3)]
    assert list(all_coords({}, ("tp",))) == [{"tp": 0}]


# ---------------------------------------------------------------------------------------------
# generic: every logical element appears, with the right multiplicity, nothing else but zeros
# ---------------------------------------------------------------------------------------------


def _is_norm(name):
    return "norm" in name


def replication(fam, cfg, sizes, name):
    """How many times each element of logical tensor ``name`` appears over all ranks."""
    tp, dp, ep = _n(sizes, "tp"), _n(sizes, "dp"), _n(sizes, "ep")
    if fam == "gpt":
        return tp if _is_norm(name) else 1
    if fam == "megatron_gpt":
        return dp * (tp if _is_norm(name) else 1)
    if fam == "hf_llama":
        if name == "model.embed_tokens.weight":
            return tp + (1 if cfg.get("tied") else 0)
        return tp if _is_norm(name) else 1
    if fam == "deepspeed_zero":
        return tp if _is_norm(name) else 1
    if fam == "moe":
        return ep * tp if "router" in name else 1
    raise AssertionError(fam)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_element_appears_with_right_multiplicity(case):
    fam, cfg, sizes = case
    shapes_fn, _ = FAMILIES[fam]
    shapes = shapes_fn(cfg)
    logical = unique_logical(shapes, _dtype(fam))
    locs = all_locals(fam, cfg, sizes, logical)
    flat = torch.cat([t.reshape(-1) for loc in locs.values() for t in loc.values()])
    assert torch.all(flat == flat.round()) and torch.all(flat >= 0)
    total = sum(t.numel() for t in logical.values())
    assert int(flat.max()) <= total
    counts = torch.bincount(flat.long(), minlength=total + 1)
    for name, t in logical.items():
        want = replication(fam, cfg, sizes, name)
        got = counts[t.reshape(-1).long()]
        assert torch.all(got == want), (name, got.tolist(), want)
    # the only other value is 0 (padding)
    real = sum(replication(fam, cfg, sizes, n) * t.numel() for n, t in logical.items())
    assert int(counts[0]) == flat.numel() - real


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_locals_are_contiguous_fresh_memory(case):
    fam, cfg, sizes = case
    logical = unique_logical(FAMILIES[fam][0](cfg), _dtype(fam))
    ptrs = {t.untyped_storage().data_ptr() for t in logical.values()}
    locs = all_locals(fam, cfg, sizes, logical)
    seen = set()
    for loc in locs.values():
        for name, t in loc.items():
            assert t.is_contiguous(), name
            assert t.dtype == _dtype(fam)
            if t.numel():
                p = t.untyped_storage().data_ptr()
                assert p not in ptrs, name
                assert p not in seen, name
                seen.add(p)


def test_layers_must_divide_pp():
    cfg = dict(GPT_CFG, layers=3)
    logical = unique_logical(FAMILIES["gpt"][0](cfg))
    with pytest.raises(ValueError):
        gpt_local(logical, cfg, {"pp": 2}, {"pp": 0})
    mcfg = dict(MOE_CFG, experts=3)
    logical = unique_logical(FAMILIES["moe"][0](mcfg))
    with pytest.raises(ValueError):
        moe_local(logical, mcfg, {"ep": 2}, {"ep": 0})


# ---------------------------------------------------------------------------------------------
# gpt
# ---------------------------------------------------------------------------------------------

GPT_TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}


def _gpt_where(name, cfg, pp):
    """(stage, local name, tp dim or None) for a gpt logical name."""
    lps = cfg["layers"] // pp
    if name == "tok_embeddings.weight":
        return 0, name, 0
    if name in ("norm.weight", "output.weight"):
        return pp - 1, name, (None if name == "norm.weight" else 0)
    _, layer, rest = name.split(".", 2)
    layer = int(layer)
    key = rest.split(".")[-2]
    return layer // lps, f"layers.{layer % lps}.{rest}", GPT_TP_DIM.get(key)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "gpt"], ids=_ids)
def test_gpt_reassemble(case):
    _, cfg, sizes = case
    pp, dp, tp = _n(sizes, "pp"), _n(sizes, "dp"), _n(sizes, "tp")
    logical = unique_logical(FAMILIES["gpt"][0](cfg))
    locs = all_locals("gpt", cfg, sizes, logical)
    for s in range(pp):
        n_local = sum(1 for _ in locs[(s, 0, 0)])
        expect = 9 * (cfg["layers"] // pp) + (s == 0) + 2 * (s == pp - 1)
        assert n_local == expect
    for name, full in logical.items():
        s, lname, tp_dim = _gpt_where(name, cfg, pp)
        tp_shards = [torch.cat([locs[(s, d, t)][lname] for d in range(dp)], 0) for t in range(tp)]
        if tp_dim is None:
            for sh in tp_shards:
                assert torch.equal(sh, full), name
        else:
            assert torch.equal(torch.cat(tp_shards, tp_dim), full), name


def test_gpt_shapes_uneven():
    cfg = GPT_CFG  # hidden 8, vocab 10, heads 4 (hd 2), kv 2 -> wk [4, 8]
    logical = unique_logical(FAMILIES["gpt"][0](cfg))
    sizes = {"dp": 3, "tp": 3}
    shp = {}
    for d, t in ((d, t) for d in range(3) for t in range(3)):
        loc = gpt_local(logical, cfg, sizes, {"dp": d, "tp": t})
        shp[(d, t)] = {k: tuple(v.shape) for k, v in loc.items()}
    # vocab 10 over tp3 -> 4,4,2 rows; then over dp3: 4 -> 2,2,0 ; 2 -> 1,1,0
    assert [shp[(d, 0)]["tok_embeddings.weight"] for d in range(3)] == [(2, 8), (2, 8), (0, 8)]
    assert [shp[(d, 2)]["output.weight"] for d in range(3)] == [(1, 8), (1, 8), (0, 8)]
    # wk rows 4 over tp3 -> 2,2,0
    assert [shp[(0, t)]["layers.0.attention.wk.weight"] for t in range(3)] == [
        (1, 8),
        (1, 8),
        (0, 8),
    ]
    assert shp[(2, 2)]["layers.0.attention.wk.weight"] == (0, 8)
    # wo [8, 8] chunked on dim 1 by tp (3,3,2) then on dim 0 by dp (3,3,2)
    assert shp[(2, 2)]["layers.1.attention.wo.weight"] == (2, 2)
    assert shp[(0, 0)]["layers.1.attention.wo.weight"] == (3, 3)
    # norms are replicated over tp, chunked over dp: 8 -> 3,3,2
    assert [shp[(d, 1)]["norm.weight"] for d in range(3)] == [(3,), (3,), (2,)]


def test_gpt_pp_renumbering():
    cfg = GPT_CFG
    logical = unique_logical(FAMILIES["gpt"][0](cfg))
    loc = gpt_local(logical, cfg, {"pp": 2}, {"pp": 1})
    assert "tok_embeddings.weight" not in loc and "output.weight" in loc
    assert "layers.2.attention.wq.weight" not in loc
    assert torch.equal(loc["layers.0.attention.wq.weight"], logical["layers.2.attention.wq.weight"])
    assert torch.equal(loc["layers.1.ffn_norm.weight"], logical["layers.3.ffn_norm.weight"])
    loc0 = gpt_local(logical, cfg, {"pp": 2}, {"pp": 0})
    assert "tok_embeddings.weight" in loc0 and "norm.weight" not in loc0


# ---------------------------------------------------------------------------------------------
# megatron_gpt
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "megatron_gpt"], ids=_ids)
def test_megatron_reassemble(case):
    _, cfg, sizes = case
    pp, dp, tp = _n(sizes, "pp"), _n(sizes, "dp"), _n(sizes, "tp")
    lps = cfg["layers"] // pp
    hd = cfg["hidden"] // cfg["heads"]
    r = cfg["heads"] // cfg["kv_heads"]
    logical = unique_logical(FAMILIES["megatron_gpt"][0](cfg))
    locs = all_locals("megatron_gpt", cfg, sizes, logical)
    assert len(locs) == pp * dp * tp
    # dp replicates everything
    for (s, _d, t), loc in locs.items():
        ref = locs[(s, 0, t)]
        assert loc.keys() == ref.keys()
        assert all(torch.equal(loc[k], ref[k]) for k in loc)
    vpad = megatron_padded_vocab(cfg, tp)
    div = cfg.get("vocab_divisor", 128)
    assert vpad % (div * tp) == 0 and cfg["vocab"] <= vpad < cfg["vocab"] + div * tp

    for lname, hfname, s in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight", 0),
        ("output_layer.weight", "lm_head.weight", pp - 1),
    ):
        parts = [locs[(s, 0, t)][lname] for t in range(tp)]
        assert all(p.shape == (vpad // tp, cfg["hidden"]) for p in parts)
        full = torch.cat(parts, 0)
        assert torch.equal(full[: cfg["vocab"]], logical[hfname])
        assert torch.all(full[cfg["vocab"] :] == 0)
    for s in range(pp):
        assert ("embedding.word_embeddings.weight" in locs[(s, 0, 0)]) == (s == 0)
        assert ("output_layer.weight" in locs[(s, 0, 0)]) == (s == pp - 1)
        assert ("decoder.final_layernorm.weight" in locs[(s, 0, 0)]) == (s == pp - 1)
    for t in range(tp):
        assert torch.equal(
            locs[(pp - 1, 0, t)]["decoder.final_layernorm.weight"], logical["model.norm.weight"]
        )

    for layer in range(cfg["layers"]):
        s, i = divmod(layer, lps)
        p, ln = f"model.layers.{layer}", f"decoder.layers.{i}"
        q, k, v, o, gate, up = [], [], [], [], [], []
        for t in range(tp):
            loc = locs[(s, 0, t)]
            qkv = loc[f"{ln}.self_attention.linear_qkv.weight"]
            group_rows = (r + 2) * hd
            assert qkv.shape[0] % group_rows == 0
            for grp in qkv.split(group_rows, 0):
                q.append(grp[: r * hd])
                k.append(grp[r * hd : (r + 1) * hd])
                v.append(grp[(r + 1) * hd :])
            proj = loc[f"{ln}.self_attention.linear_proj.weight"]
            # the columns of exactly the q heads this rank holds
            assert proj.shape[1] == (qkv.shape[0] // group_rows) * r * hd
            o.append(proj)
            fc1 = loc[f"{ln}.mlp.linear_fc1.weight"]
            half = fc1.shape[0] // 2
            gate.append(fc1[:half])
            up.append(fc1[half:])
            assert torch.equal(
                loc[f"{ln}.self_attention.linear_qkv.layer_norm_weight"],
                logical[f"{p}.input_layernorm.weight"],
            )
            assert torch.equal(
                loc[f"{ln}.mlp.linear_fc1.layer_norm_weight"],
                logical[f"{p}.post_attention_layernorm.weight"],
            )
        assert torch.equal(torch.cat(q), logical[f"{p}.self_attn.q_proj.weight"])
        assert torch.equal(torch.cat(k), logical[f"{p}.self_attn.k_proj.weight"])
        assert torch.equal(torch.cat(v), logical[f"{p}.self_attn.v_proj.weight"])
        assert torch.equal(torch.cat(o, 1), logical[f"{p}.self_attn.o_proj.weight"])
        assert torch.equal(torch.cat(gate), logical[f"{p}.mlp.gate_proj.weight"])
        assert torch.equal(torch.cat(up), logical[f"{p}.mlp.up_proj.weight"])
        fc2 = [locs[(s, 0, t)][f"{ln}.mlp.linear_fc2.weight"] for t in range(tp)]
        assert torch.equal(torch.cat(fc2, 1), logical[f"{p}.mlp.down_proj.weight"])


def _marked_llama(cfg):
    """Llama logical tensors whose column 0 marks the row: q 100+row, k 200+row, v 300+row,
    o_proj row 0 marks columns 400+col."""
    logical = {k: torch.zeros(s) for k, s in FAMILIES["megatron_gpt"][0](cfg).items()}
    for layer in range(cfg["layers"]):
        p = f"model.layers.{layer}.self_attn"
        for proj, base in (("q_proj", 100), ("k_proj", 200), ("v_proj", 300)):
            w = logical[f"{p}.{proj}.weight"]
            w[:, 0] = base + torch.arange(w.shape[0]) + 1000 * layer
        o = logical[f"{p}.o_proj.weight"]
        o[0, :] = 400 + torch.arange(o.shape[1]) + 1000 * layer
    return logical


def test_megatron_qkv_interleaving_gqa():
    # hidden 4, heads 4 -> hd 1; kv 2 -> r 2: group g = q heads 2g, 2g+1, k g, v g
    cfg = dict(hidden=4, heads=4, kv_heads=2, ffn=4, vocab=3, layers=2)
    logical = _marked_llama(cfg)
    rows = {}
    cols = {}
    for t in range(2):
        loc = megatron_gpt_local(logical, cfg, {"tp": 2, "pp": 2}, {"tp": t, "pp": 1})
        rows[t] = loc["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
        cols[t] = loc["decoder.layers.0.self_attention.linear_proj.weight"][0, :].tolist()
    # pp stage 1, local layer 0 == global layer 1 (+1000)
    assert rows[0] == [1100, 1101, 1200, 1300]
    assert rows[1] == [1102, 1103, 1201, 1301]
    assert cols[0] == [1400, 1401]
    assert cols[1] == [1402, 1403]
    loc = megatron_gpt_local(logical, cfg, {}, {})
    assert loc["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [
        100, 101, 200, 300, 102, 103, 201, 301,
    ]  # fmt: skip


def test_megatron_qkv_uneven_groups():
    # hidden 12, heads 6 -> hd 2; kv 3 -> r 2; tp 2 -> groups (0, 1) | (2,); tp 4 -> 1,1,1,0
    cfg = dict(hidden=12, heads=6, kv_heads=3, ffn=4, vocab=3, layers=1)
    logical = _marked_llama(cfg)
    qkv = [
        megatron_gpt_local(logical, cfg, {"tp": 2}, {"tp": t})[
            "decoder.layers.0.self_attention.linear_qkv.weight"
        ][:, 0].tolist()
        for t in range(2)
    ]
    assert qkv[0] == [100, 101, 102, 103, 200, 201, 300, 301,
                      104, 105, 106, 107, 202, 203, 302, 303]  # fmt: skip
    assert qkv[1] == [108, 109, 110, 111, 204, 205, 304, 305]
    loc3 = megatron_gpt_local(logical, cfg, {"tp": 4}, {"tp": 3})
    assert loc3["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (0, 12)
    assert loc3["decoder.layers.0.self_attention.linear_proj.weight"].shape == (12, 0)
    loc2 = megatron_gpt_local(logical, cfg, {"tp": 4}, {"tp": 2})
    assert loc2["decoder.layers.0.self_attention.linear_proj.weight"][0].tolist() == [
        408, 409, 410, 411,
    ]  # fmt: skip


def test_megatron_vocab_padding_and_fc1():
    cfg = dict(hidden=2, heads=1, kv_heads=1, ffn=3, vocab=10, layers=1, vocab_divisor=4)
    logical = unique_logical(FAMILIES["megatron_gpt"][0](cfg))
    assert megatron_padded_vocab(cfg, 2) == 16
    assert megatron_padded_vocab(dict(cfg, vocab_divisor=128), 2) == 256
    assert megatron_padded_vocab(dict(vocab=256), 2) == 256
    assert megatron_padded_vocab(dict(vocab=257), 1) == 384
    loc1 = megatron_gpt_local(logical, cfg, {"tp": 2}, {"tp": 1})
    emb = loc1["embedding.word_embeddings.weight"]
    assert emb.shape == (8, 2)
    assert torch.equal(emb[:2], logical["model.embed_tokens.weight"][8:])
    assert torch.all(emb[2:] == 0)
    # ffn 3 over tp 2 -> gate rows 2 | 1, fc1 = [gate part; up part]
    g, u = (
        logical["model.layers.0.mlp.gate_proj.weight"],
        logical["model.layers.0.mlp.up_proj.weight"],
    )
    loc0 = megatron_gpt_local(logical, cfg, {"tp": 2}, {"tp": 0})
    assert torch.equal(loc0["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([g[:2], u[:2]]))
    assert torch.equal(loc1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([g[2:], u[2:]]))


# ---------------------------------------------------------------------------------------------
# hf_llama
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hf_llama"], ids=_ids)
def test_hf_llama_reassemble(case):
    _, cfg, sizes = case
    tp = _n(sizes, "tp")
    shapes = FAMILIES["hf_llama"][0](cfg)
    assert ("lm_head.weight" in shapes) == (not cfg.get("tied"))
    logical = unique_logical(shapes)
    locs = all_locals("hf_llama", cfg, sizes, logical)
    for t in range(tp):
        assert set(locs[(t,)]) == set(shapes) | {"lm_head.weight"}
    for name, full in logical.items():
        parts = [locs[(t,)][name] for t in range(tp)]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) or name.endswith(
            ("gate_proj.weight", "up_proj.weight", "lm_head.weight")
        ):
            assert torch.equal(torch.cat(parts, 0), full), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), full), name
        else:
            assert all(torch.equal(p, full) for p in parts), name
    if cfg.get("tied"):
        head = torch.cat([locs[(t,)]["lm_head.weight"] for t in range(tp)], 0)
        assert torch.equal(head, logical["model.embed_tokens.weight"])


def test_hf_llama_shapes():
    cfg = dict(HF_CFG, tied=True)  # vocab 10, kv rows 4, ffn 12
    logical = unique_logical(FAMILIES["hf_llama"][0](cfg))
    loc = [hf_llama_local(logical, cfg, {"tp": 3}, {"tp": t}) for t in range(3)]
    assert [x["model.layers.0.self_attn.k_proj.weight"].shape[0] for x in loc] == [2, 2, 0]
    assert [x["lm_head.weight"].shape for x in loc] == [(4, 8), (4, 8), (2, 8)]
    assert [x["model.layers.1.mlp.down_proj.weight"].shape for x in loc] == [(8, 4)] * 3
    assert all(x["model.embed_tokens.weight"].shape == (10, 8) for x in loc)


# ---------------------------------------------------------------------------------------------
# deepspeed_zero
# ---------------------------------------------------------------------------------------------

DS_TP_DIM = {"embed.weight": 0, "attn.weight": 0, "attn.bias": 0, "mlp.weight": 1}
DS_LOCAL = (("fp32_flat_groups.0", ""), ("exp_avg.0", ".exp_avg"), ("exp_avg_sq.0", ".exp_avg_sq"))


def _ds_tp_dim(name):
    for suffix, d in DS_TP_DIM.items():
        if name.endswith(suffix):
            return d
    return None


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "deepspeed_zero"], ids=_ids)
def test_deepspeed_reassemble(case):
    _, cfg, sizes = case
    pp, dp, tp = _n(sizes, "pp"), _n(sizes, "dp"), _n(sizes, "tp")
    lps = cfg["layers"] // pp
    align = cfg.get("align", 1)
    logical = unique_logical(deepspeed_zero_logical_shapes(cfg), torch.float32)
    locs = all_locals("deepspeed_zero", cfg, sizes, logical)
    for s in range(pp):
        order = ["embed.weight"] if s == 0 else []
        for layer in range(s * lps, (s + 1) * lps):
            order += [f"layers.{layer}.{x}" for x in ("attn.weight", "attn.bias", "mlp.weight")]
            order += [f"layers.{layer}.norm.weight"]
        order += ["final_norm.weight"] if s == pp - 1 else []
        for t in range(tp):
            for lname, suffix in DS_LOCAL:
                parts = [locs[(s, d, t)][lname] for d in range(dp)]
                assert len({p.numel() for p in parts}) == 1
                buf = torch.cat(parts)
                assert buf.numel() % (2 * dp) == 0
                covered = torch.zeros(buf.numel(), dtype=torch.bool)
                off = 0
                for name in order:
                    full = logical[name + suffix]
                    dim = _ds_tp_dim(name)
                    x = full if dim is None else torch.chunk(full, tp, dim)
                    if dim is not None:
                        x = x[t] if t < len(x) else full.narrow(dim, 0, 0)
                    off = -(-off // align) * align
                    got = buf[off : off + x.numel()]
                    assert torch.equal(got, x.reshape(-1)), (name, suffix)
                    covered[off : off + x.numel()] = True
                    off += x.numel()
                assert buf.numel() - off < 2 * dp  # only the minimal tail padding
                assert torch.all(buf[~covered] == 0)


def test_deepspeed_hand_example_dp3():
    # hidden 2, ffn 3, vocab 3, 1 layer: embed 6, attn.w 4, attn.b 2, mlp 6, norm 2, final 2
    cfg = dict(hidden=2, ffn=3, vocab=3, layers=1)
    logical = unique_logical(deepspeed_zero_logical_shapes(cfg), torch.float32)
    e = logical["embed.weight"].reshape(-1).tolist()
    w = logical["layers.0.attn.weight"].reshape(-1).tolist()
    b = logical["layers.0.attn.bias"].tolist()
    m = logical["layers.0.mlp.weight"].reshape(-1).tolist()
    n = logical["layers.0.norm.weight"].tolist()
    f = logical["final_norm.weight"].tolist()
    # 22 elements, padded to a multiple of 2*3 -> 24, 8 per rank
    got = [
        deepspeed_zero_local(logical, cfg, {"dp": 3}, {"dp": d})["fp32_flat_groups.0"]
        for d in range(3)
    ]
    assert got[0].tolist() == e + w[:2]
    assert got[1].tolist() == w[2:] + b + m[:4]
    assert got[2].tolist() == m[4:] + n + f + [0, 0]
    ea = logical["embed.weight.exp_avg"].reshape(-1).tolist()
    assert deepspeed_zero_local(logical, cfg, {"dp": 3}, {"dp": 0})["exp_avg.0"].tolist()[:6] == ea
    # align 4: embed@0, w@8, b@12, m@16, n@24, f@28 -> 30 (already a multiple of 6), 10 per rank
    cfg4 = dict(cfg, align=4)
    got = [
        deepspeed_zero_local(logical, cfg4, {"dp": 3}, {"dp": d})["fp32_flat_groups.0"]
        for d in range(3)
    ]
    assert torch.cat(got).tolist() == e + [0, 0] + w + b + [0, 0] + m + [0, 0] + n + [0, 0] + f
    # tp 2: embed rows 2|1, attn.w row 1|1, bias 1|1, mlp [2,3] columns 2|1 (C-order flatten)
    mm = logical["layers.0.mlp.weight"]
    loc = deepspeed_zero_local(logical, cfg, {"tp": 2}, {"tp": 0})["fp32_flat_groups.0"]
    want = e[:4] + w[:2] + b[:1] + mm[:, :2].reshape(-1).tolist() + n + f
    assert loc.tolist() == want + [0] * (len(loc) - len(want))
    assert len(loc) == 16  # 15 -> multiple of 2
    loc = deepspeed_zero_local(logical, cfg, {"tp": 2}, {"tp": 1})["fp32_flat_groups.0"]
    want = e[4:] + w[2:] + b[1:] + mm[:, 2:].reshape(-1).tolist() + n + f
    assert loc.tolist() == want + [0]  # 11 -> 12


def test_deepspeed_stages():
    cfg = dict(DS_CFG, layers=2)
    logical = unique_logical(deepspeed_zero_logical_shapes(cfg), torch.float32)
    s1 = deepspeed_zero_local(logical, cfg, {"pp": 2}, {"pp": 1})["fp32_flat_groups.0"]
    # stage 1: layer 1 (16 + 4 + 24 + 4) + final_norm 4 = 52
    assert s1.numel() == 52
    assert torch.equal(s1[:16], logical["layers.1.attn.weight"].reshape(-1))
    assert torch.equal(s1[-4:], logical["final_norm.weight"])


# ---------------------------------------------------------------------------------------------
# moe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "moe"], ids=_ids)
def test_moe_reassemble(case):
    _, cfg, sizes = case
    pp, ep, tp = _n(sizes, "pp"), _n(sizes, "ep"), _n(sizes, "tp")
    lps, epr = cfg["layers"] // pp, cfg["experts"] // ep
    logical = unique_logical(FAMILIES["moe"][0](cfg))
    locs = all_locals("moe", cfg, sizes, logical)
    for key, loc in locs.items():
        assert len(loc) == lps * (1 + 2 * epr), key
    for layer in range(cfg["layers"]):
        s, i = divmod(layer, lps)
        for c in range(ep):
            for t in range(tp):
                got = locs[(s, c, t)][f"layers.{i}.moe.router.weight"]
                assert torch.equal(got, logical[f"layers.{layer}.router.weight"])
        for gexp in range(cfg["experts"]):
            c, e = divmod(gexp, epr)
            p = f"layers.{i}.moe.experts.{e}"
            w1 = torch.cat([locs[(s, c, t)][f"{p}.w1.weight"] for t in range(tp)], 0)
            w2 = torch.cat([locs[(s, c, t)][f"{p}.w2.weight"] for t in range(tp)], 1)
            assert torch.equal(w1, logical[f"layers.{layer}.experts.{gexp}.w1.weight"])
            assert torch.equal(w2, logical[f"layers.{layer}.experts.{gexp}.w2.weight"])


def test_moe_local_numbering():
    cfg = MOE_CFG  # 4 experts, ffn 6
    logical = unique_logical(FAMILIES["moe"][0](cfg))
    loc = moe_local(logical, cfg, {"pp": 2, "ep": 2, "tp": 4}, {"pp": 1, "ep": 1, "tp": 3})
    assert set(loc) == {
        "layers.0.moe.router.weight",
        "layers.0.moe.experts.0.w1.weight",
        "layers.0.moe.experts.0.w2.weight",
        "layers.0.moe.experts.1.w1.weight",
        "layers.0.moe.experts.1.w2.weight",
    }
    # local expert 1 on ep 1 is global expert 3 of global layer 1; ffn 6 over tp 4 -> 2,2,2,0
    assert loc["layers.0.moe.experts.1.w1.weight"].shape == (0, 4)
    assert loc["layers.0.moe.experts.1.w2.weight"].shape == (4, 0)
    loc = moe_local(logical, cfg, {"pp": 2, "ep": 2, "tp": 4}, {"pp": 1, "ep": 1, "tp": 0})
    w1 = logical["layers.1.experts.3.w1.weight"]
    assert torch.equal(loc["layers.0.moe.experts.1.w1.weight"], w1[:2])
