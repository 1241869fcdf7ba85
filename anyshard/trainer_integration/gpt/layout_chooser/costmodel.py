"""Predict the reference trainer's step time under every layout of a world, from measured rates.

A layout's step is counted, not guessed: `workload` lists what one rank does in one step under a
layout (every matrix multiply with its shape, the bytes element-wise kernels stream, the ops it
dispatches, and each collective with its group size and bytes: FSDP's all-gathers and
reduce-scatters, the replicate all-reduce, tensor and context parallel activations, pipeline
sends, expert all-to-alls), then `predict` divides each by a `Rates` measured on the job's own
ranks (`calibrate`): matrix-multiply throughput at several sizes with every rank busy (and the
largest with one rank alone: how much ranks that share cores slow each other), streaming
bandwidth, the cost of dispatching an op and a DTensor op, and each collective's latency and
bandwidth for every group size, over the job's backend; and, given the model, one of its blocks'
forward and backward timed against what the counts predict for it (what the counts leave out:
autograd, the kernels' efficiency on the model's own shapes). Nothing in it is fitted to a model
or a machine; `Refiner` then scales the three terms (compute, communication, dispatch) to the step
times the job measures, so layouts not run yet are predicted from those that were.

`rank_layouts` gives the ranked table (`anyshard layouts` prints it)::

    >>> from anyshard.trainer_integration.gpt.config import Config
    >>> rates = Rates.nominal()
    >>> table = rank_layouts(Config(), 2, rates, memory_bytes=1 << 34)
    >>> [r.layout for r in table.rows][:1] != []
    True

What it does not see: the network beyond one collective's measured group (topology, several
jobs sharing links), overlap of communication with compute beyond what the measured steps fold
into the refined scales, and kernels that are faster or slower than a square matrix multiply of
the same size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.candidates import (
    candidate_layouts,
    layout_text,
)
from anyshard.trainer_integration.gpt.layout_chooser.memory import (
    FLOAT,
    default_budget,
    memory_per_rank,
    parameter_count,
    root_params,
    switch_memory,
)

__all__ = [
    "Collective",
    "Prediction",
    "Rates",
    "Refiner",
    "Table",
    "Workload",
    "block_model_s",
    "calibrate",
    "predict",
    "rank_layouts",
    "rates_from_timings",
    "switch_memory",
    "workload",
]

# how many times each collective's ring moves its message per rank, over (g - 1) / g
_RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0}


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``kind`` per step over groups of ``group`` ranks, each on a
    ``bytes`` message (the whole gathered or reduced tensor); ``dim`` names the mesh dim."""

    dim: str
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, send
    group: int
    bytes: int
    count: int


@dataclass(frozen=True)
class Workload:
    """What one rank does in one step under a layout (the busiest pipeline stage's rank)."""

    gemms: tuple[tuple[float, int], ...]  # (flops of one multiply, how many) per step
    stream_bytes: float  # bytes element-wise kernels read and write
    ops: int  # ops dispatched
    dtensor_ops: int  # of which on DTensors (tensor parallel)
    collectives: tuple[Collective, ...]
    bubble: float  # the pipeline's idle fraction over its work: (pp - 1) / microbatches
    memory_bytes: int  # parameters, gradients, AdamW state and activations per rank

    @property
    def flops(self) -> float:
        return sum(f * n for f, n in self.gemms)


