"""Predict the reference trainer's step time under every layout of a world, from measured rates.

A layout's step is counted, not guessed: `workload` lists what one rank does in one step under a
layout (every matrix multiply with its shape, the bytes element-wise kernels and AdamW's step
stream, the ops it dispatches, and each collective with its group size and bytes: FSDP's all-gathers and
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

Across nodes: given the job's `topology.Topology` (`cluster.job_topology`, read from its
process groups), each collective's group is placed on the nodes as the trainer's mesh lays it
out (`cluster.dim_spans`), and one that crosses nodes is priced at the rate `calibrate` measured
over groups across nodes (`Rates.crossing`); on one node nothing changes.

What it does not see: the network beyond the groups it measured (several jobs sharing links,
a fabric's oversubscription between groups of nodes), overlap of communication with compute beyond what the measured steps fold
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
from anyshard.trainer_integration.gpt.layout_chooser.cluster import dim_spans, job_topology
from anyshard.trainer_integration.gpt.layout_chooser.measure import (
    block_s,
    slowest,
    time_calls,
    time_collectives,
    time_crossing,
    time_gemms,
    time_local,
)
from anyshard.trainer_integration.gpt.layout_chooser.memory import (
    BYTES_PER_PARAMETER,
    FLOAT,
    default_budget,
    memory_per_rank,
    parameter_count,
    root_params,
    state_bytes,
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
from anyshard.trainer_integration.planning.topology import Topology

__all__ = [
    "Refiner",
    "block_model_s",
    "calibrate",
    "optimizer_bytes",
    "predict",
    "rank_layouts",
    "workload",
]

# AdamW's step streams, per parameter of a rank: it reads the parameter, its gradient and the
# two moments, and writes the parameter and both moments
ADAMW_FLOATS = 7


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


def workload(
    cfg: Config, p: ParallelConfig, topology: Topology | None = None, *, optimizer: bool = True
) -> Workload:
    """Count one rank's step under layout ``p`` (the trainer's model, batch and schedule): its
    collectives placed on ``topology``'s nodes where given (`cluster.dim_spans`), the optimizer's
    step (`optimizer_bytes`) unless ``optimizer`` is False."""
    m, t = cfg.model, cfg.train
    s = _Sizes.of(cfg, p)
    # element-wise traffic per token and layer: norms, residuals, rotary, activations (x dim,
    # x ffn) and the attention scores (x keys per head); backward twice the forward
    per_token = 14 * m.dim + 6 * s.ffn * (m.top_k if m.n_experts else 1) + 4 * s.heads * t.seq_len
    stream = 3.0 * FLOAT * s.tok * s.micro * (s.layers * per_token + 3 * m.vocab_size // p.tp)
    stream += optimizer_bytes(cfg, p) if optimizer else 0
    ops_layer = 40 + (12 if m.n_experts else 0)
    ops = 3 * s.micro * (ops_layer * s.layers + 12)
    dtensor_ops = 3 * s.micro * (12 * s.layers + 6) if p.tp > 1 else 0
    bubble = (p.pp - 1) / s.micro if p.pp > 1 else 0.0
    collectives = _collectives(cfg, p, s)
    if topology is not None:
        spans = dim_spans(p, topology.devices_per_node)
        collectives = tuple(dataclasses.replace(c, span=spans[c.dim]) for c in collectives)
    return Workload(
        gemms=_gemms(cfg, p, s),
        stream_bytes=stream,
        ops=ops,
        dtensor_ops=dtensor_ops,
        collectives=collectives,
        bubble=bubble,
        memory_bytes=memory_per_rank(cfg, p),
    )


def optimizer_bytes(cfg: Config, p: ParallelConfig) -> float:
    """Bytes AdamW's step streams on one rank under ``p``: `ADAMW_FLOATS` floats per parameter
    the rank holds (its shard of its stage's parameters, as `memory.state_bytes` counts them)."""
    return float(state_bytes(cfg, p) // BYTES_PER_PARAMETER * ADAMW_FLOATS * FLOAT)


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
    topology: Topology | None = None,
) -> Prediction:
    """Step time of layout ``p``: its `workload` (on ``topology``'s nodes, where given) under
    ``rates`` and the refined ``scales`` (compute, communication, dispatch), as
    `step_cost.predict_workload` adds it up."""
    w = workload(cfg, p, topology)
    return predict_workload(w, rates, scales, layout=layout_text(p), parallel=p)


def _probe_parallel(cfg: Config, world: int) -> ParallelConfig:
    """Pure data parallelism over ``world`` ranks: the layout the block probe's tokens are of."""
    return dataclasses.replace(cfg.parallel, pp=1, dp_replicate=world, dp_shard=1, ep=1, cp=1, tp=1)


def block_model_s(cfg: Config, world: int, rates: Rates) -> float:
    """Counted seconds (compute and dispatch, unscaled) of one block's forward and backward at
    a data-parallel rank's tokens of ``world`` ranks: the difference of the model at two and at
    one layer, everything outside the blocks cancelling (the optimizer's step left out: the
    block is timed forward and backward only)."""
    p = _probe_parallel(cfg, world)
    one, two = (
        sum(local_s(workload(dataclasses.replace(cfg, model=m), p, optimizer=False), rates))
        for m in (dataclasses.replace(cfg.model, n_layers=n) for n in (1, 2))
    )
    return two - one


def terms(
    cfg: Config, p: ParallelConfig, rates: Rates, topology: Topology | None = None
) -> tuple[float, float, float]:
    """The unscaled (compute, communication, dispatch) seconds `predict` adds up."""
    base = predict(cfg, p, rates, topology=topology)
    return base.compute_s, base.comm_s, base.dispatch_s


class Refiner(step_cost.Refiner):
    """`step_cost.Refiner` over the trainer's layouts: each one's terms as `predict` counts them
    for ``cfg`` under ``rates`` (on ``topology``'s nodes, where given), a layout measured again
    under its `layout_text` replacing its step."""

    def __init__(self, cfg: Config, rates: Rates, topology: Topology | None = None) -> None:
        super().__init__(functools.partial(terms, cfg, rates=rates, topology=topology), layout_text)


def rank_layouts(
    cfg: Config,
    world: int,
    rates: Rates,
    *,
    memory_bytes: int | None = None,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
    topology: Topology | None = None,
    topology_source: str = "",
) -> Table:
    """Predict every valid layout of ``world`` ranks (`candidates.candidate_layouts`, whose memory
    filter here counts activations too) and rank them, fastest first; on ``topology``'s nodes
    where given (``topology_source``: how it was found, for the table)."""
    budget = memory_bytes if memory_bytes is not None else default_budget()
    fits, rejected = candidate_layouts(cfg, world, budget, memory=memory_per_rank)
    rows = sorted(
        (predict(cfg, p, rates, scales, topology) for p, _ in fits), key=lambda r: r.step_s
    )
    notes = _crossing_notes(cfg, [p for p, _ in fits], rates, topology)
    return Table(
        world,
        tuple(rows),
        tuple(rejected),
        budget,
        rates.source,
        topology,
        topology_source,
        notes,
    )


def _crossing_notes(
    cfg: Config, layouts: Sequence[ParallelConfig], rates: Rates, topology: Topology | None
) -> tuple[str, ...]:
    """Why some collectives across nodes are priced at in-node rates: none were measured
    across nodes for their kind (rates calibrated on one node)."""
    if topology is None or topology.nodes < 2:
        return ()
    kinds = [
        c.kind for p in layouts for c in workload(cfg, p, topology).collectives if c.crosses_nodes
    ]
    missing = rates.missing_crossing(kinds)
    if not missing:
        return ()
    where = rates.measured_topology
    on = f"{where.nodes} node(s)" if where is not None else "a job that recorded no topology"
    return (
        f"no rate across nodes measured for {', '.join(missing)} (the rates come from {on}): "
        "those collectives across nodes are priced at the in-node rate of their group size",
    )


def calibrate(
    group_sizes: Iterable[int] | None = None,
    *,
    gemm_sizes: Sequence[int] = (32, 128, 384, 768),
    message_bytes: Sequence[int] = (1 << 10, 1 << 20),
    budget_s: float = 0.25,
    cfg: Config | None = None,
    topology: tuple[Topology, str] | None = None,
) -> Rates:
    """Measure the rates on every rank of the default process group at once (call it on every
    rank): square multiplies of ``gemm_sizes``, streaming adds, an op's and a DTensor op's
    dispatch, and all_gather / reduce_scatter / all_reduce / all_to_all / send over subgroups of
    each of ``group_sizes`` consecutive ranks (every size dividing the world when None), at each
    of ``message_bytes``; where the job's ``topology`` (and how it was found; None: read from
    the process group, `cluster.job_topology`) has several nodes, the same over subgroups whose
    members sit on several nodes (`measure.time_crossing`). The subgroups are destroyed before
    it returns. All ranks get rank 0's figures (the slowest rank's for the multiplies and the
    block), so every rank ranks layouts alike. The largest multiply is timed once more on rank
    0 alone, the others waiting: its contention. Given the trainer's ``cfg``, one of its blocks
    is timed on every rank at once against its counted time: ``Rates.block_scale``."""
    import torch.distributed as dist

    from anyshard._compat import process_groups

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    topo, topo_source = topology or job_topology()
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
    across = time_crossing(sizes, message_bytes, coll, world, rank, topo.devices_per_node)
    barrier()
    block = block_s(cfg, world, budget_s) if cfg is not None else 0.0
    if world > 1:
        from anyshard.api.collectives import broadcast_json

        gemm, block = slowest(gemm, block)
        figures = broadcast_json([gemm, stream, op_s, dtensor_op_s, coll, alone, wait, across])
        gemm, stream, op_s, dtensor_op_s, coll, alone, wait, across = figures  # rank 0's
        for group in process_groups() - before:  # the DTensor mesh's and the subgroups
            dist.destroy_process_group(group)
    contention = min(float(world), gemm[-1][1] / alone) if alone > 0 else 1.0
    rates = rates_from_timings(
        gemm, stream, op_s, dtensor_op_s, coll, contention, wait, crossing=across
    )
    shape = (topo.devices_per_node, topo.nodes)
    rates = dataclasses.replace(rates, topology=shape, topology_source=topo_source)
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
    try:
        topo, source = _cli_topology(args.devices_per_node, rates, args.world)
    except ValueError as e:
        p.error(str(e))
    table = rank_layouts(
        cfg, args.world, rates, memory_bytes=budget, topology=topo, topology_source=source
    )
    if args.json:
        print(json.dumps(_table_json(table, args.world, rates), indent=1))
    else:
        print(table.text())
    return 0 if table.rows else 1


def _cli_topology(per_node: int | None, rates: Rates, world: int) -> tuple[Topology, str]:
    """The nodes ``anyshard layouts`` predicts on, and how it found them: ``--devices-per-node``,
    else ``ANYSHARD_DEVICES_PER_NODE``, else the nodes the rates file was measured on (a job
    reads them from its process groups), else one node of the whole world."""
    import os

    from anyshard.trainer_integration.gpt.layout_chooser.cluster import DEVICES_PER_NODE_ENV

    env = os.environ.get(DEVICES_PER_NODE_ENV, "").strip()
    if per_node is not None:
        source = "--devices-per-node"
    elif env:
        if not env.isdigit():
            raise ValueError(f"{DEVICES_PER_NODE_ENV}={env!r}: not a number of ranks")
        per_node, source = int(env), DEVICES_PER_NODE_ENV
    elif rates.topology is not None:
        per_node, source = rates.topology[0], f"{rates.topology_source}, in the rates file"
    else:
        return Topology(world, 1), "one node: none given, none in the rates"
    if per_node < 1 or (per_node < world and world % per_node):
        raise ValueError(f"{per_node} ranks per node ({source}) do not divide {world} ranks")
    return Topology(min(per_node, world), max(1, world // per_node)), source


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
    p.add_argument(
        "--devices-per-node",
        type=int,
        metavar="N",
        help="ranks per node (default: ANYSHARD_DEVICES_PER_NODE, else the nodes the rates "
        "were measured on, else one node)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def _table_json(table: Table, world: int, rates: Rates) -> dict:
    """``anyshard layouts --json``: the ranked layouts (with the dims whose groups cross
    nodes), the rejected ones, the budget, the topology and the notes on the rates."""
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
            "crosses_nodes": list(r.crossing),
        }
        for r in table.rows
    ]
    rejected = [{"layout": n, "why": w} for n, w in table.rejected]
    topo = table.topology
    return {
        "world": world,
        "rates": rates.source,
        "topology": None
        if topo is None
        else {
            "devices_per_node": topo.devices_per_node,
            "nodes": topo.nodes,
            "source": table.topology_source,
        },
        "notes": list(table.notes),
        "layouts": rows,
        "rejected": rejected,
        "budget_bytes": table.budget_bytes,
    }
