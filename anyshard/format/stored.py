"""Where the stored shards of a logical tensor are, whichever way the manifest describes them.

A tensor entry with a mapping has one stored shard per coordinate of its mesh, under its own
name. A checkpoint saved with a UCL spec stores each rank's local tensors under their local
names; compiling the spec for every coordinate of its mesh says which logical regions each holds
(`spec_index`). Both give the same thing: ``(rank, key, shard)`` triples.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from anyshard.format.manifest import Manifest, MeshEntry
from anyshard.reshard.boxes import Box, box_numel, intersect
from anyshard.ucl.compile import Shard, enumerate_shards
from anyshard.ucl.evaluate import LocalTensor, all_coords, compile, layout_for
from anyshard.ucl.spec import Spec, parse

__all__ = ["SpecIndex", "StoredShard", "describe_spec", "spec_index", "stored_shards"]


@dataclass(frozen=True, slots=True)
class StoredShard:
    """Stored tensor ``key`` in the data file of ``rank`` holds ``shard`` of a logical tensor."""

    rank: int
    key: str
    shard: Shard
    coords: dict[str, int]


@dataclass(frozen=True, slots=True)
class SpecIndex:
    spec: Spec
    written: dict[int, dict[str, LocalTensor]]  # rank -> local tensors it wrote, by local name
    sources: dict[str, list[StoredShard]]  # logical name -> the stored shards holding it
    logical_shapes: dict[str, tuple[int, ...]]  # every logical tensor any rank holds

    def coverage_problems(self, limit: int = 8) -> list[str]:
        """Logical tensors that the saved local tensors do not hold exactly once."""
        problems = []
        for logical, shape in sorted(self.logical_shapes.items()):
            boxes = [
                (p.logical_box, s)
                for s in self.sources.get(logical, ())
                for p in s.shard.pieces
                if box_numel(p.logical_box)
            ]
            held, want = sum(box_numel(b) for b, _ in boxes), math.prod(shape)
            where = ""
            if held == want and len(boxes) <= 4096:
                for i, (a, sa) in enumerate(boxes):
                    for b, sb in boxes[i + 1 :]:
                        if intersect(a, b) is not None:
                            where = f"; {sa.key} (rank {sa.rank}) and {sb.key} (rank {sb.rank}) both save {list(intersect(a, b))}"
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


@functools.lru_cache(maxsize=16)
def _index(text: str, layout: tuple[tuple[str, int], ...], mesh: MeshEntry) -> SpecIndex:
    spec = parse(text)
    lay = layout_for(spec, dict(layout))
    written: dict[int, dict[str, LocalTensor]] = {}
    sources: dict[str, list[StoredShard]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for coords in all_coords(lay.sizes):
        rank = mesh.rank(coords)
        for name, t in compile(spec, lay, coords).items():
            for part in t.parts:
                shapes.setdefault(part.logical, part.logical_shape)
            if not t.written:
                continue
            written.setdefault(rank, {})[name] = t
            for part in t.parts:
                if part.primary:
                    sources.setdefault(part.logical, []).append(
                        StoredShard(rank, name, part.shard, coords)
                    )
    return SpecIndex(spec, written, sources, shapes)


def spec_index(manifest: Manifest) -> SpecIndex:
    """The spec of ``manifest`` compiled for every rank that saved (cached)."""
    s = manifest.spec
    if s is None:
        raise ValueError("the manifest has no spec")
    return _index(s.text, tuple(sorted(s.layout.items())), manifest.meshes[s.mesh])


def stored_shards(manifest: Manifest, fqn: str, needed: Box | None = None) -> Iterator[StoredShard]:
    """The stored shards of logical tensor ``fqn`` (only those meeting ``needed``, if given)."""
    entry = manifest.tensors[fqn]
    if entry.mapping is None:
        for s in spec_index(manifest).sources.get(fqn, ()):
            if needed is None or any(
                intersect(p.logical_box, needed) is not None for p in s.shard.pieces
            ):
                yield s
        return
    mesh = manifest.meshes[entry.mesh]
    for coords, shard in enumerate_shards(entry.parsed, entry.shape, mesh.axis_sizes, needed):
        yield StoredShard(mesh.rank(coords), fqn, shard, coords)


def describe_spec(manifest: Manifest) -> str:
    """A short description of the manifest's spec and layout, for messages."""
    s = manifest.spec
    if s is None:
        return "no spec"
    layout = ",".join(f"{k}={v}" for k, v in sorted(s.layout.items()))
    first = next((ln.strip() for ln in s.text.splitlines() if ln.strip()), "")
    return f"layout {layout}; spec starting {first[:60]!r}"
