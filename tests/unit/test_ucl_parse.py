"""The UCL spec parser under hostile input, and its printer.

1. `ucl.parse` raises nothing but `UCLSyntaxError` / `UCLSemanticError` for any text, and the error
   points inside the text (or just past its end), says what was expected and shows the line with a
   caret: arbitrary text, mutations of valid specs, every truncation of a spec.
2. ``parse(str(spec)) == spec`` for the shipped specs, hand-written ones and specs generated from
   the syntax tree's types (with the printer's parentheses where precedence needs them).
3. Errors sit at the exact line and column of the wrong place.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import anyshard
from anyshard.errors import UCLError, UCLSemanticError, UCLSyntaxError
from anyshard.ucl import syntax as S
from anyshard.ucl.check import DTYPES, FUNCTIONS
from anyshard.ucl.library import parse
from anyshard.ucl.parser import MAX_DEPTH

SPEC_DIR = Path(S.__file__).parent / "specs"
SHIPPED = {p.stem: p.read_text() for p in sorted(SPEC_DIR.glob("*.ucl"))}

HAND = {
    "everything": """\
# every statement and primitive once
mesh pp, dp, tp, ep;
param hidden, heads, kv_heads = heads, ffn = 4 * hidden, vocab, layers = 2, tied = 0;
let hd = hidden / heads;
let lps = cdiv(layers, pp);
let odd = -(hidden % 7) + --heads - (ffn - (vocab - 1)) // (2 * (3 - 1));
let top = round_up(max(hidden, ffn, 3), min(8, heads));
"a.{i:int}.b" for i in range(lps) when rank(pp) == 0 and not rank(tp) != 1 or rank(dp) >= 2
    -> "x.{rank(pp) * lps + i}.y{i}{i}" [hidden, ffn]
       : chunk(0, tp) | chunk(1, dp, unit=2) | chunk(0, 2, 1) | split(0, ep, [1, hidden - 1])
       | slice(1, 0, hd) | pad(0, 3) | pad(1, multiple=8) | flatten() | range(0, 4)
       | replicate(pp) | average(dp) | on(ep, 0) | transpose(0, 1) | cast(bf16);
"e.{j:int}.{k:int}" for j in range(2), k in range(heads)
    -> interleave(0, [hd, hd], "q.{j}.{k}" [hd] : chunk(0, tp), "k.{j}" [hd] when k == 0)
       | replicate(dp) | cast(fp32);
"flat"
    -> bucket(align=4, "p" [1] when tied == 1, for i in range(2) { "w.{i}" [3] : chunk(0, tp),
         when i < 1 { "v.{i}" [2] } }, multiple=2 * dp, when vocab > 0 { }) | chunk(0, dp);
alias "fused" -> fuse(1, "g" [ffn, hidden], "u" [ffn, hidden]) | transpose(0, 1);
"odd # not a comment.{i:int}" for i in range(1) -> "é {i} #" [];
""",
    "small": """\
mesh dp, tp;
param n, m = 2 * n;
let k = -(n - 1) / 2;
"w.{i:int}" for i in range(n) when rank(tp) == 0 or not k > 1
    -> fuse(0, "a.{i}" [n, m] : chunk(0, tp), for j in range(2) { "b.{j}" [m] when j == 0 })
       | replicate(dp) | cast(bf16);
