"""The step time and memory per GPU of a transformer (dense or MoE) trained under a layout on a
cluster: ``estimate(shape, hardware, batch, layout)``.

What one GPU of the slowest pipeline stage does in a step is counted from the model's shape and
the layout (`Layout`): each matrix multiply with its own shape, attention, the element-wise
passes, the optimizer step, and every collective of every mesh dim with the links it crosses
(`topology.placement`: the mesh is laid out tp, cp, dp_shard, dp_replicate, pp, innermost
first; ep borrows from cp x dp_shard). Each is priced on the `Hardware`:

- a multiply takes its FLOPs at ``gemm_efficiency`` of the device's peak plus its bytes at
  ``hbm_efficiency`` of its memory bandwidth, plus ``kernel_s`` per kernel: a small or thin
  multiply runs below peak because of its shape, not a per-model constant;
- attention runs at ``attention_efficiency`` of peak (a fused kernel) or, unfused, as batched
  multiplies and a softmax streamed through memory;
- a collective at ``network_efficiency`` of its links' bandwidth (`topology.collective_s`);
- communication the schedule can hide (FSDP's gathers, pipeline sends, context-parallel ring
  passes, tensor-parallel with sequence parallelism, the data-parallel reduction behind the
  last backward) is hidden up to ``overlap`` of it and never beyond the compute beside it.

The pipeline runs ``m`` micro-batches per step: ``(m + (pp - 1) / vpp)`` micro-batch times of
the slowest stage (the one with the output layer), then what the step does once. Memory follows
Korthikanti et al. 2022 (activations per layer, by recomputation and sequence parallelism), the
first stage holding its pipeline's in-flight micro-batches.

A step also pays ``step_overhead_s`` once. The fitted numbers (`Params`, seven; at most eight)
live in ``cost_params.json`` beside this module, written by ``tools/fit_cost_model.py`` from
the two published tables it names (docs/planning.md).

    >>> from anyshard.trainer_integration.planning.hardware import load_hardware
    >>> from anyshard.trainer_integration.planning.model_shape import ModelShape
    >>> gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24,
    ...                  ffn=4 * 2304, vocab=51200, gated_mlp=False)
    >>> e = estimate(gpt, load_hardware("a100-80gb"), Batch(512, 2048),
    ...              Layout(dp_replicate=32, micro_batch=4))
    >>> e.fits, 0.2 < e.mfu < 0.7, sorted(e.breakdown)[:3]
    (True, True, ['bubble', 'compute', 'dp_replicate'])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from anyshard.trainer_integration.planning.hardware import Hardware
from anyshard.trainer_integration.planning.model_shape import ModelShape, model_flops_per_token
from anyshard.trainer_integration.planning.topology import Links, Span, collective_s, span_at

__all__ = [
    "RECOMPUTE",
    "Batch",
    "Estimate",
    "Layout",
    "Params",
    "estimate",
    "load_params",
]

RECOMPUTE = ("none", "selective", "full")
PARAMS_FILE = os.path.join(os.path.dirname(__file__), "cost_params.json")
RESERVED_BYTES = 4e9  # per device: CUDA context, NCCL buffers, allocator fragmentation (assumed)
BF16, FP32 = 2, 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How a job is laid out: mesh dims, ZeRO-1 (``zero=1``: the optimizer sharded over the
    data-parallel ranks of replicated weights), the micro-batch (sequences), virtual pipeline
    stages, activation recomputation and sequence parallelism."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False

    DIMS = ("tp", "pp", "vpp", "cp", "ep", "dp_shard", "dp_replicate", "zero")

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def name(self) -> str:
        """A short name: the dims above 1 and the options."""
        dims = [f"{d}={getattr(self, d)}" for d in self.DIMS if getattr(self, d) > 1]
        if self.zero:
            dims.append("zero=1")
        sp = ",sp" if self.sequence_parallel else ""
        return f"{','.join(dims) or 'single'} mb={self.micro_batch},rc={self.recompute}{sp}"

    @classmethod
    def parse(cls, text: str) -> dict[str, int]:
        """The dims of ``tp=8,pp=16,vpp=2,dp_shard=64`` (checked, not yet a layout).

        >>> Layout.parse("tp=8,pp=2")
        {'tp': 8, 'pp': 2}
        >>> Layout.parse("tp=8,dp=2")
        Traceback (most recent call last):
        ...
        ValueError: --layout: unknown dim 'dp' in 'dp=2' (known: tp, pp, vpp, cp, ep, dp_shard, dp_replicate, zero)
        """
        out: dict[str, int] = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, eq, value = item.partition("=")
            if key not in cls.DIMS:
                known = ", ".join(cls.DIMS)
                raise ValueError(f"--layout: unknown dim {key!r} in {item!r} (known: {known})")
            if not eq or not value.isdigit() or (int(value) < 1 and key != "zero"):
                raise ValueError(f"--layout: {item!r} (expected {key}=N with N >= 1)")
            if key == "zero" and int(value) > 1:
                raise ValueError(f"--layout: {item!r} (zero is 0 or 1)")
            out[key] = int(value)
        return out


@dataclass(frozen=True, slots=True)
class Batch:
    """A step's batch: ``global_batch`` sequences of ``seq`` tokens."""

    global_batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq


