"""A spec's arithmetic under one layout: integer expressions, conditions and name templates.

`Evaluator` holds the layout's values (mesh sizes, params, lets) and the rank's mesh coordinates
(what ``rank(dim)`` reads), and turns every error into a `UCLSemanticError` that points at the
node in the spec's text.
"""

from __future__ import annotations

from collections.abc import Mapping

from anyshard.errors import UCLSemanticError
from anyshard.ucl.syntax import And, BinOp, Call, Compare, Neg, Not, Num, Or, Spec, Template, Var

__all__ = ["Evaluator"]

_COMPARE = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


class Evaluator:
    """Evaluates ``spec``'s expressions with ``env`` (the layout's values) at mesh ``coords``."""

    def __init__(self, spec: Spec, env: dict[str, int], coords: Mapping[str, int]):
        self.spec = spec
        self.text = spec.text or str(spec)
        self.env = env
        self.coords = coords

    def error(self, node, message: str, expected: str) -> UCLSemanticError:
        return UCLSemanticError.at(node, message, text=self.text, expected=expected)

    def expr(self, e, env: Mapping[str, int]) -> int:
        if isinstance(e, Num):
            return e.value
        if isinstance(e, Var):
            return env[e.name]
        if isinstance(e, Neg):
            return -self.expr(e.operand, env)
        if isinstance(e, BinOp):
            return self._binop(e, self.expr(e.left, env), self.expr(e.right, env))
        if isinstance(e, Call):
            return self._call(e, env)
        raise AssertionError(e)

    def _binop(self, e: BinOp, a: int, b: int) -> int:
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

    def _call(self, e: Call, env: Mapping[str, int]) -> int:
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

    def cond(self, c, env) -> bool:
        if isinstance(c, Compare):
            return _COMPARE[c.op](self.expr(c.left, env), self.expr(c.right, env))
        if isinstance(c, Not):
            return not self.cond(c.operand, env)
        if isinstance(c, And):
            return self.cond(c.left, env) and self.cond(c.right, env)
        if isinstance(c, Or):
            return self.cond(c.left, env) or self.cond(c.right, env)
        raise AssertionError(c)

    def name(self, t: Template, env) -> str:
        return "".join(p if isinstance(p, str) else str(self.expr(p, env)) for p in t.parts)
