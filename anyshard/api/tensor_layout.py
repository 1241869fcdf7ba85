"""From torch objects to layouts: the mesh and the mapping of a DTensor's or a plain tensor's shard.

Shard(d) placements apply in mesh-dim order, each as ``chunk(d, axis)`` (torch.chunk, as DTensor
computes uneven shards). FSDP2 over TP marks the earlier mesh dim ``_StridedShard(d, sf)``:
it applies after the later mesh dims that shard ``d`` (their sizes multiply to ``sf``).
Mesh dims of the root mesh that a sub-mesh leaves out replicate the tensor, except
pipeline dims (named ``pp`` or starting with ``pp``), where other stages hold other tensors.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from anyshard._compat import root_mesh, strided_shard_type
from anyshard.errors import LayoutError
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.shards import Shard, chunk_bounds
from anyshard.ucl.lowering import compile_mapping_cached
from anyshard.ucl.mapping import Chunk, Mapping, On, Op, Replicate

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SPREAD_MIN_BYTES", "TensorLayout", "hold_mapping", "layout_of", "stored_mapping"]

# Replicated tensors at least this large are split among their replicas for writing.
SPREAD_MIN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """What this rank holds of a logical tensor, and which part of it this rank writes."""

    mesh: MeshEntry
    coords: dict[str, int]
    hold: Mapping  # the mapping of the local tensor (replicate() on replicated dims)
    local: torch.Tensor  # the local tensor (a plain tensor)
    global_shape: tuple[int, ...]

    def shard(self) -> Shard:
        shard = compile_mapping_cached(
            self.hold, self.global_shape, self.mesh.axis_sizes, self.coords
        )
        assert shard is not None
        return shard

    def write_plan(self, fqn: str) -> tuple[Mapping, torch.Tensor | None]:
        """The stored mapping (see `stored_mapping`) and the part of the local tensor this rank
        writes (None if another replica writes it)."""
        nbytes = self.local.numel() * self.local.element_size()
        stored = stored_mapping(fqn, self.hold, self.mesh.axis_sizes, nbytes, self.local.dim())
        part = self.local
        sizes = self.mesh.axis_sizes
        kept = sum(not isinstance(op, Replicate) for op in self.hold.ops)
        for op in stored.ops[kept:]:  # the ops that resolve the replicated dims to writers
            if isinstance(op, On) and self.coords[op.axis] != op.index:
                return stored, None
            if isinstance(op, Chunk) and op.axis is not None:
                start, stop = chunk_bounds(part.shape[0], sizes[op.axis], self.coords[op.axis])
                part = part[start:stop]
        return stored, part


def stored_mapping(
    fqn: str, hold: Mapping, sizes: dict[str, int], nbytes: int, ndim: int
) -> Mapping:
    """The mapping of what gets stored: ``hold`` with each ``replicate(a)`` resolved to writers.

    A local shard of at least `SPREAD_MIN_BYTES` is split among its replicas along dim 0
    (``chunk(0, a)``); a smaller one is written whole by one replica chosen from a hash of its
    name (``on(a, k)``), so that small tensors spread over the ranks too. Every rank decides
    this alone, from the same inputs.
    """
    replicated = [op.axis for op in hold.ops if isinstance(op, Replicate)]
    base = Mapping(tuple(op for op in hold.ops if not isinstance(op, Replicate)))
    if not replicated:
        return base
    if ndim >= 1 and nbytes >= SPREAD_MIN_BYTES:
        return base.then(*(Chunk(dim=0, axis=a) for a in replicated))
    writer = zlib.crc32(fqn.encode()) % math.prod(sizes[a] for a in replicated)
    ops: list[Op] = []
    for a in reversed(replicated):
        writer, k = divmod(writer, sizes[a])
        ops.append(On(axis=a, index=k))
    return base.then(*reversed(ops))


def _group_rank(global_rank: int, group) -> int:
    member_rank = getattr(group, "member_rank", None)  # a PeerGroup across worlds
    if member_rank is not None:
        return member_rank(global_rank)
    if group is None or not dist.is_initialized():
        return global_rank
    return dist.get_group_rank(group, global_rank)


def _mesh_names(mesh) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"mesh_dim_{i}" for i in range(mesh.ndim))


def _is_pipeline(name: str) -> bool:
    return name == "pp" or name.startswith("pp_")


def _root_view(mesh: DeviceMesh) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The root mesh of ``mesh`` when ``mesh`` is a plain slice of it, else ``mesh`` itself."""
    root = root_mesh(mesh)
    if root is mesh or root is None:
        return mesh, _mesh_names(mesh)
    names, root_names = _mesh_names(mesh), _mesh_names(root)
    if not set(names) <= set(root_names):  # a flattened dim: describe the mesh on its own
        return mesh, names
    return root, root_names


def _shard_ops(placements, names: tuple[str, ...], sizes: tuple[int, ...], fqn: str) -> list[Op]:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    strided = strided_shard_type()
    by_dim: dict[int, list[tuple[int, object]]] = {}
    replicated: list[Op] = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise LayoutError(
                f"{fqn}: placement Partial on mesh dim {names[i]!r} holds unreduced partial sums; "
                "reduce it first (e.g. dtensor.redistribute(placements=[Replicate()...])) and save that"
            )
        if isinstance(p, TShard) or (strided is not None and isinstance(p, strided)):
            by_dim.setdefault(p.dim, []).append((i, p))
        elif isinstance(p, TReplicate):
            replicated.append(Replicate(axis=names[i]))
        else:
            raise LayoutError(f"{fqn}: placement {p!r} on mesh dim {names[i]!r} is not supported")
    chunks: list[Op] = []
    for d in sorted(by_dim):
        chunks += [
            Chunk(dim=d, axis=names[i]) for i in _application_order(by_dim[d], sizes, names, fqn)
        ]
    return chunks + replicated


