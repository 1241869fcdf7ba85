"""Static checks of a parsed spec: every name defined, every primitive called correctly.

What needs the layout's numbers (exact divisions, shapes that fit) is checked when the spec is
compiled (`anyshard.ucl.evaluate`).
"""

from __future__ import annotations

from collections.abc import Iterable

from anyshard.errors import UCLSemanticError
from anyshard.ucl.syntax import (
    And,
    BinOp,
    Call,
    Combine,
    Compare,
    Group,
    KwArg,
    Let,
    ListArg,
    MeshDecl,
    Neg,
    Not,
    Num,
    OpCall,
    Or,
    ParamDecl,
    Part,
    Rule,
    Spec,
    Var,
)

__all__ = ["DTYPES", "FUNCTIONS", "OPS", "check_spec"]

# function -> number of arguments (None: one or more)
FUNCTIONS = {"rank": 1, "min": None, "max": None, "cdiv": 2, "round_up": 2}

DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "fp64": "F64",
    "fp32": "F32",
    "fp16": "F16",
    "bf16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}

# Mapping primitives: name -> accepted signatures. Letters: e expression, a mesh dim (axis),
# l list of expressions, d dtype name; "k=" a keyword argument.
OPS: dict[str, tuple[str, ...]] = {
    "chunk": ("ea", "ea unit=", "eee"),
    "split": ("eal",),
    "slice": ("eee",),
    "pad": ("ee", "e multiple="),
    "flatten": ("",),
    "range": ("ee",),
    "replicate": ("a",),
    "average": ("a",),
    "on": ("ae",),
    "transpose": ("ee",),
    "cast": ("d",),
}
USAGE = {
    "chunk": "chunk(dim, axis), chunk(dim, axis, unit=n) or chunk(dim, parts, index)",
    "split": "split(dim, axis, [size, ...])",
    "slice": "slice(dim, start, stop)",
    "pad": "pad(dim, size) or pad(dim, multiple=m)",
    "flatten": "flatten()",
    "range": "range(start, stop)",
    "replicate": "replicate(axis)",
    "average": "average(axis)",
    "on": "on(axis, index)",
    "transpose": "transpose(dim0, dim1)",
    "cast": "cast(dtype), e.g. cast(bf16)",
    "fuse": "fuse(dim, part, part, ...)",
    "interleave": "interleave(dim, [block, ...], part, ...)",
    "bucket": "bucket(part, ..., align=a, multiple=m)",
}
TAIL_OPS = ("transpose", "cast")  # only at the end of a rule's mapping


