"""Where the stored shards of a logical tensor are, whichever way the manifest describes them.

A tensor entry with a mapping has one stored shard per coordinate of its mesh, under its own
name. A checkpoint saved with a UCL spec stores each rank's local tensors under their local
names; compiling the spec for every coordinate of its mesh says which logical regions each holds
(`spec_index`). Both give the same thing: `ShardSource` records.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from anyshard.format.manifest import Manifest
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Box, intersect
from anyshard.geometry.shards import Shard
from anyshard.ucl.evaluate import LocalTensor
from anyshard.ucl.lowering import enumerate_shards
from anyshard.ucl.ranks import compile_every_rank, logical_shapes, written_parts

__all__ = [
    "ShardSource",
    "SpecIndex",
    "describe_spec",
    "index_spec",
    "spec_index",
    "stored_shards",
]


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Stored tensor ``key`` in the data file of ``rank`` holds ``shard`` of a logical tensor."""

    rank: int
    key: str
    shard: Shard
    coords: dict[str, int]


@dataclass(frozen=True, slots=True)
class SpecIndex:
    """What the ranks of a spec-saved checkpoint wrote, and where each logical tensor is."""

    written: dict[int, dict[str, LocalTensor]]  # rank -> local tensors it wrote, by local name
    sources: dict[str, list[ShardSource]]  # logical name -> the stored shards holding it
    logical_shapes: dict[str, tuple[int, ...]]  # every logical tensor any rank holds


@functools.lru_cache(maxsize=16)
def index_spec(
    text: str,
    layout: tuple[tuple[str, int], ...],
    mesh: MeshEntry,
    saved: tuple[int, ...] | None = None,
) -> SpecIndex:
    """The spec ``text`` under ``layout`` (sorted items), its ranks numbered by ``mesh``
    (row-major); for the ranks ``saved`` only, when given (those with a data file)."""
    ranks = compile_every_rank(text, layout, saved)
    written: dict[int, dict[str, LocalTensor]] = {}
    for r in ranks:
        mine = {name: t for name, t in r.tensors.items() if t.written}
        if mine:
            written[mesh.rank(r.coords)] = mine
    sources = {
        logical: [ShardSource(mesh.rank(w.coords), w.key, w.shard, w.coords) for w in parts]
        for logical, parts in written_parts(ranks).items()
    }
    return SpecIndex(written, sources, logical_shapes(ranks))


def spec_index(manifest: Manifest) -> SpecIndex:
    """The spec of ``manifest`` compiled for every rank that saved (cached)."""
    s = manifest.spec
    if s is None:
        raise ValueError("the manifest has no spec")
    layout = tuple(sorted(s.layout.items()))
    return index_spec(s.text, layout, manifest.meshes[s.mesh], tuple(sorted(manifest.files)))


def stored_shards(manifest: Manifest, fqn: str, needed: Box | None = None) -> Iterator[ShardSource]:
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
    sizes = tuple(mesh.axis_sizes.items())
    for coords, shard in _shards(entry.parsed, tuple(entry.shape), sizes, needed):
        yield ShardSource(mesh.rank(dict(coords)), fqn, shard, dict(coords))


@functools.lru_cache(maxsize=4096)
def _shards(mapping, shape: tuple, sizes: tuple, needed: Box | None) -> tuple:
    """`enumerate_shards`, remembered: a model's layers share shapes and mappings, and a job's
    ranks load the same regions of each."""
    return tuple(
        (tuple(coords.items()), shard)
        for coords, shard in enumerate_shards(mapping, shape, dict(sizes), needed)
    )


def describe_spec(manifest: Manifest) -> str:
    """A short description of the manifest's spec and layout, for messages."""
    s = manifest.spec
    if s is None:
        return "no spec"
    layout = ",".join(f"{k}={v}" for k, v in sorted(s.layout.items()))
    first = next((ln.strip() for ln in s.text.splitlines() if ln.strip()), "")
    return f"layout {layout}; spec starting {first[:60]!r}"
