"""Predict the reference trainer's step time under every layout of a world, from measured rates.

A layout's step is counted, not guessed: `workload` lists what one rank does in one step under a
layout (every matrix multiply with its shape, the bytes element-wise kernels stream, the ops it
dispatches, and each collective with its group size and bytes: FSDP's all-gathers and
reduce-scatters, the replicate all-reduce, tensor and context parallel activations, pipeline
sends, expert all-to-alls), then `predict` divides each by a `Rates` measured on the job's own
ranks (`calibrate`; the model itself, which needs no trainer, is
`anyshard.trainer_integration.planning.step_cost`): matrix-multiply throughput at several sizes with every rank busy (and the
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
import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.candidates import (
    candidate_layouts,
    layout_text,
)
from anyshard.trainer_integration.gpt.layout_chooser.measure import (
    block_s,
    slowest,
    time_calls,
    time_collectives,
    time_gemms,
    time_local,
)
from anyshard.trainer_integration.gpt.layout_chooser.memory import (
    FLOAT,
    default_budget,
    memory_per_rank,
    parameter_count,
    root_params,
)
from anyshard.trainer_integration.planning import step_cost
from anyshard.trainer_integration.planning.step_cost import (
    Collective,
    Prediction,
    Rates,
    Table,
    Workload,
    local_s,
    predict_workload,
    rates_from_timings,
)

__all__ = ["Refiner", "block_model_s", "calibrate", "predict", "rank_layouts", "workload"]


@dataclass(frozen=True)
class _Sizes:
    """The sizes one rank's step works on under a layout (the busiest pipeline stage's rank)."""

    micro: int  # microbatches per step
    seqs: int  # sequences per microbatch on this rank
    s_q: int  # this rank's queries; keys span the whole sequence
    tok: int  # rows of every multiply (tensor parallel ranks gather the sequence)
    layers: int  # layers of one pipeline stage
    hd: int  # head size
    heads: int  # query heads on this rank
    kv: int  # key (or value) width on this rank
    ffn: int  # MLP hidden size on this rank

    @classmethod
    def of(cls, cfg: Config, p: ParallelConfig) -> _Sizes:
        m, t = cfg.model, cfg.train
        hd = m.dim // m.n_heads
        micro = p.microbatches if p.pp > 1 else 1
        seqs = t.global_batch // p.dp_size // micro
        s_q = t.seq_len // p.cp
        return cls(
            micro=micro,
            seqs=seqs,
            s_q=s_q,
            tok=seqs * s_q,
            layers=m.n_layers // p.pp,
            hd=hd,
            heads=m.n_heads // p.tp,
            kv=m.n_kv_heads * hd // p.tp,
            ffn=m.ffn_dim // p.tp,
        )


def workload(cfg: Config, p: ParallelConfig) -> Workload:
    """Count one rank's step under layout ``p`` (the trainer's model, batch and schedule)."""
    m, t = cfg.model, cfg.train
    s = _Sizes.of(cfg, p)
    # element-wise traffic per token and layer: norms, residuals, rotary, activations (x dim,
    # x ffn) and the attention scores (x keys per head); backward twice the forward
    per_token = 14 * m.dim + 6 * s.ffn * (m.top_k if m.n_experts else 1) + 4 * s.heads * t.seq_len
    stream = 3.0 * FLOAT * s.tok * s.micro * (s.layers * per_token + 3 * m.vocab_size // p.tp)
    ops_layer = 40 + (12 if m.n_experts else 0)
    ops = 3 * s.micro * (ops_layer * s.layers + 12)
    dtensor_ops = 3 * s.micro * (12 * s.layers + 6) if p.tp > 1 else 0
    bubble = (p.pp - 1) / s.micro if p.pp > 1 else 0.0
    return Workload(
        gemms=_gemms(cfg, p, s),
        stream_bytes=stream,
        ops=ops,
        dtensor_ops=dtensor_ops,
        collectives=_collectives(cfg, p, s),
        bubble=bubble,
        memory_bytes=memory_per_rank(cfg, p),
    )


def _gemms(cfg: Config, p: ParallelConfig, s: _Sizes) -> tuple[tuple[float, int], ...]:
    """The step's matrix multiplies: (flops of one, how many), forward and backward."""
    m, t = cfg.model, cfg.train
    seqs, s_q, tok, layers, micro = s.seqs, s.s_q, s.tok, s.layers, s.micro
    hd, heads, kv, ffn = s.hd, s.heads, s.kv, s.ffn
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
    return tuple(sorted(counts.items()))


