"""Read once by a replica split, for loads of DTensors and plain tensors (`anyshard.load` with
``read_once``): a target replicated over some mesh dims is first loaded into a *part* layout, the
same mesh with each replicated dim splitting a tensor dim instead, so that its replicas read
different parts, which `anyshard.redistribute` then moves into the target layout. A plain tensor,
which every rank passes whole, counts as replicated over the whole process group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from anyshard._compat import compute_local_shape_and_global_offset
from anyshard.api.tensor_layout import layout_of
from anyshard.reshard.fill import Fill

__all__ = ["split_fills", "world_mesh"]


def split_fills(
    fills: Sequence[Fill], targets: Mapping[str, torch.Tensor], mesh, group
) -> tuple[list[Fill], dict[str, tuple[Any, Any]]]:
    """``fills`` (of the tensors ``targets``, by name) with each replicated target's replaced
    by the fill of its part, and the targets split: fqn -> (the part this rank reads, the
    target). ``mesh``: the mesh plain tensors are replicated over (None: read whole)."""
    out, split = [], {}
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fill in fills:
        value = targets[fill.fqn]
        target = value if hasattr(value, "device_mesh") else _as_replicated(value, mesh)
        part = _replica_part(target)
        if part is None:
            out.append(fill)
            continue
        split[fill.fqn] = (part, target)
        held = layout_of(fill.fqn, part, group, meshes)
        out.append(Fill(fill.fqn, held.local, held.shard().pieces))
    return out, split


def world_mesh(process_group):
    """A 1-d DeviceMesh over ``process_group`` (no new process group is made)."""
    from torch.distributed.device_mesh import DeviceMesh

    group = process_group or dist.group.WORLD
    assert group is not None  # torch.distributed is initialised: its default group exists
    device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    return DeviceMesh.from_group(group, device, mesh_dim_names=("read_once",))


def _as_replicated(value: torch.Tensor, mesh) -> torch.Tensor:
    """A plain tensor that every rank passes whole, as the replicated DTensor it is: its local
    tensor is ``value`` itself, so that filling the DTensor fills ``value``."""
    from torch.distributed.tensor import DTensor, Replicate

    if mesh is None or value.numel() == 0:
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)


def _replica_part(value: torch.Tensor):
    """For a DTensor replicated over some mesh dims, a DTensor of the same tensor on the same
    mesh where each of those dims splits a tensor dim instead (so the replicas hold different
    parts, which together cover what each of them needs); None when there is none, or no dim
    is large enough to split."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor) or value.numel() == 0:
        return None
    mesh, placements = value.device_mesh, list(value.placements)
    shape = tuple(value.shape)
    ways = [1] * len(shape)  # how many parts each tensor dim is cut into so far
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            ways[p.dim] *= mesh.size(i)
    changed = False
    for i, p in enumerate(placements):
        if not isinstance(p, Replicate) or mesh.size(i) == 1:
            continue
        for d, n in enumerate(shape):
            if n // (ways[d] * mesh.size(i)) >= 1:
                placements[i] = Shard(d)
                ways[d] *= mesh.size(i)
                changed = True
                break
    if not changed:
        return None
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = torch.empty(local_shape, dtype=value.dtype, device=value.to_local().device)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
