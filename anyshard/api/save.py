"""``anyshard.save``: every rank writes the shards it holds, as they are; one rank commits.

A save plans what each rank writes (`anyshard.api.save_plan`), then writes and commits
(`anyshard.api.save_commit`), at once, or staged in host memory and written in the background
(`anyshard.api.async_save`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import torch

from anyshard.api import async_save
from anyshard.api.save_commit import write_and_commit
from anyshard.api.save_plan import LocalPlan, SaveOptions, plan_save
from anyshard.api.spec_state import spec_writes
from anyshard.api.state import Leaf, copy_containers, flatten_state, json_roundtrip
from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.format.commit import (
    DATA_DIR,
    ReportedSpec,
    SaveReport,
    build_manifest,
    commit_manifest,
    data_file_name,
    refuse_committed,
)
from anyshard.format.datafile import write_datafile
from anyshard.format.incremental import Incremental
from anyshard.format.mesh import MeshEntry
from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
from anyshard.ucl.library import load_spec

__all__ = ["save", "save_local_states"]


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
    options = SaveOptions(spec=spec, layout=layout, coords=coords, check_replicas=check_replicas,
                          incremental=Incremental.of(base, frozen, content_hash))  # fmt: skip
    if async_ and defer_staging:  # flattens in the background
        return _deferred(path, state_dict, process_group, options)
    error: BaseException | None = None
    flat: dict | None = None
    try:
        if spec is None:
            flat = flatten_state(state_dict)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        error = e
    plan, error = plan_save(
        path, state_dict, flat, error, process_group, options, to_host=not async_
    )
    if not async_:
        write_and_commit(path, plan, error, process_group)
        return None
    group = async_save.background_group(process_group)
    plan.writes = async_save.stage(plan.writes)
    return async_save.submit(lambda: write_and_commit(path, plan, error, group))


def _flat_snapshot(state_dict: dict[str, Any]) -> dict[str, Leaf]:
    """``state_dict`` flattened, its JSON values as JSON reads them back."""
    flat = flatten_state(state_dict)
    for leaf in flat.values():
        if not isinstance(leaf.value, torch.Tensor):
            leaf.value = json_roundtrip(leaf.value)
    return flat


def _deferred(path: str, state_dict, process_group, options: SaveOptions, before=None):
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
        err, plan, flat = error, LocalPlan(), None
        try:
            if before is not None:
                err = before(group) or err
            if options.spec is None and err is None:
                try:
                    flat = _flat_snapshot(state_dict)
                except Exception as e:  # every rank still takes part in the planning
                    err = e
            plan, err = plan_save(path, state_dict, flat, err, group, options, to_host=False)
            if err is None:
                plan.writes = async_save.stage(plan.writes, after)
        except Exception as e:  # reported like any other: every rank still takes part
            err, plan.writes = e, []
        finally:
            staged.set()
        write_and_commit(path, plan, err, group)

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
    incremental = Incremental.of(base, frozen, content_hash)
    options = SaveOptions(check_replicas=check_replicas, incremental=incremental)
    return _deferred(path, state_dict, process_group, options, before)


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
