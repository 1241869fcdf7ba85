"""``anyshard.load``: fill a state dict in place, under whatever layout its tensors have.

A load is planned once (`_plan`: the manifest read, the state dict checked against it, the fills
of this rank's tensors), then takes one of three routes, chosen in one place (`_load`): each rank
reads what it needs (direct), or, reading once per job, the ranks read the stored shards once and
send the regions to the ranks that need them (by stored shards: spec loads, column splits), or
each replica reads a part of a replicated tensor and the parts are redistributed (replica split).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from anyshard.api import collectives as coll
from anyshard.api.read_once import fill_shared, reads_column_slice
from anyshard.api.replica_split import split_fills, world_mesh
from anyshard.api.spec_state import spec_fills
from anyshard.api.state import flatten_state
from anyshard.api.tensor_layout import layout_of
from anyshard.errors import StateDictMismatchError
from anyshard.format import storage
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import Manifest, read_manifest
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.ucl.library import load_spec

__all__ = ["LoadReport", "load", "load_is_collective", "load_reporting", "read_once_pays"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


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
    options = _Options(strict=strict, process_group=process_group, cast=cast, threads=threads,
                       spec=spec, layout=layout, coords=coords, verify=verify,
                       read_once=read_once, collective=collective)  # fmt: skip
    return _load(path, flatten_state(state_dict), options)


def _signature_of(model: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function, which passes its arguments on to ``model``, ``model``'s
    parameters (for `inspect`, ``help`` and type checkers) and keep its own return type."""

    def take(f: Callable[..., R]) -> Callable[P, R]:
        returns = inspect.signature(f).return_annotation
        f.__signature__ = inspect.signature(model).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return f

    return take


@_signature_of(load_reporting)
def load(path: str, state_dict: dict[str, Any], **options: Any) -> None:
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
    load_reporting(path, state_dict, **options)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Options:
    """The keyword arguments of `load`, as given."""

    strict: bool
    process_group: Any
    cast: bool
    threads: int
    spec: Any
    layout: dict[str, int] | None
    coords: dict[str, int] | None
    verify: bool
    read_once: bool | None
    collective: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """A load planned once: the checkpoint's manifest, the state dict checked against it, and
    what this rank fills, before anything is read."""

    path: str
    manifest: Manifest
    fills: list[Fill]  # this rank's part of each tensor, by name
    values: list[str]  # the JSON values of the state dict that the checkpoint holds
    targets: dict[str, torch.Tensor]  # the state dict's tensors, by name (none for a spec load)
    spec: bool


def _load(path: str, flat: dict, options: _Options) -> LoadReport:
    """Plan the load once and choose its route (the one place that does). Without read once,
    each rank reads what it needs (direct), and the ranks agree on the outcome after every
    rank's read, where the load is collective. Reading once, the ranks agree on every rank's
    plan before anything moves; then, with other ranks to share the reading with, a spec load,
    or one where some rank needs a column slice, reads by stored shards; any other load of
    DTensors or plain tensors by a replica split; a spec load alone, directly."""
    group = options.process_group
    read_once = options.read_once
    if read_once is None:
        read_once = read_once_pays(path, group)
    if not read_once:
        collective = options.collective
        if collective is None:
            collective = _collective(flat, group, options.spec, options.coords, options.read_once)

        def plan_and_read() -> tuple[_Plan, LoadReport]:
            plan = _plan(path, flat, options)
            return plan, _read_direct(plan, options)

        plan, report = _agreed(plan_and_read, collective, group, path)
    else:
        shared = coll.world_size(group) > 1
        plan, columns = _agreed(
            lambda: _plan_columns(path, flat, options, shared), True, group, path
        )
        if shared and (plan.spec or any(coll.all_gather_json(columns, group))):
            report = _read_by_stored_shards(plan, options)
        elif plan.spec:
            report = _read_direct(plan, options)
        else:
            report = _read_replica_split(plan, options, shared)
    for k in plan.values:
        flat[k].replace(plan.manifest.values[k])
    return report


def _agreed(step: Callable[[], T], agree: bool, group, path: str) -> T:
    """``step()``; where ``agree`` (collective over ``group``), an error any rank meets in it
    is raised on every rank (`coll.raise_together`) instead of the others going on into the
    next collective and waiting there for it."""
    if not agree:  # no collective follows: this rank's error is its own
        return step()
    try:
        result = step()
    except Exception as e:
        coll.raise_together(e, group, f"load of {path}")
        raise  # raise_together raised it (or the agreed error) already
    coll.raise_together(None, group, f"load of {path}")
    return result


def _plan(path: str, flat: dict, options: _Options) -> _Plan:
    """Read the manifest and check ``flat`` against it: every mismatch raised at once."""
    manifest = read_manifest(path)
    if options.spec is not None:
        fills, values, problems = _fills_by_spec(manifest, flat, options)
        targets: dict[str, torch.Tensor] = {}
    else:
        fills, targets, problems = _fills_by_layout(manifest, flat, options)
        values = [k for k in flat if k in manifest.values]
    if problems:
        raise StateDictMismatchError(
            f"{path}: the state dict does not match the checkpoint:\n  " + "\n  ".join(problems)
        )
    spec = options.spec is not None
    return _Plan(
        path=path, manifest=manifest, fills=fills, values=values, targets=targets, spec=spec
    )


