"""Online data shares from the own work the ranks measured: where to move, whether the move is
worth it, and whether a move made the step worse, each judged against the noise the run's own
steps show rather than a fixed margin.

A data rank's own work per step is modelled as a line in its share, ``fixed + per_sample x
share`` (`Lines`): the fixed part (the optimizer, the collectives' latency) does not move with
the share. With one measured share a rank's line goes through the origin (all of its work per
sample); once a rank has been measured under two shares its line is their secant, so the next
move lands on the balance instead of creeping up on it. `balanced` gives the shares at which
every rank's predicted own work is the same.

Noise is measured, not assumed: each step of a window gives its own estimate of what a move
saves (`step_gains`), and a move is made only when the median of those estimates beats both a
floor and ``z`` standard errors of that median (`median_error`: the steps' spread by their
median absolute deviation, robust to the odd step a save or a burst makes long). A move that
measured the busiest rank's own work longer than before it by more than the same kind of bound
goes back (`worse`).

    >>> lines = fit([0.2, 0.4], (6, 6))  # rank 1 takes twice as long per sample
    >>> balanced(lines, 12)
    (8, 4)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Lines",
    "Move",
    "back_to_even",
    "balanced",
    "fit",
    "median_error",
    "propose",
    "spread",
    "worse",
]

MAD_SIGMA = 1.4826  # a normal spread's standard deviation per median absolute deviation
MEDIAN_SE = 1.2533  # a median's standard error over a mean's, for normal noise
SLOPE_RANGE = (0.2, 1.0)  # a secant's per-sample work against the line through the origin


def spread(values: Sequence[float]) -> float:
    """A robust standard deviation of ``values``: their median absolute deviation, scaled.

    >>> round(spread([1.0, 1.1, 0.9, 5.0]), 4)  # the outlier hardly counts
    0.1483
    """
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return MAD_SIGMA * statistics.median(abs(v - mid) for v in values)


def median_error(values: Sequence[float]) -> float:
    """The standard error of the median of ``values`` (0 for fewer than two)."""
    return MEDIAN_SE * spread(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Lines:
    """Each data rank's own work per step as a line in its share: ``fixed[i] + per_sample[i] x
    share``."""

    fixed: tuple[float, ...]
    per_sample: tuple[float, ...]

    def at(self, shares: Sequence[int]) -> list[float]:
        """Each rank's predicted own work per step under ``shares``."""
        return [a + b * s for a, b, s in zip(self.fixed, self.per_sample, shares, strict=True)]


def fit(
    own: Sequence[float],
    shares: Sequence[int],
    before: tuple[Sequence[float], Sequence[int]] | None = None,
) -> Lines:
    """Each rank's line from its median own work ``own`` under ``shares``: through the origin,
    or the secant through ``before`` (own work and shares measured under the shares before)
    where the rank's share moved by two samples or more and the secant rises no steeper than the
    line through the origin (a secant that falls, or has work below zero at no samples, means
    the rank's speed changed between the two: the older point no longer describes it). A
    secant flatter than `SLOPE_RANGE`'s low end of the line through the origin is taken at that
    end (a rank's own work also holds waits that shrink as its share grows).

    >>> lines = fit([0.5, 0.3], (6, 2), before=([0.4, 0.4], (4, 4)))
    >>> [round(x, 3) for x in lines.fixed], [round(x, 3) for x in lines.per_sample]
    ([0.2, 0.2], [0.05, 0.05])
    """
    fixed, per = [], []
    for i, (m, s) in enumerate(zip(own, shares, strict=True)):
        through_origin = m / max(s, 1)
        slope = through_origin
        if before is not None and abs(s - before[1][i]) >= 2:
            secant = (m - before[0][i]) / (s - before[1][i])
            lo, hi = (k * through_origin for k in SLOPE_RANGE)
            if 0 < secant <= hi:
                slope = max(lo, secant)
        fixed.append(m - slope * s)
        per.append(slope)
    return Lines(tuple(fixed), tuple(per))


def balanced(lines: Lines, global_batch: int, least: int = 1) -> tuple[int, ...]:
    """Whole shares of ``global_batch`` (each at least ``least``) that make the ranks' predicted
    own work as even as whole samples can: the real-valued balance first, then each sample
    left over to the rank whose predicted work stays lowest with it."""
    n = len(lines.fixed)
    if global_batch < n * least:
        raise ValueError(f"a global batch of {global_batch} has no {least} samples for each of {n}")
    free = set(range(n))
    want = [float(least)] * n
    while free:  # the balance among the ranks not held at the floor
        a = [lines.fixed[i] for i in free]
        b = [lines.per_sample[i] for i in free]
        room = global_batch - least * (n - len(free))
        level = (room + sum(x / y for x, y in zip(a, b, strict=True))) / sum(1 / y for y in b)
        for i in free:
            want[i] = (level - lines.fixed[i]) / lines.per_sample[i]
        low = {i for i in free if want[i] < least}
        if not low:
            break
        for i in low:
            want[i] = float(least)
        free -= low
    out = [max(least, math.floor(w)) for w in want]

    def work(i: int, extra: int) -> float:
        return lines.fixed[i] + lines.per_sample[i] * (out[i] + extra)

    while sum(out) > global_batch:  # the floor's clamps took more than the batch holds
        out[max((i for i in range(n) if out[i] > least), key=lambda i: work(i, 0))] -= 1
    while sum(out) < global_batch:
        out[min(range(n), key=lambda i: (work(i, 1), i))] += 1
    return tuple(out)


