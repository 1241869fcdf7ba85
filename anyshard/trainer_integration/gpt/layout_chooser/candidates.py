"""Choose a layout for a world size: what an elastic job does when it re-forms on fewer or more
ranks than its configured layout has.

`choose_layout` enumerates every mesh (pp, dp_replicate, dp_shard, ep, cp, tp) whose degrees
multiply to the world size, keeps those the model splits over evenly and the batch divides
over (the rules `config.validate` applies), estimates each one's memory per rank (parameters,
gradients and AdamW's two moments in fp32, sharded by pp x tp x dp_shard x ep x cp), drops those
over the budget, and prefers, in order: the configured layout itself; keeping the configured
pp, tp, ep and cp degrees (they shape the model's code paths; data parallelism absorbs the
change); sharding over replicating (less memory); fewer pipeline stages. It says why.

>>> from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
>>> cfg = Config(parallel=ParallelConfig(pp=2, dp_shard=2))
>>> choice = choose_layout(cfg, 2, memory_bytes=1 << 30)
>>> choice.parallel.dims()
(('pp', 2), ('dp_replicate', 1), ('dp_shard', 1), ('ep', 1), ('cp', 1), ('tp', 1))
>>> print(choice.reasons[0])
the configured layout pp=2 x dp_shard=2 needs 4 ranks, 2 run
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from anyshard.trainer_integration.gpt.config import MESH_ORDER, Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.memory import (
    default_budget,
    parameter_count,
    state_bytes,
)
from anyshard.trainer_integration.gpt.layout_chooser.valid import batch_problems, split_problems

__all__ = [
    "Choice",
    "candidate_layouts",
    "choose_layout",
    "default_budget",
    "layout_text",
    "parameter_count",
    "state_bytes",
]


@dataclass(frozen=True)
class Choice:
    """The layout chosen for a world size, and why (the first reason is the situation)."""

    parallel: ParallelConfig
    reasons: tuple[str, ...]
    bytes_per_rank: int


def layout_text(p: ParallelConfig) -> str:
    """``pp=2 x dp_shard=2`` (the degrees that are not 1), or ``single``."""
    parts = [f"{d}={getattr(p, d)}" for d in MESH_ORDER if getattr(p, d) > 1]
    return " x ".join(parts) or "single"


def _candidates(world: int):
    """Every assignment of degrees to the six mesh dims that multiplies to ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for degrees in itertools.product(divisors, repeat=len(MESH_ORDER)):
        if math.prod(degrees) == world:
            yield dict(zip(MESH_ORDER, degrees, strict=True))


def candidate_layouts(
    cfg: Config,
    world: int,
    budget: int,
    *,
    memory: Callable[[Config, ParallelConfig], int] = state_bytes,
) -> tuple[list[tuple[ParallelConfig, int]], list[tuple[str, str]]]:
    """The layouts of ``world`` ranks the model splits over evenly, the batch divides over and
    whose ``memory`` per rank fits ``budget``, each with that memory; and the others, each with
    its first problem. The configured schedule and microbatches are kept."""
    fits, rejected = [], []
    for sizes in _candidates(world):
        p = dataclasses.replace(cfg.parallel, **sizes, relayout_at=None)
        problems = split_problems(cfg.model, p) + batch_problems(cfg.model, p, cfg.train)
        if p.cp > 1 and cfg.model.n_experts:
            problems.append("context parallelism is not combined with experts here")
        need = memory(cfg, p)
        if need > budget:
            problems.append(
                f"{need / 2**20:.0f} MiB per rank exceeds the {budget / 2**20:.0f} MiB budget"
            )
        if problems:
            rejected.append((layout_text(p), problems[0]))
        else:
            fits.append((p, need))
    return fits, rejected


def choose_layout(cfg: Config, world: int, *, memory_bytes: int | None = None) -> Choice:
    """The layout for ``world`` ranks (see the module docstring); `ValueError` when none fits,
    naming why the closest ones do not."""
    want = cfg.parallel
    budget = memory_bytes if memory_bytes is not None else default_budget()
    if want.world_size == world:
        situation = f"the configured layout {layout_text(want)} fits {world} ranks"
    else:
        situation = (
            f"the configured layout {layout_text(want)} needs {want.world_size} ranks, {world} run"
        )
    fits, rejected = candidate_layouts(cfg, world, budget)
    scored = []
    for p, need in fits:
        keeps = sum(getattr(p, d) == getattr(want, d) for d in ("pp", "tp", "ep", "cp"))
        score = (
            p == dataclasses.replace(want, relayout_at=None),
            keeps,
            p.dp_shard >= p.dp_replicate,  # shard rather than replicate
            -p.pp,
            -p.tp,
            -p.cp,
            p.dp_shard,
        )
        scored.append((score, p, need))
    if not scored:
        raise ValueError(
            f"no layout of {world} ranks fits the model and batch ({situation}):\n  "
            + "\n  ".join(f"{name}: {why}" for name, why in rejected[:8])
        )
    scored.sort(key=lambda x: x[0], reverse=True)
    _, best, need = scored[0]
    reasons = [situation]
    if best == dataclasses.replace(want, relayout_at=None):
        reasons.append("kept it")
    else:
        kept = [
            f"{d}={getattr(best, d)}"
            for d in ("pp", "tp", "ep", "cp")
            if getattr(best, d) == getattr(want, d) and getattr(want, d) > 1
        ]
        changed = [
            f"{d} {getattr(want, d)} -> {getattr(best, d)}"
            for d in MESH_ORDER
            if getattr(best, d) != getattr(want, d)
        ]
        if kept:
            reasons.append(f"kept the configured {', '.join(kept)}")
        reasons.append(
            f"changed {', '.join(changed)}; {len(scored)} layouts fit, {len(rejected)} do not"
        )
    reasons.append(
        f"about {need / 2**20:.1f} MiB per rank for parameters, gradients and AdamW state "
        f"(budget {budget / 2**20:.0f} MiB)"
    )
    return Choice(best, tuple(reasons), need)