def _plan_columns(path: str, flat: dict, options: _Options, shared: bool) -> tuple[_Plan, list]:
    """`_plan`, and (a load of DTensors or plain tensors, with ranks to share with) the
    tensors of which this rank needs a column slice."""
    plan = _plan(path, flat, options)
    if plan.spec or not shared:
        return plan, []
    return plan, sorted({f.fqn for f in plan.fills if reads_column_slice(plan.manifest, f)})


def _fills_by_spec(
    manifest, flat: dict, options: _Options
) -> tuple[list[Fill], list[str], list[str]]:
    """The fills of the spec's local tensors in ``flat``, the JSON values to replace, and the
    mismatches found."""
    parsed = load_spec(options.spec)
    fills, problems, value_keys = spec_fills(
        manifest,
        flat,
        parsed,
        options.layout or {},
        options.coords,
        options.process_group,
        strict=options.strict,
        cast=options.cast,
    )
    for k in value_keys:
        if k not in manifest.values and options.strict:
            problems.append(f"{k}: a JSON value the checkpoint lacks")
    return fills, [k for k in value_keys if k in manifest.values], problems


def _fills_by_layout(
    manifest, flat: dict, options: _Options
) -> tuple[list[Fill], dict[str, torch.Tensor], list[str]]:
    """The fills of the tensors of ``flat`` as this rank holds them, the tensors by name, and
    the mismatches found."""
    problems = _key_problems(flat, manifest) if options.strict else []
    fills: list[Fill] = []
    targets: dict[str, torch.Tensor] = {}
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fqn, leaf in sorted(flat.items()):
        value = leaf.value
        if fqn in manifest.tensors:
            problem = _tensor_problem(fqn, value, manifest.tensors[fqn], options.cast)
            if problem is not None:
                problems.append(problem)
                continue
            held = layout_of(fqn, value, options.process_group, meshes)
            fills.append(Fill(fqn, held.local, held.shard().pieces))
            targets[fqn] = value
        elif fqn in manifest.values and isinstance(value, torch.Tensor):
            problems.append(f"{fqn}: the checkpoint holds a JSON value, the state dict a tensor")
    return fills, targets, problems


def _tensor_problem(fqn: str, value, entry, cast: bool) -> str | None:
    """What does not match between the state dict's ``value`` and the stored tensor ``entry``."""
    if not isinstance(value, torch.Tensor):
        return f"{fqn}: the checkpoint holds a tensor, the state dict a {type(value).__name__}"
    if tuple(value.shape) != entry.shape:
        return f"{fqn}: global shape {list(value.shape)} in the state dict, {list(entry.shape)} in the checkpoint"
    stored = ST_TO_DTYPE[entry.dtype]
    if value.dtype != stored and not cast:
        return f"{fqn}: dtype {value.dtype} in the state dict, {stored} in the checkpoint (pass cast=True to convert)"
    return None


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


def _read_direct(plan: _Plan, options: _Options) -> LoadReport:
    """Each rank reads what it needs."""
    done = fill_regions(
        plan.path, plan.manifest, plan.fills, threads=options.threads, verify=options.verify
    )
    return LoadReport(bytes_read=done.bytes_read)


def _read_by_stored_shards(plan: _Plan, options: _Options) -> LoadReport:
    """Every region is read by one of the ranks needing it, the regions read from the same
    stored shards by the same rank (whole rows once), and sent to the others
    (`anyshard.api.read_once`). Where some rank needs a column slice of a tensor (a region
    narrower than the stored shards it reads from, in the last dim), splitting each target
    between its replicas instead would have every tensor-parallel rank read the whole rows of
    its columns. Collective."""
    group = options.process_group
    nbytes, assigned = fill_shared(
        plan.path, plan.manifest, plan.fills, group, threads=options.threads, verify=options.verify
    )
    if plan.spec:  # a spec load reports the bytes it read only
        return LoadReport(bytes_read=nbytes)
    me = coll.rank(group)
    received = {a.region[0] for a in assigned if me in a.receivers}
    return LoadReport(bytes_read=nbytes, forwarded=len(received))


def _read_replica_split(plan: _Plan, options: _Options, shared: bool) -> LoadReport:
    """Each replica of a replicated tensor (a plain tensor, with other ranks to share with:
    replicated over the whole group) reads a different part of it, and the parts go to the
    other replicas (`anyshard.redistribute`). Collective."""
    from anyshard.api.redistribute import redistribute

    group = options.process_group
    mesh = world_mesh(group) if shared else None  # plain tensors: whole on every rank

    def read() -> tuple[int, dict[str, tuple[Any, Any]]]:
        fills, split = split_fills(plan.fills, plan.targets, mesh, group)
        done = fill_regions(
            plan.path, plan.manifest, fills, threads=options.threads, verify=options.verify
        )
        return done.bytes_read, split

    # a rank's error reaches every rank before the exchange
    nbytes, split = _agreed(read, True, group, plan.path)
    redistribute(  # every rank takes part, with or without replicated tensors
        {k: part for k, (part, _) in split.items()},
        {k: target for k, (_, target) in split.items()},
        process_group=group,
        strict=False,
    )
    return LoadReport(bytes_read=nbytes, forwarded=len(split))
