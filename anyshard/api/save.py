"""``anyshard.save``: every rank writes the shards it holds, as they are; one rank commits."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import traceback
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from anyshard.api import async_save
from anyshard.api import collectives as coll
from anyshard.api.spec_state import rank_coords, spec_writes
from anyshard.api.state import Leaf, copy_containers, flatten_state, json_roundtrip
from anyshard.api.tensor_layout import TensorLayout, layout_of
from anyshard.errors import AnyshardError, SaveError
from anyshard.format import storage
from anyshard.format.checksum import crc32c
from anyshard.format.commit import (
    DATA_DIR,
    ReportedSpec,
    ReportedTensor,
    SaveReport,
    build_manifest,
    commit_manifest,
    data_file_name,
    refuse_committed,
)
from anyshard.format.datafile import tensor_bytes, write_datafile
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.incremental import Incremental
from anyshard.format.manifest import MANIFEST_NAME, MeshEntry, Ref
from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
from anyshard.ucl.library import load_spec
from anyshard.ucl.mapping import On

__all__ = ["save", "save_local_states"]


def _host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _is_representative(layout: TensorLayout) -> bool:
    pinned = {op.axis for op in layout.hold.ops if isinstance(op, On)}
    return all(c == 0 for axis, c in layout.coords.items() if axis not in pinned)


@dataclass(slots=True)
class _LocalPlan:
    """What this rank writes (stored key, tensor) and reports, before anything is written."""

    writes: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    tensors: dict[str, ReportedTensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    spec: ReportedSpec | None = None
    incremental: Incremental | None = None  # hash, and reference what the base holds
    # frozen shards the base holds: referenced, never staged nor hashed (key -> base shard)
    held: dict = field(default_factory=dict)
    # (rank 0) the checkpoint's directory did not exist before this save: a failed save
    # removes it again when nothing else is in it
    new_dir: bool = False


def _plan_local(flat: dict, holders: dict[str, list[int]], group, *, to_host: bool) -> _LocalPlan:
    """This rank's shards to write (as contiguous host tensors when ``to_host``; an async save
    stages them itself, straight from the device), the tensors it reports, and its JSON
    values. ``flat`` is the flattened state, ``holders`` what `_plain_holders` found."""
    plan = _LocalPlan()
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fqn, leaf in flat.items():
        value = leaf.value
        if not isinstance(value, torch.Tensor):
            plan.values[fqn] = json_roundtrip(value)
            continue
        if value.dtype not in DTYPE_TO_ST:
            raise AnyshardError(f"{fqn}: dtype {value.dtype} cannot be stored in safetensors")
        layout = layout_of(fqn, value, group, meshes, holders.get(fqn))
        write, part = layout.write_plan(fqn)
        if part is not None:
            plan.writes.append((fqn, _host(part) if to_host else part))
        if _is_representative(layout):
            plan.tensors[fqn] = ReportedTensor(
                dtype=DTYPE_TO_ST[value.dtype],
                shape=layout.global_shape,
                mesh=layout.mesh,
                mapping=str(write),
            )
    return plan


def _plan_spec(state_dict, spec, layout, coords, group) -> _LocalPlan:
    parsed = load_spec(spec)
    lay = layout_for(parsed, layout)
    me = rank_coords(lay, coords, group, saving=True)
    writes, tensors, values = spec_writes(flatten_state(state_dict), parsed, lay, me, group)
    return _LocalPlan(writes, tensors, values, ReportedSpec.of(parsed, lay))


def _plain_tensor_crc(t: torch.Tensor) -> int:
    """crc32c of a plain tensor's bytes as this rank holds them (from host memory)."""
    host = t.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")
    return crc32c(tensor_bytes(host.contiguous()))