def _collectives(cfg: Config, p: ParallelConfig, s: _Sizes) -> tuple[Collective, ...]:
    """The step's collectives, by the mesh dim that runs them."""
    m, t = cfg.model, cfg.train
    micro, layers = s.micro, s.layers
    fsdp = p.dp_shard * p.ep * p.cp
    local_params = parameter_count(cfg) / (p.pp * p.tp)
    block = (local_params - root_params(cfg) / p.tp) / max(1, layers)
    act = s.tok * m.dim * FLOAT  # one activation of the residual stream, whole per tp group
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
        logits = s.tok * m.vocab_size * FLOAT
        coll.append(Collective("tp", "all_gather", p.tp, logits, micro))  # replicated logits
        coll.append(Collective("tp", "reduce_scatter", p.tp, act, 2 * micro))  # embedding
    if p.cp > 1:  # keys and values gathered forward, their gradients scattered backward
        kv_all = s.seqs * t.seq_len * s.kv * FLOAT
        for kind in ("all_gather", "reduce_scatter"):
            coll.append(Collective("cp", kind, p.cp, kv_all, 2 * layers * micro))
    if p.ep > 1 and m.n_experts:  # tokens dispatched and combined, forward and backward
        moved = s.tok * m.top_k * m.dim * FLOAT
        coll.append(Collective("ep", "all_to_all", p.ep, moved, 4 * layers * micro))
    if p.pp > 1:  # a middle stage receives and sends activations forward and gradients back
        per = 4 if p.pp > 2 else 2
        coll.append(Collective("pp", "send", 2, act // p.tp, per * micro))
    coll.append(Collective("world", "all_reduce", p.world_size, FLOAT, 2))  # clip norm, loss
    return tuple(coll)


def predict(
    cfg: Config,
    p: ParallelConfig,
    rates: Rates,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Prediction:
    """Step time of layout ``p``: its `workload` under ``rates`` and the refined ``scales``
    (compute, communication, dispatch), as `step_cost.predict_workload` adds it up."""
    w = workload(cfg, p)
    return predict_workload(w, rates, scales, layout=layout_text(p), parallel=p)


def _probe_parallel(cfg: Config, world: int) -> ParallelConfig:
    """Pure data parallelism over ``world`` ranks: the layout the block probe's tokens are of."""
    return dataclasses.replace(cfg.parallel, pp=1, dp_replicate=world, dp_shard=1, ep=1, cp=1, tp=1)


def block_model_s(cfg: Config, world: int, rates: Rates) -> float:
    """Counted seconds (compute and dispatch, unscaled) of one block's forward and backward at
    a data-parallel rank's tokens of ``world`` ranks: the difference of the model at two and at
    one layer, everything outside the blocks cancelling."""
    p = _probe_parallel(cfg, world)
    one, two = (
        sum(local_s(workload(dataclasses.replace(cfg, model=m), p), rates))
        for m in (dataclasses.replace(cfg.model, n_layers=n) for n in (1, 2))
    )
    return two - one


def terms(cfg: Config, p: ParallelConfig, rates: Rates) -> tuple[float, float, float]:
    """The unscaled (compute, communication, dispatch) seconds `predict` adds up."""
    base = predict(cfg, p, rates)
    return base.compute_s, base.comm_s, base.dispatch_s


class Refiner(step_cost.Refiner):
    """`step_cost.Refiner` over the trainer's layouts: each one's terms as `predict` counts them
    for ``cfg`` under ``rates``, a layout measured again under its `layout_text` replacing its
    step."""

    def __init__(self, cfg: Config, rates: Rates) -> None:
        super().__init__(functools.partial(terms, cfg, rates=rates), layout_text)


def rank_layouts(
    cfg: Config,
    world: int,
    rates: Rates,
    *,
    memory_bytes: int | None = None,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Table:
    """Predict every valid layout of ``world`` ranks (`candidates.candidate_layouts`, whose memory
    filter here counts activations too) and rank them, fastest first."""
    budget = memory_bytes if memory_bytes is not None else default_budget()
    fits, rejected = candidate_layouts(cfg, world, budget, memory=memory_per_rank)
    rows = sorted((predict(cfg, p, rates, scales) for p, _ in fits), key=lambda r: r.step_s)
    return Table(world, tuple(rows), tuple(rejected), budget, rates.source)


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
    import torch.distributed as dist

    from anyshard._compat import process_groups

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    before = process_groups()
    sizes = sorted(set(group_sizes or [g for g in range(2, world + 1) if world % g == 0]))

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    gemm, mm = time_gemms(gemm_sizes, budget_s, barrier)
    barrier()
    reps = max(2, int(budget_s / 4 / max(1e-6, gemm[-1][1])))
    alone = time_calls(mm, reps) if rank == 0 else 0.0  # the others wait in the barrier below
    barrier()
    stream, op_s, dtensor_op_s = time_local(world, barrier)
    coll, wait = time_collectives(sizes, message_bytes, gemm, world, rank)
    barrier()
    block = block_s(cfg, world, budget_s) if cfg is not None else 0.0
    if world > 1:
        from anyshard.api.collectives import broadcast_json

        gemm, block = slowest(gemm, block)
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


def main(argv: Sequence[str] | None = None) -> int:
    """``anyshard layouts``: the ranked table of every layout of a world for the trainer's model."""
    from anyshard.trainer_integration.gpt.config import ConfigError, load_config

    p = _parser()
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
        print(json.dumps(_table_json(table, args.world, rates), indent=1))
    else:
        print(table.text())
    return 0 if table.rows else 1


def _parser():
    """The command line of ``anyshard layouts``: its own flags; the rest are config overrides."""
    import argparse

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
    return p


def _table_json(table: Table, world: int, rates: Rates) -> dict:
    """``anyshard layouts --json``: the ranked layouts, the rejected ones, the budget."""
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
    return {
        "world": world,
        "rates": rates.source,
        "layouts": rows,
        "rejected": rejected,
        "budget_bytes": table.budget_bytes,
    }
