"""Saving and loading plain local tensors that a UCL spec describes (``spec=``, ``layout=``)."""

from __future__ import annotations

import difflib
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from anyshard.api import collectives as coll
from anyshard.api.state import Leaf, json_roundtrip
from anyshard.errors import AnyshardError, LayoutError, StateDictMismatchError
from anyshard.format.commit import ReportedTensor
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.manifest import Manifest
from anyshard.format.mesh import MeshEntry
from anyshard.reshard.fill import Fill
from anyshard.ucl.evaluate import (
    Layout,
    LocalTensor,
    all_coords,
    compile,
    coords_of_rank,
    layout_for,
    recorded_layout,
)
from anyshard.ucl.ranks import compile_every_rank
from anyshard.ucl.syntax import Combine, Group, Part, Spec

__all__ = ["axis_group", "match_locals", "rank_coords", "spec_fills", "spec_writes"]


def rank_coords(
    lay: Layout, coords: Mapping[str, int] | None, group, *, saving: bool = False
) -> dict[str, int]:
    """This rank's mesh coordinates: given, or from its rank in ``group`` (row-major). A save
    needs one process per rank of the layout; a load may run anywhere with ``coords``."""
    world = coll.world_size(group)
    if lay.world_size != world and (saving or coords is None or coll.active(group)):
        raise LayoutError(
            f"the layout {dict(lay.sizes)} has {lay.world_size} rank(s) but the process group has "
            f"{world}; launch {lay.world_size} processes, or write every rank's tensors from one "
            "process with anyshard.ucl.save_local_states"
        )
    if coords is not None:
        out = {d: int(coords.get(d, 0)) for d in lay.sizes}
        unknown = set(coords) - set(lay.sizes)
        if unknown:
            raise LayoutError(f"coordinates for {sorted(unknown)}, not mesh dims of the spec")
        return out
    return coords_of_rank(lay.sizes, coll.rank(group))


def _suggest(name: str, value: torch.Tensor, locals_: dict[str, LocalTensor]) -> str:
    close = difflib.get_close_matches(name, list(locals_), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shape = ", ".join(str(n) for n in value.shape)
    return (
        f"{name}: no rule of the spec gives this local tensor under this layout{hint}; "
        f'add a rule, e.g.  "{name}" -> "{name}" [{shape}] : <mapping>;'
    )


def match_locals(
    flat: dict[str, Leaf], locals_: dict[str, LocalTensor], strict: bool
) -> tuple[list[tuple[str, torch.Tensor, LocalTensor]], dict[str, Leaf], list[str]]:
    """Pair the state's tensors with the spec's local tensors; JSON values pass through."""
    pairs, values, problems = [], {}, []
    for name, leaf in sorted(flat.items()):
        v = leaf.value
        if not isinstance(v, torch.Tensor):
            values[name] = leaf
            continue
        t = locals_.get(name)
        if t is None:
            problems.append(_suggest(name, v, locals_))
            continue
        if tuple(v.shape) != t.shape:
            problems.append(
                f"{name}: local shape {list(v.shape)} in the state dict, but the spec gives "
                f"{list(t.shape)} under this layout (rule at line {t.rule.line})"
            )
            continue
        pairs.append((name, v, t))
    if strict:
        missing = sorted(set(locals_) - set(flat))
        if missing:
            problems.append(
                f"the spec gives {len(missing)} local tensor(s) that the state dict lacks: "
                + ", ".join(missing)
            )
    return pairs, values, problems


def _average(
    name: str, value: torch.Tensor, t: LocalTensor, lay: Layout, me, group
) -> torch.Tensor:
    out = value.detach().clone()
    for axis in t.average:
        g = axis_group(lay, axis, me, group)
        if g is not None:
            out = out.float() if not out.is_floating_point() else out
            dist.all_reduce(out, group=g)
            out /= lay.sizes[axis]
    return out.to(value.dtype)


# The axis groups made over each process group, by (layout sizes, axis): weakly keyed by the
# group object, so that they go with it (an id() could be reused by a later group), the default
# group (None) under its own map. Locked: threads may save at the same time.
_GROUPS_LOCK = threading.Lock()
_GROUPS: weakref.WeakKeyDictionary[Any, dict[tuple, dict[tuple, Any]]] = weakref.WeakKeyDictionary()
_DEFAULT_GROUPS: dict[tuple, dict[tuple, Any]] = {}


def axis_group(lay: Layout, axis: str, coords: Mapping[str, int], group):
    """The process group of the ranks that differ from ``coords`` only along ``axis``.

    Collective: every rank of ``group`` creates every such group, in the same order.
    """
    if not coll.active(group) or lay.sizes[axis] == 1:
        return None
    key = (tuple(lay.sizes.items()), axis)
    with _GROUPS_LOCK:
        kept = _DEFAULT_GROUPS if group is None else _GROUPS.setdefault(group, {})
        made = kept.get(key)
    # destroyed since: every rank of ``group`` finds so at the same call, and makes them anew
    if made is None or not all(coll.alive(g) for g in made.values()):
        mesh = MeshEntry.row_major(lay.sizes)
        made = {}
        others = {d: n for d, n in lay.sizes.items() if d != axis}
        for c in all_coords(others):
            members = [mesh.rank({**c, axis: i}) for i in range(lay.sizes[axis])]
            ranks = [dist.get_global_rank(group, r) if group is not None else r for r in members]
            made[tuple(sorted(c.items()))] = dist.new_group(ranks)
        with _GROUPS_LOCK:
            kept[key] = made
    mine = tuple(sorted((d, v) for d, v in coords.items() if d != axis))
    return made[mine]


def _average_axes(spec: Spec, lay: Layout) -> list[str]:
    """Mesh dims that some rule averages over, from the text alone (the same on every rank)."""
    axes: dict[str, None] = {}

    def ops_of(node):
        if isinstance(node, Part):
            yield from node.ops
        elif isinstance(node, Combine):
            for item in node.items:
                yield from ops_of(item)
        elif isinstance(node, Group):
            for item in node.items:
                yield from ops_of(item)

    for r in spec.rules:
        for op in [*ops_of(r.source), *r.ops]:
            if op.name == "average":
                axes.setdefault(op.args[0].name)
    return [a for a in axes if lay.sizes.get(a, 1) > 1]


def spec_writes(
    state_flat: dict[str, Leaf],
    spec: Spec,
    lay: Layout,
    coords: Mapping[str, int],
    group,
    *,
    distributed: bool = True,
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, ReportedTensor], dict[str, Any]]:
    """What this rank writes (local name, tensor as stored), the logical tensors it reports,
    and its JSON values."""
    locals_ = compile(spec, lay, coords)
    if distributed:  # collective (group creation): before anything that may fail on one rank
        for axis in _average_axes(spec, lay):
            axis_group(lay, axis, coords, group)
    pairs, values, problems = match_locals(state_flat, locals_, strict=True)
    if problems:
        raise StateDictMismatchError(
            "the state dict does not match the spec:\n  " + "\n  ".join(problems)
        )
    writes: list[tuple[str, torch.Tensor]] = []
    entries: dict[str, ReportedTensor] = {}
    mesh = MeshEntry.row_major(lay.sizes)
    for name, value, t in pairs:
        if value.dtype not in DTYPE_TO_ST:
            raise AnyshardError(f"{name}: dtype {value.dtype} cannot be stored in safetensors")
        stored = value
        if t.average and distributed:
            stored = _average(name, stored, t, lay, coords, group)
        if t.transpose is not None:
            stored = stored.transpose(*t.transpose)
        if t.dtype is not None:
            stored = stored.to(ST_TO_DTYPE[t.dtype])
        code = DTYPE_TO_ST[stored.dtype]
        for part in t.parts:
            if part.primary and not t.alias:
                entries[part.logical] = ReportedTensor(
                    dtype=code, shape=part.logical_shape, mesh=mesh, mapping=None
                )
        if t.written:
            if stored.device.type != "cpu":
                stored = stored.to("cpu")
            writes.append((name, stored.contiguous()))
    return writes, entries, {k: json_roundtrip(leaf.value) for k, leaf in values.items()}


