"""Live resharding: move a state from one layout to another over the network, no storage.

Every rank describes the layouts of its source and destination state (DTensor meshes and
placements, plain tensors, a UCL spec and layout), the ranks exchange those descriptions (each
distinct one once), and every rank plans its own part from them (`anyshard.reshard.exchange`):
local copies for what it already holds, point-to-point messages for the rest, in rounds of
bounded size that both ends of each message agree on. Nothing is pickled; only JSON
descriptions and raw tensor bytes cross ranks.

Every piece that crosses ranks carries its crc32c (`anyshard.format.transit`): the sender
computes it as it packs the piece (or over the region it sends in place), sends the values in
a small side tensor with the message, and the receiver checks each piece as it unpacks it; the
ranks then agree, and a piece damaged in transit is a `ChecksumError` on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from anyshard._lru import LRU
from anyshard.api import collectives as coll
from anyshard.api.spec_state import match_locals
from anyshard.api.state import flatten_state, json_roundtrip
from anyshard.api.tensor_layout import layout_of
from anyshard.errors import AnyshardError, LayoutError, StateDictMismatchError
from anyshard.format import transit
from anyshard.format.checksum import crc32c
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Box, Piece, full_box, intersect
from anyshard.reshard.exchange import (
    Move,
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


@dataclass(frozen=True, slots=True)
class _Held:
    """A local tensor holding ``piece`` of a logical tensor."""

    tensor: torch.Tensor
    piece: Piece


class _Side:
    """One state (source or destination) of this rank: its description for the other ranks,
    and the local tensors that hold each logical tensor."""

    def __init__(self) -> None:
        self.desc: dict[str, Any] = {"tensors": {}, "values": {}}
        self.held: dict[str, list[_Held]] = {}
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
            side.held[fqn] = [_Held(value.detach(), Piece(0, tuple(shape), box, box))]
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
        side.held[fqn] = [_Held(local, p) for p in pieces]
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
            side.held.setdefault(part.logical, []).extend(_Held(dest, p) for p in part.shard.pieces)
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


# --------------------------------------------------------------------------- moving bytes


def _region(held: list[_Held], box: Box, fqn: str, what: str) -> list[torch.Tensor]:
    """Views of ``box`` in every local tensor holding all of it."""
    views = []
    for h in held:
        inter = intersect(h.piece.logical_box, box)
        if inter != box:
            continue
        p = h.piece.restrict(box)
        assert p is not None  # the piece holds all of ``box``
        t = h.tensor
        if p.base == 0 and tuple(p.array_shape) == tuple(t.shape):
            arr = t
        else:
            try:
                flat = t.view(-1)
            except RuntimeError:
                raise LayoutError(
                    f"{fqn}: the {what} local tensor is not contiguous; pass contiguous tensors"
                ) from None
            n = 1
            for s in p.array_shape:
                n *= s
            arr = flat[p.base : p.base + n].view(p.array_shape)
        views.append(arr[tuple(slice(lo, hi) for lo, hi in p.array_box)])
    if not views:  # the plan only moves regions some piece holds whole
        raise AssertionError(f"{fqn}: no {what} piece holds {box}")
    return views


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# Moves of at least this many bytes travel as their own message, straight from and into the
# local tensors where those are contiguous; smaller ones are packed into one message per peer.
DIRECT_MIN_BYTES = 256 << 10


class _Staging:
    """The bytes that cannot travel in place (small moves packed together, strided regions)
    are staged in one buffer per call, reused round after round: a round's messages hold at
    most the in-flight budget, and every message of a round is done before the next round
    packs. Fresh pages for every packed message cost more than the copies themselves (the
    kernel zeroes each page at its first touch); untouched pages of the buffer cost nothing.

    A call that repeats an earlier one (its plan reused) keeps its buffer on CPU for the next
    such call, as CUDA's caching allocator does on GPUs: one buffer in the process, taken by
    one call at a time."""

    def __init__(self, rounds: list[Round], dev: torch.device, repeated: bool) -> None:
        self.size = max(
            (sum(m.nbytes for _, ms in (*r.send, *r.recv) for m in ms) for r in rounds), default=0
        )
        self.dev = dev
        self.keep = repeated and dev.type == "cpu"
        self.buf: torch.Tensor | None = None
        self.used = 0

    def next_round(self) -> None:
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None:
            spare = _SPARE.pop() if self.keep and _SPARE else None
            if spare is not None and spare.numel() >= self.size:
                self.buf = spare
            else:
                self.buf = torch.empty(self.size, dtype=torch.uint8, device=self.dev)
        if self.used + nbytes > self.size:  # the plan bounds each round; this cannot happen
            raise AssertionError(f"staging: {self.used} + {nbytes} bytes over {self.size}")
        out = self.buf[self.used : self.used + nbytes]
        self.used += nbytes
        return out

    def release(self) -> None:
        if self.keep and self.buf is not None:
            _SPARE[:] = [self.buf]
        self.buf = None


_SPARE: list[torch.Tensor] = []  # the staging buffer kept for the next repeated call


def _outgoing(
    moves: list[Move], src: _Side, stage: _Staging, checked: bool
) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors to send for one message (the small moves packed, then each large one), and,
    when ``checked``, the crc32c of each move (in the order of ``moves``), computed as the move
    is packed (the bytes just written) or over the region sent in place."""
    out = []
    crcs = [transit.UNCHECKED] * len(moves) if checked else []
    small = [i for i, m in enumerate(moves) if m.nbytes < DIRECT_MIN_BYTES]
    if small:
        buf = stage.take(sum(moves[i].nbytes for i in small))
        raw = transit.host_bytes(buf) if checked else None
        off = 0
        for i in small:
            m = moves[i]
            view = _region(src.held[m.fqn], m.box, m.fqn, "source")[0]
            seg = buf[off : off + m.nbytes]
            seg.view(view.dtype).view(view.shape).copy_(view)
            if checked:
                end = off + m.nbytes
                crcs[i] = transit.crc_of(seg) if raw is None else crc32c(raw[off:end])
            off += m.nbytes
        out.append(buf)
    for i, m in enumerate(moves):
        if m.nbytes >= DIRECT_MIN_BYTES:
            view = _region(src.held[m.fqn], m.box, m.fqn, "source")[0]
            if view.is_contiguous() and view.device == stage.dev:
                t = _bytes_of(view)
            else:
                t = stage.take(m.nbytes)
                t.view(view.dtype).view(view.shape).copy_(view)
            if checked:
                crcs[i] = transit.crc_of(t)
            out.append(t)
    return out, crcs