def step_gains(
    steps: Sequence[Sequence[float]], shares: Sequence[int], new: Sequence[int], lines: Lines
) -> list[float]:
    """Per step, the share of the busiest rank's own work that ``new`` would save: each rank's
    measured work moved along its line by the samples it gains or gives."""
    gains = []
    for own in steps:
        now = max(own)
        then = max(
            o + b * (t - s) for o, b, s, t in zip(own, lines.per_sample, shares, new, strict=True)
        )
        gains.append(1 - then / now if now > 0 else 0.0)
    return gains


@dataclass(frozen=True)
class Move:
    """New shares worth moving to: ``gain``, the median share of the busiest rank's own work
    per step they are predicted to save; ``bound``, what it had to beat (the floor, or the
    measured noise); ``slow``, the data rank that gives the most samples."""

    shares: tuple[int, ...]
    gain: float
    bound: float
    slow: int
    lines: Lines


def propose(
    steps: Sequence[Sequence[float]],
    shares: Sequence[int],
    global_batch: int,
    *,
    floor: float,
    z: float,
    before: tuple[Sequence[float], Sequence[int]] | None = None,
) -> Move | None:
    """The move ``steps`` (each data rank's own work per step, all under ``shares``) call for,
    or None: straight back to even where a rank given more samples became the busiest
    (`back_to_even`); else to the balance of the fitted lines (`fit`, `balanced`; even instead where
    its predicted busiest rank is within the bound of the balance's: even shares need no
    reason), and only where the median predicted saving beats ``floor`` and ``z`` standard
    errors of that median."""
    n = len(shares)
    own = [statistics.median(col) for col in zip(*steps, strict=True)]
    back = back_to_even(steps, shares, global_batch, floor=floor, z=z)
    if back is not None:
        return back
    lines = fit(own, shares, before)
    least = max(1, global_batch // (8 * n))  # a rank keeps an eighth of an even share
    new = balanced(lines, global_batch, least)
    first = step_gains(steps, shares, new, lines)
    bound = max(floor, z * median_error(first))
    even = tuple([global_batch // n] * n) if global_batch % n == 0 else None
    if even is not None and new != even:
        at_even, at_new = max(lines.at(even)), max(lines.at(new))
        if at_even <= at_new * (1 + bound):
            new = even
    if tuple(new) == tuple(shares):
        return None
    gains = step_gains(steps, shares, new, lines)
    gain = statistics.median(gains)
    bound = max(floor, z * median_error(gains))
    if gain <= bound:
        return None
    slow = min(range(n), key=lambda i: (new[i] - shares[i], i))
    return Move(tuple(new), gain, bound, slow, lines)


def back_to_even(
    steps: Sequence[Sequence[float]],
    shares: Sequence[int],
    global_batch: int,
    *,
    floor: float,
    z: float,
) -> Move | None:
    """Even shares, where the busiest data rank is one that holds more than an even share and
    works longer than every rank that holds no more, per step, by more than ``floor`` and ``z``
    standard errors (a slow rank that recovered: the ranks it gave samples to are now the busy
    ones). Straight to even rather than along the lines: a recovered rank's line, fitted while
    it was slow, no longer holds, and a small share's fixed work makes it look slow per sample.
    The next window judges the move like any other (`worse`).

    >>> back_to_even([[0.2, 0.1]] * 10, (19, 5), 24, floor=0.1, z=3).shares
    (12, 12)
    """
    n = len(shares)
    if global_batch % n or n < 2:
        return None
    even = global_batch // n
    own = [statistics.median(col) for col in zip(*steps, strict=True)]
    busiest = max(range(n), key=lambda i: (own[i], -i))
    small = [j for j in range(n) if shares[j] <= even]
    if shares[busiest] <= even or not small:
        return None
    apart = [1 - max(step[j] for j in small) / step[busiest] for step in steps if step[busiest]]
    if not apart:
        return None
    gain, bound = statistics.median(apart), max(floor, z * median_error(apart))
    if gain <= bound:
        return None
    lines = fit(own, shares)
    return Move(tuple([even] * n), gain, bound, busiest, lines)


def worse(
    before: Sequence[float], after: Sequence[float], *, floor: float, z: float
) -> tuple[bool, float]:
    """Whether the per-step figures ``after`` (the busiest rank's own work under new shares)
    are worse than ``before`` beyond the noise both show: their medians differ by more than
    ``floor`` and ``z`` standard errors of the difference; and that bound (as a fraction of
    the median before).

    >>> worse([1.0, 1.02, 0.98, 1.0], [1.1, 1.12, 1.08, 1.1], floor=0.03, z=3)[0]
    True
    >>> worse([1.0, 1.2, 0.8, 1.0], [1.1, 1.3, 0.9, 1.1], floor=0.03, z=3)[0]
    False
    """
    was, now = statistics.median(before), statistics.median(after)
    error = math.hypot(median_error(before), median_error(after))
    bound = max(floor, z * error / was) if was > 0 else floor
    return now > was * (1 + bound), bound
