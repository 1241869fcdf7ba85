"""``anyshard.load``: fill a state dict in place, under whatever layout its tensors have."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from anyshard._compat import compute_local_shape_and_global_offset
from anyshard.api import collectives as coll
from anyshard.api.spec_state import spec_fills
from anyshard.api.state import flatten_state
from anyshard.api.tensor_layout import layout_of
from anyshard.errors import StateDictMismatchError
from anyshard.format import storage
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import intersect
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.reshard.stored import stored_shards
from anyshard.ucl.library import load_spec

__all__ = ["LoadReport", "load", "load_is_collective", "load_reporting", "read_once_pays"]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a `load` did on this rank: the bytes it fetched from storage (whole checksum blocks
    included), and the tensors it received from other ranks instead (read once per job)."""

    bytes_read: int
    forwarded: int = 0


def read_once_pays(path: str, process_group=None) -> bool:
    """The cost model behind ``load(read_once=None)``: whether fetching each stored byte once
    per job and forwarding it to the other ranks that need it beats every rank fetching it.

    - Object stores (any URL): yes, with more than one rank. A fetch pays a request's latency
      and the store's bandwidth, which all ranks of a job share; forwarding pays the network
      between the ranks (a collective fabric, many times the store's bandwidth per node), and
      each replica group splits the fetching among its members.
    - Local paths: no. Ranks on one node share the page cache, so a second read of the same
      bytes costs a memory copy, less than a message; a shared file system behaves as one store
      per node and is read directly too.
    - No process group, or one rank: no (nothing to share).
    """
    return storage.is_url(path) and coll.world_size(process_group) > 1


def _key_problems(flat: dict, manifest) -> list[str]:
    stored = set(manifest.tensors) | set(manifest.values)
    missing = sorted(set(flat) - stored)
    unexpected = sorted(stored - set(flat))
    out = []
    if missing:
        out.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        out.append(
            f"in the checkpoint but not in the state dict ({len(unexpected)}): {', '.join(unexpected)}"
        )
    return out


