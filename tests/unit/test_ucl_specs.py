"""Every shipped spec, checked against the independent plain-torch reference (tests/ucl_ref).

For each spec: random logical tensors; every rank's local tensors under layout A built by the
reference; saved with the spec from those local tensors; loaded under other layouts (changing
tp, pp, dp/zero and ep together) into zeroed local tensors; bit-exact against the reference's
local tensors for that layout. Also: the logical view (anyshard.open) equals the logical tensors.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import anyshard
from anyshard import ucl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucl_ref.reference import FAMILIES, all_coords  # noqa: E402

ORDERS = {
    "gpt": ("pp", "dp", "tp"),
    "megatron_gpt": ("pp", "dp", "tp"),
    "hf_llama": ("tp",),
    "deepspeed_zero": ("pp", "dp", "tp"),
    "moe": ("pp", "ep", "tp"),
}

CFG = {
    "gpt": dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=4),
    # uneven GQA: 3 query groups over tp=2; vocab padding changes with tp
    "megatron_gpt": dict(
        hidden=12, heads=6, kv_heads=3, ffn=10, vocab=7, layers=4, vocab_divisor=4
    ),
    "hf_llama": dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=2),
    "hf_llama_tied": dict(hidden=8, heads=4, kv_heads=2, ffn=12, vocab=10, layers=2, tied=1),
    "deepspeed_zero": dict(hidden=4, ffn=6, vocab=5, layers=4),
    "deepspeed_zero_aligned": dict(hidden=4, ffn=6, vocab=5, layers=4, align=4),
    "moe": dict(hidden=4, ffn=6, layers=4, experts=4),
}

# (saved layout, loaded layouts): tp, pp, dp/zero and ep change together
LAYOUTS = {
    "gpt": (
        {"pp": 2, "dp": 2, "tp": 2},
        [{"tp": 4}, {"pp": 4, "dp": 1, "tp": 1}, {"dp": 3, "tp": 2}, {}],
    ),
    "megatron_gpt": (
        {"pp": 2, "dp": 2, "tp": 2},
        [{"tp": 3}, {"pp": 4, "tp": 1}, {"pp": 1, "dp": 3, "tp": 2}, {"tp": 4}],
    ),
    "hf_llama": ({"tp": 2}, [{"tp": 1}, {"tp": 3}, {"tp": 4}]),
    "deepspeed_zero": (
        {"pp": 2, "dp": 3, "tp": 2},
        [{"pp": 1, "dp": 2, "tp": 1}, {"pp": 4, "dp": 1, "tp": 2}, {"pp": 2, "dp": 4, "tp": 3}],
    ),
    "moe": (
        {"pp": 2, "ep": 2, "tp": 2},
        [{"ep": 1}, {"ep": 4, "pp": 1}, {"pp": 4, "ep": 2, "tp": 3}],
    ),
}

CASES = [
    ("gpt", "gpt"),
    ("megatron_gpt", "megatron_gpt"),
    ("hf_llama", "hf_llama"),
    ("hf_llama", "hf_llama_tied"),
    ("deepspeed_zero", "deepspeed_zero"),
    ("deepspeed_zero", "deepspeed_zero_aligned"),
    ("moe", "moe"),
]


def _logical(family: str, cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    shapes_fn, _ = FAMILIES[family]
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in sorted(shapes_fn(cfg).items())}


def _sizes(family: str, layout: dict) -> dict[str, int]:
    return {d: layout.get(d, 1) for d in ORDERS[family]}


def _locals(family, logical, cfg, layout):
    _, local_fn = FAMILIES[family]
    sizes = _sizes(family, layout)
    return [local_fn(logical, cfg, sizes, c) for c in all_coords(sizes, ORDERS[family])]


def _params(cfg: dict, family: str) -> dict:
    spec = ucl.load_spec(family)
    names = {p.name for p in spec.params}
    return {k: v for k, v in cfg.items() if k in names}


@pytest.mark.parametrize("family,cfg_name", CASES)
def test_shipped_spec_reshards_bit_exact(tmp_path, family, cfg_name):
    cfg = CFG[cfg_name]
    logical = _logical(family, cfg)
    saved, targets = LAYOUTS[family]
    params = _params(cfg, family)
    states = dict(enumerate(_locals(family, logical, cfg, saved)))
    path = str(tmp_path / "ckpt")
    ucl.save_local_states(path, states, spec=family, layout={**_sizes(family, saved), **params})

    view = anyshard.open(path)
    assert sorted(view.keys()) == sorted(logical)
    for name, t in logical.items():
        assert torch.equal(view.get_tensor(name), t), name

    for target in targets:
        sizes = _sizes(family, target)
        expected = _locals(family, logical, cfg, target)
        for coords, want in zip(all_coords(sizes, ORDERS[family]), expected, strict=True):
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            anyshard.load(path, got, spec=family, layout={**sizes, **params}, coords=coords)
            for k in want:
                assert torch.equal(got[k], want[k]), (target, coords, k)
