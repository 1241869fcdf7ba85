"""What each rank of a `anyshard.save` writes and reports, planned before anything is written:
its shards (as they are, or as a UCL spec describes them), its JSON values, and the checks that
every rank takes part in first (no committed checkpoint under ``path``, plain tensors' replicas
that agree)."""

from __future__ import annotations

import hashlib
import json
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from anyshard.api import collectives as coll
from anyshard.api.spec_state import rank_coords, spec_writes
from anyshard.api.state import flatten_state, json_roundtrip
from anyshard.api.tensor_layout import TensorLayout, layout_of
from anyshard.errors import AnyshardError, SaveError
from anyshard.format import storage
from anyshard.format.checksum import crc32c
from anyshard.format.commit import ReportedSpec, ReportedTensor, refuse_committed
from anyshard.format.datafile import tensor_bytes
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.incremental import Incremental
from anyshard.ucl.evaluate import layout_for
from anyshard.ucl.library import load_spec
from anyshard.ucl.mapping import On

__all__ = ["LocalPlan", "SaveOptions", "error_text", "plan_save"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """What `save` writes beyond the state dict's shards as they are: a spec's local tensors
    (``spec``, ``layout``, ``coords``), the check of plain tensors' replicas, an incremental
    save's base."""

    spec: Any = None
    layout: dict[str, int] | None = None
    coords: dict[str, int] | None = None
    check_replicas: bool = True
    incremental: Incremental | None = None


@dataclass(slots=True)
class LocalPlan:
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


def plan_save(
    path: str,
    state_dict,
    flat: dict | None,
    error: BaseException | None,
    group,
    options: SaveOptions,
    *,
    to_host: bool,
) -> tuple[LocalPlan, BaseException | None]:
    """This rank's plan of a save over ``group`` (collective: every rank takes part, whatever
    happened to it before, ``error``), and the error that stops it (None: none). The frozen
    shards an incremental save's base holds are set aside already (`_set_aside_frozen`)."""
    me = coll.rank(group)
    new_dir, refused = False, None
    try:
        if me == 0:
            new_dir = not storage.is_url(path) and not storage.exists(path)
            if error is None:
                refuse_committed(path)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        error = e
        refused = error_text(e).strip()
    # no rank writes into a committed checkpoint: the refusal reaches every rank first
    refused = coll.broadcast_json(refused, group)
    if refused is not None and error is None:
        error = SaveError(f"rank 0: {refused}")
    incremental = options.incremental
    holders, divergent = (
        _plain_holders(
            flat or {},
            group,
            check_replicas=options.check_replicas and error is None,
            unchecked=incremental.frozen if incremental and incremental.base else frozenset(),
        )
        if options.spec is None
        else ({}, "")
    )
    if divergent and error is None:
        error = SaveError(f"save to {path}: {divergent}; nothing was committed")
    plan = LocalPlan()
    if error is None:
        try:
            if options.spec is not None:
                plan = _plan_spec(state_dict, options, group)
                plan.spec = plan.spec if me == 0 else None
            else:
                plan = _plan_local(flat or {}, holders, group, to_host=to_host)
        except Exception as e:  # reported to rank 0 so that no rank waits forever
            error, plan = e, LocalPlan()
    plan.new_dir = new_dir
    plan.incremental = incremental
    return plan, _set_aside_frozen(path, plan, error, group)


def _host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _is_representative(layout: TensorLayout) -> bool:
    pinned = {op.axis for op in layout.hold.ops if isinstance(op, On)}
    return all(c == 0 for axis, c in layout.coords.items() if axis not in pinned)


def _plan_local(flat: dict, holders: dict[str, list[int]], group, *, to_host: bool) -> LocalPlan:
    """This rank's shards to write (as contiguous host tensors when ``to_host``; an async save
    stages them itself, straight from the device), the tensors it reports, and its JSON
    values. ``flat`` is the flattened state, ``holders`` what `_plain_holders` found."""
    plan = LocalPlan()
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


def _plan_spec(state_dict, options: SaveOptions, group) -> LocalPlan:
    parsed = load_spec(options.spec)
    lay = layout_for(parsed, options.layout or {})
    me = rank_coords(lay, options.coords, group, saving=True)
    writes, tensors, values = spec_writes(flatten_state(state_dict), parsed, lay, me, group)
    return LocalPlan(writes, tensors, values, ReportedSpec.of(parsed, lay))


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


def error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e))


def _set_aside_frozen(
    path: str, plan: LocalPlan, error: BaseException | None, group
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