@dataclass(frozen=True, slots=True, kw_only=True)
class Params:
    """The fitted numbers (see ``cost_params.json`` and ``tools/fit_cost_model.py``)."""

    gemm_efficiency: float  # of peak FLOP/s, for a multiply large enough to be compute-bound
    attention_efficiency: float  # of peak FLOP/s, a fused (flash) attention kernel
    hbm_efficiency: float  # of memory bandwidth, element-wise passes and thin multiplies
    network_efficiency: float  # of a link's bandwidth, collectives and sends
    overlap: float  # of the communication the schedule can hide, the share hidden
    kernel_s: float  # fixed cost of one kernel (launch, tail), seconds
    step_overhead_s: float  # fixed cost of a step (data, loss and norm reductions, host work)

    FIELDS = (
        "gemm_efficiency",
        "attention_efficiency",
        "hbm_efficiency",
        "network_efficiency",
        "overlap",
        "kernel_s",
        "step_overhead_s",
    )

    def vector(self) -> list[float]:
        return [getattr(self, f) for f in self.FIELDS]

    @classmethod
    def of(cls, values: list[float]) -> Params:
        return cls(**dict(zip(cls.FIELDS, values, strict=True)))


@lru_cache(maxsize=4)
def load_params(path: str = PARAMS_FILE) -> Params:
    """The fitted parameters in ``path`` (default: the committed ``cost_params.json``)."""
    with open(path) as f:
        data = json.load(f)
    return Params(**{k: float(data["params"][k]["value"]) for k in Params.FIELDS})


@dataclass(frozen=True, slots=True)
class Estimate:
    """A layout's predicted step: ``breakdown`` splits ``step_s`` into compute (with what
    recomputation adds), the pipeline bubble, the optimizer step and, per mesh dim, the
    communication left exposed (``<dim>``) and the part hidden behind compute
    (``<dim>_overlapped``, not in the step)."""

    layout: Layout
    step_s: float
    memory_bytes: float
    budget_bytes: float
    breakdown: dict[str, float]
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    microbatches: int
    state_bytes: float  # what a checkpoint saves of this GPU's replica: fp32 weights and Adam

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_json(),
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "memory_gib_per_gpu": self.memory_bytes / 2**30,
            "fits": self.fits,
            "microbatches": self.microbatches,
            "state_gib_per_gpu": self.state_bytes / 2**30,
            "breakdown": dict(self.breakdown),
        }