def load(
    path: str,
    state_dict: dict[str, Any],
    *,
    strict: bool = True,
    process_group=None,
    cast: bool = False,
    threads: int = 8,
    spec=None,
    layout: dict[str, int] | None = None,
    coords: dict[str, int] | None = None,
    verify: bool = True,
    read_once: bool | None = None,
    collective: bool | None = None,
) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    Tensors may be DTensors on any mesh with any placements, or plain tensors (filled whole);
    each rank reads only the byte ranges its shards overlap. JSON values are replaced. Every rank
    plans and reads on its own; no data moves between ranks.

    With ``collective`` (default: `load_is_collective`, i.e. when torch.distributed runs more
    than one rank and the load is one every rank makes: the state dict holds a DTensor, or
    ``process_group``, ``read_once`` or a spec without ``coords`` is given), the ranks of
    ``process_group`` agree on the outcome before returning: an error any rank meets (a
    checksum, a missing file, a state dict that does not match) is raised on every rank, as the
    same `AnyshardError` naming the rank that met it, instead of the others going on into the
    next collective and waiting there until the process group times out. ``collective=False``
    makes the load rank-local (a rank that loads alone, e.g. to inspect).

    With ``spec`` and ``layout`` (see `save`), ``state_dict`` holds this rank's plain local
    tensors as the spec describes them under ``layout``, whatever layout (or spec, or none) the
    checkpoint was saved with; ``coords`` gives the rank's mesh coordinates (default: from its
    rank in the process group, row-major over the spec's mesh dims).

    Every byte filled in is verified: it lies in a checksum block of its data file that was
    read whole and checked (a `ChecksumError` names the file otherwise); a read of part of a
    block widens to the whole block. ``verify=False`` reads only the needed bytes, unchecked.

    With ``read_once`` (default: `read_once_pays`, i.e. from an object store with more than
    one rank), a DTensor replicated over some mesh dims is fetched once per replica group: each
    replica fetches a different part, and the parts are forwarded to the other replicas over
    ``process_group`` (`anyshard.redistribute`'s transport); where some rank needs a column
    slice of a stored shard, the regions read from the same stored shards are read once by one
    rank and sent to the others instead (`anyshard.api.read_once`). The load is then collective.
    `load_reporting` loads the same way and returns what it fetched (a `LoadReport`).

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> anyshard.save(d, {"w": torch.arange(4.0), "epoch": 3})
    >>> state = {"w": torch.zeros(4), "epoch": 0}
    >>> anyshard.load(d, state)
    >>> state
    {'w': tensor([0., 1., 2., 3.]), 'epoch': 3}
    """
    load_reporting(
        path,
        state_dict,
        strict=strict,
        process_group=process_group,
        cast=cast,
        threads=threads,
        spec=spec,
        layout=layout,
        coords=coords,
        verify=verify,
        read_once=read_once,
        collective=collective,
    )


def load_is_collective(
    state_dict: dict[str, Any],
    *,
    process_group=None,
    spec=None,
    coords: dict[str, int] | None = None,
    read_once: bool | None = None,
) -> bool:
    """What ``load(collective=None)`` decides: whether every rank of ``process_group`` takes
    part in this load, and so agrees on its outcome. Yes when torch.distributed runs more than
    one rank in the group and the load is one every rank makes: a DTensor in the state dict, an
    explicit ``process_group`` or ``read_once``, or a spec load whose coordinates come from the
    rank. A load of plain tensors, or of one spec rank at given ``coords``, stays rank-local."""
    return _collective(flatten_state(state_dict), process_group, spec, coords, read_once)


def _collective(flat: dict, process_group, spec, coords, read_once) -> bool:
    """`load_is_collective` of a flattened state dict."""
    if coll.world_size(process_group) <= 1:
        return False
    if process_group is not None or read_once or (spec is not None and coords is None):
        return True
    return any(hasattr(leaf.value, "device_mesh") for leaf in flat.values())


def load_reporting(
    path: str,
    state_dict: dict[str, Any],
    *,
    strict: bool = True,
    process_group=None,
    cast: bool = False,
    threads: int = 8,
    spec=None,
    layout: dict[str, int] | None = None,
    coords: dict[str, int] | None = None,
    verify: bool = True,
    read_once: bool | None = None,
    collective: bool | None = None,
) -> LoadReport:
    """`load`, returning what this rank fetched from storage and what it received from other
    ranks instead (a `LoadReport`)."""
    flat = flatten_state(state_dict)
    if collective is None:
        collective = _collective(flat, process_group, spec, coords, read_once)
    if spec is not None:
        if read_once is None:
            read_once = read_once_pays(path, process_group)
        # read once: ranks that need the same stored region share one read
        once = bool(read_once) and coll.world_size(process_group) > 1
        report, error = None, None
        try:
            report = _load_spec(
                path,
                flat,
                spec,
                layout or {},
                coords,
                process_group,
                strict,
                cast,
                threads,
                verify,
                once,
            )
        except Exception as e:
            if not collective or once:  # read once agrees on every error it raises
                raise
            error = e
        if collective and not once:
            coll.raise_together(error, process_group, f"load of {path}")
        assert report is not None
        return report
    if read_once is None:
        read_once = read_once_pays(path, process_group)
    mesh = None  # plain tensors, whole on every rank, are replicated over the whole group
    manifest = None  # read once, where the column-split check has read it
    if read_once and dist.is_available() and dist.is_initialized():
        if dist.get_world_size(process_group) > 1:
            report, manifest = _load_by_stored_shards(
                path, flat, process_group, strict, cast, threads, verify
            )
            if report is not None:
                return report
            mesh = _world_mesh(process_group)
    agree = collective or mesh is not None  # read once is collective whatever ``collective`` says
    split: dict[str, tuple[Any, Any]] = {}  # fqn -> (the part this rank fetches, the target)
    bytes_read, error = 0, None
    try:
        manifest, plan = _plan_load(path, flat, split, mesh, process_group, strict, cast,
                                    read_once, threads, verify, manifest=manifest)  # fmt: skip
        bytes_read = plan.bytes_read
    except Exception as e:
        if not agree:  # no collective follows: this rank's error is its own
            raise
        error = e
    if agree:  # a rank's error reaches every rank before the exchange
        coll.raise_together(error, process_group, f"load of {path}")
    if read_once:  # collective: every rank takes part, with or without replicated tensors
        from anyshard.api.redistribute import redistribute

        redistribute(
            {k: part for k, (part, _) in split.items()},
            {k: target for k, (_, target) in split.items()},
            process_group=process_group,
            strict=False,
        )
    assert manifest is not None  # read on every rank that got here
    for fqn, leaf in flat.items():
        if fqn in manifest.values:
            leaf.replace(manifest.values[fqn])
    return LoadReport(bytes_read=bytes_read, forwarded=len(split))


def _load_by_stored_shards(
    path, flat, group, strict, cast, threads, verify
) -> tuple[LoadReport | None, Any]:
    """Read once where some rank needs a column slice of a tensor (a region narrower than the
    stored shards it reads from, in the last dim): every region is read by one of the ranks
    needing it, the regions read from the same stored shards by the same rank (whole rows once),
    and sent to the others (`anyshard.api.read_once`). Splitting each target between its
    replicas instead would have every tensor-parallel rank read the whole rows of its columns.
    Collective. No report where no rank needs a column slice (the replica split serves best):
    then the manifest it read, for that load."""
    error, mine, fills, manifest = None, [], [], None
    try:
        manifest, fills = _plan_load(path, flat, {}, None, group, strict, cast, False, threads,
                                     verify, execute=False)  # fmt: skip
        mine = sorted({f.fqn for f in fills if _column_slice(manifest, f)})
    except Exception as e:
        error = e
    coll.raise_together(error, group, f"load of {path}")
    if not any(coll.all_gather_json(mine, group)):
        return None, manifest
    assert manifest is not None
    nbytes, plan = _fill_once(path, manifest, fills, group, threads, verify)
    for fqn, leaf in flat.items():
        if fqn in manifest.values:
            leaf.replace(manifest.values[fqn])
    me = coll.rank(group)
    received = {a.region[0] for a in plan if me in a.receivers}
    return LoadReport(bytes_read=nbytes, forwarded=len(received)), manifest


def _fill_once(path, manifest, fills, group, threads, verify) -> tuple[int, list]:
    """Fill ``fills`` reading each stored region once per job (`anyshard.api.read_once`): the
    ranks exchange what they need, agree who reads what, read and send. Collective; the bytes
    this rank read and the agreement."""
    from anyshard.api import read_once as ro

    wanted = [[fqn, [list(r) for r in box]] for fqn, box in ro.needs_of(fills)]
    everyone = [
        [(fqn, tuple((lo, hi) for lo, hi in box)) for fqn, box in needs]
        for needs in coll.all_gather_json(wanted, group)
    ]
    peers = [
        dist.get_global_rank(group, r) if group is not None else r
        for r in range(coll.world_size(group))
    ]
    plan = ro.assign(everyone, manifest)
    nbytes = ro.fill_once(path, manifest, fills, plan, coll.rank(group), peers, group=group,
                          threads=threads, verify=verify)  # fmt: skip
    return nbytes, plan


def _column_slice(manifest, fill: Fill) -> bool:
    """Whether ``fill`` reads a column slice of a stored shard of two or more dims: a part of
    its rows narrower than the stored rows (reads widen it to whole rows or tiles)."""
    for p in fill.pieces:
        if len(p.logical_box) < 2:
            continue
        for s in stored_shards(manifest, fill.fqn, p.logical_box):
            for sp in s.shard.pieces:
                common = intersect(sp.logical_box, p.logical_box)
                if common is not None and common[-1] != sp.logical_box[-1]:
                    return True
    return False


def _plan_load(
    path,
    flat,
    split,
    mesh,
    process_group,
    strict,
    cast,
    read_once,
    threads,
    verify,
    execute=True,
    manifest=None,
):
    """Read the manifest, check ``flat`` against it and fill this rank's part (``split``
    collects the replicated targets that read-once splits); the manifest and the fill plan
    (without ``execute``: the fills, unread). ``manifest``: the checkpoint's, if already read."""
    manifest = manifest if manifest is not None else read_manifest(path)
    problems = _key_problems(flat, manifest) if strict else []
    fills: list[Fill] = []
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fqn, leaf in sorted(flat.items()):
        value = leaf.value
        if fqn in manifest.tensors:
            entry = manifest.tensors[fqn]
            if not isinstance(value, torch.Tensor):
                problems.append(
                    f"{fqn}: the checkpoint holds a tensor, the state dict a {type(value).__name__}"
                )
                continue
            if tuple(value.shape) != entry.shape:
                problems.append(
                    f"{fqn}: global shape {list(value.shape)} in the state dict, {list(entry.shape)} in the checkpoint"
                )
                continue
            stored = ST_TO_DTYPE[entry.dtype]
            if value.dtype != stored and not cast:
                problems.append(
                    f"{fqn}: dtype {value.dtype} in the state dict, {stored} in the checkpoint (pass cast=True to convert)"
                )
                continue
            part = None
            if read_once:
                target = value if hasattr(value, "device_mesh") else _as_replicated(value, mesh)
                part = _replica_part(target)
                if part is not None:
                    split[fqn] = (part, target)
            if part is not None:
                value = part
            held = layout_of(fqn, value, process_group, meshes)
            fills.append(Fill(fqn, held.local, held.shard().pieces))
        elif fqn in manifest.values:
            if isinstance(value, torch.Tensor):
                problems.append(
                    f"{fqn}: the checkpoint holds a JSON value, the state dict a tensor"
                )
    if problems:
        raise StateDictMismatchError(
            f"{path}: the state dict does not match the checkpoint:\n  " + "\n  ".join(problems)
        )
    if not execute:
        return manifest, fills
    plan = fill_regions(path, manifest, fills, threads=threads, verify=verify)
    return manifest, plan


