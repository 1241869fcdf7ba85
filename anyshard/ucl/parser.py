"""UCL specs: from text to the syntax tree (`parse_syntax`), with errors that carry line, column
and what was expected.

The grammar is ``spec.lark``, loaded once. This module only reads the text's structure; names,
argument kinds and captures are checked by `anyshard.ucl.check`, and `anyshard.ucl.parse` runs
both.
"""

from __future__ import annotations

import bisect
import functools
import re
from pathlib import Path

import lark

from anyshard.errors import UCLSemanticError, UCLSyntaxError
from anyshard.ucl.syntax import (
    And,
    Arg,
    BinOp,
    Call,
    Capture,
    Combine,
    Compare,
    Cond,
    Expr,
    Group,
    KwArg,
    Let,
    ListArg,
    Loop,
    MeshDecl,
    Neg,
    Not,
    Num,
    OpCall,
    Or,
    Param,
    ParamDecl,
    Part,
    Pattern,
    Rule,
    Spec,
    Statement,
    Template,
    Var,
)

__all__ = ["MAX_DEPTH", "parse_syntax"]


MAX_DEPTH = 100
"""How deeply a spec may nest (expressions, conditions, groups, counted together): deeper text is
a `UCLSyntaxError` at the place it gets too deep, not a RecursionError in what walks the tree."""


@functools.cache
def _parser() -> lark.Lark:
    grammar = (Path(__file__).parent / "spec.lark").read_text()
    return lark.Lark(
        grammar, parser="lalr", start=["start", "expr"], propagate_positions=True, strict=False
    )


_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "STRING": 'a quoted name ("...")',
    "$END": "the end of the spec",
    "COMBINER": "fuse(, interleave( or bucket(",
    "CMP": "a comparison (==, !=, <, <=, >, >=)",
    "MULOP": "*, /, // or %",
    "ALIAS": "'alias'",
}


def _describe(terminals, words=_WORDS) -> str:
    literals = {
        t.name: t.pattern.value
        for t in _parser().terminals
        if isinstance(t.pattern, lark.lexer.PatternStr)
    }
    out = {words.get(n) or (repr(literals[n]) if n in literals else n) for n in terminals}
    return ", ".join(sorted(out))


class _Lines:
    """Offsets into a text as (line, column), both from 1, with lines counted as `str.splitlines`
    counts them: the count the error's excerpt uses, so that the caret sits under the offset."""

    def __init__(self, text: str):
        self.starts: list[int] = []
        self.lengths: list[int] = []
        pos = 0
        for chunk in text.splitlines(keepends=True):
            self.starts.append(pos)
            self.lengths.append(len((chunk.splitlines() or [""])[0]))
            pos += len(chunk)
        if not self.starts:
            self.starts, self.lengths = [0], [0]
        self.end = len(text)

    def at(self, offset: int) -> tuple[int, int]:
        """The line and column of ``offset`` (at most just past the end of its line)."""
        offset = min(max(offset, 0), self.end)
        i = bisect.bisect_right(self.starts, offset) - 1
        return i + 1, min(offset - self.starts[i], self.lengths[i]) + 1


def _error(cls, lines: _Lines, text: str, offset: int, message: str, expected: str):
    line, column = lines.at(offset)
    return cls(message, text=text, line=line, column=column, expected=expected)


def _end_of_previous(e: lark.exceptions.UnexpectedInput) -> int | None:
    """The offset just past the last symbol the parser accepted before ``e``, where lark says."""
    try:
        value = e.interactive_parser.parser_state.value_stack[-1]
    except (AttributeError, IndexError, TypeError):
        return None
    if isinstance(value, lark.Token):
        return value.end_pos
    meta = getattr(value, "meta", None)
    if meta is None or getattr(meta, "empty", True):
        return None
    return getattr(meta, "end_pos", None)


def _expected(e: lark.exceptions.UnexpectedInput) -> set[str]:
    """The terminals that could come at the place of ``e``: those the parser, restarted there,
    accepts (LALR's own list merges the lookaheads of similar places), else lark's list."""
    try:
        accepts = set(e.interactive_parser.accepts())
    except Exception:  # noqa: BLE001 - lark internals; its own list will do
        accepts = set()
    return accepts or set(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())