def layout_problems(shape: ModelShape, batch: Batch, lay: Layout, gpus: int) -> list[str]:
    """Why ``lay`` cannot run ``shape`` at ``batch`` on ``gpus`` (empty when it can)."""
    p = []
    if lay.gpus != gpus:
        p.append(f"tp x pp x cp x dp_shard x dp_replicate = {lay.gpus}, not {gpus} GPUs")
    if shape.num_heads % lay.tp or (shape.num_kv_heads % lay.tp and lay.tp % shape.num_kv_heads):
        p.append(f"tp={lay.tp} does not divide the {shape.num_heads} attention heads")
    if lay.pp * lay.vpp > shape.num_layers:
        p.append(f"pp x vpp = {lay.pp * lay.vpp} stages for {shape.num_layers} layers")
    if batch.seq % (2 * lay.cp) and lay.cp > 1:
        p.append(f"cp={lay.cp}: sequence {batch.seq} does not split into 2 x cp chunks")
    per_dp = batch.global_batch / lay.dp
    if per_dp != int(per_dp) or int(per_dp) % lay.micro_batch:
        p.append(
            f"global batch {batch.global_batch} is not micro-batch {lay.micro_batch} x "
            f"dp {lay.dp} x a whole number of micro-batches"
        )
    if shape.num_experts:
        if shape.num_experts % lay.ep or (lay.cp * lay.dp_shard * lay.dp_replicate) % lay.ep:
            p.append(f"ep={lay.ep} must divide the experts and cp x dp")
    elif lay.ep > 1:
        p.append("ep > 1 on a dense model")
    if lay.recompute not in RECOMPUTE:
        p.append(f"recompute={lay.recompute!r} (expected one of {', '.join(RECOMPUTE)})")
    if lay.vpp > 1 and lay.pp == 1:
        p.append("vpp > 1 needs pp > 1")
    if lay.zero and lay.dp_replicate == 1:
        p.append("zero=1 shards the optimizer over dp_replicate, which is 1")
    if lay.zero and lay.dp_shard > 1:
        p.append("zero=1 with dp_shard > 1: FSDP shards the optimizer already")
    return p


class _Pricer:
    """Seconds of kernels and collectives on one `Hardware` with `Params`."""

    def __init__(self, hw: Hardware, k: Params) -> None:
        self.flops = hw.peak_flops * k.gemm_efficiency
        self.attn_flops = hw.peak_flops * k.attention_efficiency
        self.hbm = hw.hbm_bytes_per_s * k.hbm_efficiency
        self.kernel_s = k.kernel_s
        e = k.network_efficiency
        self.links = Links(
            hw.intra_node_bytes_per_s * e,
            hw.inter_node_bytes_per_s * e,
            hw.intra_node_latency_s,
            hw.inter_node_latency_s,
            pod_nodes=hw.pod_nodes,
            oversubscription=hw.oversubscription,
        )
        self.dpn = hw.devices_per_node

    def gemm(self, m: float, k: float, n: float, count: float = 1.0) -> float:
        """``count`` multiplies of (m x k) by (k x n) in bf16."""
        t = 2 * m * k * n / self.flops + BF16 * (m * k + k * n + m * n) / self.hbm
        return count * (t + self.kernel_s)

    def stream(self, nbytes: float, kernels: float) -> float:
        return nbytes / self.hbm + kernels * self.kernel_s

    def coll(self, kind: str, span: Span, nbytes: float) -> float:
        return collective_s(kind, span, nbytes, self.links)


def _stage_layers(shape: ModelShape, lay: Layout) -> int:
    """Layers on the busiest pipeline stage (stages as even as the layers allow)."""
    return math.ceil(shape.num_layers / (lay.pp * lay.vpp)) * lay.vpp


def _params_per_gpu(shape: ModelShape, lay: Layout) -> tuple[float, float, float]:
    """(dense, expert) weights of one layer on one GPU, and the embedding or output layer's."""
    h = shape.hidden
    attn = h * (2 * shape.q_dim + 2 * shape.kv_dim) / lay.tp
    mats = 3 if shape.gated_mlp else 2
    if shape.num_experts:
        dense = attn + mats * h * shape.moe_ffn * shape.num_shared_experts / lay.tp
        dense += h * shape.num_experts
        expert = mats * h * shape.moe_ffn * shape.num_experts / (lay.ep * lay.tp)
    else:
        dense, expert = attn + mats * h * shape.ffn / lay.tp, 0.0
    # the busiest stage holds the embedding or the output layer; a single stage both, unless tied
    tables = 2 if lay.pp == 1 and not shape.tied_embeddings else 1
    return dense + 2 * h, expert, tables * shape.vocab * h / lay.tp


