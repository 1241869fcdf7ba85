"""Where the chunks of a DCP save go in an anyshard checkpoint: each tensor's chunks as a grid
over writers (a UCL mesh and mapping in the manifest), each chunk in its writer's data file.

DCP hands every rank's chunks to the coordinator's global plan; a tensor is stored as the chunks
tile it, which must be a grid (as DTensors and plain tensors shard), one chunk per cell.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

from anyshard.errors import AnyshardError
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Box


@dataclass(frozen=True, slots=True)
class Placed:
    """A logical tensor as the global plan stores it: dtype, shape, its grid as a UCL mesh and
    mapping, and the ranks that store a shard of it."""

    dtype: str
    shape: tuple[int, ...]
    mesh: MeshEntry
    mapping: str
    writers: tuple[int, ...]


def _intervals(fqn: str, dim: int, n: int, spans: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The chunks' extents along ``dim`` as consecutive parts of ``[0, n)``, or an error."""
    parts = sorted(spans)
    at = 0
    for lo, hi in parts:
        if lo != at:
            break
        at = hi
    else:
        if at == n:
            return parts
    raise AnyshardError(
        f"{fqn}: the chunks DCP saves of it do not tile it as a grid along dim {dim} (extents "
        f"{parts[:8]} of {n}); AnyshardWriter stores tensors sharded as DTensors shard them. Save "
        "this state with anyshard.save, which takes any UCL layout"
    )


def tensor_data(item: WriteItem) -> TensorWriteData:
    td = item.tensor_data
    assert td is not None  # DCP plans every tensor write with its chunk and properties
    return td


class Writers:
    """Writer numbers: a rank's own (its rank), and past the world one more for each further
    chunk of one tensor the rank holds (its k-th chunk of any tensor goes to its k-th writer, a
    data file of its own, since a data file holds one shard of each tensor)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.extra: dict[tuple[int, int], int] = {}  # (rank, k >= 1) -> writer

    def of(self, rank: int, k: int) -> int:
        if k == 0:
            return rank
        return self.extra.setdefault((rank, k), self.world + len(self.extra))


def place_chunks(
    fqn: str, items: list[tuple[int, WriteItem]], writers: Writers
) -> tuple[Placed, list[tuple[int, tuple, int]]]:
    """Where the chunks of ``fqn`` (rank, write item) go: its grid over writers, and the (rank,
    offsets, writer) of the chunks that store it (each non-empty chunk once; duplicates
    dropped)."""
    td = tensor_data(items[0][1])
    shape = tuple(int(n) for n in td.size)
    dtype = td.properties.dtype
    if dtype not in DTYPE_TO_ST:
        raise AnyshardError(f"{fqn}: dtype {dtype} has no safetensors name; cast it to save it")
    st = DTYPE_TO_ST[dtype]
    if math.prod(shape) == 0:  # nothing to store but the shape: the first writer stores it whole
        rank = min(r for r, _ in items)
        mesh = MeshEntry(dims=(), sizes=(), ranks=(rank,))
        return Placed(st, shape, mesh, "", (rank,)), []
    boxes: dict[Box, tuple[int, tuple]] = {}
    for rank, item in items:
        c = tensor_data(item).chunk
        offsets = tuple(int(o) for o in c.offsets)
        box = tuple((o, o + int(s)) for o, s in zip(offsets, c.sizes, strict=True))
        if any(lo == hi for lo, hi in box):
            continue  # an empty chunk (uneven sharding) holds nothing
        boxes.setdefault(box, (rank, offsets))
    parts = [_intervals(fqn, d, n, {box[d] for box in boxes}) for d, n in enumerate(shape)]
    cells = math.prod(len(p) for p in parts)
    index = [{span: i for i, span in enumerate(p)} for p in parts]
    grid: dict[tuple[int, ...], int] = {}
    for box, (rank, _) in boxes.items():
        grid[tuple(index[d][span] for d, span in enumerate(box))] = rank
    if len(boxes) != cells or len(grid) != cells:
        raise AnyshardError(
            f"{fqn}: DCP saves {len(boxes)} distinct chunks of it, which do not tile it as a "
            f"grid of {[len(p) for p in parts]} parts; save this state with anyshard.save"
        )
    split = [d for d, p in enumerate(parts) if len(p) > 1]
    dims = tuple(f"c{d}" for d in split)
    sizes = tuple(len(parts[d]) for d in split)
    held: dict[int, int] = defaultdict(int)  # rank -> chunks of this tensor placed so far
    writer_of: dict[tuple[int, ...], int] = {}
    for cell in sorted(grid):
        writer_of[cell] = writers.of(grid[cell], held[grid[cell]])
        held[grid[cell]] += 1
    ranks = [writer_of[cell] for cell in sorted(grid)]
    mesh = (
        MeshEntry.from_rank_grid(dims, sizes, ranks)
        if dims
        else MeshEntry(dims=(), sizes=(), ranks=(ranks[0],))
    )
    mapping = " | ".join(
        f"split({d}, c{d}, [{', '.join(str(hi - lo) for lo, hi in parts[d])}])" for d in split
    )
    stored = [
        (rank, offsets, writer_of[tuple(index[d][span] for d, span in enumerate(box))])
        for box, (rank, offsets) in boxes.items()
    ]
    return Placed(st, shape, mesh, mapping, tuple(sorted(set(ranks)))), stored