def _syntax_error(
    e: lark.exceptions.UnexpectedInput,
    text: str,
    lines: _Lines,
    base: int = 0,
    close: int | None = None,
) -> UCLSyntaxError:
    """``e`` as a `UCLSyntaxError`; ``base`` is the offset in ``text`` of what was parsed (the
    inside of a template's braces, whose ``}`` is at ``close``), 0 for the spec itself."""
    expected = _expected(e)
    words = _WORDS if close is None else {**_WORDS, "$END": "'}'"}
    what = "unexpected input"
    offset = getattr(e, "pos_in_stream", None)
    token = getattr(e, "token", None)
    if isinstance(token, lark.Token) and token.type == "$END":
        if close is not None:
            what, offset = "unexpected '}'", close - base
        else:
            what = "unexpected end of input"
            offset = token.end_pos if token.end_pos is not None else len(text)
    elif isinstance(token, lark.Token):
        shown = str(token) if token.type == "STRING" else repr(str(token))
        what, offset = f"unexpected {shown:.40}", token.start_pos
        previous = _end_of_previous(e)
        if (
            "SEMICOLON" in expected
            and previous is not None
            and token.start_pos is not None
            and lines.at(base + previous)[0] < lines.at(base + token.start_pos)[0]
        ):
            # `let a = 1` NEWLINE `let b = 2;`: the ';' is missing where the line ends
            what, offset = "missing ';' at the end of the statement", previous
    elif isinstance(e, lark.exceptions.UnexpectedCharacters):
        what = f"unexpected character {e.char!r}"
    if not isinstance(offset, int) or offset < 0:
        offset = len(text) - base
    return _error(
        UCLSyntaxError,
        lines,
        text,
        base + offset,
        what,
        _describe(expected, words) or "a statement",
    )


