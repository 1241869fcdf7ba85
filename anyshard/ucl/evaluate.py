"""Compile a spec for a layout: the mapping of every local tensor of a rank, as pieces.

``compile(spec, layout, coords)`` evaluates the spec's arithmetic with the layout's numbers and
the rank's mesh coordinates, expands every rule over its loops, and turns each mapping into
`Shard` pieces (the same box correspondences the rest of anyshard plans reads with). A local
tensor may hold pieces of several logical tensors (``fuse``, ``interleave``, ``bucket``).

The steps live beside it: the arithmetic in `anyshard.ucl.arithmetic`, one function per mapping
primitive in `anyshard.ucl.primitives`, local tensors of several parts in `anyshard.ucl.combine`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from anyshard.errors import LayoutError
from anyshard.geometry.shards import Shard
from anyshard.ucl.arithmetic import Evaluator
from anyshard.ucl.combine import combine
from anyshard.ucl.library import load_spec
from anyshard.ucl.primitives import apply, new_flags, part_state
from anyshard.ucl.syntax import Let, ParamDecl, Part, Rule, Spec

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


def _local_tensor(ev: Evaluator, r: Rule, env) -> LocalTensor:
    """The local tensor that rule ``r`` makes under ``env`` (its loop variables bound)."""
    name = _local_name(r, env)
    if isinstance(r.source, Part):
        flags = new_flags()
        logical, shape, st = part_state(ev, r.source, env, flags)
        parts = [(logical, shape, st, flags)]
    else:
        parts = combine(ev, r.source, env)
        if not parts:
            raise ev.error(
                r.source,
                f"{r.source.kind}() holds no logical tensor under this layout (every part "
                f"is excluded by 'when' or an empty loop), so local tensor {name!r} would be empty",
                "at least one part, or a 'when' on the rule",
            )
        for _logical, _shape, st, flags in parts:
            for op in r.ops:
                apply(ev, st, op, env, flags)
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
    ev = Evaluator(spec, env, {})
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
    ev = Evaluator(spec, dict(lay.values), dict(coords))
    out: dict[str, LocalTensor] = {}
    for r in spec.rules:
        for renv in _loop_envs(ev, r.loops, dict(lay.values)):
            if r.when is not None and not ev.cond(r.when, renv):
                continue
            t = _local_tensor(ev, r, renv)
            if t.name in out:
                raise ev.error(
                    r,
                    f"local tensor {t.name!r} comes from two rules (lines {out[t.name].rule.line} and {r.line})",
                    "rules whose local names do not overlap (use 'when' to choose)",
                )
            out[t.name] = t
    return out


def _loop_envs(ev: Evaluator, loops, env: dict) -> Iterator[dict]:
    """Every binding of the rule's loop variables; a count may use the loops before it."""
    if not loops:
        yield env
        return
    first, rest = loops[0], loops[1:]
    for v in range(ev.expr(first.count, env)):
        yield from _loop_envs(ev, rest, {**env, first.var: v})
