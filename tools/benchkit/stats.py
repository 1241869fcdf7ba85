"""Repetitions and what is made of them: systems alternated in rotated order (`rotations`,
`paired`), medians and spreads over repetitions, each repetition's worst rank, rank correlation.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .measure import measure

if TYPE_CHECKING:
    from .report import Records


def rotations(names: Sequence[str], reps: int) -> Iterator[tuple[int, list[str]]]:
    """``(rep, order)``: the systems rotated by one each repetition (A B C, B C A, ...)."""
    for rep in range(reps):
        yield rep, list(names[rep % len(names) :]) + list(names[: rep % len(names)])


def paired(
    systems: dict[str, Callable[[], Any]],
    reps: int,
    *,
    before: Callable[[str], Any] | None = None,
    check: Callable[[str], Any] | None = None,
    other_pids: Sequence[int] = (),
    records: Records | None = None,
    **labels: Any,
) -> dict[str, list[dict]]:
    """`measure` every system once per repetition in `rotations` order: ``before(name)`` ahead
    of each (untimed), ``check(name)`` after it (stored as ``exact``); the records per system,
    each also added to ``records`` with ``labels``."""
    out: dict[str, list[dict]] = {n: [] for n in systems}
    for rep, order in rotations(list(systems), reps):
        for name in order:
            if before is not None:
                before(name)
            rec = measure(systems[name], other_pids)
            if check is not None:
                rec["exact"] = check(name)
            out[name].append(records.add(rec, system=name, rep=rep, **labels) if records else rec)
    return out


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (NaN for none)."""
    return statistics.median(xs) if len(xs) else float("nan")


def median_of(recs: Sequence[dict], key: str) -> float:
    """The median of one counter over repetitions' records."""
    return median([r[key] for r in recs])


def fmt_spread(xs: Sequence[float], form: str = ".2f") -> str:
    """``median [min-max]``, or the one value."""
    tail = f" [{min(xs):{form}}-{max(xs):{form}}]" if len(xs) > 1 else ""
    return f"{median(xs):{form}}{tail}"


def medians(recs: Sequence[dict], keys: Sequence[str], missing: float = 0.0) -> dict[str, float]:
    """The median of each counter in ``keys`` over repetitions' records (``missing`` where a
    record lacks it)."""
    return {k: median([r.get(k, missing) for r in recs]) for k in keys}


def worst_ranks(reps: Sequence[Sequence[dict]], keys: Sequence[str]) -> dict[str, list[float]]:
    """Per counter in ``keys``, each repetition's worst rank: the largest value over the records
    of its ranks (the slowest rank's time, the most bytes one rank read)."""
    return {k: [max(r[k] for r in ranks) for ranks in reps] for k in keys}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation of two equally long lists (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        s = sorted(v)
        return [s.index(x) + (s.count(x) - 1) / 2 for x in v]

    try:
        return statistics.correlation(ranks(xs), ranks(ys))
    except statistics.StatisticsError:  # fewer than two values, or all alike
        return float("nan")
