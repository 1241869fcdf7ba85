"""Data-parallel shares of the global batch: what the layout scheduler gives a slow data rank.

A data rank that takes longer per sample gets fewer samples of the same global batch, in
proportion to its measured speed (`shares_for`; online, the scheduler moves to the balance of
each rank's measured own work, `balance`); only layouts without pipeline stages or experts
take uneven shares (`shares_move`).
"""

from __future__ import annotations

from collections.abc import Sequence

from anyshard.trainer_integration.gpt.config import ParallelConfig

__all__ = ["shares_for", "shares_move"]


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


def shares_move(p: ParallelConfig) -> bool:
    """Whether data ranks can take uneven shares under ``p``: not with pipeline stages (their
    microbatches split each share) nor experts (their ranks route tokens to each other)."""
    return p.pp == 1 and p.ep == 1