def _layer_forward_s(shape: ModelShape, lay: Layout, seq: int, pr: _Pricer, flash: bool):
    """One layer's forward on one micro-batch: (matrix multiplies, element-wise, attention)."""
    t, h = lay.tp, shape.hidden
    tokens = lay.micro_batch * seq / lay.cp
    q, kv = shape.q_dim / t, shape.kv_dim / t
    s = pr.gemm(tokens, h, q + 2 * kv) + pr.gemm(tokens, q, h)
    mats = 3 if shape.gated_mlp else 2
    if shape.num_experts:
        local = shape.num_experts / lay.ep
        per_expert = tokens * shape.top_k / local  # tokens each local expert gets (balanced)
        f = shape.moe_ffn / t
        s += pr.gemm(per_expert, h, (mats - 1) * f, local) + pr.gemm(per_expert, f, h, local)
        if shape.num_shared_experts:
            f_sh = f * shape.num_shared_experts
            s += pr.gemm(tokens, h, (mats - 1) * f_sh) + pr.gemm(tokens, f_sh, h)
        s += pr.gemm(tokens, h, shape.num_experts)
        width = f * (shape.top_k + shape.num_shared_experts)
    else:
        f = shape.ffn / t
        s += pr.gemm(tokens, h, (mats - 1) * f) + pr.gemm(tokens, f, h)
        width = f
    # element-wise: norms, residual adds, dropout on h-wide rows (each rank's share under
    # sequence parallelism, all of them without), the activation on the MLP's width
    rows = tokens / t if lay.sequence_parallel else tokens
    elementwise = pr.stream(BF16 * (16 * rows * h + (mats + 1) * tokens * width), 10)
    heads, d = shape.num_heads / t, shape.q_dim / shape.num_heads
    kv_len = seq  # each context-parallel rank attends its queries to the whole sequence
    if flash:
        a = 2 * tokens * kv_len * d * heads  # two multiplies, causal: half of 4 x
        attn = a / pr.attn_flops + pr.kernel_s
    else:
        per_seq = lay.micro_batch * heads
        attn = pr.gemm(seq / lay.cp, d, kv_len, 2 * per_seq)
        attn += pr.stream(9 * (seq / lay.cp) * kv_len * per_seq, 3)
    return s, elementwise, attn


def _comm(shape, batch, lay, pr, layers, dense_p, expert_p, embed_p):
    """Per micro-batch: {dim: (exposed-only seconds, hideable seconds)}; and once per step:
    {dim: (the gradients' reduction, hideable behind a backward pass; the weights' gather of a
    sharded optimizer, hideable behind the next step's first forward pass)}."""
    dpn, h = pr.dpn, shape.hidden
    tokens = lay.micro_batch * batch.seq / lay.cp
    # forward and backward (+ the recomputed forward): tensor parallelism's two all-reduces
    # (or gather and reduce-scatter pairs) and expert parallelism's two all-to-alls each
    passes = {"none": 2, "selective": 2, "full": 3}[lay.recompute]
    per_mb: dict[str, tuple[float, float]] = {}
    if lay.tp > 1:
        sp = lay.sequence_parallel
        t = 2 * passes * layers * pr.coll("all_reduce", span_at(lay.tp, 1, dpn), BF16 * tokens * h)
        per_mb["tp"] = (0.0, t) if sp else (t, 0.0)
    if lay.cp > 1:
        kv = BF16 * 2 * tokens * shape.kv_dim / lay.tp
        span = span_at(2, lay.tp, dpn)
        ring = (passes + 1) * layers * (lay.cp - 1)  # the backward passes keys and values back
        per_mb["cp"] = (0.0, ring * pr.coll("send", span, kv))
    if shape.num_experts and lay.ep > 1:
        msg = BF16 * tokens * shape.top_k * h
        a2a = pr.coll("all_to_all", span_at(lay.ep, lay.tp, dpn), msg)
        per_mb["ep"] = (2 * passes * layers * a2a, 0.0)
    if lay.pp > 1:
        stages = span_at(lay.pp, lay.tp * lay.cp * lay.dp, dpn)
        span = Span(2, 1 if stages.nodes > 1 else 2)  # the slowest hop: across nodes if any is
        act = BF16 * tokens * h / lay.tp  # scatter/gather over the tensor-parallel ranks
        per_mb["pp"] = (0.0, 2 * lay.vpp * pr.coll("send", span, act))
    shard = lay.cp * lay.dp_shard
    once: dict[str, tuple[float, float]] = {}
    weights = layers * (dense_p + expert_p) + embed_p
    if lay.dp_shard > 1:
        span = span_at(shard, lay.tp, dpn)
        gathers = 2 * pr.coll("all_gather", span, BF16 * weights)
        per_mb["dp_shard"] = (0.0, gathers + pr.coll("reduce_scatter", span, FP32 * weights))
        weights /= shard
    if lay.dp_replicate > 1 or (lay.dp_shard == 1 and lay.cp > 1):
        group = lay.dp_replicate * (1 if lay.dp_shard > 1 else lay.cp)
        span = span_at(group, lay.tp * (shard if lay.dp_shard > 1 else 1), dpn)
        if lay.zero:
            once["dp_replicate"] = (
                pr.coll("reduce_scatter", span, FP32 * weights),
                pr.coll("all_gather", span, BF16 * weights),
            )
        else:
            once["dp_replicate"] = (pr.coll("all_reduce", span, FP32 * weights), 0.0)
    return per_mb, once