class _Checker:
    def __init__(self, spec: Spec, text: str):
        self.spec = spec
        self.text = text
        self.mesh: tuple[str, ...] = ()

    def error(self, node, message: str, expected: str) -> UCLSemanticError:
        return UCLSemanticError.at(node, message, text=self.text, expected=expected)

    def run(self) -> None:
        meshes = [s for s in self.spec.statements if isinstance(s, MeshDecl)]
        if len(meshes) > 1:
            raise self.error(meshes[1], "a spec declares its mesh once", "a single mesh statement")
        self.mesh = meshes[0].dims if meshes else ()
        scope: set[str] = set()
        for d in self.mesh:
            if d in scope:
                raise self.error(meshes[0], f"mesh dim {d!r} is declared twice", "distinct names")
            if d in FUNCTIONS:
                raise self.error(meshes[0], f"mesh dim {d!r} is a function name", "another name")
            scope.add(d)
        self.in_rule = False
        patterns: dict[tuple, list[Rule]] = {}
        for s in self.spec.statements:
            if isinstance(s, MeshDecl):
                if s is not meshes[0]:
                    continue
                if any(isinstance(x, (ParamDecl, Let, Rule)) for x in self._before(s)):
                    raise self.error(
                        s, "the mesh statement must come first", "mesh before param, let and rules"
                    )
            elif isinstance(s, ParamDecl):
                for p in s.params:
                    self._define(p, p.name, scope)
                    if p.default is not None:
                        self.expr(p.default, scope)
                    scope.add(p.name)
            elif isinstance(s, Let):
                self.expr(s.expr, scope)
                self._define(s, s.name, scope)
                scope.add(s.name)
            elif isinstance(s, Rule):
                self.in_rule = True
                self.rule(s, scope)
                self.in_rule = False
                key = tuple(p if isinstance(p, str) else "{}" for p in s.pattern.parts)
                earlier = patterns.get(key, [])
                clash = next((r for r in earlier if r.when is None or s.when is None), None)
                if clash is not None:
                    raise self.error(
                        s,
                        f"rule for {s.pattern} repeats the one at line {clash.line}",
                        "one rule per local-name pattern (use 'when' on each to choose among layouts)",
                    )
                patterns.setdefault(key, []).append(s)

    def _before(self, stmt):
        for s in self.spec.statements:
            if s is stmt:
                return
            yield s

    def _define(self, node, name: str, scope: set[str]) -> None:
        if name in scope:
            raise self.error(node, f"{name!r} is already defined", "a new name")
        if name in FUNCTIONS:
            raise self.error(node, f"{name!r} is a function name", "another name")

    def expr(self, e, scope: set[str]) -> None:
        if isinstance(e, Num):
            return
        if isinstance(e, Var):
            if e.name not in scope:
                raise self.error(e, f"unknown name {e.name!r}", _one_of(scope, "a defined name"))
            return
        if isinstance(e, BinOp):
            self.expr(e.left, scope)
            self.expr(e.right, scope)
            return
        if isinstance(e, Neg):
            self.expr(e.operand, scope)
            return
        if isinstance(e, Call):
            if e.fn not in FUNCTIONS:
                raise self.error(e, f"unknown function {e.fn!r}", _one_of(FUNCTIONS, "a function"))
            n = FUNCTIONS[e.fn]
            if (n is not None and len(e.args) != n) or (n is None and not e.args):
                raise self.error(
                    e,
                    f"{e.fn}() takes {n if n is not None else 'one or more'} argument(s), got {len(e.args)}",
                    f"{e.fn}(" + ", ".join(["x"] * (n or 2)) + ")",
                )
            if e.fn == "rank":
                if not self.in_rule:
                    raise self.error(
                        e,
                        "rank() is a rank's coordinate: it has a value only inside a rule",
                        "rank() in a rule's names, conditions or mappings, not in param or let",
                    )
                self.axis(e.args[0])
                return
            for a in e.args:
                self.expr(a, scope)
            return
        raise self.error(e, f"expected an expression, found {e}", "an expression")

    def cond(self, c, scope: set[str]) -> None:
        if isinstance(c, Compare):
            self.expr(c.left, scope)
            self.expr(c.right, scope)
        elif isinstance(c, Not):
            self.cond(c.operand, scope)
        elif isinstance(c, (And, Or)):
            self.cond(c.left, scope)
            self.cond(c.right, scope)

    def axis(self, e) -> None:
        if not isinstance(e, Var) or e.name not in self.mesh:
            raise self.error(
                e, f"{e} is not a mesh dim", _one_of(self.mesh, "a mesh dim (declare it with mesh)")
            )

    def op(self, op: OpCall, scope: set[str]) -> None:
        if op.name not in OPS:
            if op.name in ("fuse", "interleave", "bucket"):
                raise self.error(
                    op,
                    f"{op.name}() combines logical tensors and must come first, right after '->'",
                    USAGE[op.name],
                )
            raise self.error(
                op, f"unknown mapping primitive {op.name!r}", _one_of(OPS, "a primitive")
            )
        sig = next((s for s in OPS[op.name] if self._fits(op, s)), None)
        if sig is None:
            # the arguments have the right shape but one meant as a mesh dim is not: say which
            sig = next((s for s in OPS[op.name] if self._fits(op, s, any_axis=True)), None)
        if sig is None:
            raise self.error(op, f"wrong arguments to {op.name}", USAGE[op.name])
        slots = iter(sig.split(" ")[0])
        for a in op.args:
            if isinstance(a, KwArg):
                self.expr(a.value, scope)
                continue
            kind = next(slots)
            if kind == "l":
                for x in a.items:
                    self.expr(x, scope)
            elif kind == "e":
                self.expr(a, scope)
            elif kind == "a":
                self.axis(a)
            elif kind == "d" and (not isinstance(a, Var) or a.name not in DTYPES):
                raise self.error(a, f"{a} is not a dtype", _one_of(DTYPES, "a dtype"))

    def _fits(self, op: OpCall, sig: str, any_axis: bool = False) -> bool:
        head, *kws = sig.split(" ")
        positional = [a for a in op.args if not isinstance(a, KwArg)]
        kwargs = [a.name for a in op.args if isinstance(a, KwArg)]
        if [k.rstrip("=") for k in kws] != kwargs or len(positional) != len(head):
            return False
        for a, kind in zip(positional, head, strict=True):
            if kind == "l" and not isinstance(a, ListArg):
                return False
            if kind in "ead" and isinstance(a, ListArg):
                return False
            if kind == "a" and not any_axis and not (isinstance(a, Var) and a.name in self.mesh):
                return False
            if kind == "e" and isinstance(a, Var) and a.name in DTYPES and a.name not in self.mesh:
                return False
        return True

    def ops(self, ops: Iterable[OpCall], scope: set[str], tail_ok: bool) -> None:
        ops = list(ops)
        seen_tail = False
        for op in ops:
            self.op(op, scope)
            if op.name in TAIL_OPS:
                if not tail_ok:
                    raise self.error(
                        op,
                        f"{op.name}() applies to a whole local tensor",
                        f"{op.name}() at the end of the rule, after the combinator",
                    )
                seen_tail = True
            elif seen_tail:
                raise self.error(
                    op,
                    f"{op.name}() after transpose()/cast()",
                    "transpose() and cast() last in the mapping",
                )

    def template(self, t, scope: set[str]) -> None:
        for p in t.parts:
            if not isinstance(p, str):
                self.expr(p, scope)

    def part(self, p: Part, scope: set[str], tail_ok: bool) -> None:
        self.template(p.name, scope)
        for d in p.shape:
            self.expr(d, scope)
        if p.when is not None:
            self.cond(p.when, scope)
        self.ops(p.ops, scope, tail_ok)

    def items(self, items, scope: set[str]) -> int:
        n = 0
        for it in items:
            if isinstance(it, Part):
                self.part(it, scope, tail_ok=False)
                n += 1
            else:
                inner = set(scope)
                if it.loop is not None:
                    self.expr(it.loop.count, scope)
                    self._define(it.loop, it.loop.var, scope)
                    inner.add(it.loop.var)
                else:
                    self.cond(it.when, scope)
                n += self.items(it.items, inner)
        return n

    def combine(self, c: Combine, scope: set[str]) -> None:
        params = c.params
        kw: dict[str, KwArg] = {}
        for a in params:
            if isinstance(a, KwArg):
                if a.name in kw:
                    raise self.error(a, f"{a.name}= is given twice", USAGE[c.kind])
                kw[a.name] = a
        pos = [a for a in params if not isinstance(a, KwArg)]
        allowed = {
            "fuse": ("e", ()),
            "interleave": ("el", ()),
            "bucket": ("", ("align", "multiple")),
        }
        shape, kws = allowed[c.kind]
        ok = len(pos) == len(shape) and set(kw) <= set(kws)
        ok = ok and all(
            isinstance(a, ListArg) == (k == "l") for a, k in zip(pos, shape, strict=False)
        )
        if not ok:
            raise self.error(c, f"wrong arguments to {c.kind}", USAGE[c.kind])
        for a in params:
            if isinstance(a, KwArg):
                self.expr(a.value, scope)
            elif isinstance(a, ListArg):
                for x in a.items:
                    self.expr(x, scope)
            else:
                self.expr(a, scope)
        if not c.items:
            raise self.error(c, f"{c.kind}() combines no logical tensor", USAGE[c.kind])
        n = self.items(c.items, scope)
        if c.kind == "interleave" and not any(isinstance(i, Group) for i in c.items):
            blocks = pos[1].items
            if len(blocks) != n:
                raise self.error(
                    pos[1],
                    f"interleave() lists {len(blocks)} block size(s) for {n} part(s)",
                    "one block size per part",
                )

    def rule(self, r: Rule, globals_: set[str]) -> None:
        scope = set(globals_)
        for lp in r.loops:
            self.expr(lp.count, scope)
            self._define(lp, lp.var, scope)
            scope.add(lp.var)
        loop_vars = [lp.var for lp in r.loops]
        caps = r.pattern.captures
        for p in r.pattern.parts:
            if not isinstance(p, str) and p.name not in loop_vars:
                raise self.error(
                    p,
                    f"capture {p.name!r} has no range",
                    f"'for {p.name} in range(n)' after the pattern",
                )
        for lp in r.loops:
            if lp.var not in caps:
                raise self.error(
                    lp,
                    f"loop variable {lp.var!r} does not appear in the local name {r.pattern}",
                    f"a capture {{{lp.var}:int}} in the pattern",
                )
        if len(set(caps)) != len(caps):
            raise self.error(r.pattern, "a capture appears twice in the pattern", "distinct names")
        if r.when is not None:
            self.cond(r.when, scope)
        if isinstance(r.source, Part):
            self.part(r.source, scope, tail_ok=True)
        else:
            self.combine(r.source, scope)
        self.ops(r.ops, scope, tail_ok=True)


def _one_of(names: Iterable[str], fallback: str) -> str:
    names = sorted(names)
    if not names:
        return fallback
    return "one of " + ", ".join(names)


def check_spec(spec: Spec, text: str) -> None:
    """Raise `UCLSemanticError` at the first statically wrong place of ``spec``."""
    _Checker(spec, text).run()