def _plain_holders(
    flat: dict, group, *, check_replicas: bool, unchecked: frozenset[str] = frozenset()
) -> tuple[dict[str, list[int]], str]:
    """The ranks holding each plain tensor that not every rank holds (the tensors of one
    pipeline stage, say), and, with ``check_replicas``, the plain tensors whose copies differ
    between the ranks holding them (a message naming them; empty when they all agree), except
    those named in ``unchecked`` (declared frozen: unchanged since a save that checked them).
    One 32-byte all-gather when every rank holds the same names and the same bytes."""
    from torch.distributed.tensor import DTensor

    if coll.world_size(group) == 1:  # one copy of everything: nothing to hold or compare
        return {}, ""
    plain = {
        k: leaf.value
        for k, leaf in sorted(flat.items())
        if isinstance(leaf.value, torch.Tensor) and not isinstance(leaf.value, DTensor)
    }
    crcs = (
        {k: _plain_tensor_crc(t) for k, t in plain.items() if k not in unchecked}
        if check_replicas
        else {}
    )
    digest = hashlib.sha256(json.dumps([list(plain), crcs]).encode()).digest()
    if coll.all_equal(digest, group):
        return {}, ""
    reports = coll.gather_json([list(plain), crcs], group)
    outcome = None
    if reports is not None:
        held: dict[str, list[int]] = {}
        for r, (names, _) in enumerate(reports):
            for n in names:
                held.setdefault(n, []).append(r)
        partial = {n: rs for n, rs in held.items() if len(rs) < len(reports)}
        outcome = [partial, _divergence(held, reports)]
    partial, divergent = coll.broadcast_json(outcome, group)
    return partial, divergent


def _divergence(held: dict[str, list[int]], reports: list) -> str:
    """A message naming the plain tensors whose holders hold different bytes, or ''."""
    lines = []
    for name, ranks in sorted(held.items()):
        groups: dict[int, list[int]] = {}
        for r in ranks:
            crc = reports[r][1].get(name)
            if crc is not None:
                groups.setdefault(crc, []).append(r)
        if len(groups) > 1:
            seen = "; ".join(f"ranks {rs}" for rs in sorted(groups.values()))
            lines.append(f"{name}: {len(groups)} different values ({seen} agree)")
    if not lines:
        return ""
    return (
        f"{len(lines)} plain tensor(s) differ between the ranks that hold them, and a plain "
        "tensor is saved as one replicated value:\n  "
        + "\n  ".join(lines[:16])
        + "\nGive per-rank state per-rank names (or make it a DTensor), or pass "
        "check_replicas=False to save one copy anyway"
    )


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e))


def save(
    path: str,
    state_dict: dict[str, Any],
    *,
    process_group=None,
    async_: bool = False,
    spec=None,
    layout: dict[str, int] | None = None,
    coords: dict[str, int] | None = None,
    check_replicas: bool = True,
    defer_staging: bool = False,
    base: str | None = None,
    frozen: Collection[str] | None = None,
    content_hash: bool = False,
):
    """Save ``state_dict`` to ``path`` (a directory or URL), collectively over ``process_group``.

    Each rank writes the shards it holds into its own safetensors file (replicated regions once,
    spread over their holders); then rank 0 writes ``manifest.json``, the commit.

    With ``spec`` (a UCL spec: text, path, shipped name or `anyshard.ucl.Spec`) and ``layout``
    (mesh dim sizes and params, e.g. ``{"tp": 2, "pp": 2, "hidden": 4096}``), ``state_dict``
    holds this rank's plain local tensors as the spec describes them (fused, padded, flattened,
    locally numbered); each rank writes them as they are and the manifest records the spec. The
    rank's mesh coordinates come from its rank in row-major order of the spec's mesh dims, or
    from ``coords``.

    A plain tensor (not a DTensor) is one value replicated over the ranks that hold it, saved
    once: when its copies differ between ranks (an RNG state, a per-rank counter), the save
    fails naming it, unless ``check_replicas=False`` (then one copy is saved).

    With ``async_=True`` it returns a `SaveHandle` as soon as the shards are staged in host
    memory (pinned when CUDA is used): the caller may modify its tensors right away, and the
    files are written and committed in the background. One async save is in flight at a time:
    the next save waits for it, and a failure surfaces there or at ``handle.result()``.

    With ``defer_staging=True`` as well, it returns at once, having copied only the state
    dict's containers (dicts and lists); flattening, planning and the copies into the staging
    buffers run in the background too (for device tensors, on a side stream that waits for the
    work queued so far), and a value that cannot be stored fails the save there. The caller
    must not modify the saved tensors before ``handle.wait_staged()`` returns, e.g. in an
    optimizer pre-step hook (the Checkpointer's `guard`). Forward and backward passes, which
    only read the parameters and optimizer states, overlap the copy.

    With ``base`` (a committed step in the same root: ``path``'s sibling directory), the save is
    incremental: each rank hashes the shards it would write (xxh3-128) and references, instead
    of writing, those that the same rank stored under the same name in ``base`` with the same
    bytes (the manifest records the referenced file, offsets and hash; retention and ``anyshard
    gc`` keep a referenced file as long as a step references it). Stored names in ``frozen``
    are referenced without hashing when the base recorded their hash: declare only tensors that
    did not change. ``content_hash=True`` records the hashes without a base, so that a later
    incremental save can reference this one's shards without reading them back.

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/step-1", {"w": torch.arange(6.0).reshape(2, 3), "step": 1})
    >>> anyshard.open(d + "/step-1").get_tensor("w")[1]
    tensor([3., 4., 5.])
    """
    async_save.wait_for_previous()  # staging buffers are reused; a failure surfaces here
    incremental = Incremental.of(base, frozen, content_hash)
    if async_ and defer_staging:  # flattens in the background
        return _deferred(
            path,
            state_dict,
            spec,
            layout,
            coords,
            process_group,
            check_replicas,
            incremental=incremental,
        )
    error: BaseException | None = None
    flat: dict | None = None
    try:
        if spec is None:
            flat = flatten_state(state_dict)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        error = e
    plan, error = _plan_save(
        path,
        state_dict,
        flat,
        error,
        spec,
        layout,
        coords,
        process_group,
        check_replicas,
        to_host=not async_,
        incremental=incremental,
    )
    plan.incremental = incremental
    error = _set_aside_frozen(path, plan, error, process_group)
    if not async_:
        _write_and_commit(path, plan, error, process_group)
        return None
    group = async_save.background_group(process_group)
    plan.writes = async_save.stage(plan.writes)
    return async_save.submit(lambda: _write_and_commit(path, plan, error, group))


