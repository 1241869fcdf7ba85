"""Live resharding: move a state from one layout to another over the network, no storage.

Every rank describes the layouts of its source and destination state (DTensor meshes and
placements, plain tensors, a UCL spec and layout), the ranks exchange those descriptions (each
distinct one once), and every rank plans its own part from them (`anyshard.reshard.exchange`):
local copies for what it already holds, point-to-point messages for the rest, in rounds of
bounded size that both ends of each message agree on. Nothing is pickled; only JSON
descriptions and raw tensor bytes cross ranks.

Every piece that crosses ranks carries its crc32c (`anyshard.format.transit`), checked on
arrival; the ranks then agree, and a piece damaged in transit is a `ChecksumError` on every rank.
The bytes move, and are checked, in `anyshard.api.transfer`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from anyshard._lru import LRU
from anyshard.api import collectives as coll
from anyshard.api.spec_state import match_locals
from anyshard.api.state import flatten_state, json_roundtrip
from anyshard.api.tensor_layout import layout_of
from anyshard.api.transfer import Held, agree_on_transit, execute_plan
from anyshard.errors import AnyshardError, LayoutError, StateDictMismatchError
from anyshard.format import transit
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Box, Piece, full_box
from anyshard.reshard.exchange import (
    Plan,
    Round,
    TensorSides,
    message_cap,
    plan_moves,
    plan_rank,
    rounds_for,
)
from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
from anyshard.ucl.library import load_spec
from anyshard.ucl.lowering import compile_mapping_cached
from anyshard.ucl.mapping import parse_mapping
from anyshard.ucl.ranks import compile_every_rank

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "agree_on_transit",
    "plan_redistribution",
    "redistribute",
]

DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20

# Plans of recent calls, by (every rank's description digest, rank, budget, strict): a call whose
# layouts every rank describes as before skips the exchange of descriptions and the planning.
# Each with whether the call checks transit checksums (every rank's description says whether
# it asks to). Locked: calls from several threads share it.
_PLANS_KEPT = 8
_PLANS: LRU[tuple, tuple[Plan, list[Round], dict[str, Any], bool]] = LRU(_PLANS_KEPT)


class _Side:
    """One state (source or destination) of this rank: its description for the other ranks,
    and the local tensors that hold each logical tensor."""

    def __init__(self) -> None:
        self.desc: dict[str, Any] = {"tensors": {}, "values": {}}
        self.held: dict[str, list[Held]] = {}
        self.leaves: dict[str, Any] = {}  # JSON value leaves (destination: replaced)
        self.problems: list[str] = []


def _describe_side(
    state: Any, spec, layout: Mapping[str, int] | None, group, me: int, strict: bool, what: str
) -> _Side:
    side = _Side()
    if state is None:
        return side
    try:
        flat = flatten_state(state)
    except AnyshardError as e:
        side.problems.append(f"{what}: {e}")
        return side
    if spec is not None:
        _describe_spec_side(side, flat, spec, layout or {}, me, strict, what)
        return side
    cache: dict = {}
    layouts: dict[tuple, tuple] = {}
    for fqn, leaf in sorted(flat.items()):
        value = leaf.value
        if not isinstance(value, torch.Tensor):
            side.desc["values"][fqn] = json_roundtrip(value)
            side.leaves[fqn] = leaf
            continue
        if value.dtype not in DTYPE_TO_ST:
            side.problems.append(f"{what} {fqn}: dtype {value.dtype} is not supported")
            continue
        dtype = DTYPE_TO_ST[value.dtype]
        if not hasattr(value, "device_mesh"):
            shape = list(value.shape)
            box = full_box(shape)
            side.desc["tensors"][fqn] = {"shape": shape, "dtype": dtype}
            side.held[fqn] = [Held(value.detach(), Piece(0, tuple(shape), box, box))]
            continue
        dt = cast("DTensor", value)  # it has a device mesh
        # DTensors of one mesh, placements and shape share their description and pieces
        key = (id(dt.device_mesh), tuple(dt.placements), tuple(dt.shape))
        hit = layouts.get(key)
        if hit is None or hit[0] is not dt.device_mesh:
            try:
                lay = layout_of(fqn, dt, group, cache)
            except LayoutError as e:
                side.problems.append(f"{what} {e}")
                continue
            entry = {
                "shape": list(lay.global_shape),
                "mesh": lay.mesh.to_json(),
                "map": str(lay.hold),
            }
            hit = layouts[key] = (dt.device_mesh, entry, lay.shard().pieces)
        _, entry, pieces = hit
        local = dt.to_local().detach()
        side.desc["tensors"][fqn] = {**entry, "dtype": dtype}
        side.held[fqn] = [Held(local, p) for p in pieces]
    return side


def _describe_spec_side(side: _Side, flat, spec, layout, me: int, strict: bool, what: str):
    try:
        parsed = load_spec(spec)
        lay = layout_for(parsed, layout)
    except AnyshardError as e:
        side.problems.append(f"{what}: {e}")
        return
    if me >= lay.world_size:
        if any(isinstance(leaf.value, torch.Tensor) for leaf in flat.values()):
            side.problems.append(
                f"{what}: rank {me} passes tensors, but the layout {dict(lay.sizes)} has only "
                f"{lay.world_size} rank(s); pass an empty state on the ranks outside it"
            )
        return
    locals_ = compile(parsed, lay, coords_of_rank(lay.sizes, me))
    pairs, values, problems = match_locals(flat, locals_, strict)
    side.problems += [f"{what} {p}" for p in problems]
    names: dict[str, str] = {}
    for name, value, t in pairs:
        if t.average or t.dtype is not None:
            side.problems.append(
                f"{what} {name}: the rule at line {t.rule.line} averages or casts; redistribute "
                "moves the bytes each rank holds as they are and cannot apply it"
            )
            continue
        if value.dtype not in DTYPE_TO_ST:
            side.problems.append(f"{what} {name}: dtype {value.dtype} is not supported")
            continue
        dest = value.transpose(*t.transpose) if t.transpose is not None else value
        names[name] = DTYPE_TO_ST[value.dtype]
        for part in t.parts:
            side.held.setdefault(part.logical, []).extend(Held(dest, p) for p in part.shard.pieces)
    for k, leaf in values.items():
        side.desc["values"][k] = json_roundtrip(leaf.value)
        side.leaves[k] = leaf
    side.desc["spec"] = {"text": parsed.text or str(parsed), "layout": dict(layout), "names": names}


# --------------------------------------------------------------------------- remote boxes


def _layout_groups(desc: Mapping[str, Any], cache: dict) -> dict[tuple, list[tuple[str, str]]]:
    """The tensors of one description grouped by layout: ("mesh", mesh JSON text, mapping,
    shape) or ("plain", shape) -> [(fqn, dtype)], worked out once per description (ranks that
    describe their state alike share one description), not once per rank."""
    hit = cache.get(("groups", id(desc)))
    if hit is not None and hit[0] is desc:
        return hit[1]
    groups: dict[tuple, list[tuple[str, str]]] = {}
    for fqn, e in desc["tensors"].items():
        shape = tuple(e["shape"])
        if "mesh" not in e:
            groups.setdefault(("plain", shape), []).append((fqn, e["dtype"]))
            continue
        text = repr(e["mesh"])
        cache.setdefault(("mesh", text), e["mesh"])
        groups.setdefault(("mesh", text, e["map"], shape), []).append((fqn, e["dtype"]))
    cache[("groups", id(desc))] = (desc, groups)
    return groups


def _layout_boxes(key: tuple, rank: int, fqn: str, cache: dict) -> list[Box]:
    """The boxes that ``rank`` holds of a tensor of layout group ``key`` (`_layout_groups`)."""
    if key[0] == "plain":
        return [full_box(key[1])]
    boxes = cache.get((key, rank))
    if boxes is None:
        _, mesh_text, text, shape = key
        mesh_json = cache[("mesh", mesh_text)]
        mesh = MeshEntry.from_json(mesh_json)
        where = (mesh.rank_grid() == rank).nonzero()
        if not len(where[0]):
            raise LayoutError(f"{fqn}: rank {rank} describes a mesh it is not in: {mesh_json}")
        coords = {d: int(w[0]) for d, w in zip(mesh.dims, where, strict=True)}
        mapping = cache.get(("map", text))
        if mapping is None:
            mapping = cache[("map", text)] = parse_mapping(text)
        shard = compile_mapping_cached(mapping, shape, mesh.axis_sizes, coords)
        boxes = [p.logical_box for p in shard.pieces] if shard is not None else []
        cache[(key, rank)] = boxes
    return boxes


def _spec_boxes(desc: Mapping[str, Any], rank: int) -> dict[str, tuple]:
    """From a description through a UCL spec: logical tensor -> (shape, dtype, boxes)."""
    out: dict[str, tuple] = {}
    s = desc.get("spec")
    if s is None:
        return out
    (compiled,) = compile_every_rank(s["text"], tuple(sorted(s["layout"].items())), (rank,))
    locals_ = compiled.tensors
    for name, dtype in s["names"].items():
        t = locals_[name]
        for part in t.parts:
            shape, _, boxes = out.setdefault(part.logical, (part.logical_shape, dtype, []))
            boxes.extend(p.logical_box for p in part.shard.pieces)
    return out


def _sides(descs: list[dict], strict: bool) -> tuple[dict[str, TensorSides], list[str]]:
    """Every logical tensor's boxes on every rank, checked to agree on shape and dtype.

    Ranks that describe a side alike share one description (`all_gather_json`), and tensors
    of one layout in it share one map of rank -> boxes: the work is per distinct layout and
    rank, not per tensor and rank."""
    problems: list[str] = []
    found: dict[str, dict] = {}
    cache: dict = {}

    def record(fqn: str, which: str, shape, dtype: str, rank: int, per: dict) -> None:
        f = found.setdefault(fqn, {"shape": shape, "dtype": dtype, "src": [], "dst": []})
        if (shape, dtype) != (f["shape"], f["dtype"]):
            problems.append(
                f"{fqn}: {which} of rank {rank} holds it as {dtype} {list(shape)}, other "
                f"ranks as {f['dtype']} {list(f['shape'])}"
            )
            return
        f[which].append(per)

    for which in ("src", "dst"):
        alike: dict[int, tuple[Mapping[str, Any], list[int]]] = {}
        for rank, d in enumerate(descs):
            alike.setdefault(id(d[which]), (d[which], []))[1].append(rank)
        for desc, ranks in alike.values():
            for key, members in _layout_groups(desc, cache).items():
                shape = key[1] if key[0] == "plain" else key[3]
                per = {r: _layout_boxes(key, r, members[0][0], cache) for r in ranks}
                for fqn, dtype in members:
                    record(fqn, which, shape, dtype, ranks[0], per)
            if desc.get("spec") is not None:
                for r in ranks:
                    for fqn, (shape, dtype, boxes) in _spec_boxes(desc, r).items():
                        record(fqn, which, shape, dtype, r, {r: boxes})
    out: dict[str, TensorSides] = {}
    for fqn, f in sorted(found.items()):
        if f["dst"] and not f["src"]:
            problems.append(f"{fqn}: in the destination state, but in no rank's source state")
            continue
        if f["src"] and not f["dst"] and strict:
            problems.append(
                f"{fqn}: in the source state, but in no rank's destination state "
                "(pass strict=False to drop it)"
            )
            continue
        itemsize = ST_TO_DTYPE[f["dtype"]].itemsize
        out[fqn] = TensorSides(f["shape"], itemsize, _merged(f["src"]), _merged(f["dst"]))
    return out, problems


def _merged(parts: list[dict[int, list[Box]]]) -> dict[int, list[Box]]:
    """One map of rank -> boxes from several (the one itself, shared, when there is one)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[int, list[Box]] = {}
    for per in parts:
        for r, boxes in per.items():
            out.setdefault(r, []).extend(boxes)
    return dict(sorted(out.items()))


