"""Local tensors that hold several logical tensors: ``fuse``, ``interleave`` and ``bucket``.

Each part is built alone (its primitives applied), then the parts are placed side by side in
one local tensor: ``fuse`` joins them along a dim, ``interleave`` alternates blocks of them along
a dim, ``bucket`` lays flat parts one after the other (aligned, padded to a multiple).
"""

from __future__ import annotations

from collections.abc import Iterator

from anyshard.geometry.boxes import Piece
from anyshard.ucl.arithmetic import Evaluator
from anyshard.ucl.lowering import ShardState, flatten_pieces, narrow_block
from anyshard.ucl.primitives import new_flags, part_state
from anyshard.ucl.syntax import Combine, KwArg, ListArg, Part

__all__ = ["combine"]


def combine(ev: Evaluator, c: Combine, env) -> list[tuple[str, tuple[int, ...], ShardState, dict]]:
    """The parts of ``c`` under ``env`` as they sit in the local tensor: (logical name, logical
    shape, pieces, flags) each."""
    parts = []
    for part, penv in _expand(ev, c.items, env):
        flags = new_flags()
        logical, shape, st = part_state(ev, part, penv, flags)
        parts.append((logical, shape, st, flags, part))
    params = c.params
    pos = [a for a in params if not isinstance(a, KwArg)]
    kw = {a.name: ev.expr(a.value, env) for a in params if isinstance(a, KwArg)}
    if c.kind == "bucket":
        states = _bucket(ev, [p[2] for p in parts], kw.get("align", 1), kw.get("multiple", 1), c)
    else:
        dim = ev.expr(pos[0], env)
        if c.kind == "fuse":
            blocks = None
        else:
            sizes = pos[1]
            assert isinstance(sizes, ListArg)  # check_spec: interleave(dim, [block, ...])
            blocks = [ev.expr(x, env) for x in sizes.items]
            if len(blocks) != len(parts):
                raise ev.error(
                    pos[1],
                    f"interleave() lists {len(blocks)} block size(s) for {len(parts)} part(s)",
                    "one block size per part",
                )
        states = _concat(ev, parts, dim, blocks, c)
    return [(p[0], p[1], s, p[3]) for p, s in zip(parts, states, strict=True)]


def _expand(ev: Evaluator, items, env) -> Iterator[tuple[Part, dict]]:
    """Every part of ``items`` under its loops and ``when`` conditions, with its variables."""
    for it in items:
        if isinstance(it, Part):
            if it.when is None or ev.cond(it.when, env):
                yield it, env
        elif it.loop is not None:
            for j in range(ev.expr(it.loop.count, env)):
                yield from _expand(ev, it.items, {**env, it.loop.var: j})
        elif ev.cond(it.when, env):
            yield from _expand(ev, it.items, env)


def _concat(ev: Evaluator, parts, dim: int, blocks, c: Combine) -> list[ShardState]:
    """``fuse`` (``blocks`` None) or ``interleave`` of the parts along ``dim``."""
    states = [p[2] for p in parts]
    flat = {s.flat for s in states}
    if len(flat) > 1:
        raise ev.error(c, f"{c.kind}() mixes flat and block parts", "parts of one kind")
    if flat == {True}:
        if blocks is not None or dim != 0:
            raise ev.error(c, f"{c.kind}() of flat parts", "fuse(0, ...) of flat parts")
        offsets, total = [], 0
        for s in states:
            offsets.append(total)
            total += s.shape[0]
        return _laid_flat(states, offsets, total)
    _check_joinable(ev, parts, dim, c)
    if blocks is None:
        return _interleave(states, dim, [s.shape[dim] for s in states], 1)
    return _interleave(states, dim, blocks, _num_groups(ev, parts, dim, blocks, c))


def _check_joinable(ev: Evaluator, parts, dim: int, c: Combine) -> None:
    """Block parts join along ``dim`` only where they have that dim and agree on every other."""
    states = [p[2] for p in parts]
    ndims = {len(s.shape) for s in states}
    if len(ndims) != 1 or not 0 <= dim < ndims.pop():
        raise ev.error(
            c,
            f"{c.kind}(): parts of shapes {[list(s.shape) for s in states]} cannot be joined on dim {dim}",
            "parts with the same number of dims",
        )
    others = {s.shape[:dim] + s.shape[dim + 1 :] for s in states}
    if len(others) != 1:
        names = ", ".join(f"{p[0]} {list(p[2].shape)}" for p in parts)
        raise ev.error(
            c,
            f"{c.kind}(): local parts {names} differ outside dim {dim}",
            f"parts that differ only along dim {dim}",
        )


def _num_groups(ev: Evaluator, parts, dim: int, blocks: list[int], c: Combine) -> int:
    """How many blocks every part of an ``interleave`` holds (the same for all)."""
    groups_of = set()
    for (logical, _, s, _, _), b in zip(parts, blocks, strict=True):
        if b <= 0 or s.shape[dim] % b:
            raise ev.error(
                c,
                f"interleave(): the local part of {logical} has {s.shape[dim]} elements on dim {dim}, "
                f"not a multiple of its block {b}",
                "blocks that divide each part",
            )
        groups_of.add(s.shape[dim] // b)
    if len(groups_of) != 1:
        raise ev.error(
            c,
            f"interleave(): the parts hold different numbers of blocks {sorted(groups_of)}",
            "as many blocks in every part",
        )
    return groups_of.pop()


def _interleave(
    states: list[ShardState], dim: int, blocks: list[int], groups: int
) -> list[ShardState]:
    """The parts' pieces in a tensor that holds, ``groups`` times along ``dim``, a block of
    ``blocks[i]`` elements of part i after one of each part before it."""
    stride = sum(blocks)
    shape = states[0].shape[:dim] + (stride * groups,) + states[0].shape[dim + 1 :]
    out = []
    offset = 0
    for s, b in zip(states, blocks, strict=True):
        pieces = []
        for g in range(groups):  # block g of this part, cut out, then placed at `start`
            block = ShardState(s.shape, s.pieces, s.flat)
            narrow_block(block, dim, g * b, (g + 1) * b)
            start = g * stride + offset
            for p in block.pieces:
                box = tuple(
                    (lo + start, hi + start) if d == dim else (lo, hi)
                    for d, (lo, hi) in enumerate(p.array_box)
                )
                pieces.append(Piece(0, shape, box, p.logical_box))
        out.append(ShardState(shape, pieces, False))
        offset += b
    return out


def _bucket(
    ev: Evaluator, states: list[ShardState], align: int, multiple: int, c: Combine
) -> list[ShardState]:
    """Flat parts one after the other, each starting at a multiple of ``align``, in a tensor
    of a multiple of ``multiple`` elements."""
    if align <= 0 or multiple <= 0:
        raise ev.error(c, f"bucket(): align={align}, multiple={multiple}", "positive values")
    cursor = 0
    offsets = []
    for s in states:
        if not s.flat:
            flatten_pieces(s)
        start = -(-cursor // align) * align
        offsets.append(start)
        cursor = start + s.shape[0]
    return _laid_flat(states, offsets, -(-cursor // multiple) * multiple)


def _laid_flat(states: list[ShardState], offsets: list[int], total: int) -> list[ShardState]:
    """Flat parts placed at ``offsets`` of a flat tensor of ``total`` elements."""
    return [
        ShardState(
            (total,),
            [Piece(p.base + o, p.array_shape, p.array_box, p.logical_box) for p in s.pieces],
            True,
        )
        for s, o in zip(states, offsets, strict=True)
    ]