def _world_mesh(process_group):
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


def _load_spec(
    path, flat, spec, layout, coords, group, strict, cast, threads, verify, once=False
) -> LoadReport:
    """A spec load; with ``once``, collective: each stored region that several ranks need is
    read by one of them and sent to the others (`anyshard.api.read_once`)."""
    error = manifest = None
    try:
        manifest = read_manifest(path)
        parsed = load_spec(spec)
        fills, problems, value_keys = spec_fills(
            manifest, flat, parsed, layout, coords, group, strict=strict, cast=cast
        )
        for k in value_keys:
            if k not in manifest.values and strict:
                problems.append(f"{k}: a JSON value the checkpoint lacks")
        if problems:
            raise StateDictMismatchError(
                f"{path}: the state dict does not match the checkpoint:\n  " + "\n  ".join(problems)
            )
    except Exception as e:
        if not once:
            raise
        error = e
    if once:  # every rank's error, before any collective that could wait for it
        coll.raise_together(error, group, f"load of {path}")
    assert manifest is not None
    if once:
        bytes_read, _ = _fill_once(path, manifest, fills, group, threads, verify)
    else:
        bytes_read = fill_regions(path, manifest, fills, threads=threads, verify=verify).bytes_read
    for k in value_keys:
        if k in manifest.values:
            flat[k].replace(manifest.values[k])
    return LoadReport(bytes_read=bytes_read)
