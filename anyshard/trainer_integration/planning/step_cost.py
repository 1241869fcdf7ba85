"""The step-time model of a layout: what one rank does in a step (`Workload`: matrix multiplies,
streamed bytes, dispatched ops, collectives), divided by rates measured on the job's own ranks
(`Rates`), gives the step's compute, communication and dispatch (`predict_workload`);
`Refiner` scales those three terms to the step times a job measures, so that layouts not run
yet are predicted from those that were; `Table` ranks the predictions.

Pure: no trainer, no process group, no files. The trainer's side (its config counted into a
`Workload`, the rates measured on its process groups, the ``anyshard layouts`` command) is
`anyshard.trainer_integration.gpt.layout_chooser.costmodel`.

    >>> w = Workload(gemms=((2e9, 3),), stream_bytes=0.0, ops=100, dtensor_ops=0,
    ...              collectives=(Collective("fsdp", "all_gather", 2, 1 << 20, 4),),
    ...              bubble=0.0, memory_bytes=0)
    >>> p = predict_workload(w, Rates.nominal(), layout="dp_shard=2")
    >>> round(p.compute_s, 3), round(p.comm_s, 4), p.dominant
    (0.15, 0.0029, 'compute (98%)')
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyshard.trainer_integration.planning.topology import Span, Topology

__all__ = [
    "RING",
    "Collective",
    "Prediction",
    "Rates",
    "Refiner",
    "Table",
    "Workload",
    "local_s",
    "predict_workload",
    "rates_from_timings",
]

# how many times each collective's ring moves its message per rank, over (g - 1) / g
RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0}


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``kind`` per step over groups of ``group`` ranks, each on a
    ``bytes`` message (the whole gathered or reduced tensor); ``dim`` names the mesh dim;
    ``span`` where the group sits on the job's nodes (`topology.placement`; None: one node)."""

    dim: str
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, send
    group: int
    bytes: int
    count: int
    span: Span | None = None

    @property
    def crosses_nodes(self) -> bool:
        return self.span is not None and self.span.nodes > 1


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
    per rank) over consecutive ranks (inside a node, where the group fits one);
    ``crossing``: the same per (kind, group size, members per node) over groups whose members
    sit on several nodes, measured where the job ran on more than one (``topology``: its
    devices per node and nodes, as read from its process groups, ``topology_source`` says
    how); the rest per rank with every rank busy. ``contention``: how much longer the
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
    crossing: dict[str, tuple[float, float]] = field(default_factory=dict)  # "kind/group/per_node"
    topology: tuple[int, int] | None = None  # (devices per node, nodes) measured on
    topology_source: str = ""

    @classmethod
    def nominal(cls) -> Rates:
        """Round figures of one CPU core (for examples and tests; never for a decision)."""
        coll = {
            f"{k}/{g}": (1e-4 * g, 1e-9) for k in (*RING, "send") for g in (2, 4, 8, 16, 32, 64)
        }
        gemm = ((1e5, 5e9), (1e7, 2e10), (1e9, 4e10))
        return cls(gemm, 5e9, 5e-6, 5e-5, coll, source="nominal")

    @property
    def measured_topology(self) -> Topology | None:
        """The nodes the rates were measured on (None: not recorded)."""
        return None if self.topology is None else Topology(*self.topology)

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
        """Seconds for one collective: a group that crosses nodes (``c.span``) at the rate
        measured across nodes nearest its span (`crossing_rate`); any other at the in-node rate
        of the nearest measured group size at or above, and so is a group that crosses nodes
        where no rate across nodes was measured (rates of one node: `missing_crossing` names
        the kinds, and the table says so)."""
        rate = self.crossing_rate(c.kind, c.span) if c.crosses_nodes else None
        alpha, beta = rate if rate is not None else self.in_node_rate(c.kind, c.group)
        moved = c.bytes if c.kind == "send" else RING[c.kind] * c.bytes * (c.group - 1) / c.group
        return alpha + beta * moved

    def in_node_rate(self, kind: str, group: int) -> tuple[float, float]:
        """(latency, seconds per byte moved) of ``kind`` over consecutive ranks: the measured
        group size ``group``, else the nearest at or above, else the largest."""
        key = f"{kind}/{group}"
        if key not in self.collectives:
            sizes = sorted(int(k.split("/")[1]) for k in self.collectives if k.startswith(kind))
            if not sizes:
                raise KeyError(f"no measured rate for {kind}; calibrate with this kind")
            bigger = [g for g in sizes if g >= group]
            key = f"{kind}/{bigger[0] if bigger else sizes[-1]}"
        return self.collectives[key]

    def crossing_rate(self, kind: str, span: Span | None) -> tuple[float, float] | None:
        """(latency, seconds per byte moved) of ``kind`` over a group placed as ``span``, from
        the measurement across nodes nearest it: the same number of nodes first, then the same
        members per node, then the nearest group size (at or above before below). None where
        no rate of ``kind`` across nodes was measured."""
        if span is None:
            return None
        found = [(int(g), int(q)) for k, g, q in (x.split("/") for x in self.crossing) if k == kind]
        if not found:
            return None

        def distance(gq: tuple[int, int]) -> tuple[float, bool, bool, float]:
            g, q = gq
            nodes = max(1, g // max(1, q))
            return (
                abs(math.log(nodes / span.nodes)),
                q != span.per_node,
                g < span.size,
                abs(math.log(g / span.size)),
            )

        g, q = min(found, key=distance)
        return self.crossing[f"{kind}/{g}/{q}"]

    def missing_crossing(self, kinds: Sequence[str]) -> list[str]:
        """Those of ``kinds`` with no rate measured across nodes."""
        have = {k.split("/")[0] for k in self.crossing}
        return [k for k in dict.fromkeys(kinds) if k not in have]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Rates:
        """The rates of `to_json` (files written before rates across nodes load too)."""
        d = json.loads(text)
        d["gemm"] = tuple(tuple(x) for x in d["gemm"])
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        d["crossing"] = {k: tuple(v) for k, v in d.get("crossing", {}).items()}
        d.setdefault("peer_wait", {})
        if d.get("topology") is not None:
            d["topology"] = tuple(d["topology"])
        return cls(**d)


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step, split into what makes it up."""

    layout: str
    parallel: Any  # the layout predicted (the trainer's ParallelConfig)
    step_s: float
    compute_s: float
    comm_s: float
    dispatch_s: float
    by_dim: dict[str, float]
    memory_bytes: int
    crossing: tuple[str, ...] = ()  # the mesh dims whose groups cross nodes

    @property
    def dominant(self) -> str:
        """What most of the step is: compute, dispatch, or a mesh dim's communication."""
        parts = {"compute": self.compute_s, "dispatch": self.dispatch_s, **self.by_dim}
        name = max(parts, key=lambda k: parts[k])
        what = name if name in ("compute", "dispatch") else f"{name} communication"
        return f"{what} ({parts[name] / self.step_s:.0%})"


def predict_workload(
    w: Workload,
    rates: Rates,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
    *,
    layout: str = "",
    parallel: Any = None,
) -> Prediction:
    """Step time of a layout's workload ``w``: (compute + dispatch) x (1 + pipeline bubble) +
    communication, each term times its refined scale (compute, communication, dispatch), compute
    and dispatch also times the calibration's ``rates.block_scale``. Where ranks share
    cores (``rates.contention`` > 1), a pipeline's idle stages leave theirs to the busy ones:
    its compute runs at the rate of the fewer ranks busy at once, 1 / (1 + bubble) of them.
    ``layout`` and ``parallel`` name the layout in the prediction."""
    compute, dispatch = local_s(w, rates)
    by_dim: dict[str, float] = {}
    for c in w.collectives:
        by_dim[c.dim] = by_dim.get(c.dim, 0.0) + c.count * rates.collective_s(c) * scales[1]
    k = max(1.0, rates.contention)
    busy = (1 + w.bubble) * max(1.0, k / (1 + w.bubble)) / k  # (1 + bubble) where k is 1
    compute *= scales[0] * busy * rates.block_scale
    dispatch *= scales[2] * busy * rates.block_scale
    comm = sum(by_dim.values())
    step = compute + dispatch + comm
    crossing = tuple(dict.fromkeys(c.dim for c in w.collectives if c.crosses_nodes))
    return Prediction(
        layout, parallel, step, compute, comm, dispatch, by_dim, w.memory_bytes, crossing
    )


def local_s(w: Workload, rates: Rates) -> tuple[float, float]:
    """The unscaled compute and dispatch seconds of a workload."""
    compute = sum(f * n / rates.gemm_rate(f) for f, n in w.gemms)
    compute += w.stream_bytes / rates.stream_bytes_per_s
    return compute, w.ops * rates.op_s + w.dtensor_ops * rates.dtensor_op_s


@dataclass
class Refiner:
    """Scales the model's three terms to measured step times: with one or two layouts measured,
    one scale for all; with more, a least-squares fit of each term's scale to the relative
    errors, pulled towards that one scale (ridge) and kept within 0.2-5x of it, so that a few
    noisy steps or nearly proportional layouts cannot send a term to zero.

    ``terms`` gives a layout's unscaled (compute, communication, dispatch) seconds, as
    `predict_workload` adds them up at scales of 1.

    >>> r = Refiner(lambda layout: (1.0, 0.5, 0.5))
    >>> r.add("a", 4.0)
    >>> r.scales()
    (2.0, 2.0, 2.0)
    """

    terms: Callable[[Any], tuple[float, float, float]]  # a layout's unscaled terms
    name: Callable[[Any], str] = str  # a layout measured again under its name replaces its step
    measured: dict[str, tuple[Any, float]] = field(default_factory=dict)
    RIDGE = 0.05  # weight of the pull towards the global ratio, against a measured step's error

    def add(self, layout: Any, step_s: float) -> None:
        self.measured[self.name(layout)] = (layout, step_s)

    def scales(self) -> tuple[float, float, float]:
        if not self.measured:
            return (1.0, 1.0, 1.0)
        rows = [(self.terms(p), s) for p, s in self.measured.values()]
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
    """Every layout of a world ranked by predicted step time, and those rejected, with why;
    the nodes it was predicted on (None: one node, not shown) and how they were found, and
    notes on the rates (what they lack for the topology)."""

    world: int
    rows: tuple[Prediction, ...]
    rejected: tuple[tuple[str, str], ...]
    budget_bytes: int
    rates_source: str
    topology: Topology | None = None
    topology_source: str = ""
    notes: tuple[str, ...] = ()

    def topology_text(self) -> str:
        """``2 nodes x 2 ranks (from the process group)``; "" without a topology."""
        t = self.topology
        if t is None:
            return ""
        nodes = f"{t.nodes} node{'s' if t.nodes != 1 else ''}"
        src = f" ({self.topology_source})" if self.topology_source else ""
        return f"{nodes} x {t.devices_per_node} ranks{src}"

    def text(self) -> str:
        across = self.topology is not None
        lines = [
            f"{len(self.rows)} layouts of {self.world} ranks fit (budget "
            f"{self.budget_bytes / 2**20:.0f} MiB per rank; rates: {self.rates_source})",
            *([f"topology: {self.topology_text()}"] if across else []),
            *[f"note: {n}" for n in self.notes],
            f"{'#':>3}  {'layout':<28} {'step ms':>9} {'memory MiB':>11}  "
            + (f"{'across nodes':<22} " if across else "")
            + "dominated by",
        ]
        best = self.rows[0].step_s if self.rows else 1.0
        for i, r in enumerate(self.rows, 1):
            lines.append(
                f"{i:>3}  {r.layout:<28} {r.step_s * 1e3:>9.1f} "
                f"{r.memory_bytes / 2**20:>11.1f}  "
                + (f"{', '.join(r.crossing) or '-':<22} " if across else "")
                + r.dominant
                + ("" if i == 1 else f"; {r.step_s / best:.2f}x the best")
            )
        if self.rejected:
            lines.append(f"rejected ({len(self.rejected)}):")
            lines += [f"     {name:<28} {why}" for name, why in self.rejected]
        return "\n".join(lines)


def rates_from_timings(
    gemm: Sequence[tuple[int, float]],
    stream: tuple[float, float],
    op_s: float,
    dtensor_op_s: float,
    collectives: Mapping[str, Sequence[tuple[int, float]]],
    contention: float = 1.0,
    peer_wait: dict[str, float] | None = None,
    crossing: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> Rates:
    """The rates of measured timings: ``gemm`` (n, seconds of an n x n multiply), ``stream``
    (bytes, seconds), an op's and a DTensor op's seconds, and per "kind/group" the seconds of a
    collective at two or more message sizes (bytes, seconds): its latency and seconds per byte
    moved are the line through the smallest and the largest; ``contention`` as `Rates` has it
    (below 1 is noise: 1); ``peer_wait`` (per group size, seconds) is added to the latency of
    every collective of that group size; ``crossing``: as ``collectives``, per
    "kind/group/per_node", over groups across nodes."""
    wait = dict(peer_wait or {})
    coll = {key: _line(key, points, wait) for key, points in collectives.items()}
    across = {key: _line(key, points, wait) for key, points in (crossing or {}).items()}
    rates = tuple((2.0 * n**3, 2.0 * n**3 / t) for n, t in gemm)
    return Rates(
        rates,
        stream[0] / stream[1],
        op_s,
        dtensor_op_s,
        coll,
        contention=max(1.0, contention),
        peer_wait=wait,
        crossing=across,
    )


def _line(
    key: str, points: Sequence[tuple[int, float]], wait: Mapping[str, float]
) -> tuple[float, float]:
    """(latency, seconds per byte moved) of a "kind/group[/per_node]" collective's timings at
    two or more message sizes: the line through the smallest and the largest, the wait for
    peers of its group size added to the latency."""
    kind, g = key.split("/")[0], int(key.split("/")[1])
    (b0, t0), (b1, t1) = min(points), max(points)
    ring = 1.0 if kind == "send" else RING[kind] * (g - 1) / g
    beta = max(0.0, (t1 - t0) / (ring * (b1 - b0)))
    return (max(0.0, t0 - beta * ring * b0) + wait.get(str(g), 0.0), beta)