def _held_logical(spec: Spec, lay: Layout) -> frozenset[str]:
    """Every logical tensor some rank of the layout holds (the spec compiled once per text and
    layout, not at every load of every rank)."""
    layout = tuple(sorted(recorded_layout(spec, lay).items()))
    ranks = compile_every_rank(spec.text or str(spec), layout)
    return frozenset(p.logical for r in ranks for t in r.tensors.values() for p in t.parts)


def spec_fills(
    manifest: Manifest,
    flat: dict[str, Leaf],
    spec: Spec,
    layout: Mapping[str, int],
    coords: Mapping[str, int] | None,
    group,
    *,
    strict: bool,
    cast: bool,
) -> tuple[list[Fill], list[str], list[str]]:
    """Fills for the local tensors of ``flat`` under ``spec`` at ``layout``; with the problems
    found and the JSON value keys."""
    lay = layout_for(spec, layout)
    me = rank_coords(lay, coords, group)
    locals_ = compile(spec, lay, me)
    pairs, values, problems = match_locals(flat, locals_, strict)
    fills: list[Fill] = []
    for name, value, t in pairs:
        if not value.is_contiguous():
            problems.append(f"{name}: the local tensor is not contiguous; pass contiguous tensors")
            continue
        dest = value.transpose(*t.transpose) if t.transpose is not None else value
        for part in t.parts:
            entry = manifest.tensors.get(part.logical)
            if entry is None:
                if strict:
                    problems.append(
                        f"{name}: holds logical tensor {part.logical!r}, which the checkpoint lacks"
                    )
                continue
            if entry.shape != part.logical_shape:
                problems.append(
                    f"{name}: logical tensor {part.logical!r} has shape {list(entry.shape)} in the "
                    f"checkpoint, {list(part.logical_shape)} under this spec and layout"
                )
                continue
            stored = ST_TO_DTYPE[entry.dtype]
            if value.dtype != stored and not cast and t.dtype is None:
                problems.append(
                    f"{name}: dtype {value.dtype}, but {part.logical!r} is {stored} in the "
                    "checkpoint (pass cast=True to convert, or add cast() to the rule)"
                )
                continue
            fills.append(Fill(part.logical, dest, part.shard.pieces))
    if strict:
        wanted = _held_logical(spec, lay)
        extra = sorted(set(manifest.tensors) - wanted)
        if extra:
            problems.append(
                f"in the checkpoint but held by no rank under this spec and layout ({len(extra)}): "
                + ", ".join(extra)
            )
    return fills, problems, sorted(values)
