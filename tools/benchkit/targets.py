"""A benchmark's targets: checks ``(name, ok, detail)``, made alike and printed as one list."""

from __future__ import annotations

from collections.abc import Sequence

Check = tuple[str, bool | None, str]  # ok None: for information, no target


def targets(checks: Sequence[Check]) -> str:
    """``Targets:`` and a line per check ``(name, ok, detail)``: ``- PASS name: detail`` (or
    ``FAIL``; ``INFO`` where ``ok`` is None)."""
    verdict = lambda ok: "INFO" if ok is None else "PASS" if ok else "FAIL"  # noqa: E731
    return "\n".join(["Targets:", "", *(f"- {verdict(ok)} {n}: {d}" for n, ok, d in checks)])


def at_most(name: str, value: float, limit: float, ref: float, unit: str = "s") -> Check:
    """Whether ``value`` is at most ``limit`` x ``ref``, the three figures in the detail:
    ``1.20 s vs 1.1 x 1.00 s = 1.10 s``."""
    detail = f"{value:.2f} {unit} vs {limit} x {ref:.2f} {unit} = {limit * ref:.2f} {unit}"
    return name, value <= limit * ref, detail
