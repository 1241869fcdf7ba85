"""Checking a spec under a layout, and explaining where a tensor lives: pure text out.

`check_layout` compiles the spec for every rank and reports logical tensors that the ranks'
primary copies do not cover exactly once, and logical names given different shapes. `explain`
draws which rank holds which region of a logical tensor (or what a local tensor holds).
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from dataclasses import dataclass

from anyshard.geometry.boxes import Box, box_numel, intersect
from anyshard.ucl.evaluate import Layout, LocalTensor, all_coords, compile, layout_for
from anyshard.ucl.syntax import Spec

__all__ = ["LayoutReport", "check_layout", "explain"]


@dataclass(frozen=True, slots=True)
class LayoutReport:
    ranks: int
    local_tensors: int  # summed over ranks
    logical: dict[str, tuple[int, ...]]
    problems: list[str]


def _compile_all(spec: Spec, lay: Layout) -> list[tuple[dict[str, int], dict[str, LocalTensor]]]:
    return [(c, compile(spec, lay, c)) for c in all_coords(lay.sizes)]


def _fmt_coords(c: Mapping[str, int]) -> str:
    return ",".join(f"{d}={v}" for d, v in c.items()) or "-"


def check_layout(spec: Spec, layout: Mapping[str, int]) -> LayoutReport:
    """Compile ``spec`` for every rank of ``layout`` and check that every logical tensor is
    covered exactly once by the ranks' primary (saved) copies, with one shape everywhere."""
    lay = layout_for(spec, layout)
    ranks = _compile_all(spec, lay)
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: dict[str, list[tuple[Box, str]]] = {}
    problems: list[str] = []
    n_local = 0
    for coords, locals_ in ranks:
        for name, t in locals_.items():
            n_local += 1
            for part in t.parts:
                known = shapes.setdefault(part.logical, part.logical_shape)
                if known != part.logical_shape:
                    problems.append(
                        f"{part.logical}: shape {list(part.logical_shape)} in {name} at "
                        f"{_fmt_coords(coords)} (rule at line {t.rule.line}), {list(known)} elsewhere"
                    )
                if part.primary and t.written:
                    where = f"{name} at {_fmt_coords(coords)}"
                    boxes.setdefault(part.logical, []).extend(
                        (p.logical_box, where)
                        for p in part.shard.pieces
                        if box_numel(p.logical_box)
                    )
    for logical, shape in sorted(shapes.items()):
        held = boxes.get(logical, [])
        total = sum(box_numel(b) for b, _ in held)
        want = math.prod(shape)
        if total < want:
            problems.append(
                f"{logical}: the saved copies hold {total} of its {want} elements; no rank saves "
                "the rest (a replicate() or on() that leaves no primary copy, or an alias only?)"
            )
            continue
        if len(held) <= 2048:
            for i, (a, wa) in enumerate(held):
                hit = next(((b, wb) for b, wb in held[i + 1 :] if intersect(a, b)), None)
                if hit is not None:
                    problems.append(
                        f"{logical}: region {list(intersect(a, hit[0]))} is saved twice, by "
                        f"{wa} and {hit[1]}; mark one copy with replicate() or on()"
                    )
                    break
        if total > want and not any(p.startswith(f"{logical}:") for p in problems):
            problems.append(f"{logical}: the saved copies hold {total} elements, {want} exist")
    return LayoutReport(len(ranks), n_local, dict(sorted(shapes.items())), problems)


_SYMBOLS = string.digits + string.ascii_letters


def _symbol(i: int) -> str:
    return _SYMBOLS[i] if i < len(_SYMBOLS) else "*"