""",
    "tiny": 'mesh tp;\nparam n;\n"w" -> "w" [n, 2 * n] : chunk(0, tp);\n',
    "empty": "",
    "comments only": "# nothing\n   # here\n",
    "no mesh": 'param n = 3;\nlet m = n * n;\n"a" -> "b" [m, -n];\n',
    "crlf": 'mesh tp;\r\nparam n;\r\n"w.{i:int}" for i in range(n)\r\n  -> "w{i}" [n] : chunk(0, tp);\r\n',
    "tricky names": (
        "mesh range, fuse;\nparam int, formula, in_, not_a, bucket = 1;\n"
        '"w" -> fuse (0, "x" [fuse, range] : chunk(0, fuse) | replicate(range));\n'
    ),
}
VALID = {
    **{f"shipped:{k}": v for k, v in SHIPPED.items()},
    **{f"hand:{k}": v for k, v in HAND.items()},
}

# the grammar's punctuation, letters, digits and whitespace (# and " included)
CHARS = 'abcdefgilmnoprstuxyz_019{}[]()|,;:=<>!+-*/%#". \n\t'
WORDS = [
    *"mesh param let for in range when alias and or not fuse interleave bucket".split(),
    *"chunk split slice pad flatten replicate average on transpose cast rank min max".split(),
    *"cdiv round_up tp dp pp i j n x unit align multiple bf16 int".split(),
    *'{ } [ ] ( ) | , ; : = == != <= >= < > + - * / // % # " -> . 0 1 17'.split(),
    *[" ", "\n", "\r\n", '"a.{i:int}"', '"b.{i}"', "{i:int}", "{rank(tp)}", "for i in range(2)"],
]
ODD = ["\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\x00", "é", "\ufeff", "\\", "'", "$", "@"]

FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


# --- what every error must be ---------------------------------------------------------------------


def check_error(text: str, e: BaseException) -> None:
    assert isinstance(e, (UCLSyntaxError, UCLSemanticError)), repr(e)
    assert isinstance(e, ValueError) and isinstance(e, anyshard.AnyshardError)
    assert type(e.line) is int and type(e.column) is int, (e.line, e.column)
    lines = text.splitlines() or [""]
    assert 1 <= e.line <= len(lines), (e.line, len(lines), str(e))
    assert 1 <= e.column <= len(lines[e.line - 1]) + 1, (e.line, e.column, str(e))
    assert isinstance(e.expected, str) and e.expected.strip(), str(e)
    src = lines[e.line - 1]
    assert e.excerpt == src + "\n" + " " * (e.column - 1) + "^"
    message = str(e)
    assert f"at line {e.line}, column {e.column}; expected {e.expected}" in message
    assert message.endswith(f"  {src}\n  {' ' * (e.column - 1)}^")


def parse_anything(text: str) -> S.Spec | None:
    """Parse ``text``: a spec that round-trips, or an error that passes `check_error`."""
    try:
        spec = parse(text)
    except UCLError as e:
        check_error(text, e)
        return None
    assert_round_trip(spec)
    return spec


def assert_round_trip(spec: S.Spec) -> None:
    text = str(spec)
    again = parse(text)
    assert again == spec, text
    assert str(again) == text


# --- 1. nothing but UCL errors, at places inside the text -------------------------------------------


@FAST
@given(
    st.one_of(
        st.text(alphabet=CHARS, max_size=80),
        st.lists(st.sampled_from(WORDS), max_size=40).map(" ".join),
        st.lists(st.sampled_from(WORDS + ODD), max_size=40).map("".join),
        st.text(max_size=40),
    )
)
def test_arbitrary_text_gives_a_spec_or_a_placed_error(text):
    parse_anything(text)


@st.composite
def mutated(draw, sources: dict[str, str]):
    text = draw(st.sampled_from(sorted(sources.values())))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["del", "ins", "rep", "dup", "drop", "swap", "cut"]))
        i = draw(st.integers(0, len(text)))
        if kind == "del" and text:
            j = min(len(text), i + draw(st.integers(1, 3)))
            text = text[:i] + text[j:]
        elif kind == "ins":
            text = text[:i] + draw(st.sampled_from(WORDS + ODD + list(CHARS))) + text[i:]
        elif kind == "rep" and text:
            text = text[:i] + draw(st.sampled_from(WORDS + list(CHARS))) + text[i + 1 :]
        elif kind in ("dup", "drop"):
            lines = text.split("\n")
            k = draw(st.integers(0, len(lines) - 1))
            if kind == "dup":
                lines.insert(k, lines[k])
            else:
                del lines[k]
            text = "\n".join(lines)
        elif kind == "swap":
            words = text.split(" ")
            a, b = draw(st.integers(0, len(words) - 1)), draw(st.integers(0, len(words) - 1))
            words[a], words[b] = words[b], words[a]
            text = " ".join(words)
        elif kind == "cut":
            text = text[:i]
    return text


@FAST
@given(mutated(SHIPPED))
def test_mutated_shipped_specs_give_a_spec_or_a_placed_error(text):
    parse_anything(text)


@FAST
@given(mutated(HAND))
def test_mutated_hand_written_specs_give_a_spec_or_a_placed_error(text):
    parse_anything(text)


@pytest.mark.parametrize("name", ["hand:small", "shipped:moe"])
def test_every_truncation_gives_a_spec_or_a_placed_error(name):
    text = VALID[name]
    ends = 0
    for i in range(len(text) + 1):
        if parse_anything(text[:i]) is None:
            ends += 1
    assert ends > len(text) // 2


@pytest.mark.parametrize(
    "text",
    [
        "let x = " + "-" * 5000 + "1;",
        "let x = 1" + " + 1" * 5000 + ";",
        'mesh tp; "a" when ' + "not " * 5000 + '1 == 1 -> "b" [1];',
        'mesh tp; "a" when 1 == 1' + " or 1 == 1" * 3000 + ' -> "b" [1];',
        'mesh tp; "a" -> "b{' + "-" * 3000 + '1}" [1];',
        'mesh tp; "a" -> "b" [' + "min(" * 3000 + "1" + ")" * 3000 + "];",
        'mesh tp; "a" -> fuse(0, ' + "for i in range(1) { " * 500 + "}" * 500 + ");",
        "let x = " + "9" * 5000 + ";",
        'mesh tp; "a" -> "b{' + "9" * 5000 + '}" [1];',
    ],
    ids=lambda t: t[:24],
)
def test_deep_or_huge_input_is_an_error_not_a_crash(text):
    with pytest.raises(UCLSyntaxError) as e:
        parse(text)
    check_error(text, e.value)


def test_parentheses_nest_freely():
    spec = parse("let x = " + "(" * 5000 + "1" + ")" * 5000 + ";")
    assert spec.lets[0].expr == S.Num(value=1)


def test_nesting_up_to_the_limit_parses_prints_and_compares():
    depth = MAX_DEPTH - 3  # start, let_decl and the number itself are levels too
    text = "let x = " + "-" * depth + "1;"
    spec = parse(text)
    assert_round_trip(spec)
    with pytest.raises(UCLSyntaxError, match="nested too deeply"):
        parse("let x = " + "-" * (depth + 1) + "1;")


# --- 2. printing and parsing again gives the same tree ---------------------------------------------


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_specs_round_trip(name):
    spec = parse(VALID[name])
    assert spec.text == VALID[name]
    assert_round_trip(spec)


def _v(name):
    return S.Var(name=name)


def _n(value):
    return S.Num(value=value)


def _b(op, left, right):
    return S.BinOp(op=op, left=left, right=right)


def _neg(e):
    return S.Neg(operand=e)


a, b, c = _v("a"), _v("b"), _v("c")


@pytest.mark.parametrize(
    "expr,shown",
    [
        (_b("-", a, _b("-", b, c)), "a - (b - c)"),
        (_b("-", _b("-", a, b), c), "a - b - c"),
        (_b("/", a, _b("*", b, c)), "a / (b * c)"),
        (_b("*", _b("/", a, b), c), "a / b * c"),
        (_b("//", a, _b("%", b, c)), "a // (b % c)"),
        (_b("+", a, _b("+", b, c)), "a + (b + c)"),
        (_b("*", _b("+", a, b), c), "(a + b) * c"),
        (_b("+", a, _b("*", b, c)), "a + b * c"),
        (_neg(_b("+", a, b)), "-(a + b)"),
        (_neg(_b("*", a, b)), "-(a * b)"),
        (_neg(_neg(a)), "--a"),
        (_b("*", _neg(a), b), "-a * b"),
        (_b("-", a, _neg(b)), "a - -b"),
        (_b("*", a, _neg(_n(1))), "a * -1"),
        (S.Call(fn="min", args=(_b("-", a, b), _neg(c))), "min(a - b, -c)"),
    ],
)
def test_expressions_print_with_the_parentheses_precedence_needs(expr, shown):
    assert str(expr) == shown
    spec = parse(f"param a, b, c;\nlet x = {shown};\n")
    assert spec.lets[0].expr == expr


KEYWORDS = {"mesh", "param", "let", "for", "in", "when", "alias", "and", "or", "not"}
NAMES = st.one_of(
    st.from_regex(r"[a-z_][a-z0-9_]{0,4}", fullmatch=True),
    st.sampled_from(["range", "fuse", "bucket", "int", "in_", "formula", "not_", "unit"]),
).filter(lambda n: n not in KEYWORDS and n not in FUNCTIONS and n not in DTYPES)
TEXT = st.text(alphabet="abcxyz019._-/# é", min_size=1, max_size=6)
INDEX = st.integers(0, 99)
OPS = st.lists(
    st.sampled_from("chunk split slice pad flatten range replicate average on".split()), max_size=3
)
TAILS = st.lists(st.sampled_from(["transpose", "cast"]), max_size=2)

# Expressions and conditions are drawn with placeholders (Var "#k": the k-th name in scope, Var
# "@k": the k-th mesh dim) from strategies built once, then bound to the names of the place.
_LEAF = st.one_of(
    st.integers(0, 300).map(_n),
    INDEX.map(lambda k: _v(f"#{k}")),
    INDEX.map(lambda k: S.Call(fn="rank", args=(_v(f"@{k}"),))),
)


def _compound(sub):
    return st.one_of(
        st.builds(_b, st.sampled_from(["+", "-", "*", "/", "//", "%"]), sub, sub),
        st.builds(_neg, sub),
        st.builds(
            lambda fn, args: S.Call(fn=fn, args=tuple(args)),
            st.sampled_from(["min", "max"]),
            st.lists(sub, min_size=1, max_size=3),
        ),
        st.builds(
            lambda fn, x, y: S.Call(fn=fn, args=(x, y)),
            st.sampled_from(["cdiv", "round_up"]),
            sub,
            sub,
        ),
    )


EXPR = st.recursive(_LEAF, _compound, max_leaves=6)
# outside rules (param defaults, lets) there is no rank to ask rank() about
GLOBAL_EXPR = st.recursive(
    st.one_of(st.integers(0, 300).map(_n), INDEX.map(lambda k: _v(f"#{k}"))),
    _compound,
    max_leaves=6,
)
SMALL = st.recursive(_LEAF, _compound, max_leaves=3)
_COMPARE = st.builds(
    lambda op, x, y: S.Compare(op=op, left=x, right=y),
    st.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
    SMALL,
    SMALL,
)
# only the shapes the grammar makes: `or` and `and` lean left, `not` binds tightest
_NOT = st.recursive(_COMPARE, lambda inner: inner.map(lambda x: S.Not(operand=x)), max_leaves=3)
_AND = st.recursive(
    _NOT, lambda inner: st.builds(lambda x, y: S.And(left=x, right=y), inner, _NOT), max_leaves=3
)
COND = st.recursive(
    _AND, lambda inner: st.builds(lambda x, y: S.Or(left=x, right=y), inner, _AND), max_leaves=3
)


def bind(node, scope: list[str], mesh: list[str]):
    """``node`` with its placeholders replaced by names of ``scope`` and ``mesh``."""
    if isinstance(node, S.Var) and node.name[0] == "#":
        k = int(node.name[1:])
        return _v(scope[k % len(scope)]) if scope else _n(k)
    if isinstance(node, S.Var) and node.name[0] == "@":
        return _v(mesh[int(node.name[1:]) % len(mesh)])
    if isinstance(node, S.Call):
        return S.Call(fn=node.fn, args=tuple(bind(x, scope, mesh) for x in node.args))
    if isinstance(node, (S.BinOp, S.Compare)):
        left, right = bind(node.left, scope, mesh), bind(node.right, scope, mesh)
        return type(node)(op=node.op, left=left, right=right)
    if isinstance(node, (S.And, S.Or)):
        return type(node)(left=bind(node.left, scope, mesh), right=bind(node.right, scope, mesh))
    if isinstance(node, (S.Neg, S.Not)):
        return type(node)(operand=bind(node.operand, scope, mesh))
    return node


class _Gen:
    """Draws the parts of one valid spec."""

    def __init__(self, draw):
        self.draw = draw
        self.used: set[str] = set()
        self.mesh: list[str] = []

    def fresh(self) -> str:
        name = self.draw(NAMES)
        while name in self.used:
            name += "_"
        self.used.add(name)
        return name

    def pick(self, names: list[str]) -> str:
        return names[self.draw(INDEX) % len(names)]

    choose = pick

    def expr(self, scope, strategy=SMALL):
        return bind(self.draw(strategy), scope, self.mesh)

    def cond(self, scope):
        return bind(self.draw(COND), scope, self.mesh)

    def ops(self, scope, tail: bool) -> tuple[S.OpCall, ...]:
        e = lambda: self.expr(scope)  # noqa: E731
        axis = lambda: _v(self.pick(self.mesh))  # noqa: E731
        makers = {
            "chunk": [
                lambda: (e(), axis()),
                lambda: (e(), axis(), S.KwArg(name="unit", value=e())),
                lambda: (e(), e(), e()),
            ],
            "split": [
                lambda: (
                    e(),
                    axis(),
                    S.ListArg(items=tuple(e() for _ in range(self.draw(INDEX) % 3))),
                )
            ],
            "slice": [lambda: (e(), e(), e())],
            "pad": [lambda: (e(), e()), lambda: (e(), S.KwArg(name="multiple", value=e()))],
            "flatten": [lambda: ()],
            "range": [lambda: (e(), e())],
            "replicate": [lambda: (axis(),)],
            "average": [lambda: (axis(),)],
            "on": [lambda: (axis(), e())],
        }
        tails = {
            "transpose": [lambda: (e(), e())],
            "cast": [lambda: (_v(self.pick(sorted(DTYPES))),)],
        }
        out = []
        for name in self.draw(OPS):
            out.append(S.OpCall(name=name, args=self.choose(makers[name])()))
        if tail:
            for name in self.draw(TAILS):
                out.append(S.OpCall(name=name, args=self.choose(tails[name])()))
        return tuple(out)

    def template(self, scope) -> S.Template:
        parts: list = []
        for _ in range(self.draw(st.integers(1, 4))):
            if self.draw(st.booleans()):
                text = self.draw(TEXT)
                if parts and isinstance(parts[-1], str):
                    parts[-1] += text
                else:
                    parts.append(text)
            else:
                parts.append(self.expr(scope, EXPR))
        return S.Template(parts=tuple(parts))

    def part(self, scope, tail: bool, when: bool) -> S.Part:
        return S.Part(
            name=self.template(scope),
            shape=tuple(self.expr(scope, EXPR) for _ in range(self.draw(st.integers(0, 3)))),
            ops=self.ops(scope, tail),
            when=self.cond(scope) if when and self.draw(st.booleans()) else None,
        )

    def items(self, scope, depth: int) -> tuple:
        out = []
        for _ in range(self.draw(st.integers(0 if depth else 1, 2))):
            kind = self.draw(st.sampled_from(["part", "part", "loop", "when"]))
            if kind == "part" or depth >= 2:
                out.append(self.part(scope, tail=False, when=True))
            elif kind == "loop":
                loop = S.Loop(var=self.fresh(), count=self.expr(scope))
                out.append(S.Group(loop=loop, items=self.items([*scope, loop.var], depth + 1)))
            else:
                out.append(S.Group(when=self.cond(scope), items=self.items(scope, depth + 1)))
        return tuple(out)

    def combine(self, scope) -> S.Combine:
        kind = self.draw(st.sampled_from(["fuse", "interleave", "bucket"]))
        things = self.items(scope, 0)
        if kind == "fuse":
            params = (self.expr(scope),)
        elif kind == "interleave":
            if any(isinstance(t, S.Group) for t in things):
                blocks = tuple(self.expr(scope) for _ in range(self.draw(INDEX) % 3))
            else:
                blocks = tuple(self.expr(scope) for _ in things)
            params = (self.expr(scope), S.ListArg(items=blocks))
        else:
            keys = self.draw(st.lists(st.sampled_from(["align", "multiple"]), unique=True))
            params = tuple(S.KwArg(name=k, value=self.expr(scope)) for k in keys)
        if kind == "bucket" and self.draw(st.booleans()):
            return S.Combine(kind=kind, args=things + params)
        return S.Combine(kind=kind, args=params + things)

    def rule(self, index: int, scope) -> S.Rule:
        loops = []
        inner = list(scope)
        for _ in range(self.draw(st.integers(0, 2))):
            loops.append(S.Loop(var=self.fresh(), count=self.expr(inner)))
            inner.append(loops[-1].var)
        order = self.draw(st.permutations([lp.var for lp in loops]))
        parts: list = [f"r{index}" + self.draw(TEXT)]
        for var in order:
            parts += [S.Capture(name=var), self.draw(TEXT)]
        if order and self.draw(st.booleans()):
            parts.pop()
        when = self.cond(inner) if self.draw(st.booleans()) else None
        if self.draw(st.booleans()):
            source, ops = self.part(inner, tail=True, when=False), ()
        else:
            source, ops = self.combine(inner), self.ops(inner, tail=True)
        return S.Rule(
            pattern=S.Pattern(parts=tuple(parts)),
            source=source,
            ops=ops,
            loops=tuple(loops),
            when=when,
            alias=self.draw(st.booleans()),
        )


@st.composite
def specs(draw) -> S.Spec:
    g = _Gen(draw)
    g.mesh = [g.fresh() for _ in range(draw(st.integers(1, 3)))]
    statements: list = [S.MeshDecl(dims=tuple(g.mesh))]
    scope = list(g.mesh)
    rules = 0
    for kind in draw(st.lists(st.sampled_from(["param", "let", "rule", "rule"]), max_size=4)):
        if kind == "param":
            params = []
            for _ in range(draw(st.integers(1, 3))):
                default = g.expr(scope, GLOBAL_EXPR) if draw(st.booleans()) else None
                params.append(S.Param(name=g.fresh(), default=default))
                scope.append(params[-1].name)
            statements.append(S.ParamDecl(params=tuple(params)))
        elif kind == "let":
            statements.append(S.Let(name=g.fresh(), expr=g.expr(scope, GLOBAL_EXPR)))
            scope.append(statements[-1].name)
        else:
            statements.append(g.rule(rules, scope))
            rules += 1
    return S.Spec(tuple(statements))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs())
def test_generated_specs_print_and_parse_back_equal(spec):
    text = str(spec)
    parsed = parse(text)
    assert parsed == spec, text
    assert str(parsed) == text


# --- 3. errors at the right place ------------------------------------------------------------------

PRELUDE = "mesh pp, tp;\nparam n;\n"  # the cases below start on line 3


@pytest.mark.parametrize(
    "body,cls,line,column,reason,expected",
    [
        # unknown name in a template, inside the quotes
        ('"a" -> "x.{n + m}" [n];', UCLSemanticError, 3, 16, "unknown name 'm'", "one of n, pp"),
        # unknown primitive
        (
            '"a" -> "x" [n] : chunk(0, tp) | shard(0, tp);',
            UCLSemanticError,
            3,
            33,
            "unknown mapping primitive 'shard'",
            "one of average, cast, chunk",
        ),
        # wrong number of arguments: to a primitive, to a function
        (
            '"a" -> "x" [n] : chunk(0);',
            UCLSemanticError,
            3,
            18,
            "wrong arguments to chunk",
            "chunk(dim, axis)",
        ),
        (
            '"a" -> "x" [cdiv(n)];',
            UCLSemanticError,
            3,
            13,
            "cdiv() takes 2 argument(s), got 1",
            "cdiv(x, x)",
        ),
        # an axis that is not a mesh dim: in a primitive, in rank()
        (
            '"a" -> "x" [n] : replicate(dp);',
            UCLSemanticError,
            3,
            28,
            "dp is not a mesh dim",
            "one of pp, tp",
        ),
        (
            '"a" -> "x" [n] : chunk(0, n);',
            UCLSemanticError,
            3,
            27,
            "n is not a mesh dim",
            "one of pp, tp",
        ),
        (
            '"a" -> "x.{rank(n)}" [n];',
            UCLSemanticError,
            3,
            17,
            "n is not a mesh dim",
            "one of pp, tp",
        ),
        # a capture without a loop, a loop variable not in the pattern
        (
            '"a.{i:int}" -> "x" [n];',
            UCLSemanticError,
            3,
            4,
            "capture 'i' has no range",
            "'for i in range(n)'",
        ),
        (
            '"a.{i:int}" for i in range(n), j in range(2) -> "x" [n];',
            UCLSemanticError,
            3,
            32,
            "loop variable 'j' does not appear",
            "a capture {j:int} in the pattern",
        ),
        # the same pattern twice
        (
            '"a.{i:int}" for i in range(n) -> "x{i}" [n];\n  "a.{j:int}" for j in range(n) -> "y{j}" [n];',
            UCLSemanticError,
            4,
            3,
            "repeats the one at line 3",
            "one rule per local-name pattern",
        ),
        # transpose()/cast() only last, only outside a combinator
        (
            '"a" -> "x" [n, n] : transpose(0, 1) | chunk(0, tp);',
            UCLSemanticError,
            3,
            39,
            "chunk() after transpose()/cast()",
            "transpose() and cast() last",
        ),
        (
            '"a" -> fuse(0, "x" [n, n] : transpose(0, 1));',
            UCLSemanticError,
            3,
            29,
            "transpose() applies to a whole local tensor",
            "after the combinator",
        ),
        # unbalanced braces in names
        (
            '"a.{i:int" for i in range(n) -> "x" [n];',
            UCLSyntaxError,
            3,
            4,
            "unbalanced brace",
            "{capture} with both braces",
        ),
        (
            '"a" -> "x.n}.y" [n];',
            UCLSyntaxError,
            3,
            12,
            "unbalanced brace",
            "{expression} with both braces",
        ),
        (
            '"a" -> "x.}{n}" [n];',
            UCLSyntaxError,
            3,
            11,
            "unbalanced brace",
            "{expression} with both braces",
        ),
        # syntax inside a template's braces
        (
            '"a" -> "x.{n +}" [n];',
            UCLSyntaxError,
            3,
            15,
            "unexpected '}'",
            "'(', '-', a name, an integer",
        ),
        ('"a" -> "x.{n n}" [n];', UCLSyntaxError, 3, 14, "unexpected 'n'", "'+', '-', '}'"),
        # a missing ';' is reported where the statement ends, not where the next one starts
        ("let a = n\n\n# gap\nlet b = 2;", UCLSyntaxError, 3, 10, "missing ';'", "';'"),
        (
            '"a" -> "x" [n] : chunk(0, tp)\n"b" -> "y" [n];',
            UCLSyntaxError,
            3,
            30,
            "missing ';'",
            "';', '|'",
        ),
        # on one line the unexpected token itself is the place
        ("let a = n let b = 2;", UCLSyntaxError, 3, 11, "unexpected 'let'", "';'"),
        # the end of the input where more was needed: just past the last token
        (
            '"a" -> fuse(0, "x" [n]   # a comment\n',
            UCLSyntaxError,
            3,
            23,
            "unexpected end of input",
            "')', ','",
        ),
        ("let a = (n", UCLSyntaxError, 3, 11, "unexpected end of input", "')'"),
        ("let a = n $ 1;", UCLSyntaxError, 3, 11, "unexpected character '$'", "';'"),
        ("let pp = 2;", UCLSemanticError, 3, 5, "'pp' is already defined", "a new name"),
        (
            '"a" -> bucket(align=1, align=2, "x" [n]);',
            UCLSemanticError,
            3,
            24,
            "align= is given twice",
            "bucket(",
        ),
    ],
)
def test_errors_point_at_the_wrong_place(body, cls, line, column, reason, expected):
    text = PRELUDE + body
    with pytest.raises(cls) as info:
        parse(text)
    e = info.value
    check_error(text, e)
    assert (e.line, e.column) == (line, column), str(e)
    assert reason in e.reason, str(e)
    assert expected in e.expected, str(e)


@pytest.mark.parametrize(
    "text,line,column",
    [
        # lines counted the way the excerpt counts them (str.splitlines)
        ('mesh tp;\r"a" -> "b{m}" [1];', 2, 11),
        ('mesh tp;\r\n"a" -> "b{m}" [1];', 2, 11),
        ('mesh tp;\x0c"a" -> "b{m}" [1];', 2, 11),
        ('mesh tp;\n"a.\u2028" -> "b{m}" [1];', 3, 9),
        ("\ttp", 1, 2),
    ],
)
def test_lines_are_the_lines_the_excerpt_shows(text, line, column):
    with pytest.raises(UCLError) as info:
        parse(text)
    check_error(text, info.value)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)


# --- 4. what the errors are ------------------------------------------------------------------------


def test_errors_are_value_errors_with_the_caret_excerpt_in_the_message():
    text = 'mesh tp;\n"w" -> "w" [n] : chunk(0, tp);\n'
    with pytest.raises(ValueError) as info:
        parse(text)
    e = info.value
    assert isinstance(e, UCLSemanticError) and isinstance(e, anyshard.AnyshardError)
    assert e.excerpt == '"w" -> "w" [n] : chunk(0, tp);\n            ^'
    assert str(e) == (
        "unknown name 'n' at line 2, column 13; expected one of tp:\n"
        '  "w" -> "w" [n] : chunk(0, tp);\n'
        "              ^"
    )
    again = pickle.loads(pickle.dumps(e))  # noqa: S301 - our own error, round-tripped
    assert type(again) is UCLSemanticError and str(again) == str(e)
    with pytest.raises(anyshard.AnyshardError):
        parse("mesh tp")


def test_parse_wants_text():
    with pytest.raises(TypeError):
        parse(b"mesh tp;")  # type: ignore[arg-type]
