"""The layouts of a job, ranked by the cost model: every way to lay ``gpus`` out in tp, cp, pp,
ep and data-parallel dims (`dim_candidates`), each with the options a user left out chosen
(`best_options`: the micro-batch, virtual stages, recomputation, sequence parallelism and ZeRO-1,
the fastest that fits in memory), ``search`` sorting the lot.

Options the user states are pinned: a pinned value is never changed, and a layout that cannot
hold it is not a candidate.

    >>> from anyshard.trainer_integration.planning.hardware import load_hardware
    >>> from anyshard.trainer_integration.planning.model_shape import ModelShape
    >>> gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24,
    ...                  ffn=4 * 2304, vocab=51200, gated_mlp=False)
    >>> best = search(gpt, load_hardware("a100-80gb"), Batch(512, 2048), 32, {"tp": 1, "pp": 1})
    >>> best[0].layout.tp, best[0].layout.pp, best[0].layout.dp
    (1, 1, 32)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from anyshard.trainer_integration.planning.hardware import Hardware
from anyshard.trainer_integration.planning.model_shape import ModelShape
from anyshard.trainer_integration.planning.transformer_cost import (
    RECOMPUTE,
    Batch,
    Estimate,
    Layout,
    Params,
    estimate,
    layout_problems,
)

__all__ = ["MICRO_BATCHES", "VPPS", "best_options", "dim_candidates", "search"]

MICRO_BATCHES = (1, 2, 4, 8)
VPPS = (1, 2, 3, 4, 6, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _choices(name: str, pins: Mapping[str, Any], default: list) -> list:
    return [pins[name]] if name in pins else default


def dim_candidates(
    shape: ModelShape, hw: Hardware, batch: Batch, gpus: int, pins: Mapping[str, Any]
) -> Iterator[dict[str, int]]:
    """Every (tp, cp, pp, ep, dp_shard, dp_replicate) of ``gpus`` the pins allow: tp a power
    of two within a node, cp a power of two up to 32, pp any that divides, the data-parallel
    ranks as replicas (ZeRO-1 or not), as FSDP, or as FSDP over a power of two of them."""
    tps = _choices("tp", pins, _powers_of_two(min(hw.devices_per_node, shape.num_heads)))
    cps = _choices("cp", pins, [c for c in _powers_of_two(32) if batch.seq % (2 * c) == 0])
    for tp in tps:
        for cp in cps:
            if gpus % (tp * cp):
                continue
            rest = gpus // (tp * cp)
            pps = _choices("pp", pins, [p for p in _divisors(rest) if p <= shape.num_layers])
            for pp in pps:
                if rest % pp:
                    continue
                dp = rest // pp
                if batch.global_batch % dp:
                    continue
                yield from _dp_splits(shape, dp, cp, pins, dict(tp=tp, cp=cp, pp=pp))


def _dp_splits(shape, dp, cp, pins, dims) -> Iterator[dict[str, int]]:
    """The ways to split ``dp`` into dp_shard x dp_replicate, and the expert-parallel sizes."""
    if "dp_shard" in pins or "dp_replicate" in pins:
        shard = pins.get("dp_shard", dp // pins.get("dp_replicate", 1))
        splits = [shard] if shard >= 1 and dp % shard == 0 else []
    else:
        splits = sorted({1, dp, *(s for s in _powers_of_two(dp) if dp % s == 0 and s >= 8)})
    if shape.num_experts:
        eps = [e for e in _powers_of_two(shape.num_experts) if shape.num_experts % e == 0]
        eps = _choices("ep", pins, [e for e in eps if (cp * dp) % e == 0])
    else:
        eps = _choices("ep", pins, [1])
    for shard in splits:
        rep = dp // shard
        if "dp_replicate" in pins and pins["dp_replicate"] != rep:
            continue
        for ep in eps:
            yield dict(dims, dp_shard=shard, dp_replicate=rep, ep=ep)


def best_options(
    shape: ModelShape,
    hw: Hardware,
    batch: Batch,
    dims: Mapping[str, int],
    pins: Mapping[str, Any],
    params: Params | None = None,
    *,
    flash_attention: bool = True,
    require_fit: bool = True,
) -> Estimate | None:
    """The fastest `Estimate` of ``dims`` over the options not pinned, among those that fit in
    memory (None when none fits or the pins cannot hold). Unpinned, sequence parallelism is on
    where tp > 1 and ZeRO-1 on where weights are replicated, not sharded (neither is ever
    slower in the model, both save memory); recomputation is the least that fits. Without
    ``require_fit``, where none fits: the one that needs the least memory (``fits`` False)."""
    tp, pp, dp = dims["tp"], dims["pp"], dims["dp_shard"] * dims["dp_replicate"]
    per_dp = batch.global_batch // dp
    mbs = _choices("micro_batch", pins, [b for b in MICRO_BATCHES if per_dp % b == 0])
    vpps = _choices("vpp", pins, [v for v in VPPS if pp > 1 or v == 1])
    sp = pins.get("sequence_parallel", tp > 1)
    zero = pins.get("zero", 1 if dims["dp_replicate"] > 1 and dims["dp_shard"] == 1 else 0)
    recomputes = _choices("recompute", pins, list(RECOMPUTE))
    best: Estimate | None = None
    leanest: Estimate | None = None
    for mb in mbs:
        for vpp in vpps:
            if pp * vpp > shape.num_layers:
                continue
            for rc in recomputes:
                lay = Layout(
                    **dims, vpp=vpp, zero=zero, micro_batch=mb, recompute=rc,
                    sequence_parallel=sp,
                )  # fmt: skip
                if layout_problems(shape, batch, lay, lay.gpus):
                    break
                e = estimate(shape, hw, batch, lay, params, flash_attention=flash_attention)
                if e.fits:
                    if best is None or e.step_s < best.step_s:
                        best = e
                    break  # more recomputation is only slower
                if leanest is None or e.memory_bytes < leanest.memory_bytes:
                    leanest = e
    return best if best is not None or require_fit else leanest


def search(
    shape: ModelShape,
    hw: Hardware,
    batch: Batch,
    gpus: int,
    pins: Mapping[str, Any],
    params: Params | None = None,
    *,
    top: int | None = None,
    flash_attention: bool = True,
    require_fit: bool = True,
) -> list[Estimate]:
    """Every layout of ``gpus`` that the pins allow and that fits, fastest first (the first
    ``top``). Raises ValueError, saying why, where none does. Without ``require_fit``, where
    none fits: each layout at the options that need the least memory, the leanest first, each
    with ``fits`` False (a layout the user pinned, predicted though the model says it does not
    fit)."""
    found: list[Estimate] = []
    over: list[Estimate] = []
    tried = 0
    for dims in dim_candidates(shape, hw, batch, gpus, pins):
        tried += 1
        e = best_options(shape, hw, batch, dims, pins, params, flash_attention=flash_attention,
                         require_fit=require_fit)  # fmt: skip
        if e is not None:
            (found if e.fits else over).append(e)
    if not found and over:
        over.sort(key=lambda e: e.memory_bytes)
        return over[:top] if top else over
    if not found:
        pinned = ", ".join(f"{k}={v}" for k, v in pins.items()) or "nothing pinned"
        raise ValueError(
            f"no layout of {gpus} GPUs runs this model at global batch {batch.global_batch} "
            f"x {batch.seq} tokens within {hw.memory_bytes / 1e9:.0f} GB per GPU "
            f"({tried} dim choices tried; {pinned}): add GPUs, pin fewer dims, or lower the "
            "micro-batch"
        )
    found.sort(key=lambda e: e.step_s)
    return found[:top] if top else found