def _flat_snapshot(state_dict: dict[str, Any]) -> dict[str, Leaf]:
    """``state_dict`` flattened, its JSON values as JSON reads them back."""
    flat = flatten_state(state_dict)
    for leaf in flat.values():
        if not isinstance(leaf.value, torch.Tensor):
            leaf.value = json_roundtrip(leaf.value)
    return flat


def _deferred(
    path,
    state_dict,
    spec,
    layout,
    coords,
    process_group,
    check_replicas,
    before=None,
    *,
    incremental: Incremental | None = None,
):
    """An async save that returns at once: planning (its collectives over the background
    group), staging and writing all run in the background; ``staged`` is set once the staging
    copies are done (or the save failed before them), whatever happens. ``before(group)``, if
    given, runs first in the background on every rank (collective over ``group``) and returns
    an error that stops the save, or None.

    The caller's thread only copies the state dict's containers (`copy_containers`): flattening
    it and snapshotting its JSON values run in the background too, on that private copy, before
    the staging copies (so before the caller may change anything)."""
    group = async_save.background_group(process_group)
    staged = threading.Event()
    after = async_save.current_stream_event()
    error: BaseException | None = None
    try:
        state_dict = copy_containers(state_dict)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        error = e

    def plan_stage_write_commit() -> None:
        err, plan, flat = error, _LocalPlan(), None
        try:
            if before is not None:
                err = before(group) or err
            if spec is None and err is None:
                try:
                    flat = _flat_snapshot(state_dict)
                except Exception as e:  # every rank still takes part in the planning
                    err = e
            plan, err = _plan_save(
                path,
                state_dict,
                flat,
                err,
                spec,
                layout,
                coords,
                group,
                check_replicas,
                to_host=False,
                incremental=incremental,
            )
            plan.incremental = incremental
            err = _set_aside_frozen(path, plan, err, group)
            if err is None:
                plan.writes = async_save.stage(plan.writes, after)
        except Exception as e:  # reported like any other: every rank still takes part
            err, plan.writes = e, []
        finally:
            staged.set()
        _write_and_commit(path, plan, err, group)

    return async_save.submit(plan_stage_write_commit, staged)


def save_deferred(
    path: str,
    state_dict: dict[str, Any],
    *,
    process_group=None,
    check_replicas: bool = True,
    before=None,
    base: str | None = None,
    frozen: Collection[str] | None = None,
    content_hash: bool = False,
):
    """`save` with ``async_=True, defer_staging=True``, and ``before(group)`` run first in the
    background (on every rank, collective over the background ``group``; it returns an error
    that stops the save, or None): the Checkpointer clears a crashed attempt's files there
    rather than in a barrier that would hold the training loop up."""
    async_save.wait_for_previous()
    return _deferred(
        path,
        state_dict,
        None,
        None,
        None,
        process_group,
        check_replicas,
        before,
        incremental=Incremental.of(base, frozen, content_hash),
    )