class _Builder:
    def __init__(self, text: str):
        self.text = text
        self.lines = _Lines(text)
        # offset in the spec of the text being built: the inside of a template's braces, or 0
        self.base = 0
        self.depth: dict[int, int] = {}  # start offset of a STRING token -> its depth in the tree

    def error_at(self, offset: int, cls, message: str, expected: str):
        return _error(cls, self.lines, self.text, offset, message, expected)

    def pos(self, tree_or_token) -> dict[str, int]:
        if isinstance(tree_or_token, lark.Token):
            offset = tree_or_token.start_pos
        else:
            meta = tree_or_token.meta
            offset = 0 if getattr(meta, "empty", True) else meta.start_pos
        line, column = self.lines.at(self.base + (offset or 0))
        return {"line": line, "column": column}

    def check_depth(self, tree: lark.Tree, limit: int) -> None:
        """Raise where ``tree`` nests deeper than ``limit``; note the depth of every quoted name."""
        stack = [(tree, 1)]
        while stack:
            t, d = stack.pop()
            if d > limit:
                at = t.children[1] if t.data == "binop" else t
                offset = at.start_pos if isinstance(at, lark.Token) else at.meta.start_pos
                raise self.error_at(
                    self.base + offset,
                    UCLSyntaxError,
                    f"nested too deeply (more than {MAX_DEPTH} levels)",
                    "a flatter expression (name its parts with let)",
                )
            for c in reversed(t.children):
                if isinstance(c, lark.Tree):
                    stack.append((c, d + 1))
                elif isinstance(c, lark.Token) and c.type == "STRING":
                    self.depth[c.start_pos] = d

    # expressions
    def expr(self, t) -> Expr:
        if isinstance(t, lark.Token):
            raise AssertionError(t)
        k = t.data
        if k == "num":
            tok = t.children[0]
            try:
                value = int(tok)
            except ValueError:  # longer than sys.get_int_max_str_digits()
                raise self.error_at(
                    self.base + tok.start_pos,
                    UCLSyntaxError,
                    f"integer literal of {len(tok)} digits is too long",
                    "a shorter integer",
                ) from None
            return Num(value=value, **self.pos(t))
        if k == "var":
            return Var(name=str(t.children[0]), **self.pos(t))
        if k == "call":
            fn, *args = t.children
            return Call(
                fn=str(fn), args=tuple(self.expr(a) for a in args if a is not None), **self.pos(t)
            )
        if k == "binop":
            left, op, right = t.children
            return BinOp(op=str(op), left=self.expr(left), right=self.expr(right), **self.pos(op))
        if k == "neg":
            return Neg(operand=self.expr(t.children[1]), **self.pos(t))
        raise AssertionError(k)

    def cond(self, t) -> Cond:
        k = t.data
        if k == "compare":
            left, op, right = t.children
            return Compare(op=str(op), left=self.expr(left), right=self.expr(right), **self.pos(t))
        if k == "not_":
            return Not(operand=self.cond(t.children[0]), **self.pos(t))
        if k == "and_":
            return And(left=self.cond(t.children[0]), right=self.cond(t.children[1]), **self.pos(t))
        if k == "or_":
            return Or(left=self.cond(t.children[0]), right=self.cond(t.children[1]), **self.pos(t))
        raise AssertionError(k)

    def arg(self, t) -> Arg:
        if t.data == "kwarg":
            name, value = t.children
            return KwArg(name=str(name), value=self.expr(value), **self.pos(t))
        if t.data == "list_arg":
            return ListArg(
                items=tuple(self.expr(c) for c in t.children if c is not None), **self.pos(t)
            )
        return self.expr(t)

    def op(self, t) -> OpCall:
        name, *args = t.children
        return OpCall(
            name=str(name), args=tuple(self.arg(a) for a in args if a is not None), **self.pos(name)
        )

    def literal(self, body: str, i: int, j: int, start: int, parts: list, expected: str) -> None:
        """Append ``body[i:j]``, the text between two braced parts of a quoted name that starts at
        offset ``start``, to ``parts``; a brace in it has no partner."""
        stray = re.search(r"[{}]", body[i:j])
        if stray is not None:
            raise self.error_at(
                start + i + stray.start(), UCLSyntaxError, "unbalanced brace in a name", expected
            )
        if j > i:
            parts.append(body[i:j])

    def pattern(self, tok: lark.Token) -> Pattern:
        body = str(tok)[1:-1]
        start = tok.start_pos + 1
        parts: list[str | Capture] = []
        i = 0
        for m in re.finditer(r"\{([^{}]*)\}", body):
            self.literal(body, i, m.start(), start, parts, "{capture} with both braces")
            where = dict(zip(("line", "column"), self.lines.at(start + m.start()), strict=True))
            cap = re.fullmatch(
                r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::\s*([A-Za-z_]+)\s*)?", m.group(1)
            )
            if cap is None:
                raise UCLSyntaxError(
                    f"malformed capture {m.group(0)!r} in a local-name pattern",
                    text=self.text,
                    expected="a capture such as {i:int}",
                    **where,
                )
            kind = cap.group(2) or "int"
            if kind != "int":
                raise UCLSemanticError(
                    f"capture type {kind!r} is not supported",
                    text=self.text,
                    expected="int",
                    **where,
                )
            if parts and isinstance(parts[-1], Capture):
                raise UCLSemanticError(
                    "two captures must be separated by text",
                    text=self.text,
                    expected="text such as '.' between captures",
                    **where,
                )
            parts.append(Capture(name=cap.group(1), **where))
            i = m.end()
        self.literal(body, i, len(body), start, parts, "{capture} with both braces")
        return Pattern(parts=tuple(parts), **self.pos(tok))

    def template(self, tok: lark.Token) -> Template:
        body = str(tok)[1:-1]
        start = tok.start_pos + 1
        parts: list[str | Expr] = []
        i = 0
        for m in re.finditer(r"\{([^{}]*)\}", body):
            self.literal(body, i, m.start(), start, parts, "{expression} with both braces")
            inner = start + m.start() + 1  # offset of the text inside the braces
            try:
                tree = _parser().parse(m.group(1), start="expr")
            except lark.exceptions.UnexpectedInput as e:
                raise _syntax_error(
                    e, self.text, self.lines, inner, inner + len(m.group(1))
                ) from None
            self.base = inner
            try:
                self.check_depth(tree, MAX_DEPTH - self.depth.get(tok.start_pos, 0))
                parts.append(self.expr(tree))
            finally:
                self.base = 0
            i = m.end()
        self.literal(body, i, len(body), start, parts, "{expression} with both braces")
        return Template(parts=tuple(parts), **self.pos(tok))

    def loop(self, t) -> Loop:
        var, count = t.children
        return Loop(var=str(var), count=self.expr(count), **self.pos(var))

    def part(self, t, when=None) -> Part:
        name, shape, pipeline = t.children
        ops = () if pipeline is None else tuple(self.op(o) for o in pipeline.children)
        dims = tuple(self.expr(c) for c in shape.children if c is not None)
        return Part(name=self.template(name), shape=dims, ops=ops, when=when, **self.pos(name))

    def item(self, t) -> Part | Group:
        if t.data == "part_item":
            part, *rest = t.children
            when = self.cond(rest[0].children[0]) if rest else None
            return self.part(part, when)
        if t.data == "group":
            loop, *items = t.children
            return Group(
                loop=self.loop(loop),
                items=tuple(self.item(i) for i in items if i is not None),
                **self.pos(t),
            )
        if t.data == "cond_group":
            cond, *items = t.children
            return Group(
                when=self.cond(cond),
                items=tuple(self.item(i) for i in items if i is not None),
                **self.pos(t),
            )
        raise AssertionError(t.data)

    def combine(self, t) -> Combine:
        kind, *args = t.children
        out = []
        for a in args:
            if a is None:
                continue
            if isinstance(a, lark.Tree) and a.data in ("part_item", "group", "cond_group"):
                out.append(self.item(a))
            else:
                out.append(self.arg(a))
        return Combine(kind=str(kind), args=tuple(out), **self.pos(kind))

    def rule(self, t) -> Rule:
        children = list(t.children)
        alias = False
        if isinstance(children[0], lark.Token) and children[0].type == "ALIAS":
            alias = True
            children.pop(0)
        pattern = self.pattern(children.pop(0))
        loops: tuple[Loop, ...] = ()
        when = None
        body = children.pop()
        for c in children:
            if c is None:
                continue
            if c.data == "loops":
                loops = tuple(self.loop(lp) for lp in c.children)
            elif c.data == "when":
                when = self.cond(c.children[0])
        src, *ops = body.children
        rule_ops = tuple(self.op(o) for o in ops)
        if src.data == "part":
            # `"x" [n] | op` and `"x" [n] : op` say the same: keep one form, so that printing
            # and parsing again gives an equal tree.
            part = self.part(src)
            source = Part(
                name=part.name,
                shape=part.shape,
                ops=part.ops + rule_ops,
                line=part.line,
                column=part.column,
            )
            rule_ops = ()
        else:
            source = self.combine(src)
        return Rule(
            pattern=pattern,
            source=source,
            ops=rule_ops,
            loops=loops,
            when=when,
            alias=alias,
            line=pattern.line,
            column=pattern.column,
        )

    def statement(self, t) -> Statement:
        k = t.data
        if k == "mesh_decl":
            return MeshDecl(dims=tuple(str(c) for c in t.children), **self.pos(t))
        if k == "param_decl":
            params = []
            for p in t.children:
                name, default = p.children
                params.append(
                    Param(
                        name=str(name),
                        default=None if default is None else self.expr(default),
                        **self.pos(name),
                    )
                )
            return ParamDecl(params=tuple(params), **self.pos(t))
        if k == "let_decl":
            name, expr = t.children
            return Let(name=str(name), expr=self.expr(expr), **self.pos(name))
        if k == "rule":
            return self.rule(t)
        raise AssertionError(k)


def parse_syntax(text: str) -> Spec:
    """The syntax tree of a spec, unchecked; raises `UCLSyntaxError` (and nothing else, whatever
    the text) with the line and column of the first wrong place. `anyshard.ucl.parse` checks it
    too."""
    if not isinstance(text, str):
        raise TypeError(f"parse() takes the spec's text, not {type(text).__name__}")
    b = _Builder(text)
    try:
        tree = _parser().parse(text, start="start")
    except lark.exceptions.UnexpectedInput as e:
        raise _syntax_error(e, text, b.lines) from None
    b.check_depth(tree, MAX_DEPTH)
    return Spec(tuple(b.statement(s) for s in tree.children), text=text)