@dataclass(frozen=True)
class Rates:
    """Measured rates the predictions divide by.

    ``gemm``: (flops of one square multiply, flops per second) with every rank multiplying at
    once, by size; ``collectives``: per (kind, group size), (latency s, seconds per byte moved
    per rank); the rest per rank with every rank busy. ``contention``: how much longer the
    largest multiply takes with every rank multiplying than with one rank alone (1 where each
    rank has its own device or core; about ranks / cores where ranks share cores).
    ``block_scale``: one of the model's blocks, forward and backward at a data-parallel rank's
    tokens with every rank busy, measured over what its counted multiplies, streams and
    dispatches predict (1 when not measured); it scales every layout's compute and dispatch.
    ``peer_wait``: per group size, how much longer a collective takes between bursts of compute
    with every rank busy than with the ranks idle (the wait for peers that share cores to be
    scheduled, and to finish their own burst); 0 where each rank has its own device. It is
    part of every collective's latency in ``collectives`` already, kept here to be reported."""

    gemm: tuple[tuple[float, float], ...]
    stream_bytes_per_s: float
    op_s: float
    dtensor_op_s: float
    collectives: dict[str, tuple[float, float]]  # "kind/group" -> (alpha, beta)
    source: str = "measured"
    contention: float = 1.0
    block_scale: float = 1.0
    peer_wait: dict[str, float] = field(default_factory=dict)  # group size -> s per collective

    @classmethod
    def nominal(cls) -> Rates:
        """Round figures of one CPU core (for examples and tests; never for a decision)."""
        coll = {
            f"{k}/{g}": (1e-4 * g, 1e-9) for k in (*_RING, "send") for g in (2, 4, 8, 16, 32, 64)
        }
        gemm = ((1e5, 5e9), (1e7, 2e10), (1e9, 4e10))
        return cls(gemm, 5e9, 5e-6, 5e-5, coll, source="nominal")

    def gemm_rate(self, flops: float) -> float:
        """Flops per second of one multiply of ``flops``: interpolated in log size."""
        pts = sorted(self.gemm)
        if flops <= pts[0][0]:
            return pts[0][1] * max(flops / pts[0][0], 0.05)  # small multiplies are overhead
        for (f0, r0), (f1, r1) in zip(pts, pts[1:], strict=False):
            if flops <= f1:
                w = math.log(flops / f0) / math.log(f1 / f0)
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def collective_s(self, c: Collective) -> float:
        """Seconds for one collective, from the nearest measured group size at or above."""
        key = f"{c.kind}/{c.group}"
        if key not in self.collectives:
            sizes = sorted(int(k.split("/")[1]) for k in self.collectives if k.startswith(c.kind))
            if not sizes:
                raise KeyError(f"no measured rate for {c.kind}; calibrate with this kind")
            bigger = [g for g in sizes if g >= c.group]
            key = f"{c.kind}/{bigger[0] if bigger else sizes[-1]}"
        alpha, beta = self.collectives[key]
        moved = c.bytes if c.kind == "send" else _RING[c.kind] * c.bytes * (c.group - 1) / c.group
        return alpha + beta * moved

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Rates:
        d = json.loads(text)
        d["gemm"] = tuple(tuple(x) for x in d["gemm"])
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        d.setdefault("peer_wait", {})
        return cls(**d)


