"""A job planned whole: its layouts ranked by the cost model (`layout_search`), the fastest run
through the failure simulator (`failures`) in every recovery mode at its best checkpoint
interval, ranked by the tokens per second they keep after failures, and the layouts to reshard
into when nodes are lost (``anyshard plan --model``, in `plan_cli`).

- `Planner.fit`: the layouts of a GPU count, or, where none runs the model at exactly that
  count (a global batch the data-parallel ranks cannot split, a count no mesh tiles), those of
  the fastest of the first `COMPARE` counts below it, in whole nodes, that have one (at most
  `MAX_TRIES` nodes fewer); the rest sit idle.
- `plan_layouts`: each layout, and the ZeRO-0 variant of a ZeRO-1 one, in every mode.
  The FT modes' replica groups are the layout's ``dp_replicate`` groups (`ft_replicas`): a
  ZeRO-1 layout shards its optimizer over them, so one group cannot heal from another and the
  FT modes have one group; its variant without ZeRO has more, smaller groups that fail alone
  more cheaply yet send more gradient bytes. The simulator takes groups of whole nodes: where a
  node holds ranks of several replica groups (``tp x cp x dp_shard`` not a multiple of the
  node's devices), adjacent groups are merged until each is whole nodes (`whole_node_groups`),
  down to one group.
- `replan`: for nodes lost, the layout to reshard into and its throughput (global batch kept).

    >>> from anyshard.trainer_integration.planning.hardware import load_hardware
    >>> from anyshard.trainer_integration.planning.model_shape import ModelShape
    >>> gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24,
    ...                  ffn=4 * 2304, vocab=51200, gated_mlp=False)
    >>> planner = Planner(gpt, load_hardware("a100-80gb"), Batch(512, 2048))
    >>> used, found, compared = planner.fit(56, {"pp": 1})  # unpipelined, 512 sequences
    >>> used, found[0].layout.gpus, [c["gpus"] for c in compared]  # need 2^n GPUs
    (32, 32, [32, 16, 8])
    >>> whole_node_groups(Layout(tp=2, dp_replicate=8), devices_per_node=8)  # 4 per node
    2
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from anyshard.trainer_integration.planning.failures import MODES, Summary, best_interval
from anyshard.trainer_integration.planning.hardware import Hardware
from anyshard.trainer_integration.planning.layout_search import (
    best_options,
    dim_candidates,
    search,
)
from anyshard.trainer_integration.planning.model_shape import ModelShape
from anyshard.trainer_integration.planning.recovery_costs import Cluster, Costs, Profile, costs
from anyshard.trainer_integration.planning.transformer_cost import Batch, Estimate, Layout

__all__ = [
    "COMPARE",
    "LOSSES",
    "MAX_TRIES",
    "Planner",
    "dominant",
    "ft_replicas",
    "layout_json",
    "plan_layouts",
    "replan",
    "whole_node_groups",
]

MAX_TRIES = 256  # GPU counts tried, one node fewer each, for one that has a layout
COMPARE = 4  # counts with a layout compared, for the fastest, where the count asked has none
LOSSES = (1, 2, 4, 8)  # nodes lost, for the re-plan table
MESH_DIMS = ("tp", "cp", "pp", "ep", "dp_shard", "dp_replicate")
REPLAN_PINS = ("recompute", "sequence_parallel")  # kept across a reshard; the rest re-chosen


class Planner:
    """Layout searches of one model, hardware and batch, each GPU count and pins searched once."""

    def __init__(
        self,
        shape: ModelShape,
        hw: Hardware,
        batch: Batch,
        *,
        flash_attention: bool = True,
    ) -> None:
        self.shape, self.hw, self.batch = shape, hw, batch
        self.flash_attention = flash_attention
        self._found: dict[tuple, list[Estimate] | None] = {}

    def layouts(self, gpus: int, pins: Mapping[str, Any]) -> list[Estimate] | None:
        """Every layout of exactly ``gpus`` that fits, fastest first (None: none)."""
        key = (gpus, tuple(sorted(pins.items())))
        if key not in self._found:
            found = None
            if self._may_tile(gpus, pins) and next(
                iter(dim_candidates(self.shape, self.hw, self.batch, gpus, pins)), None
            ):
                try:
                    found = search(self.shape, self.hw, self.batch, gpus, pins,
                                   flash_attention=self.flash_attention)  # fmt: skip
                except ValueError:
                    found = None
            self._found[key] = found
        return self._found[key]

    def _may_tile(self, gpus: int, pins: Mapping[str, Any]) -> bool:
        """Whether ``gpus`` can be tp x cp x pp x dp at all (a quick necessary test): dp
        divides the global batch, tp and cp are powers of two (or pinned), so what is left
        of ``gpus`` must divide pp, which is at most the layers."""
        cover = self.batch.global_batch * 2**20 * pins.get("tp", 1) * pins.get("cp", 1)
        return gpus // math.gcd(gpus, cover) <= pins.get("pp", self.shape.num_layers)

    def counts(self, gpus: int, pins: Mapping[str, Any], want: int) -> list[tuple[int, Any]]:
        """The first ``want`` GPU counts from ``gpus`` down, a node fewer each (at most
        `MAX_TRIES` tried), that have a layout, each with its layouts fastest first."""
        dpn, got = self.hw.devices_per_node, []
        for n in range(gpus, max(0, gpus - MAX_TRIES * dpn), -dpn):
            found = self.layouts(n, pins)
            if found:
                got.append((n, found))
                if len(got) == want:
                    break
        return got

    def fit(
        self, gpus: int, pins: Mapping[str, Any], *, exact: bool = True
    ) -> tuple[int, list[Estimate], list[dict[str, float]]]:
        """(GPUs used, their layouts fastest first, the counts compared): ``gpus`` where it
        has a layout and ``exact``, else the fastest of the first `COMPARE` counts below it
        (in whole nodes) that have one, which the largest such count often is not: an odd
        count needs a pipeline of as many stages. Raises ValueError, saying why, where none
        has within `MAX_TRIES` counts."""
        got = self.counts(gpus, pins, COMPARE)
        if not got:
            raise ValueError(self._why_none(gpus, pins))
        if exact and got[0][0] == gpus:
            got = got[:1]
        n, found = min(got, key=lambda c: c[1][0].step_s)  # ties: the most GPUs
        compared = [{"gpus": c, "tokens_per_s": self.batch.tokens / f[0].step_s} for c, f in got]
        return n, found, compared

    def _why_none(self, gpus: int, pins: Mapping[str, Any]) -> str:
        try:  # the search's own account of the count asked for
            search(self.shape, self.hw, self.batch, gpus, pins,
                   flash_attention=self.flash_attention)  # fmt: skip
            why = f"no layout of {gpus} GPUs"  # pragma: no cover - counts() found none
        except ValueError as e:
            why = str(e)
        lowest = max(self.hw.devices_per_node, gpus - (MAX_TRIES - 1) * self.hw.devices_per_node)
        return f"{why}; nor has any count down to {lowest} GPUs (whole nodes)"

    def zero0_variant(self, e: Estimate, pins: Mapping[str, Any]) -> Estimate | None:
        """``e``'s dims without ZeRO-1, its options chosen anew (None: it does not fit, or
        ``e`` has no ZeRO-1 or the user pinned it)."""
        if not e.layout.zero or "zero" in pins:
            return None
        dims = {d: getattr(e.layout, d) for d in MESH_DIMS}
        return best_options(self.shape, self.hw, self.batch, dims, {**pins, "zero": 0},
                            flash_attention=self.flash_attention)  # fmt: skip


def whole_node_groups(lay: Layout, devices_per_node: int) -> int:
    """The layout's replica groups as the simulator takes them, whole nodes each: its
    ``dp_replicate`` groups, or, where a node holds ranks of several (``tp x cp x dp_shard``
    ranks of one group are consecutive; pp is outermost), adjacent groups merged, the fewest
    that make whole nodes (1: the whole job)."""
    inner = lay.tp * lay.cp * lay.dp_shard
    per = 1  # groups merged into one
    while (inner * per) % devices_per_node or lay.dp_replicate % per:
        per += 1
        if per >= lay.dp_replicate:
            return 1
    return lay.dp_replicate // per


def ft_replicas(lay: Layout, devices_per_node: int) -> int:
    """FT-HSDP's replica groups: the layout's whole-node replica groups, one under ZeRO-1
    (its optimizer is sharded over them: no group holds a whole replica to heal another)."""
    return 1 if lay.zero else whole_node_groups(lay, devices_per_node)


def dominant(e: Estimate) -> str:
    """The breakdown's largest term in the step (overlapped communication is not in it)."""
    terms = {k: v for k, v in e.breakdown.items() if not k.endswith("_overlapped")}
    return max(terms, key=lambda k: terms[k])