def _plan_save(
    path,
    state_dict,
    flat,
    error,
    spec,
    layout,
    coords,
    group,
    check_replicas,
    *,
    to_host: bool,
    incremental: Incremental | None = None,
) -> tuple[_LocalPlan, BaseException | None]:
    """This rank's plan of a save over ``group`` (collective: every rank takes part, whatever
    happened to it before), and the error that stops it (None: none)."""
    me = coll.rank(group)
    new_dir, refused = False, None
    try:
        if me == 0:
            new_dir = not storage.is_url(path) and not storage.exists(path)
            if error is None:
                refuse_committed(path)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        error = e
        refused = _error_text(e).strip()
    # no rank writes into a committed checkpoint: the refusal reaches every rank first
    refused = coll.broadcast_json(refused, group)
    if refused is not None and error is None:
        error = SaveError(f"rank 0: {refused}")
    holders, divergent = (
        _plain_holders(
            flat or {},
            group,
            check_replicas=check_replicas and error is None,
            unchecked=incremental.frozen if incremental and incremental.base else frozenset(),
        )
        if spec is None
        else ({}, "")
    )
    if divergent and error is None:
        error = SaveError(f"save to {path}: {divergent}; nothing was committed")
    plan = _LocalPlan()
    if error is None:
        try:
            if spec is not None:
                plan = _plan_spec(state_dict, spec, layout or {}, coords, group)
                plan.spec = plan.spec if me == 0 else None
            else:
                plan = _plan_local(flat, holders, group, to_host=to_host)
        except Exception as e:  # reported to rank 0 so that no rank waits forever
            error, plan = e, _LocalPlan()
    plan.new_dir = new_dir
    return plan, error


def _set_aside_frozen(
    path: str, plan: _LocalPlan, error: BaseException | None, group
) -> BaseException | None:
    """Take the frozen shards the base holds out of ``plan.writes`` (into ``plan.held``) before
    anything is staged; the error that stops the save (None: none)."""
    if error is not None or plan.incremental is None:
        return error
    try:
        plan.writes, plan.held = plan.incremental.frozen_part(path, coll.rank(group), plan.writes)
    except Exception as e:  # reported to rank 0 like any other
        return e
    return None