# What one received tensor holds: (index in the message, move, byte offset) of each move in it,
# and whether they must be copied out (a staging buffer) or arrived in place.
_Part = tuple[torch.Tensor, list[tuple[int, Move, int]], bool]


def _incoming(moves: list[Move], dst: _Side, stage: _Staging) -> list[_Part]:
    """The tensors to receive one message into, in the order `_outgoing` sends them, each with
    the moves it holds and whether they are to be unpacked once it has arrived."""
    out: list[_Part] = []
    small = [i for i, m in enumerate(moves) if m.nbytes < DIRECT_MIN_BYTES]
    if small:
        buf = stage.take(sum(moves[i].nbytes for i in small))
        entries, off = [], 0
        for i in small:
            entries.append((i, moves[i], off))
            off += moves[i].nbytes
        out.append((buf, entries, True))
    for i, m in enumerate(moves):
        if m.nbytes >= DIRECT_MIN_BYTES:
            views = _region(dst.held[m.fqn], m.box, m.fqn, "destination")
            if len(views) == 1 and views[0].is_contiguous() and views[0].device == stage.dev:
                out.append((_bytes_of(views[0]), [(i, m, 0)], False))
            else:
                out.append((stage.take(m.nbytes), [(i, m, 0)], True))
    return out


def _arrived(
    parts: list[_Part],
    crcs: list[int] | None,
    frm: int,
    me: int,
    dst: _Side,
    failed: list[transit.Mismatch],
) -> None:
    """One message has arrived: each move's bytes checked against the sender's crc32c
    (``crcs``, None when unchecked), then unpacked where they were staged (the check reads
    them into cache for the copy)."""
    for t, entries, staged in parts:
        raw = transit.host_bytes(t) if crcs is not None else None
        for i, m, off in entries:
            seg = t[off : off + m.nbytes]
            if crcs is not None and crcs[i] != transit.UNCHECKED:
                got = transit.crc_of(seg) if raw is None else crc32c(raw[off : off + m.nbytes])
                bad = transit.mismatch(crcs[i], got, m.fqn, m.box, frm, me)
                if bad is not None:
                    failed.append(bad)
            if staged:
                _unpack(m, seg, dst)