def _grid(shape: tuple[int, ...], owners: list[tuple[Box, int]], rows: int, cols: int) -> list[str]:
    """A character map of a 1-D/2-D view of the tensor: each cell shows its owner's symbol."""
    if len(shape) == 0:
        shape = (1,)
    h = shape[0] if len(shape) >= 2 else 1
    w = math.prod(shape[1:]) if len(shape) >= 2 else shape[0]
    nr, nc = max(1, min(rows, h)), max(1, min(cols, w))
    out = []
    for i in range(nr):
        r = i * h // nr
        line = []
        for j in range(nc):
            c = j * w // nc
            idx = [r, *_unravel(c, shape[1:])] if len(shape) >= 2 else [c]
            sym = "."
            for box, owner in owners:
                if all(lo <= x < hi for x, (lo, hi) in zip(idx, box, strict=True)):
                    sym = _symbol(owner)
                    break
            line.append(sym)
        out.append("".join(line))
    return out


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return list(reversed(out))


def explain(
    spec: Spec, layout: Mapping[str, int], name: str, *, rows: int = 12, cols: int = 48
) -> str:
    """Which rank holds which region of logical tensor ``name`` (with a map), or, for a local
    tensor name, what each rank's copy holds."""
    lay = layout_for(spec, layout)
    ranks = _compile_all(spec, lay)
    lines: list[str] = []
    logical_hits = []
    local_hits = []
    for rank, (coords, locals_) in enumerate(ranks):
        for lname, t in locals_.items():
            if lname == name:
                local_hits.append((rank, coords, t))
            for part in t.parts:
                if part.logical == name and part.shard.pieces:
                    logical_hits.append((rank, coords, lname, t, part))
    if not logical_hits and not local_hits:
        from difflib import get_close_matches

        names = {p.logical for _, ls in ranks for t in ls.values() for p in t.parts}
        names |= {n for _, ls in ranks for n in ls}
        close = get_close_matches(name, sorted(names), n=3)
        hint = f"; close: {', '.join(close)}" if close else ""
        raise KeyError(f"{name!r} is neither a logical nor a local tensor under this layout{hint}")
    sizes = " x ".join(f"{d}={n}" for d, n in lay.sizes.items())
    if logical_hits:
        shape = logical_hits[0][4].logical_shape
        lines.append(f"{name}  {list(shape)}  under {sizes} ({len(ranks)} ranks)")
        owners: list[tuple[Box, int]] = []
        for rank, coords, lname, t, part in logical_hits:
            regions = [p.logical_box for p in part.shard.pieces if box_numel(p.logical_box)]
            role = "alias" if t.alias else ("saved" if part.primary else "replica")
            shown = _regions(regions)
            lines.append(
                f"  [{_symbol(rank)}] rank {rank:<3} {_fmt_coords(coords):<22} {lname}  {role}  {shown}"
            )
            if part.primary and t.written:
                owners += [(b, rank) for b in regions]
        lines.append("")
        view = "rows x columns" if len(shape) >= 2 else "elements"
        lines.append(f"  saved copies ({view}; each cell shows the rank that saves it):")
        lines += ["    " + g for g in _grid(shape, owners, rows, cols)]
    if local_hits:
        if lines:
            lines.append("")
        lines.append(f"local tensor {name} under {sizes}:")
        for rank, coords, t in local_hits:
            note = " (alias: not saved)" if t.alias else ""
            tr = f", transposed {t.transpose}" if t.transpose else ""
            lines.append(f"  rank {rank} {_fmt_coords(coords)}: shape {list(t.shape)}{tr}{note}")
            for part in t.parts:
                for p in part.shard.pieces:
                    where = (
                        f"elements {p.base}..{p.base + math.prod(p.array_shape)} as {list(p.array_shape)}"
                        if p.base or p.array_shape != part.shard.shape
                        else ""
                    )
                    lines.append(
                        f"    {_regions([p.array_box])}{(' ' + where) if where else ''} <- "
                        f"{part.logical}{_regions([p.logical_box])}"
                        + ("" if part.primary else "  (replica)")
                    )
    return "\n".join(lines)


def _regions(boxes: list[Box]) -> str:
    if not boxes:
        return "(nothing)"
    parts = []
    for b in boxes[:4]:
        parts.append("[" + ", ".join(f"{lo}:{hi}" for lo, hi in b) + "]")
    more = f" +{len(boxes) - 4} more" if len(boxes) > 4 else ""
    return " ".join(parts) + more