def _application_order(entries, sizes, names, fqn) -> list[int]:
    """Mesh dims sharding one tensor dim, in the order the chunks apply."""
    strided = strided_shard_type()
    order: list[int] = []
    pending: list[tuple[int, int]] = []  # strided (mesh dim, remaining split factor)
    for i, p in entries:
        if strided is not None and isinstance(p, strided):
            pending.append((i, int(p.split_factor)))
            continue
        order.append(i)
        still = []
        for j, rest in pending:
            if rest % sizes[i]:
                raise LayoutError(
                    f"{fqn}: _StridedShard on {names[j]!r} with split factor does not match the mesh"
                )
            rest //= sizes[i]
            if rest == 1:
                order.append(j)
            else:
                still.append((j, rest))
        pending = still
    if pending:
        raise LayoutError(
            f"{fqn}: _StridedShard on mesh dim(s) {[names[j] for j, _ in pending]} is not followed by "
            "Shard placements whose sizes make up its split factor; this layout is not supported"
        )
    return order


def layout_of(
    fqn: str,
    value: torch.Tensor,
    group=None,
    cache: dict | None = None,
    holders: list[int] | None = None,
) -> TensorLayout:
    """The layout of a DTensor (from its mesh and placements) or a plain tensor (replicated
    over every rank of ``group``, or over ``holders``, the group ranks that hold it, when only
    some do: the tensors of one pipeline stage)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return _dtensor_layout(fqn, value, group, {} if cache is None else cache)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if holders is not None and len(holders) < world:
        mesh = MeshEntry.from_rank_grid(("holders",), (len(holders),), list(holders))
        hold = Mapping((Replicate(axis="holders"),))
        coords = {"holders": holders.index(rank)}
        return TensorLayout(mesh, coords, hold, value.detach(), tuple(value.shape))
    mesh = MeshEntry(dims=("world",), sizes=(world,), offset=0, strides=(1,))
    hold = Mapping((Replicate(axis="world"),))
    return TensorLayout(mesh, {"world": rank}, hold, value.detach(), tuple(value.shape))


@dataclass(frozen=True, slots=True)
class _MeshView:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    root_names: tuple[str, ...]
    coords: dict[str, int]
    entry: MeshEntry


def _mesh_view(mesh, group, cache: dict) -> _MeshView:
    """What a layout needs of a device mesh, computed once per mesh in ``cache``: reading a
    DeviceMesh's rank grid is not free, and a state dict holds hundreds of tensors on a handful
    of meshes. The cache lives for one save or load, so that no mesh outlives its process group."""
    key = (id(mesh), id(group))
    hit = cache.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    root, root_names = _root_view(mesh)
    grid = root.mesh
    me = dist.get_rank() if dist.is_initialized() else 0
    where = (grid == me).nonzero()
    if where.numel() == 0:
        raise LayoutError(f"this rank ({me}) is not in the device mesh {mesh}")
    coords = dict(zip(root_names, (int(c) for c in where[0]), strict=True))
    ranks = [_group_rank(int(r), group) for r in grid.reshape(-1).tolist()]
    entry = MeshEntry.from_rank_grid(root_names, tuple(grid.shape), ranks)
    view = _MeshView(_mesh_names(mesh), tuple(mesh.mesh.shape), root_names, coords, entry)
    cache[key] = (mesh, view)
    return view


def hold_mapping(
    fqn: str,
    placements,
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    root_names: tuple[str, ...],
    coords: dict[str, int],
) -> Mapping:
    """The mapping of a DTensor's local shard over its root mesh, from its placements on the
    mesh dims ``names`` (of ``sizes``); root dims it leaves out replicate it, pipeline dims pin
    it to the stage at ``coords``."""
    ops = _shard_ops(placements, names, sizes, fqn)
    for name in root_names:
        if name not in names:
            ops.append(
                On(axis=name, index=coords[name]) if _is_pipeline(name) else Replicate(axis=name)
            )
    return Mapping(tuple(ops))


def _dtensor_layout(fqn: str, value, group, cache: dict) -> TensorLayout:
    try:
        mv = _mesh_view(value.device_mesh, group, cache)
    except LayoutError as e:
        raise LayoutError(f"{fqn}: {e}") from None
    names, sizes, coords = mv.names, mv.sizes, mv.coords
    hold = hold_mapping(fqn, value.placements, names, sizes, mv.root_names, coords)
    layout = TensorLayout(mv.entry, coords, hold, value.to_local().detach(), tuple(value.shape))
    shard = layout.shard()
    if tuple(shard.shape) != tuple(layout.local.shape):
        raise LayoutError(
            f"{fqn}: placements {value.placements} on mesh {dict(zip(names, sizes, strict=True))} give a "
            f"local shape {list(shard.shape)} here, but the local tensor has {list(layout.local.shape)}"
        )
    return layout