def _unpack(m: Move, seg: torch.Tensor, dst: _Side) -> None:
    for view in _region(dst.held[m.fqn], m.box, m.fqn, "destination"):
        view.copy_(seg.view(view.dtype).view(view.shape))


def _copy_local(plan: Plan, src: _Side, dst: _Side) -> None:
    for m in plan.local:
        (source,) = _region(src.held[m.fqn], m.box, m.fqn, "source")[:1]
        for view in _region(dst.held[m.fqn], m.box, m.fqn, "destination"):
            view.copy_(source)


def _execute(
    plan: Plan,
    rounds: list[Round],
    src: _Side,
    dst: _Side,
    group,
    repeated: bool = False,
    checked: bool = False,
) -> list[transit.Mismatch]:
    """The local copies run while the first round's messages are in flight. With ``checked``,
    each message carries a side tensor of its moves' crc32c, checked on arrival; the pieces
    that arrived damaged are returned (every round is completed all the same, so that the
    ranks stay in step and can agree on them)."""
    failed: list[transit.Mismatch] = []
    if not rounds:
        _copy_local(plan, src, dst)
        return failed
    dev = coll.device(group)
    peers = group if isinstance(group, coll.PeerGroup) else None
    me = coll.rank(group)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    stage = _Staging(rounds, dev, repeated)
    for i, rnd in enumerate(rounds):
        stage.next_round()
        recvs: list[tuple[torch.Tensor, int]] = []
        arriving = []
        for frm, moves in rnd.recv:
            parts = _incoming(moves, dst, stage)
            recvs += [(t, frm) for t, _, _ in parts]
            side = None
            if checked:  # after the message's tensors, as the sender sends it
                side = torch.empty(len(moves), dtype=torch.int64, device=dev)
                recvs.append((side, frm))
            arriving.append((frm, parts, side))
        sends: list[tuple[torch.Tensor, int]] = []
        for to, moves in rnd.send:
            out, crcs = _outgoing(moves, src, stage, checked)
            sends += [(t, to) for t in out]
            if checked:
                sends.append((transit.crcs_tensor(crcs, dev), to))
        if peers is not None:
            reqs = peers.exchange(sends, recvs)
        else:
            ops = [dist.P2POp(dist.isend, t, peer(to), group) for t, to in sends]
            ops += [dist.P2POp(dist.irecv, t, peer(frm), group) for t, frm in recvs]
            reqs = dist.batch_isend_irecv(ops)
        if i == 0:
            _copy_local(plan, src, dst)
        for req in reqs:
            req.wait()
        for frm, parts, side in arriving:
            sent = side.tolist() if side is not None else None
            _arrived(parts, sent, frm, me, dst, failed)
    stage.release()  # not after an error: a message may still be landing in the buffer
    return failed


def agree_on_transit(failed: list[transit.Mismatch], group, what: str) -> None:
    """Collective over ``group``: return if no rank found a piece damaged in transit, else raise
    on every rank the same `ChecksumError` (`anyshard.format.transit.transit_error`), naming
    the tensor, the sender and the receiver. One all-gather of 32 bytes per rank when none did;
    their reports are exchanged only when some did."""
    mine = [f.to_json() for f in failed] or None
    if not coll.active(group) or coll.world_size(group) == 1:
        if mine:
            raise transit.transit_error(mine, what)
        return
    digests = coll.gather_digests(mine, group)
    if mine is None and len(set(digests)) == 1:  # every rank has None: nothing failed
        return
    everyone = coll.all_gather_json(mine, group, digests=digests)
    raise transit.transit_error([f for fs in everyone if fs for f in fs], what)


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
    failed = _execute(
        mine_plan, rounds, s, d, process_group, repeated=known is not None, checked=checked
    )
    if checked:
        agree_on_transit(failed, process_group, "redistribute")
    for k, leaf in d.leaves.items():
        if k in values:
            leaf.replace(values[k])
    return mine_plan