def layout_json(e: Estimate) -> dict[str, Any]:
    """``Estimate.to_json()`` with the layout's short name and dominant term."""
    return {**e.to_json(), "name": e.layout.name(), "dominant": dominant(e)}


def _mode_costs(e: Estimate, base: Cluster, profile: Profile, dpn: int) -> dict[str, Costs]:
    """Each mode's event costs for ``e``: its own step time and checkpoint state, the restart
    modes saving once over its whole-node replica groups, the FT modes in `ft_replicas` (none
    where that is one group: FT-HSDP heals a group from another)."""
    cluster = dataclasses.replace(
        base, gpus=e.layout.gpus, gpus_per_node=dpn, step_s=e.step_s,
        state_gib=e.state_bytes / 2**30, replicas=whole_node_groups(e.layout, dpn),
    )  # fmt: skip
    restart = costs(profile, cluster)
    ft_groups = ft_replicas(e.layout, dpn)
    if ft_groups == 1:  # no peer group to heal from: a failure restarts the job, as above
        return {m: restart for m in MODES if not m.startswith("ft")}
    ft = restart
    if ft_groups != cluster.replicas:
        ft = costs(profile, dataclasses.replace(cluster, replicas=ft_groups))
    return {m: (ft if m.startswith("ft") else restart) for m in MODES}