def _write_and_commit(path: str, plan: _LocalPlan, error: BaseException | None, group) -> None:
    """Write this rank's data file, agree with every rank, commit on rank 0, raise on failure."""
    me = coll.rank(group)
    file = begun = None
    writes = plan.writes
    refs: dict[str, Ref] = {}
    hashes: dict[str, str] | None = None
    crcs: dict[str, list[int]] | None = None  # computed with the hashes, in the same pass
    spans: dict[str, tuple[int, int]] = {}
    if error is None and plan.incremental is not None:
        try:
            writes, refs, hashes, crcs = plan.incremental.split(path, me, plan.writes)
            refs.update((k, b.ref) for k, b in plan.held.items())
        except Exception as e:
            error = e
    if error is None and (plan.writes or plan.held):
        try:
            storage.makedirs(storage.join(path, DATA_DIR))
            file = begun = data_file_name(me)  # written even when it references every shard
            write_datafile(
                storage.join(path, *file.split("/")),
                writes,
                hashes=hashes,
                spans=spans,
                crcs_of=crcs,
            )
        except Exception as e:
            error, file = e, None
    report = SaveReport(
        error=_error_text(error) if error is not None else None,
        file=file,
        count=len(plan.writes) + len(plan.held) if error is None else 0,
        tensors=plan.tensors if error is None else {},
        values=plan.values if error is None else {},
        spec=plan.spec if error is None else None,
        refs=refs if error is None else {},
    )
    reports = coll.gather_json(report.to_json(), group)
    outcome: dict[str, Any] = {"ok": True}
    if me == 0:
        assert reports is not None  # rank 0 gathers every rank's report
        try:
            manifest = build_manifest([SaveReport.from_json(r) for r in reports], path)
            data = manifest.dumps()
            commit_manifest(path, manifest, data)
            outcome["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        except Exception as e:
            outcome = {"ok": False, "error": str(e)}
    outcome = coll.broadcast_json(outcome, group)
    if error is not None or not outcome["ok"]:
        left = _remove_failed(path, begun, plan.new_dir, group)
        if error is None:
            error = SaveError(outcome["error"])
        if left:
            raise SaveError(
                f"{_error_text(error).strip()}\nthe failed save's files could not all be removed "
                f"({'; '.join(left)}): remove them, or run `anyshard gc` on the root"
            ) from error
        raise error
    if plan.incremental is not None and hashes is not None:  # the base of the next save
        kinds = {k: (DTYPE_TO_ST[t.dtype], tuple(t.shape)) for k, t in plan.writes}
        kinds.update((k, (b.dtype, b.shape)) for k, b in plan.held.items())
        plan.incremental.remember(
            path, me, outcome["manifest_sha256"], writes, spans, file, refs, hashes, kinds
        )


def _remove_failed(path: str, begun: str | None, new_dir: bool, group) -> list[str]:
    """After a failed save (collective): every rank removes the data file it wrote or began,
    then rank 0 the data directory and, if this save made it, the checkpoint's directory, each
    only when nothing else is left in it. Returns what could not be removed, with why (the same
    list on every rank). Where a manifest is there after all (a commit that landed although it
    reported an error, or another save's), nothing is touched."""
    left: list[str] = []
    committed: bool | str | None = None
    if coll.rank(group) == 0:  # a late commit (ours or another save's): touch nothing
        try:
            committed = storage.exists(storage.join(path, MANIFEST_NAME))
        except Exception as e:
            committed = f"cannot tell whether {path} committed ({e})"
    committed = coll.broadcast_json(committed, group)
    if committed:
        return [] if committed is True else [f"{path}: left as it is: {committed}"]
    if begun is not None:
        target = storage.join(path, *begun.split("/"))
        try:
            if storage.exists(target):
                storage.remove_file(target)
        except Exception as e:  # best effort: named in the error instead
            left.append(f"{target}: {e}")
    gathered = coll.gather_json(left, group)
    if gathered is not None:  # rank 0, once every rank has removed its own
        left = [x for rank_left in gathered for x in rank_left]
        dirs = [storage.join(path, DATA_DIR)] + ([path] if new_dir else [])
        for d in dirs:
            try:
                if not storage.is_url(d) and storage.exists(d) and not storage.listdir(d):
                    os.rmdir(d)  # only while empty: a concurrent writer's file stays
            except Exception as e:
                left.append(f"{d}: {e}")
    return coll.broadcast_json(left, group)


def save_local_states(
    path: str,
    states: dict[int, dict[str, Any]],
    *,
    spec,
    layout: dict[str, int],
) -> None:
    """Write a checkpoint for a whole layout from one process: ``states[rank]`` holds the local
    tensors of that rank (row-major over the spec's mesh dims), exactly as if every rank had
    called `save` with ``spec`` and ``layout``. Every rank of the layout must be given."""
    parsed = load_spec(spec)
    lay = layout_for(parsed, layout)
    if sorted(states) != list(range(lay.world_size)):
        raise AnyshardError(
            f"save_local_states needs the states of ranks 0..{lay.world_size - 1} of the layout "
            f"{dict(lay.sizes)}; got ranks {sorted(states)}"
        )
    refuse_committed(path)
    flats = {r: flatten_state(s) for r, s in states.items()}
    averaged = _average_locally(parsed, lay, flats)
    reports = []
    for rank in range(lay.world_size):
        coords = coords_of_rank(lay.sizes, rank)
        writes, tensors, values = spec_writes(
            averaged.get(rank, flats[rank]), parsed, lay, coords, None, distributed=False
        )
        file = None
        if writes:
            storage.makedirs(storage.join(path, DATA_DIR))
            file = data_file_name(rank)
            write_datafile(storage.join(path, *file.split("/")), writes)
        reports.append(
            SaveReport(
                file=file,
                count=len(writes),
                tensors=tensors,
                values=values,
                spec=ReportedSpec.of(parsed, lay) if rank == 0 else None,
            )
        )
    commit_manifest(path, build_manifest(reports, path))


def _average_locally(parsed, lay, flats: dict) -> dict:
    """``average(axis)`` tensors replaced, in copies of the states, by their mean over ``axis``."""
    mesh = MeshEntry.row_major(lay.sizes)
    out: dict[int, dict] = {}
    for rank in flats:
        coords = coords_of_rank(lay.sizes, rank)
        for name, t in compile(parsed, lay, coords).items():
            if not t.average or name not in flats[rank]:
                continue
            members = {rank}
            for axis in t.average:
                members = {
                    mesh.rank({**coords_of_rank(lay.sizes, m), axis: i})
                    for m in members
                    for i in range(lay.sizes[axis])
                }
            values = [flats[m][name].value for m in sorted(members)]
            mean = torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
            out.setdefault(rank, dict(flats[rank]))[name] = Leaf({}, name, mean)
    return out