def _memory(shape, batch, lay, layers, dense_p, expert_p, embed_p, m, flash) -> float:
    """Bytes on the busiest GPU: weights, gradients, optimizer, activations, logits."""
    params = layers * (dense_p + expert_p) + embed_p
    if lay.dp_shard > 1:  # FSDP: fp32 weights, gradients and Adam sharded; two layers gathered
        state = 16 * params / (lay.dp_shard * lay.cp) + 2 * (BF16 + FP32) * (dense_p + expert_p)
    elif lay.zero:  # bf16 weights, fp32 gradients, fp32 master weights and Adam sharded
        state = (BF16 + FP32) * params + 12 * params / (lay.dp_replicate * lay.cp)
    else:
        state = (BF16 + FP32 + 12) * params
    t, h, s = lay.tp, shape.hidden, batch.seq
    tokens = lay.micro_batch * s / lay.cp
    mats = 3 if shape.gated_mlp else 2
    width = (
        shape.moe_ffn * (shape.top_k + shape.num_shared_experts) if shape.num_experts else shape.ffn
    )
    if lay.recompute == "selective":  # the attention core and element-wise ops recomputed:
        # kept are the norms' inputs, q, k, v and the multiplies' outputs of the MLP
        sharded = 2 * shape.q_dim + 4 * shape.kv_dim + 2 * (mats - 1) * width
        replicated = 4 * h
    else:  # Korthikanti et al. 2022, Eq. 2, with the attention and MLP widths of this shape
        sharded = 4 * shape.q_dim + 4 * shape.kv_dim + 2 * mats * width
        replicated = 10 * h
    scores = 0 if flash or lay.recompute != "none" else 5 * shape.num_heads * s
    if lay.sequence_parallel:
        per_token = (replicated + sharded + scores) / t
    else:
        per_token = replicated + (sharded + scores) / t
    in_flight = float(min(m, lay.pp))  # 1F1B: pp micro-batches on the first stage
    if lay.vpp > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    if lay.recompute == "full":  # each layer's input held; one layer's in full while recomputed
        held = BF16 * h / (t if lay.sequence_parallel else 1) * tokens
        act = held * layers * in_flight + tokens * per_token
    else:
        act = tokens * per_token * layers * in_flight
    logits = 6 * tokens * shape.vocab / t  # bf16 logits and fp32 loss inputs, last stage
    return state + act + logits