def workload(cfg: Config, p: ParallelConfig) -> Workload:
    """Count one rank's step under layout ``p`` (the trainer's model, batch and schedule)."""
    m, t = cfg.model, cfg.train
    hd = m.dim // m.n_heads
    heads, kv = m.n_heads // p.tp, m.n_kv_heads * hd // p.tp
    ffn = m.ffn_dim // p.tp
    micro = p.microbatches if p.pp > 1 else 1
    seqs = t.global_batch // p.dp_size // micro  # sequences per microbatch on this rank
    s_q = t.seq_len // p.cp  # this rank's queries; keys span the whole sequence
    tok = seqs * s_q  # rows of every multiply (tensor parallel ranks gather the sequence)
    layers = m.n_layers // p.pp
    # forward multiplies of one layer: (m, n, k) -> 2mnk flops; backward does two of each
    mm = [(tok, m.dim, m.dim // p.tp), (tok, kv, m.dim), (tok, kv, m.dim), (tok, m.dim, heads * hd)]
    attn = [(s_q, t.seq_len, hd), (s_q, hd, t.seq_len)]  # q k^T and p v, per head
    per_layer = [(a, b, c, 1) for a, b, c in mm] + [(a, b, c, seqs * heads) for a, b, c in attn]
    if m.n_experts:
        local_experts = m.n_experts // p.ep
        routed = tok * m.top_k * p.ep // max(1, m.n_experts)  # tokens each local expert gets
        per_layer.append((tok, m.n_experts, m.dim, 1))  # router
        per_layer += [(routed, ffn, m.dim, local_experts)] * 2 + [
            (routed, m.dim, ffn, local_experts)
        ]
    else:
        per_layer += [(tok, ffn, m.dim, 1)] * 2 + [(tok, m.dim, ffn, 1)]
    counts: dict[float, int] = {}
    for a, b, c, n in per_layer:
        f = 2.0 * a * b * c
        counts[f] = counts.get(f, 0) + 3 * n * layers * micro
    head = 2.0 * tok * m.dim * (m.vocab_size // p.tp)  # output projection, on the last stage
    counts[head] = counts.get(head, 0) + 3 * micro
    # element-wise traffic per token and layer: norms, residuals, rotary, activations (x dim,
    # x ffn) and the attention scores (x keys per head); backward twice the forward
    per_token = 14 * m.dim + 6 * ffn * (m.top_k if m.n_experts else 1) + 4 * heads * t.seq_len
    stream = 3.0 * FLOAT * tok * micro * (layers * per_token + 3 * m.vocab_size // p.tp)
    ops_layer = 40 + (12 if m.n_experts else 0)
    ops = 3 * micro * (ops_layer * layers + 12)
    dtensor_ops = 3 * micro * (12 * layers + 6) if p.tp > 1 else 0
    fsdp = p.dp_shard * p.ep * p.cp
    params = parameter_count(cfg)
    local_params = params / (p.pp * p.tp)
    block = (local_params - root_params(cfg) / p.tp) / max(1, layers)
    act = tok * m.dim * FLOAT  # one activation of the residual stream, whole per tp group
    coll: list[Collective] = []
    if fsdp > 1:
        gathers = 2 * micro  # forward, and backward after resharding
        coll.append(Collective("fsdp", "all_gather", fsdp, int(block * FLOAT), gathers * layers))
        coll.append(Collective("fsdp", "reduce_scatter", fsdp, int(block * FLOAT), layers))
        root = int(root_params(cfg) / p.tp * FLOAT)
        coll += [Collective("fsdp", k, fsdp, root, 1) for k in ("all_gather", "reduce_scatter")]
    if p.dp_replicate > 1:
        grads = int(local_params / fsdp * FLOAT)
        coll.append(Collective("dp_replicate", "all_reduce", p.dp_replicate, grads, 1))
    if p.tp > 1:  # sequence parallel: gather before, scatter after, attention and mlp
        for kind in ("all_gather", "reduce_scatter"):
            coll.append(Collective("tp", kind, p.tp, act, 2 * 2 * layers * micro))
        logits = tok * m.vocab_size * FLOAT
        coll.append(Collective("tp", "all_gather", p.tp, logits, micro))  # replicated logits
        coll.append(Collective("tp", "reduce_scatter", p.tp, act, 2 * micro))  # embedding
    if p.cp > 1:  # keys and values gathered forward, their gradients scattered backward
        kv_all = seqs * t.seq_len * kv * FLOAT
        for kind in ("all_gather", "reduce_scatter"):
            coll.append(Collective("cp", kind, p.cp, kv_all, 2 * layers * micro))
    if p.ep > 1 and m.n_experts:  # tokens dispatched and combined, forward and backward
        moved = tok * m.top_k * m.dim * FLOAT
        coll.append(Collective("ep", "all_to_all", p.ep, moved, 4 * layers * micro))
    if p.pp > 1:  # a middle stage receives and sends activations forward and gradients back
        per = 4 if p.pp > 2 else 2
        coll.append(Collective("pp", "send", 2, act // p.tp, per * micro))
    coll.append(Collective("world", "all_reduce", p.world_size, FLOAT, 2))  # clip norm, loss
    bubble = (p.pp - 1) / micro if p.pp > 1 else 0.0
    return Workload(
        gemms=tuple(sorted(counts.items())),
        stream_bytes=stream,
        ops=ops,
        dtensor_ops=dtensor_ops,
        collectives=tuple(coll),
        bubble=bubble,
        memory_bytes=memory_per_rank(cfg, p),
    )


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step, split into what makes it up."""

    layout: str
    parallel: ParallelConfig
    step_s: float
    compute_s: float
    comm_s: float
    dispatch_s: float
    by_dim: dict[str, float]
    memory_bytes: int

    @property
    def dominant(self) -> str:
        """What most of the step is: compute, dispatch, or a mesh dim's communication."""
        parts = {"compute": self.compute_s, "dispatch": self.dispatch_s, **self.by_dim}
        name = max(parts, key=lambda k: parts[k])
        what = name if name in ("compute", "dispatch") else f"{name} communication"
        return f"{what} ({parts[name] / self.step_s:.0%})"


def predict(
    cfg: Config,
    p: ParallelConfig,
    rates: Rates,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Prediction:
    """Step time of layout ``p``: (compute + dispatch) x (1 + pipeline bubble) + communication,
    each term times its refined scale (compute, communication, dispatch), compute and dispatch
    also times the calibration's ``rates.block_scale``. Where ranks share
    cores (``rates.contention`` > 1), a pipeline's idle stages leave theirs to the busy ones:
    its compute runs at the rate of the fewer ranks busy at once, 1 / (1 + bubble) of them."""
    w = workload(cfg, p)
    compute, dispatch = _local_s(w, rates)
    by_dim: dict[str, float] = {}
    for c in w.collectives:
        by_dim[c.dim] = by_dim.get(c.dim, 0.0) + c.count * rates.collective_s(c) * scales[1]
    k = max(1.0, rates.contention)
    busy = (1 + w.bubble) * max(1.0, k / (1 + w.bubble)) / k  # (1 + bubble) where k is 1
    compute *= scales[0] * busy * rates.block_scale
    dispatch *= scales[2] * busy * rates.block_scale
    comm = sum(by_dim.values())
    step = compute + dispatch + comm
    return Prediction(layout_text(p), p, step, compute, comm, dispatch, by_dim, w.memory_bytes)


def _local_s(w: Workload, rates: Rates) -> tuple[float, float]:
    """The unscaled compute and dispatch seconds of a workload."""
    compute = sum(f * n / rates.gemm_rate(f) for f, n in w.gemms)
    compute += w.stream_bytes / rates.stream_bytes_per_s
    return compute, w.ops * rates.op_s + w.dtensor_ops * rates.dtensor_op_s


def _probe_parallel(cfg: Config, world: int) -> ParallelConfig:
    """Pure data parallelism over ``world`` ranks: the layout the block probe's tokens are of."""
    return dataclasses.replace(cfg.parallel, pp=1, dp_replicate=world, dp_shard=1, ep=1, cp=1, tp=1)


def block_model_s(cfg: Config, world: int, rates: Rates) -> float:
    """Counted seconds (compute and dispatch, unscaled) of one block's forward and backward at
    a data-parallel rank's tokens of ``world`` ranks: the difference of the model at two and at
    one layer, everything outside the blocks cancelling."""
    p = _probe_parallel(cfg, world)
    one, two = (
        sum(_local_s(workload(dataclasses.replace(cfg, model=m), p), rates))
        for m in (dataclasses.replace(cfg.model, n_layers=n) for n in (1, 2))
    )
    return two - one


def _block_s(cfg: Config, world: int, budget_s: float) -> float:
    """Measured seconds of one of the model's blocks (freshly initialised, on this rank's
    device: the CPU), forward and backward at a data-parallel rank's tokens of ``world`` ranks."""
    import torch

    from anyshard.trainer_integration.gpt.model import ParallelContext, TransformerBlock

    seqs = max(1, cfg.train.global_batch // world)
    block = TransformerBlock(cfg.model, ParallelContext())
    x = torch.randn(seqs, cfg.train.seq_len, cfg.model.dim, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return _time_busy(step, budget_s)


def terms(cfg: Config, p: ParallelConfig, rates: Rates) -> tuple[float, float, float]:
    """The unscaled (compute, communication, dispatch) seconds `predict` adds up."""
    base = predict(cfg, p, rates)
    return base.compute_s, base.comm_s, base.dispatch_s


@dataclass
class Refiner:
    """Scales the model's three terms to measured step times: with one or two layouts measured,
    one scale for all; with more, a least-squares fit of each term's scale to the relative
    errors, pulled towards that one scale (ridge) and kept within 0.2-5x of it, so that a few
    noisy steps or nearly proportional layouts cannot send a term to zero."""

    cfg: Config
    rates: Rates
    measured: dict[str, tuple[ParallelConfig, float]] = field(default_factory=dict)
    RIDGE = 0.05  # weight of the pull towards the global ratio, against a measured step's error

    def add(self, p: ParallelConfig, step_s: float) -> None:
        self.measured[layout_text(p)] = (p, step_s)

    def scales(self) -> tuple[float, float, float]:
        if not self.measured:
            return (1.0, 1.0, 1.0)
        rows = [(terms(self.cfg, p, self.rates), s) for p, s in self.measured.values()]
        if len(rows) < 3:
            ratio = sum(s for _, s in rows) / sum(sum(x) for x, _ in rows)
            return (ratio, ratio, ratio)
        import numpy as np

        a = np.array([x for x, _ in rows], dtype=float)
        b = np.array([s for _, s in rows], dtype=float)
        ratio = float(b.sum() / a.sum())
        # relative errors, and a pull of each scale towards the one global ratio: layouts whose
        # terms are nearly proportional (all compute) would otherwise leave the fit free
        pull = np.eye(3) * (self.RIDGE**0.5 / ratio)
        lhs = np.vstack([a / b[:, None], pull])
        rhs = np.concatenate([np.ones(len(b)), np.full(3, self.RIDGE**0.5)])
        fit, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
        lo, hi = 0.2 * ratio, 5.0 * ratio
        return tuple(float(min(hi, max(lo, x))) for x in fit)  # type: ignore[return-value]


@dataclass(frozen=True)
class Table:
    """Every layout of a world ranked by predicted step time, and those rejected, with why."""

    world: int
    rows: tuple[Prediction, ...]
    rejected: tuple[tuple[str, str], ...]
    budget_bytes: int
    rates_source: str

    def text(self) -> str:
        lines = [
            f"{len(self.rows)} layouts of {self.world} ranks fit (budget "
            f"{self.budget_bytes / 2**20:.0f} MiB per rank; rates: {self.rates_source})",
            f"{'#':>3}  {'layout':<28} {'step ms':>9} {'memory MiB':>11}  dominated by",
        ]
        best = self.rows[0].step_s if self.rows else 1.0
        for i, r in enumerate(self.rows, 1):
            lines.append(
                f"{i:>3}  {r.layout:<28} {r.step_s * 1e3:>9.1f} "
                f"{r.memory_bytes / 2**20:>11.1f}  {r.dominant}"
                + ("" if i == 1 else f"; {r.step_s / best:.2f}x the best")
            )
        if self.rejected:
            lines.append(f"rejected ({len(self.rejected)}):")
            lines += [f"     {name:<28} {why}" for name, why in self.rejected]
        return "\n".join(lines)


def rank_layouts(
    cfg: Config,
    world: int,
    rates: Rates,
    *,
    memory_bytes: int | None = None,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Table:
    """Predict every valid layout of ``world`` ranks (`layouts.candidate_layouts`, whose memory
    filter here counts activations too) and rank them, fastest first."""
    budget = memory_bytes if memory_bytes is not None else default_budget()
    fits, rejected = candidate_layouts(cfg, world, budget, memory=memory_per_rank)
    rows = sorted((predict(cfg, p, rates, scales) for p, _ in fits), key=lambda r: r.step_s)
    return Table(world, tuple(rows), tuple(rejected), budget, rates.source)


# --- calibration on the job's own ranks ------------------------------------------------------


def _time(fn, reps: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _time_busy(fn, budget_s: float) -> float:
    """Seconds of one call of ``fn`` while every rank calls it (call on every rank at once):
    each rank calls ``fn`` until ``budget_s`` has passed and at least twice, and counts only
    the calls that ended by then, when no rank had stopped yet; one call when none had."""
    fn()  # warm
    t0 = time.perf_counter()
    ends: list[float] = []
    while len(ends) < 2 or ends[-1] < budget_s:
        fn()
        ends.append(time.perf_counter() - t0)
    done = [t for t in ends if t <= budget_s] or ends[:1]
    return done[-1] / len(done)


def _peer_wait_s(burst, group, n: int = 5, pairs: int = 3) -> float:
    """How much longer ``n`` bursts of compute each followed by a small all-reduce in
    ``group`` take than the bursts alone, per all-reduce, with every rank doing the same at
    once (the median of ``pairs`` alternating pairs); the all-reduce's own time included."""
    import torch
    import torch.distributed as dist

    tiny = torch.ones(256)

    def both() -> None:
        burst()
        dist.all_reduce(tiny, group=group)

    extra = []
    for _ in range(pairs):
        dist.barrier()
        alone = _time(burst, n)
        dist.barrier()
        extra.append(_time(both, n) - alone)
    return max(0.0, sorted(extra)[len(extra) // 2])


def calibrate(
    group_sizes: Iterable[int] | None = None,
    *,
    gemm_sizes: Sequence[int] = (32, 128, 384, 768),
    message_bytes: Sequence[int] = (1 << 10, 1 << 20),
    budget_s: float = 0.25,
    cfg: Config | None = None,
) -> Rates:
    """Measure the rates on every rank of the default process group at once (call it on every
    rank): square multiplies of ``gemm_sizes``, streaming adds, an op's and a DTensor op's
    dispatch, and all_gather / reduce_scatter / all_reduce / all_to_all / send over subgroups of
    each of ``group_sizes`` consecutive ranks (every size dividing the world when None), at each
    of ``message_bytes``. The subgroups are destroyed before it returns. All ranks get rank 0's
    figures (the slowest rank's for the multiplies and the block), so every rank ranks layouts
    alike. The largest multiply is timed once more on rank 0 alone, the others waiting: its
    contention. Given the trainer's ``cfg``, one of its blocks is timed on every rank at once
    against its counted time: ``Rates.block_scale``."""
    import torch
    import torch.distributed as dist

    from anyshard._compat import process_groups

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    before = process_groups()
    sizes = sorted(set(group_sizes or [g for g in range(2, world + 1) if world % g == 0]))

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    gemm = []
    for n in gemm_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        barrier()

        def mm(a=a, b=b):
            return a @ b

        gemm.append((n, _time_busy(mm, budget_s / 4)))
    barrier()
    reps = max(2, int(budget_s / 4 / max(1e-6, gemm[-1][1])))
    alone = _time(mm, reps) if rank == 0 else 0.0  # the others wait in the barrier below
    barrier()
    big = torch.randn(1 << 22)
    out = torch.empty_like(big)
    barrier()
    stream = (3 * big.numel() * FLOAT, _time(lambda: torch.add(big, big, out=out), 5))
    tiny = torch.ones(4)
    op_s = _time(lambda: tiny.add(1.0), 500)
    dtensor_op_s = op_s * 10
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        dt = distribute_tensor(torch.ones(world * 4), mesh, [Shard(0)])
        dtensor_op_s = max(op_s, _time(lambda: dt.add(1.0), 100))
    coll: dict[str, list[tuple[int, float]]] = {}
    wait: dict[str, float] = {}
    # bursts of about 10 ms of multiplies with every rank busy: a step computes that long or
    # longer between two collectives
    n_burst, t_burst = gemm[-2] if len(gemm) > 1 else gemm[-1]
    a_burst, b_burst = torch.randn(n_burst, n_burst), torch.randn(n_burst, n_burst)
    burst_reps = max(1, round(0.01 / max(1e-6, t_burst)))

    def burst() -> None:
        for _ in range(burst_reps):
            a_burst @ b_burst

    for g in sizes:
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        mine = groups[rank // g]
        for kind in (*_RING, "send"):
            coll[f"{kind}/{g}"] = [
                (nbytes, _collective_s(kind, max(g, nbytes // FLOAT // g * g), g, rank % g, mine))
                for nbytes in message_bytes
            ]
        # what a collective costs among busy ranks beyond its time among idle ones
        idle = min(coll[f"all_reduce/{g}"])[1]
        wait[str(g)] = max(0.0, _peer_wait_s(burst, mine) - idle)
    barrier()
    block = _block_s(cfg, world, budget_s) if cfg is not None else 0.0
    if world > 1:
        mine_gemm = torch.tensor([t for _, t in gemm] + [block], dtype=torch.float64)
        dist.all_reduce(mine_gemm, op=dist.ReduceOp.MAX)  # the slowest rank paces the step
        *slowest, block = mine_gemm.tolist()
        gemm = [(n, float(t)) for (n, _), t in zip(gemm, slowest, strict=True)]
        from anyshard.api.collectives import broadcast_json

        figures = broadcast_json([gemm, stream, op_s, dtensor_op_s, coll, alone, wait])
        gemm, stream, op_s, dtensor_op_s, coll, alone, wait = figures  # rank 0's
        for group in process_groups() - before:  # the DTensor mesh's and the subgroups
            dist.destroy_process_group(group)
    contention = min(float(world), gemm[-1][1] / alone) if alone > 0 else 1.0
    rates = rates_from_timings(gemm, stream, op_s, dtensor_op_s, coll, contention, wait)
    counted = block_model_s(cfg, world, rates) if cfg is not None else 0.0
    if block <= 0 or counted <= 0:  # not measured, or nothing counted (fewer samples than ranks)
        return rates
    return dataclasses.replace(rates, block_scale=block / counted)


def rates_from_timings(
    gemm: Sequence[tuple[int, float]],
    stream: tuple[float, float],
    op_s: float,
    dtensor_op_s: float,
    collectives: Mapping[str, Sequence[tuple[int, float]]],
    contention: float = 1.0,
    peer_wait: dict[str, float] | None = None,
) -> Rates:
    """The rates of measured timings: ``gemm`` (n, seconds of an n x n multiply), ``stream``
    (bytes, seconds), an op's and a DTensor op's seconds, and per "kind/group" the seconds of a
    collective at two or more message sizes (bytes, seconds): its latency and seconds per byte
    moved are the line through the smallest and the largest; ``contention`` as `Rates` has it
    (below 1 is noise: 1); ``peer_wait`` (per group size, seconds) is added to the latency of
    every collective of that group size."""
    coll: dict[str, tuple[float, float]] = {}
    wait = dict(peer_wait or {})
    for key, points in collectives.items():
        kind, g = key.split("/")[0], int(key.split("/")[1])
        (b0, t0), (b1, t1) = min(points), max(points)
        ring = 1.0 if kind == "send" else _RING[kind] * (g - 1) / g
        beta = max(0.0, (t1 - t0) / (ring * (b1 - b0)))
        coll[key] = (max(0.0, t0 - beta * ring * b0) + wait.get(str(g), 0.0), beta)
    rates = tuple((2.0 * n**3, 2.0 * n**3 / t) for n, t in gemm)
    return Rates(
        rates,
        stream[0] / stream[1],
        op_s,
        dtensor_op_s,
        coll,
        contention=max(1.0, contention),
        peer_wait=wait,
    )


def _collective_s(kind: str, n: int, g: int, me: int, group) -> float:
    """Seconds for one ``kind`` collective on ``n`` floats (the whole message) in ``group``."""
    import torch
    import torch.distributed as dist

    whole, part = torch.ones(n), torch.ones(n // g)
    if kind == "all_gather":

        def fn():
            dist.all_gather_into_tensor(whole, part, group=group)
    elif kind == "reduce_scatter":

        def fn():
            dist.reduce_scatter_tensor(part, whole, group=group)
    elif kind == "all_reduce":

        def fn():
            dist.all_reduce(whole, group=group)
    elif kind == "all_to_all":
        out = torch.empty_like(whole)

        def fn():
            dist.all_to_all_single(out, whole, group=group)
    else:  # a pipeline's neighbour exchange: pairs 0 -> 1, 2 -> 3, ... within the group
        peer = me ^ 1
        ranks = dist.get_process_group_ranks(group)

        def fn():
            if peer >= g:
                return
            if me % 2 == 0:
                dist.send(whole, ranks[peer], group=group)
            else:
                dist.recv(whole, ranks[peer], group=group)

    dist.barrier(group=group)
    return _time(fn, 5)


def main(argv: Sequence[str] | None = None) -> int:
    """``anyshard layouts``: the ranked table of every layout of a world for the trainer's model."""
    import argparse

    from anyshard.trainer_integration.gpt.config import ConfigError, load_config

    p = argparse.ArgumentParser(
        prog="anyshard layouts",
        description="Rank every valid layout of a world for the reference trainer's model by "
        "predicted step time: what dominates each, its memory per rank, and why the others "
        "are rejected. Rates come from a job's calibration (RUN_DIR/rates.json, written by a "
        "job with parallel.auto start or online) or, without --rates, nominal round figures.",
        epilog="examples:\n  anyshard layouts --world 4\n"
        "  anyshard layouts --world 8 --rates runs/demo/rates.json --memory-gib 2\n"
        "  anyshard layouts --world 4 --config my.toml --model.n_layers 8 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world", type=int, required=True, help="the number of ranks")
    p.add_argument("--config", metavar="TOML", help="the trainer configuration (default.toml)")
    p.add_argument("--rates", metavar="JSON", help="measured rates (a job's RUN_DIR/rates.json)")
    p.add_argument("--memory-gib", type=float, help="memory budget per rank (default: this host)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args, overrides = p.parse_known_args(argv)
    if args.world < 1:
        p.error(f"--world {args.world}: must be at least 1")
    try:
        cfg = load_config(args.config, overrides, environ={})
    except (ConfigError, OSError) as e:
        p.error(str(e))
    if args.rates:
        try:
            with open(args.rates) as f:
                rates = Rates.from_json(f.read())
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(
                f"--rates {args.rates}: not a rates file ({e}); a job with parallel.auto "
                "start or online writes one to RUN_DIR/rates.json"
            )
    else:
        rates = Rates.nominal()
    budget = None if args.memory_gib is None else int(args.memory_gib * 2**30)
    table = rank_layouts(cfg, args.world, rates, memory_bytes=budget)
    if args.json:
        rows = [
            {
                "layout": r.layout,
                "step_s": r.step_s,
                "compute_s": r.compute_s,
                "comm_s": r.comm_s,
                "dispatch_s": r.dispatch_s,
                "comm_by_dim_s": r.by_dim,
                "memory_bytes": r.memory_bytes,
                "dominated_by": r.dominant,
            }
            for r in table.rows
        ]
        rejected = [{"layout": n, "why": w} for n, w in table.rejected]
        print(
            json.dumps(
                {
                    "world": args.world,
                    "rates": rates.source,
                    "layouts": rows,
                    "rejected": rejected,
                    "budget_bytes": table.budget_bytes,
                },
                indent=1,
            )
        )
    else:
        print(table.text())
    return 0 if table.rows else 1
