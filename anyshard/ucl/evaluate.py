"""Compile a spec for a layout: the mapping of every local tensor of a rank, as pieces.

``compile(spec, layout, coords)`` evaluates the spec's arithmetic with the layout's numbers and
the rank's mesh coordinates, expands every rule over its loops, and turns each mapping into
`Shard` pieces (the same box correspondences the rest of anyshard plans reads with). A local
tensor may hold pieces of several logical tensors (``fuse``, ``interleave``, ``bucket``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from anyshard.errors import LayoutError, MappingError, UCLSemanticError
from anyshard.geometry.boxes import Piece, intersect
from anyshard.geometry.shards import Shard, chunk_bounds
from anyshard.ucl.check import DTYPES, USAGE
from anyshard.ucl.library import load_spec
from anyshard.ucl.lowering import (
    ShardState,
    flatten_pieces,
    initial_state,
    narrow_block,
    narrow_flat,
    translate_box,
)
from anyshard.ucl.syntax import (
    And,
    BinOp,
    Call,
    Combine,
    Compare,
    KwArg,
    Let,
    ListArg,
    Neg,
    Not,
    Num,
    OpCall,
    Or,
    ParamDecl,
    Part,
    Rule,
    Spec,
    Template,
    Var,
)

__all__ = [
    "Layout",
    "LocalPart",
    "LocalTensor",
    "compile",
    "coords_of_rank",
    "layout_for",
    "all_coords",
    "recorded_layout",
]


@dataclass(frozen=True, slots=True)
class LocalPart:
    """The region of logical tensor ``logical`` that a local tensor holds: ``shard.pieces`` are
    boxes of the local tensor (before any transpose) and the logical boxes they hold.
    ``primary`` says this rank's copy is the one a checkpoint keeps (replicas are not)."""

    logical: str
    logical_shape: tuple[int, ...]
    shard: Shard
    primary: bool


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A tensor the rank holds under the layout, and what it holds."""

    name: str
    shape: tuple[int, ...]  # as the rank holds it
    stored_shape: tuple[int, ...]  # before transpose(): as a checkpoint stores it
    parts: tuple[LocalPart, ...]
    rule: Rule = field(compare=False, repr=False)
    alias: bool = False
    transpose: tuple[int, int] | None = None
    dtype: str | None = None  # cast(): the stored (logical) dtype, as a safetensors code
    average: tuple[str, ...] = ()  # mesh dims to average over before saving

    @property
    def written(self) -> bool:
        """Whether a rank holding this tensor writes it at save."""
        return not self.alias and any(p.primary for p in self.parts)


@dataclass(frozen=True, slots=True)
class Layout:
    """A spec's layout: the size of every mesh dim and the value of every param."""

    sizes: dict[str, int]  # mesh dims, in the spec's order (slowest first)
    values: dict[str, int]  # params and lets

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())


def _as_spec(spec: Spec | str) -> Spec:
    return spec if isinstance(spec, Spec) else load_spec(spec)  # text, a path, a shipped name


