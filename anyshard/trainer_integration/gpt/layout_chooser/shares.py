"""Data-parallel shares of the global batch: what the layout scheduler gives a slow data rank.

A data rank that takes longer per sample gets fewer samples of the same global batch, in
proportion to its measured speed (`shares_for`), moved half-way at a time (`halfway`); only
layouts without pipeline stages or experts take uneven shares (`shares_move`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from anyshard.trainer_integration.gpt.config import ParallelConfig

__all__ = ["halfway", "peak", "shares_for", "shares_move"]


def shares_for(busy: Sequence[float], shares: Sequence[int], global_batch: int) -> list[int]:
    """New data shares of ``global_batch``, proportional to each data rank's measured speed
    (``shares[i]`` samples in ``busy[i]`` seconds); every rank keeps at least one sample and the
    shares add up to the global batch (largest remainders get the leftover samples).

    >>> shares_for([2.0, 1.0], [4, 4], 8)  # rank 0 took twice as long for the same share
    [3, 5]
    >>> shares_for([1.0, 1.0, 1.0], [2, 3, 3], 8)
    [2, 3, 3]
    """
    if len(busy) != len(shares) or sum(shares) != global_batch:
        raise ValueError(f"{len(busy)} busy times for {len(shares)} shares of {global_batch}")
    speed = [n / max(b, 1e-9) for n, b in zip(shares, busy, strict=True)]
    spare = global_batch - len(speed)  # one sample each first
    if spare < 0:
        raise ValueError(f"a global batch of {global_batch} has no sample for each of {len(speed)}")
    ideal = [spare * s / sum(speed) for s in speed]
    out = [1 + int(x) for x in ideal]
    order = sorted(range(len(ideal)), key=lambda i: (int(ideal[i]) - ideal[i], i))
    for i in order[: global_batch - sum(out)]:
        out[i] += 1
    return out


def peak(busy: Sequence[tuple[float, ...]]) -> float | None:
    """The busiest data rank's compute per step over a window (its median), or None."""
    return statistics.median(max(b) for b in busy) if busy else None


def halfway(shares: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Shares half-way from ``shares`` to ``target`` (same total), each moving at least one
    sample towards its target where it differs.

    >>> halfway((8, 8), (12, 4))
    (10, 6)
    >>> halfway((10, 6), (11, 5))
    (11, 5)
    """
    out = []
    for a, b in zip(shares, target, strict=True):
        step = (b - a) / 2
        out.append(a + (math.ceil(step) if step > 0 else math.floor(step)))
    extra = sum(out) - sum(shares)  # rounding away from zero on both sides may add samples
    order = sorted(range(len(out)), key=lambda i: out[i] - target[i], reverse=extra > 0)
    for i in order[: abs(extra)]:
        out[i] -= 1 if extra > 0 else -1
    return tuple(out)


def shares_move(p: ParallelConfig) -> bool:
    """Whether data ranks can take uneven shares under ``p``: not with pipeline stages (their
    microbatches split each share) nor experts (their ranks route tokens to each other)."""
    return p.pp == 1 and p.ep == 1