def plan_redistribution(
    descs: list[dict], max_inflight_bytes: int, strict: bool = True, rank: int | None = None
) -> tuple[Plan, dict[str, TensorSides]]:
    """Rank ``rank``'s part of the plan, from the ranks' descriptions (what `redistribute`
    exchanges); with ``rank=None``, every rank's parts together. `LayoutError` when the
    layouts disagree or do not cover a tensor."""
    tensors, problems = _sides(descs, strict)
    if problems:
        raise LayoutError(
            "redistribute: the source and destination states do not match:\n  "
            + "\n  ".join(problems)
        )
    cap = message_cap(len(descs), max_inflight_bytes)
    if rank is None:
        return plan_moves(tensors, cap), tensors
    return plan_rank(tensors, rank, cap), tensors


def _plan_call(
    descs: list[dict], me: int, max_inflight_bytes: int, strict: bool
) -> tuple[Plan, list[Round], dict[str, Any], bool]:
    """This rank's plan and rounds, the JSON values of the source, and whether the call checks
    transit checksums (only where every rank asks to), from every rank's descriptions; the
    errors that name a tensor or value."""
    problems = [f"rank {r}: {p}" for r, x in enumerate(descs) for p in x["problems"]]
    if problems:
        raise StateDictMismatchError(
            "redistribute: the states do not match their layouts:\n  " + "\n  ".join(problems)
        )
    mine_plan, _ = plan_redistribution(descs, max_inflight_bytes, strict, rank=me)
    rounds = rounds_for(mine_plan, me, len(descs))
    values: dict[str, Any] = {}
    for x in descs:
        for k, v in x["src"]["values"].items():
            values.setdefault(k, v)
    missing = sorted(k for x in descs for k in x["dst"]["values"] if k not in values)
    if missing and strict:
        raise StateDictMismatchError(
            f"redistribute: JSON values in the destination state but in no rank's source state: "
            f"{', '.join(dict.fromkeys(missing))} (pass strict=False to keep them)"
        )
    checked = all(x.get("crc", True) for x in descs)
    return mine_plan, rounds, values, checked