def _plan_row(e: Estimate, s: Summary, c: Costs, batch: Batch, variant: bool) -> dict[str, Any]:
    return {
        "layout": e.layout.to_json(),
        "name": e.layout.name(),
        "zero0_variant": variant,
        "mode": s.mode,
        "every_steps": s.every_steps,
        "goodput": s.goodput[0],
        "goodput_ci": s.goodput[1],
        "ett": s.ett[0],
        "effective_tokens_per_s": s.goodput[0] * batch.tokens / e.step_s,
        "step_s": e.step_s,
        "replicas": c.groups,
        "failures": s.failures,
    }


def plan_layouts(
    planner: Planner,
    estimates: Sequence[Estimate],
    pins: Mapping[str, Any],
    profile: Profile,
    base: Cluster,
    *,
    days: float,
    seeds: int,
) -> list[dict[str, Any]]:
    """Every (layout, mode) at the mode's best interval, by effective tokens per second after
    failures (goodput x tokens per step / step time), best first. ``estimates`` and the ZeRO-0
    variants of their ZeRO-1 layouts; ``base`` states the cluster's failures and costs."""
    dpn = planner.hw.devices_per_node
    todo = [(e, False) for e in estimates]
    for e in estimates:
        v = planner.zero0_variant(e, pins)
        if v is not None:
            todo.append((v, True))
    rows = []
    for e, variant in todo:
        for mode, c in _mode_costs(e, base, profile, dpn).items():
            s = best_interval(mode, c, days, seeds)
            rows.append(_plan_row(e, s, c, planner.batch, variant))
    rows.sort(key=lambda r: -r["effective_tokens_per_s"])
    return rows


def replan(
    planner: Planner,
    gpus: int,
    pins: Mapping[str, Any],
    losses: Sequence[int] = LOSSES,
) -> list[dict[str, Any]]:
    """For each count of nodes lost from ``gpus``, the layout to reshard into (global batch
    kept; of the pins only `REPLAN_PINS` kept) and its throughput, or why there is none: the
    fastest layout of the first `COMPARE` GPU counts, from the healthy GPUs down in whole
    nodes, that have one (fewer GPUs can be faster: 56 need a 7-stage pipeline, 48 or 32
    need not); the healthy GPUs it leaves out sit idle."""
    dpn = planner.hw.devices_per_node
    keep = {k: v for k, v in pins.items() if k in REPLAN_PINS}
    rows = []
    for k in losses:
        healthy = gpus - k * dpn
        row: dict[str, Any] = {"nodes_lost": k, "gpus_healthy": healthy}
        try:
            if healthy < 1:
                raise ValueError(f"{gpus} GPUs less {k} node(s) of {dpn} leave none")
            used, found, compared = planner.fit(healthy, keep, exact=False)
        except ValueError as e:
            rows.append({**row, "layout": None, "error": str(e)})
            continue
        best = found[0]
        tokens_s = planner.batch.tokens / best.step_s
        rows.append({
            **row, "gpus_used": used, "idle_gpus": healthy - used,
            "layout": best.layout.to_json(), "name": best.layout.name(),
            "step_s": best.step_s, "tokens_per_s": tokens_s,
            "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu, "mfu": best.mfu,
            "counts_compared": compared,
        })  # fmt: skip
    return rows