class _Eval:
    def __init__(self, spec: Spec, env: dict[str, int], coords: Mapping[str, int]):
        self.spec = spec
        self.text = spec.text or str(spec)
        self.env = env
        self.coords = coords

    def error(self, node, message: str, expected: str) -> UCLSemanticError:
        return UCLSemanticError(
            message,
            text=self.text,
            line=max(getattr(node, "line", 1), 1),
            column=max(getattr(node, "column", 1), 1),
            expected=expected,
        )

    def expr(self, e, env: Mapping[str, int]) -> int:
        if isinstance(e, Num):
            return e.value
        if isinstance(e, Var):
            return env[e.name]
        if isinstance(e, Neg):
            return -self.expr(e.operand, env)
        if isinstance(e, BinOp):
            a, b = self.expr(e.left, env), self.expr(e.right, env)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            if b == 0:
                raise self.error(e, f"{e} divides by zero", "a non-zero divisor")
            if e.op == "/":
                if a % b:
                    raise self.error(
                        e,
                        f"{e} = {a} / {b} leaves a remainder",
                        "sizes that divide exactly (or // to round down, cdiv() to round up)",
                    )
                return a // b
            if e.op == "//":
                return a // b
            return a % b
        if isinstance(e, Call):
            if e.fn == "rank":
                axis = e.args[0]
                assert isinstance(axis, Var)  # check_spec: rank() names a mesh dim
                return self.coords.get(axis.name, 0)
            args = [self.expr(a, env) for a in e.args]
            if e.fn == "min":
                return min(args)
            if e.fn == "max":
                return max(args)
            if args[1] <= 0:
                raise self.error(e, f"{e}: the divisor is {args[1]}", "a positive divisor")
            q = -(-args[0] // args[1])
            return q if e.fn == "cdiv" else q * args[1]
        raise AssertionError(e)

    def cond(self, c, env) -> bool:
        if isinstance(c, Compare):
            a, b = self.expr(c.left, env), self.expr(c.right, env)
            return {
                "==": a == b,
                "!=": a != b,
                "<": a < b,
                "<=": a <= b,
                ">": a > b,
                ">=": a >= b,
            }[c.op]
        if isinstance(c, Not):
            return not self.cond(c.operand, env)
        if isinstance(c, And):
            return self.cond(c.left, env) and self.cond(c.right, env)
        if isinstance(c, Or):
            return self.cond(c.left, env) or self.cond(c.right, env)
        raise AssertionError(c)

    def name(self, t: Template, env) -> str:
        return "".join(p if isinstance(p, str) else str(self.expr(p, env)) for p in t.parts)

    # --- mappings ---

    def apply(self, st: ShardState, op: OpCall, env, flags: dict) -> None:
        pos = [a for a in op.args if not isinstance(a, KwArg)]
        kw = {a.name: self.expr(a.value, env) for a in op.args if isinstance(a, KwArg)}
        try:
            self._apply(st, op, pos, kw, env, flags)
        except MappingError as e:
            raise self.error(op, str(e), USAGE[op.name]) from None

    def _dim(self, st: ShardState, op: OpCall, d: int) -> int:
        ndim = len(st.shape)
        if not 0 <= d < ndim or (st.flat and d != 0):
            raise self.error(
                op,
                f"{op}: dim {d} does not exist; the tensor here has shape {list(st.shape)}",
                f"a dim in 0..{ndim - 1}",
            )
        return d

    def _narrow(self, st: ShardState, dim: int, start: int, stop: int) -> None:
        if st.flat:
            narrow_flat(st, start, stop)
        else:
            narrow_block(st, dim, start, stop)

    def _apply(self, st: ShardState, op: OpCall, pos, kw, env, flags: dict) -> None:
        name = op.name
        if name in ("replicate", "average", "on"):
            axis = pos[0].name
            if name == "on":
                index = self.expr(pos[1], env)
                if not 0 <= index < self.env[axis]:
                    raise self.error(
                        op,
                        f"{op}: index {index} is outside mesh dim {axis} of size {self.env[axis]}",
                        f"an index in 0..{self.env[axis] - 1}",
                    )
                flags["primary"] &= self.coords.get(axis, 0) == index
            else:
                flags["primary"] &= self.coords.get(axis, 0) == 0
                if name == "average":
                    flags["average"].append(axis)
            return
        if name == "transpose":
            a, b = (self.expr(x, env) for x in pos)
            if st.flat or a == b:
                raise self.error(
                    op, f"{op}: needs two distinct dims of a block tensor", USAGE[name]
                )
            self._dim(st, op, a)
            self._dim(st, op, b)
            flags["transpose"] = (a, b)
            return
        if name == "cast":
            flags["dtype"] = DTYPES[pos[0].name]
            return
        if name == "flatten":
            if not st.flat:
                flatten_pieces(st)
            return
        if name == "range":
            start, stop = (self.expr(x, env) for x in pos)
            if len(st.shape) != 1:
                raise self.error(
                    op,
                    f"{op} takes elements of a flat tensor, but this one has shape {list(st.shape)}",
                    "flatten() before range()",
                )
            if not 0 <= start <= stop <= st.shape[0]:
                raise self.error(
                    op, f"{op}: outside 0..{st.shape[0]}", f"0 <= start <= stop <= {st.shape[0]}"
                )
            narrow_flat(st, start, stop) if st.flat else narrow_block(st, 0, start, stop)
            return
        dim = self._dim(st, op, self.expr(pos[0], env))
        extent = st.shape[dim]
        if name == "pad":
            size = self.expr(pos[1], env) if len(pos) > 1 else None
            if size is None:
                m = kw["multiple"]
                if m <= 0:
                    raise self.error(op, f"{op}: multiple {m}", "a positive multiple")
                size = -(-extent // m) * m
            if size < extent:
                raise self.error(
                    op, f"{op}: dim {dim} already has {extent} elements", f"a size >= {extent}"
                )
            shape = st.shape[:dim] + (size,) + st.shape[dim + 1 :]
            if not st.flat:
                st.pieces = [Piece(0, shape, p.array_box, p.logical_box) for p in st.pieces]
            st.shape = shape
            return
        if name == "slice":
            start, stop = (self.expr(x, env) for x in pos[1:])
            if not 0 <= start <= stop <= extent:
                raise self.error(
                    op, f"{op}: outside 0..{extent} of dim {dim}", f"0 <= start <= stop <= {extent}"
                )
            self._narrow(st, dim, start, stop)
            return
        if name == "split":
            axis = pos[1].name
            sizes = [self.expr(x, env) for x in pos[2].items]
            n = self.env[axis]
            if len(sizes) != n or sum(sizes) != extent or any(s < 0 for s in sizes):
                raise self.error(
                    op,
                    f"{op}: sizes {sizes} do not cut {extent} elements into {n} parts",
                    f"{n} non-negative sizes (the size of {axis}) summing to {extent}",
                )
            c = self.coords.get(axis, 0)
            start = sum(sizes[:c])
            self._narrow(st, dim, start, start + sizes[c])
            return
        if name == "chunk":
            if len(pos) == 3:
                parts, index = (self.expr(x, env) for x in pos[1:])
                if not 0 <= index < parts:
                    raise self.error(
                        op, f"{op}: index {index} is outside 0..{parts - 1}", USAGE[name]
                    )
            else:
                parts, index = self.env[pos[1].name], self.coords.get(pos[1].name, 0)
            unit = kw.get("unit", 1)
            if unit <= 0 or extent % unit:
                raise self.error(
                    op,
                    f"{op}: dim {dim} has {extent} elements, not a multiple of the unit {unit}",
                    "a unit that divides the dim",
                )
            start, stop = chunk_bounds(extent // unit, parts, index)
            self._narrow(st, dim, start * unit, stop * unit)
            return
        raise AssertionError(name)

    def part_state(self, part: Part, env, flags: dict) -> tuple[str, tuple[int, ...], ShardState]:
        logical = self.name(part.name, env)
        shape = tuple(self.expr(d, env) for d in part.shape)
        if any(n < 0 for n in shape):
            raise self.error(part, f"{logical}: negative size in shape {list(shape)}", "sizes >= 0")
        st = initial_state(shape)
        for op in part.ops:
            self.apply(st, op, env, flags)
        return logical, shape, st

    def expand(self, items, env) -> Iterator[tuple[Part, dict]]:
        for it in items:
            if isinstance(it, Part):
                if it.when is None or self.cond(it.when, env):
                    yield it, env
            elif it.loop is not None:
                for j in range(self.expr(it.loop.count, env)):
                    yield from self.expand(it.items, {**env, it.loop.var: j})
            elif self.cond(it.when, env):
                yield from self.expand(it.items, env)

    def combine(self, c: Combine, env) -> list[tuple[str, tuple[int, ...], ShardState, dict]]:
        parts = []
        for part, penv in self.expand(c.items, env):
            flags = _flags()
            logical, shape, st = self.part_state(part, penv, flags)
            parts.append((logical, shape, st, flags, part))
        params = c.params
        pos = [a for a in params if not isinstance(a, KwArg)]
        kw = {a.name: self.expr(a.value, env) for a in params if isinstance(a, KwArg)}
        if c.kind == "bucket":
            states = self._bucket(
                [p[2] for p in parts], kw.get("align", 1), kw.get("multiple", 1), c
            )
        else:
            dim = self.expr(pos[0], env)
            if c.kind == "fuse":
                blocks = None
            else:
                sizes = pos[1]
                assert isinstance(sizes, ListArg)  # check_spec: interleave(dim, [block, ...])
                blocks = [self.expr(x, env) for x in sizes.items]
                if len(blocks) != len(parts):
                    raise self.error(
                        pos[1],
                        f"interleave() lists {len(blocks)} block size(s) for {len(parts)} part(s)",
                        "one block size per part",
                    )
            states = self._concat(parts, dim, blocks, c)
        return [(p[0], p[1], s, p[3]) for p, s in zip(parts, states, strict=True)]

    def _concat(self, parts, dim: int, blocks, c: Combine) -> list[ShardState]:
        states = [p[2] for p in parts]
        flat = {s.flat for s in states}
        if len(flat) > 1:
            raise self.error(c, f"{c.kind}() mixes flat and block parts", "parts of one kind")
        if flat == {True}:
            if blocks is not None or dim != 0:
                raise self.error(c, f"{c.kind}() of flat parts", "fuse(0, ...) of flat parts")
            out, offset = [], 0
            total = sum(s.shape[0] for s in states)
            for s in states:
                pieces = [
                    Piece(p.base + offset, p.array_shape, p.array_box, p.logical_box)
                    for p in s.pieces
                ]
                out.append(ShardState((total,), pieces, True))
                offset += s.shape[0]
            return out
        ndims = {len(s.shape) for s in states}
        if len(ndims) != 1 or not 0 <= dim < ndims.pop():
            raise self.error(
                c,
                f"{c.kind}(): parts of shapes {[list(s.shape) for s in states]} cannot be joined on dim {dim}",
                "parts with the same number of dims",
            )
        others = {s.shape[:dim] + s.shape[dim + 1 :] for s in states}
        if len(others) != 1:
            names = ", ".join(f"{p[0]} {list(p[2].shape)}" for p in parts)
            raise self.error(
                c,
                f"{c.kind}(): local parts {names} differ outside dim {dim}",
                f"parts that differ only along dim {dim}",
            )
        if blocks is None:
            blocks = [s.shape[dim] for s in states]
            groups = 1
        else:
            groups_of = set()
            for (logical, _, s, _, _), b in zip(parts, blocks, strict=True):
                if b <= 0 or s.shape[dim] % b:
                    raise self.error(
                        c,
                        f"interleave(): the local part of {logical} has {s.shape[dim]} elements on dim {dim}, "
                        f"not a multiple of its block {b}",
                        "blocks that divide each part",
                    )
                groups_of.add(s.shape[dim] // b)
            if len(groups_of) != 1:
                raise self.error(
                    c,
                    f"interleave(): the parts hold different numbers of blocks {sorted(groups_of)}",
                    "as many blocks in every part",
                )
            groups = groups_of.pop()
        stride = sum(blocks)
        shape = states[0].shape[:dim] + (stride * groups,) + states[0].shape[dim + 1 :]
        out = []
        offset = 0
        for s, b in zip(states, blocks, strict=True):
            pieces = []
            for g in range(groups):
                window = tuple(
                    (g * b, (g + 1) * b) if d == dim else (0, n) for d, n in enumerate(s.shape)
                )
                shift = g * stride + offset - g * b
                for p in s.pieces:
                    x = intersect(p.array_box, window)
                    if x is None:
                        continue
                    logical = translate_box(x, p.array_box, p.logical_box)
                    box = tuple(
                        (lo + shift, hi + shift) if d == dim else (lo, hi)
                        for d, (lo, hi) in enumerate(x)
                    )
                    pieces.append(Piece(0, shape, box, logical))
            out.append(ShardState(shape, pieces, False))
            offset += b
        return out

    def _bucket(
        self, states: list[ShardState], align: int, multiple: int, c: Combine
    ) -> list[ShardState]:
        if align <= 0 or multiple <= 0:
            raise self.error(c, f"bucket(): align={align}, multiple={multiple}", "positive values")
        cursor = 0
        offsets = []
        for s in states:
            if not s.flat:
                flatten_pieces(s)
            start = -(-cursor // align) * align
            offsets.append(start)
            cursor = start + s.shape[0]
        total = -(-cursor // multiple) * multiple
        return [
            ShardState(
                (total,),
                [Piece(p.base + o, p.array_shape, p.array_box, p.logical_box) for p in s.pieces],
                True,
            )
            for s, o in zip(states, offsets, strict=True)
        ]

    def rule(self, r: Rule, env) -> LocalTensor:
        name = _local_name(r, env)
        if isinstance(r.source, Part):
            flags = _flags()
            logical, shape, st = self.part_state(r.source, env, flags)
            parts = [(logical, shape, st, flags)]
        else:
            parts = self.combine(r.source, env)
            if not parts:
                raise self.error(
                    r.source,
                    f"{r.source.kind}() holds no logical tensor under this layout (every part "
                    f"is excluded by 'when' or an empty loop), so local tensor {name!r} would be empty",
                    "at least one part, or a 'when' on the rule",
                )
            for _logical, _shape, st, flags in parts:
                for op in r.ops:
                    self.apply(st, op, env, flags)
        stored_shape = parts[0][2].shape
        transpose = next((f["transpose"] for *_, f in parts if f["transpose"]), None)
        dtype = next((f["dtype"] for *_, f in parts if f["dtype"]), None)
        average = tuple(dict.fromkeys(a for *_, f in parts for a in f["average"]))
        shape = stored_shape
        if transpose is not None:
            a, b = transpose
            s = list(shape)
            s[a], s[b] = s[b], s[a]
            shape = tuple(s)
        return LocalTensor(
            name=name,
            shape=shape,
            stored_shape=stored_shape,
            parts=tuple(
                LocalPart(logical, lshape, Shard(st.shape, tuple(st.pieces)), f["primary"])
                for logical, lshape, st, f in parts
            ),
            rule=r,
            alias=r.alias,
            transpose=transpose,
            dtype=dtype,
            average=average,
        )


def _flags() -> dict:
    return {"primary": True, "average": [], "transpose": None, "dtype": None}


def _local_name(r: Rule, env) -> str:
    return "".join(p if isinstance(p, str) else str(env[p.name]) for p in r.pattern.parts)


def layout_for(spec: Spec | str, layout: Mapping[str, int]) -> Layout:
    """Evaluate the spec's mesh sizes, params and lets for ``layout`` (name -> int).

    Mesh dims missing from ``layout`` have size 1; params missing from it take their default.
    """
    spec = _as_spec(spec)
    known = set(spec.mesh) | {p.name for p in spec.params}
    unknown = sorted(set(layout) - known)
    if unknown:
        raise LayoutError(
            f"layout names {unknown} that the spec does not declare; it takes "
            f"mesh dims {list(spec.mesh)} and params {[p.name for p in spec.params]}"
        )
    env: dict[str, int] = {}
    for d in spec.mesh:
        n = int(layout.get(d, 1))
        if n < 1:
            raise LayoutError(f"mesh dim {d} has size {n}; sizes are >= 1")
        env[d] = n
    ev = _Eval(spec, env, {})
    for stmt in spec.statements:  # in order: a default may use an earlier let, and vice versa
        if isinstance(stmt, ParamDecl):
            for p in stmt.params:
                if p.name in layout:
                    env[p.name] = int(layout[p.name])
                elif p.default is not None:
                    env[p.name] = ev.expr(p.default, env)
                else:
                    raise LayoutError(
                        f"the layout does not give param {p.name!r} (declared at line {p.line} "
                        f"of the spec); pass it, e.g. {p.name}=..."
                    )
        elif isinstance(stmt, Let):
            env[stmt.name] = ev.expr(stmt.expr, env)
    return Layout({d: env[d] for d in spec.mesh}, env)


def recorded_layout(spec: Spec, lay: Layout) -> dict[str, int]:
    """The layout as a checkpoint records it: every mesh dim's size and every param's value
    (what `layout_for` needs to give ``lay`` back)."""
    out = dict(lay.sizes)
    for p in spec.params:
        out[p.name] = lay.values[p.name]
    return out


def all_coords(sizes: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Every coordinate of a mesh, in rank order (row-major: the last dim varies fastest)."""
    dims = list(sizes)
    for c in itertools.product(*(range(sizes[d]) for d in dims)):
        yield dict(zip(dims, c, strict=True))


def coords_of_rank(sizes: Mapping[str, int], rank: int) -> dict[str, int]:
    out = {}
    for d in reversed(list(sizes)):
        out[d] = rank % sizes[d]
        rank //= sizes[d]
    return {d: out[d] for d in sizes}


def compile(
    spec: Spec | str, layout: Mapping[str, int] | Layout, coords: Mapping[str, int]
) -> dict[str, LocalTensor]:
    """The local tensors of the rank at mesh ``coords`` under ``layout``, by local name."""
    spec = _as_spec(spec)
    lay = layout if isinstance(layout, Layout) else layout_for(spec, layout)
    for d, c in coords.items():
        if d not in lay.sizes:
            raise LayoutError(
                f"coordinate for {d!r}, which is not a mesh dim of the spec {list(lay.sizes)}"
            )
        if not 0 <= c < lay.sizes[d]:
            raise LayoutError(f"coordinate {d}={c} is outside the mesh dim of size {lay.sizes[d]}")
    return _compile(spec, lay, tuple(sorted(coords.items())))


def _compile(spec: Spec, lay: Layout, coords: tuple) -> dict[str, LocalTensor]:
    ev = _Eval(spec, dict(lay.values), dict(coords))
    out: dict[str, LocalTensor] = {}
    for r in spec.rules:
        for renv in _loop_envs(ev, r.loops, dict(lay.values)):
            if r.when is not None and not ev.cond(r.when, renv):
                continue
            t = ev.rule(r, renv)
            if t.name in out:
                raise ev.error(
                    r,
                    f"local tensor {t.name!r} comes from two rules (lines {out[t.name].rule.line} and {r.line})",
                    "rules whose local names do not overlap (use 'when' to choose)",
                )
            out[t.name] = t
    return out


def _loop_envs(ev: _Eval, loops, env: dict) -> Iterator[dict]:
    """Every binding of the rule's loop variables; a count may use the loops before it."""
    if not loops:
        yield env
        return
    first, rest = loops[0], loops[1:]
    for v in range(ev.expr(first.count, env)):
        yield from _loop_envs(ev, rest, {**env, first.var: v})
