"""A spec compiled for every rank of a layout: what each rank writes, and whether the written
local tensors hold every logical tensor exactly once.

Ranks are the coordinates of the spec's mesh in row-major order (`coords_of_rank`); callers that
number them otherwise pass ``rank_of`` for their messages.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from anyshard.geometry.boxes import box_numel, intersect
from anyshard.geometry.shards import Shard
from anyshard.ucl.evaluate import LocalTensor, all_coords, compile, coords_of_rank, layout_for
from anyshard.ucl.library import parse

__all__ = [
    "RankTensors",
    "WrittenPart",
    "compile_every_rank",
    "coverage_problems",
    "logical_shapes",
    "written_parts",
]


@dataclass(frozen=True, slots=True)
class RankTensors:
    """The local tensors of the rank at ``coords``, by local name."""

    coords: dict[str, int]
    tensors: dict[str, LocalTensor]


@dataclass(frozen=True, slots=True)
class WrittenPart:
    """Local tensor ``key``, written by the rank at ``coords``, holds ``shard`` of a logical
    tensor (the primary copy: each logical region is written by one rank)."""

    coords: dict[str, int]
    key: str
    shard: Shard


@functools.lru_cache(maxsize=16)
def compile_every_rank(
    text: str, layout: tuple[tuple[str, int], ...], ranks: tuple[int, ...] | None = None
) -> tuple[RankTensors, ...]:
    """The spec ``text`` compiled for every coordinate of its mesh under ``layout`` (sorted
    items of mesh sizes and params), in row-major order; or only for the row-major ``ranks``
    given (those outside the mesh are skipped). Cached, as a manifest's spec is compiled by
    every reader of it."""
    spec = parse(text)
    lay = layout_for(spec, dict(layout))
    if ranks is None:
        coords = list(all_coords(lay.sizes))
    else:
        coords = [coords_of_rank(lay.sizes, r) for r in ranks if 0 <= r < lay.world_size]
    return tuple(RankTensors(c, compile(spec, lay, c)) for c in coords)


def written_parts(ranks: tuple[RankTensors, ...]) -> dict[str, list[WrittenPart]]:
    """Logical name -> the written parts that hold it, over every rank."""
    out: dict[str, list[WrittenPart]] = {}
    for r in ranks:
        for name, t in r.tensors.items():
            if not t.written:
                continue
            for part in t.parts:
                if part.primary:
                    out.setdefault(part.logical, []).append(WrittenPart(r.coords, name, part.shard))
    return out


def logical_shapes(ranks: tuple[RankTensors, ...]) -> dict[str, tuple[int, ...]]:
    """Every logical tensor that some rank holds, with its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for r in ranks:
        for t in r.tensors.values():
            for part in t.parts:
                out.setdefault(part.logical, part.logical_shape)
    return out


def coverage_problems(
    ranks: tuple[RankTensors, ...],
    rank_of: Callable[[Mapping[str, int]], int],
    limit: int = 8,
) -> list[str]:
    """Logical tensors that the written local tensors do not hold exactly once."""
    sources = written_parts(ranks)
    problems = []
    for logical, shape in sorted(logical_shapes(ranks).items()):
        boxes = [
            (p.logical_box, s)
            for s in sources.get(logical, ())
            for p in s.shard.pieces
            if box_numel(p.logical_box)
        ]
        held, want = sum(box_numel(b) for b, _ in boxes), math.prod(shape)
        where = ""
        if held == want and len(boxes) <= 4096:
            for i, (a, sa) in enumerate(boxes):
                for b, sb in boxes[i + 1 :]:
                    if intersect(a, b) is not None:
                        where = (
                            f"; {sa.key} (rank {rank_of(sa.coords)}) and {sb.key} "
                            f"(rank {rank_of(sb.coords)}) both save {list(intersect(a, b))}"
                        )
                        held = want + 1
                        break
                if where:
                    break
        if held != want:
            problems.append(
                f"{logical}: the saved local tensors hold {held} of its {want} elements{where}"
            )
        if len(problems) >= limit:
            break
    return problems