def estimate(
    shape: ModelShape,
    hw: Hardware,
    batch: Batch,
    lay: Layout,
    params: Params | None = None,
    *,
    flash_attention: bool = True,
) -> Estimate:
    """The step time and memory per GPU of ``shape`` at ``batch`` under ``lay`` on ``hw``
    (``layout_problems`` must be empty; this does not check)."""
    k = params or load_params()
    pr = _Pricer(hw, k)
    layers = _stage_layers(shape, lay)
    dense_p, expert_p, embed_p = _params_per_gpu(shape, lay)
    m = batch.global_batch // (lay.dp * lay.micro_batch)
    gemm_s, elementwise_s, attn_s = _layer_forward_s(shape, lay, batch.seq, pr, flash_attention)
    gemm_s += elementwise_s
    tokens = lay.micro_batch * batch.seq / lay.cp
    head = pr.gemm(tokens, shape.hidden, shape.vocab / lay.tp, 3)
    # the loss in fp32 over the logits: cast, max, exp-sum, softmax and its gradient
    head += pr.stream(24 * tokens * shape.vocab / lay.tp, 6)
    layer = 3 * gemm_s + 3.5 * attn_s  # backward: two multiplies per multiply; attention 2.5
    extra = {"none": 0.0, "selective": attn_s + elementwise_s, "full": gemm_s + attn_s}[
        lay.recompute
    ]
    compute_mb = layers * layer + head
    recompute_mb = layers * extra
    per_mb, once = _comm(shape, batch, lay, pr, layers, dense_p, expert_p, embed_p)
    busy = compute_mb + recompute_mb
    hideable = sum(v[1] for v in per_mb.values())
    hidden = min(k.overlap * hideable, busy)
    share = 1 - hidden / hideable if hideable else 1.0
    exposed_mb = {d: a + b * share for d, (a, b) in per_mb.items()}
    t_mb = busy + sum(exposed_mb.values())
    bubble = t_mb * (lay.pp - 1) / lay.vpp
    # once per step: the data-parallel reduction, behind the last micro-batch's backward
    fwd, bwd = (gemm_s + attn_s) * layers, (2 * gemm_s + 2.5 * attn_s) * layers
    dp_once = {
        d: max(b * (1 - k.overlap), b - bwd) + max(f * (1 - k.overlap), f - fwd)
        for d, (b, f) in once.items()
    }
    # a replica's share of the weights on this GPU (FSDP shards it); ZeRO-1 also shards the
    # optimizer's share over the replicas
    replica_params = layers * (dense_p + expert_p) + embed_p
    if lay.dp_shard > 1:
        replica_params /= lay.dp_shard * lay.cp
    opt_params = replica_params / (lay.dp_replicate * lay.cp) if lay.zero else replica_params
    optimizer = pr.stream(30 * opt_params, 8)
    step = m * t_mb + bubble + sum(dp_once.values()) + optimizer + k.step_overhead_s
    breakdown = {
        "compute": m * compute_mb,
        "recompute": m * recompute_mb,
        "bubble": bubble,
        "optimizer": optimizer,
        "overhead": k.step_overhead_s,
    }
    for d, v in exposed_mb.items():
        breakdown[d] = m * v
        breakdown[f"{d}_overlapped"] = m * (per_mb[d][0] + per_mb[d][1]) - m * v
    for d, v in dp_once.items():
        breakdown[d] = breakdown.get(d, 0.0) + v
        total = sum(once[d])
        breakdown[f"{d}_overlapped"] = breakdown.get(f"{d}_overlapped", 0.0) + total - v
    gpus = lay.gpus
    model_flops = model_flops_per_token(shape, batch.seq) * batch.tokens
    tflops = model_flops / (step * gpus) / 1e12
    memory = _memory(shape, batch, lay, layers, dense_p, expert_p, embed_p, m, flash_attention)
    return Estimate(
        layout=lay,
        step_s=step,
        memory_bytes=memory,
        budget_bytes=hw.memory_bytes - RESERVED_BYTES,
        breakdown=breakdown,
        tokens_per_s_per_gpu=batch.tokens / step / gpus,
        model_tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / hw.peak_flops,
        microbatches=m,
        state_bytes=12 * replica_params,
    )
