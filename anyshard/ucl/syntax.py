"""UCL specs: the typed syntax tree and its printer.

A spec describes every local tensor of a model family under a layout::

    mesh pp, dp, tp;
    param hidden, ffn, layers;
    let lps = layers / pp;
    "layers.{i:int}.mlp.w2.weight" for i in range(lps)
        -> "layers.{rank(pp) * lps + i}.mlp.w2.weight" [hidden, ffn] : chunk(1, tp) | replicate(dp);

`anyshard.ucl.parser` builds a `Spec` from text; ``str(spec)`` gives text that parses back to
an equal `Spec`. Every node carries the line and column it was read from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "And",
    "Arg",
    "BinOp",
    "Call",
    "Capture",
    "Combine",
    "Compare",
    "Cond",
    "Expr",
    "Group",
    "KwArg",
    "Let",
    "ListArg",
    "Loop",
    "MeshDecl",
    "Neg",
    "Not",
    "Num",
    "OpCall",
    "Or",
    "Param",
    "ParamDecl",
    "Part",
    "Pattern",
    "Rule",
    "Spec",
    "Statement",
    "Template",
    "Var",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    line: int = field(default=0, compare=False, repr=False)
    column: int = field(default=0, compare=False, repr=False)


# --- expressions --------------------------------------------------------------------------------

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class Num(Node):
    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Var(Node):
    """A param, a ``let``, a loop variable, or a mesh dim (its size)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class Call(Node):
    """``rank(axis)``, ``min``, ``max``, ``cdiv(a, b)`` (ceil division), ``round_up(a, m)``."""

    fn: str
    args: tuple[Expr, ...]

    def __str__(self) -> str:
        return f"{self.fn}({', '.join(map(str, self.args))})"


@dataclass(frozen=True, slots=True, kw_only=True)
class BinOp(Node):
    """``+ - *``; ``/`` exact division (an error when it leaves a remainder); ``//`` floor; ``%``."""

    op: str
    left: Expr
    right: Expr

    def __str__(self) -> str:
        p = _PREC[self.op]
        left = _wrap(self.left, _prec(self.left) < p)
        right = _wrap(self.right, _prec(self.right) <= p)
        return f"{left} {self.op} {right}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Neg(Node):
    operand: Expr

    def __str__(self) -> str:
        return f"-{_wrap(self.operand, _prec(self.operand) < 3)}"


Expr = Num | Var | Call | BinOp | Neg


def _prec(e: Expr) -> int:
    if isinstance(e, BinOp):
        return _PREC[e.op]
    return 3 if isinstance(e, Neg) else 4


def _wrap(e: Expr, paren: bool) -> str:
    return f"({e})" if paren else str(e)


# --- conditions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Compare(Node):
    op: str
    left: Expr
    right: Expr

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Not(Node):
    operand: Cond

    def __str__(self) -> str:
        return f"not {self.operand}"


@dataclass(frozen=True, slots=True, kw_only=True)
class And(Node):
    left: Cond
    right: Cond

    def __str__(self) -> str:
        return f"{self.left} and {self.right}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Or(Node):
    left: Cond
    right: Cond

    def __str__(self) -> str:
        return f"{self.left} or {self.right}"


Cond = Compare | Not | And | Or


# --- names --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Capture(Node):
    """``{name:int}`` in a local-name pattern."""

    name: str
    type: str = "int"

    def __str__(self) -> str:
        return f"{{{self.name}:{self.type}}}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Pattern(Node):
    """A local tensor name with typed captures: ``"layers.{i:int}.attention.wqkv.weight"``."""

    parts: tuple[str | Capture, ...]

    def __str__(self) -> str:
        return '"' + "".join(str(p) for p in self.parts) + '"'

    @property
    def captures(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts if isinstance(p, Capture))

    def regex(self) -> re.Pattern:
        out = []
        for p in self.parts:
            out.append(f"(?P<{p.name}>0|[1-9][0-9]*)" if isinstance(p, Capture) else re.escape(p))
        return re.compile("".join(out))


@dataclass(frozen=True, slots=True, kw_only=True)
class Template(Node):
    """A logical tensor name computed from captures: ``"layers.{rank(pp) * lps + i}.w"``."""

    parts: tuple[str | Expr, ...]

    def __str__(self) -> str:
        return '"' + "".join(p if isinstance(p, str) else f"{{{p}}}" for p in self.parts) + '"'