def redistribute(
    src: Any,
    dst: Any,
    *,
    process_group=None,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    src_spec=None,
    src_layout: Mapping[str, int] | None = None,
    dst_spec=None,
    dst_layout: Mapping[str, int] | None = None,
    strict: bool = True,
    reuse_plan: bool = True,
    check_transit: bool | None = None,
) -> Plan:
    """Fill ``dst`` (preallocated, in layout B) from ``src`` (in layout A) over the network.

    Collective over ``process_group``. ``src`` and ``dst`` are state dicts as `save` and
    `load` take them: DTensors on any mesh with any placements, plain tensors (the whole
    tensor, on each rank that passes it), and, with ``src_spec``/``src_layout`` or
    ``dst_spec``/``dst_layout``, plain local tensors that a UCL spec describes (ranks in
    row-major order of the layout; ranks outside it pass an empty state). JSON values of
    ``dst`` are replaced by those of ``src``. A rank may pass ``src`` only (``dst=None``: it is
    leaving) or ``dst`` only (``src=None``: it is joining).

    On return every ``dst`` tensor holds its region of the logical tensors, bit-exact. A rank
    copies what it already holds; everything else it receives exactly once, from one of the
    ranks that hold it (replicas share the sending). At most ``max_inflight_bytes`` of
    messages are in flight per rank (sent plus received, in rounds). Errors that name the
    tensor (missing, shape or dtype mismatch, a layout that does not cover it) are raised on
    every rank before any byte moves. Returns this rank's part of the plan.

    A call whose source and destination every rank describes exactly as in one of the last few
    calls (the same tensors, shapes, dtypes, layouts and JSON values) reuses that call's plan:
    the ranks exchange only a digest of their descriptions. ``reuse_plan=False`` plans anew.

    Every piece that crosses ranks is checked on arrival against the crc32c its sender computed
    (`anyshard.format.transit`); a piece damaged in transit is a `ChecksumError` on every rank,
    naming the tensor, the sender and the receiver (its ``tensor``, ``sender`` and ``receiver``),
    after which ``dst`` holds no verified copy: call again. ``check_transit=False`` (or
    ``ANYSHARD_CHECK_TRANSIT=0``; default on) skips the checks; they are made only where every
    rank asks for them.

    >>> import torch, anyshard
    >>> src = {"w": torch.arange(4.0), "step": 3}
    >>> dst = {"w": torch.zeros(4), "step": 0}
    >>> _ = anyshard.redistribute(src, dst)
    >>> dst
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    """
    me = coll.rank(process_group)
    if max_inflight_bytes < 2:
        raise ValueError(f"max_inflight_bytes must be at least 2, got {max_inflight_bytes}")
    s = _describe_side(src, src_spec, src_layout, process_group, me, strict, "source")
    d = _describe_side(dst, dst_spec, dst_layout, process_group, me, strict, "destination")
    # of the destination's JSON values, only their names: the source's replace them
    dst_desc = {**d.desc, "values": sorted(d.desc["values"])}
    mine: dict[str, Any] = {"src": s.desc, "dst": dst_desc, "problems": s.problems + d.problems}
    if not transit.enabled(check_transit):
        mine["crc"] = False
    digests = coll.gather_digests(mine, process_group)
    key = (tuple(digests), me, max_inflight_bytes, strict)
    known = _PLANS.get(key) if reuse_plan else None
    # every rank must have the plan (a rank that has just started has none)
    if coll.all_equal(b"\1" if known else b"\0", process_group) and known is not None:
        mine_plan, rounds, values, checked = known
        values = copy.deepcopy(values)  # the destination may change what it is given
    else:
        descs = coll.all_gather_json(mine, process_group, digests=digests)
        mine_plan, rounds, values, checked = _plan_call(descs, me, max_inflight_bytes, strict)
        _PLANS.put(key, (mine_plan, rounds, copy.deepcopy(values), checked))
    failed = execute_plan(
        mine_plan, rounds, s, d, process_group, repeated=known is not None, checked=checked
    )
    if checked:
        agree_on_transit(failed, process_group, "redistribute")
    for k, leaf in d.leaves.items():
        if k in values:
            leaf.replace(values[k])
    return mine_plan