# --- mappings -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class KwArg(Node):
    name: str
    value: Expr

    def __str__(self) -> str:
        return f"{self.name}={self.value}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ListArg(Node):
    items: tuple[Expr, ...]

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.items))}]"


Arg = Num | Var | Call | BinOp | Neg | KwArg | ListArg


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCall(Node):
    """A mapping primitive applied to the tensor so far: ``chunk(0, tp)``, ``pad(0, 1024)``."""

    name: str
    args: tuple[Arg, ...]

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Loop(Node):
    var: str
    count: Expr

    def __str__(self) -> str:
        return f"{self.var} in range({self.count})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Part(Node):
    """A logical tensor, its global shape, and the mapping that takes it to (part of) the local
    tensor; ``when`` (inside a combinator) makes the part conditional."""

    name: Template
    shape: tuple[Expr, ...]
    ops: tuple[OpCall, ...] = ()
    when: Cond | None = None

    def __str__(self) -> str:
        s = f"{self.name} [{', '.join(map(str, self.shape))}]"
        if self.ops:
            s += " : " + " | ".join(map(str, self.ops))
        if self.when is not None:
            s += f" when {self.when}"
        return s


@dataclass(frozen=True, slots=True, kw_only=True)
class Group(Node):
    """``for j in range(n) { items }`` or ``when cond { items }`` inside a combinator."""

    items: tuple[Part | Group, ...]
    loop: Loop | None = None
    when: Cond | None = None

    def __str__(self) -> str:
        head = f"for {self.loop}" if self.loop is not None else f"when {self.when}"
        return f"{head} {{ {', '.join(map(str, self.items))} }}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Combine(Node):
    """``fuse(dim, parts...)``, ``interleave(dim, [block, ...], parts...)`` or
    ``bucket(align=a, multiple=m, parts...)``: one local tensor holding several logical ones."""

    kind: str
    args: tuple[Arg | Part | Group, ...]

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.args))})"

    @property
    def items(self) -> tuple[Part | Group, ...]:
        return tuple(a for a in self.args if isinstance(a, (Part, Group)))

    @property
    def params(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if not isinstance(a, (Part, Group)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule(Node):
    """``[alias] PATTERN [for ...] [when ...] -> SOURCE [| op ...];``"""

    pattern: Pattern
    source: Part | Combine
    ops: tuple[OpCall, ...] = ()
    loops: tuple[Loop, ...] = ()
    when: Cond | None = None
    alias: bool = False

    def __str__(self) -> str:
        s = "alias " if self.alias else ""
        s += str(self.pattern)
        if self.loops:
            s += " for " + ", ".join(map(str, self.loops))
        if self.when is not None:
            s += f" when {self.when}"
        body = str(self.source)
        if self.ops:
            body += " | " + " | ".join(map(str, self.ops))
        return f"{s}\n    -> {body};"


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshDecl(Node):
    dims: tuple[str, ...]

    def __str__(self) -> str:
        return f"mesh {', '.join(self.dims)};"


@dataclass(frozen=True, slots=True, kw_only=True)
class Param(Node):
    name: str
    default: Expr | None = None

    def __str__(self) -> str:
        return self.name if self.default is None else f"{self.name} = {self.default}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamDecl(Node):
    params: tuple[Param, ...]

    def __str__(self) -> str:
        return f"param {', '.join(map(str, self.params))};"


@dataclass(frozen=True, slots=True, kw_only=True)
class Let(Node):
    name: str
    expr: Expr

    def __str__(self) -> str:
        return f"let {self.name} = {self.expr};"


Statement = MeshDecl | ParamDecl | Let | Rule


@dataclass(frozen=True, slots=True)
class Spec:
    """A parsed spec. ``str()`` gives text that parses back to an equal `Spec`."""

    statements: tuple[Statement, ...]
    text: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return "\n".join(map(str, self.statements)) + "\n"

    @property
    def mesh(self) -> tuple[str, ...]:
        return tuple(d for s in self.statements if isinstance(s, MeshDecl) for d in s.dims)

    @property
    def params(self) -> tuple[Param, ...]:
        return tuple(p for s in self.statements if isinstance(s, ParamDecl) for p in s.params)

    @property
    def lets(self) -> tuple[Let, ...]:
        return tuple(s for s in self.statements if isinstance(s, Let))

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(s for s in self.statements if isinstance(s, Rule))
