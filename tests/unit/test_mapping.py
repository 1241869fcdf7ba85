"""Mapping expressions: printing round trips, positions, and the errors a user sees.

Run: python -m pytest tests/unit/test_mapping.py -q
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyshard.errors import MappingError, MappingSyntaxError
from anyshard.ucl.mapping import (
    Chunk,
    Flatten,
    Mapping,
    On,
    Pad,
    Range,
    Replicate,
    Slice,
    Split,
    parse_mapping,
)

FAST = settings(max_examples=150, deadline=None)

axis_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True)
small = st.integers(0, 40)


@st.composite
def fixed_chunks(draw):
    parts = draw(st.integers(1, 9))
    return Chunk(dim=draw(small), parts=parts, index=draw(st.integers(0, parts - 1)))


@st.composite
def intervals(draw, make):
    start = draw(small)
    return make(start, draw(st.integers(start, 60)))


single_ops = st.one_of(
    st.builds(lambda d, a: Chunk(dim=d, axis=a), small, axis_names),
    fixed_chunks(),
    st.builds(
        lambda d, a, s: Split(dim=d, axis=a, sizes=tuple(s)),
        small,
        axis_names,
        st.lists(small, max_size=5),
    ),
    st.builds(
        lambda d, ss: Slice(dim=d, start=ss.start, stop=ss.stop),
        small,
        intervals(lambda a, b: range(a, b)),
    ),
    st.builds(lambda d, n: Pad(dim=d, size=n), small, small),
    st.just(Flatten()),
    intervals(lambda a, b: Range(start=a, stop=b)),
    st.builds(lambda a: Replicate(axis=a), axis_names),
    st.builds(lambda a, i: On(axis=a, index=i), axis_names, small),
)
mappings = st.lists(single_ops, max_size=6).map(lambda ops: Mapping(tuple(ops)))

# Whitespace the grammar ignores, newlines included.
spaces = st.text(alphabet=" \t\n", max_size=3)


def op_tokens(op) -> list[str]:
    """The tokens of ``op`` as a user could write them."""
    text = str(op)
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[()\[\],]", text)


@st.composite
def formatted(draw, mapping_strategy=mappings):
    """A mapping and a text for it with arbitrary whitespace; also where each op's name starts."""
    mapping = draw(mapping_strategy)
    text = draw(spaces)
    starts = []
    for i, op in enumerate(mapping.ops):
        if i:
            text += "|" + draw(spaces)
        for j, tok in enumerate(op_tokens(op)):
            if j == 0:
                starts.append(position(text, len(text)))
            text += tok + draw(spaces)
    return mapping, text, starts


def position(text: str, offset: int) -> tuple[int, int]:
    """1-based (line, column) of character ``offset`` of ``text``."""
    before = text[:offset]
    return before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1


def syntax_error(text: str) -> MappingSyntaxError:
    with pytest.raises(MappingSyntaxError) as info:
        parse_mapping(text)
    return info.value


@FAST
@given(mappings)
def test_printed_mapping_parses_back_to_an_equal_mapping(mapping):
    text = str(mapping)
    assert parse_mapping(text) == mapping
    assert str(parse_mapping(text)) == text


@FAST
@given(formatted())
def test_whitespace_and_newlines_do_not_change_the_mapping_and_ops_know_their_position(case):
    mapping, text, starts = case
    parsed = parse_mapping(text)
    assert parsed == mapping
    assert [(op.line, op.column) for op in parsed.ops] == starts


@FAST
@given(formatted(), st.data())
def test_a_stray_character_is_reported_at_its_own_line_and_column(case, data):
    _, text, _ = case
    at = data.draw(st.integers(0, len(text)))
    bad = text[:at] + "$" + text[at:]
    e = syntax_error(bad)
    assert (e.line, e.column) == position(bad, at)
    assert e.expected
    assert not re.search(r"\b[A-Z_]{3,}\b", e.expected), (
        "lark terminal names leaked into the message"
    )


@FAST
@given(formatted(), st.data())
def test_a_cut_off_expression_is_reported_just_after_its_last_token(case, data):
    _, text, _ = case
    cut = text[: data.draw(st.integers(0, len(text)))]
    try:
        parse_mapping(cut)
    except MappingSyntaxError as e:
        assert (e.line, e.column) == position(cut, len(cut.rstrip()))
        assert e.expected
    else:
        assert cut.rstrip() == "" or cut.rstrip().endswith(")")


@FAST
@given(mappings)
def test_plus_signed_integers_mean_the_same_number(mapping):
    text = re.sub(r"(?<![A-Za-z0-9_])(\d+)", r"+\1", str(mapping))
    assert parse_mapping(text) == mapping


def test_empty_and_blank_text_is_the_whole_tensor():
    assert parse_mapping("") == Mapping()
    assert parse_mapping(" \n\t") == Mapping()
    assert str(Mapping()) == ""


def test_examples_from_the_module_docs_parse_to_the_ops_they_name():
    assert parse_mapping("chunk(0, dp_shard) | chunk(1, tp)").ops == (
        Chunk(dim=0, axis="dp_shard"),
        Chunk(dim=1, axis="tp"),
    )
    assert parse_mapping("chunk(0, 4, 1)").ops == (Chunk(dim=0, parts=4, index=1),)
    assert parse_mapping("split(0, tp, [4,3,3])").ops == (Split(dim=0, axis="tp", sizes=(4, 3, 3)),)
    assert parse_mapping("slice(1, 0, 5)").ops == (Slice(dim=1, start=0, stop=5),)
    assert parse_mapping("pad(0, 16)").ops == (Pad(dim=0, size=16),)
    assert parse_mapping("flatten() | range(3, 17)").ops == (Flatten(), Range(start=3, stop=17))
    assert parse_mapping("replicate(dp)").ops == (Replicate(axis="dp"),)
    assert parse_mapping("on(dp, 1)").ops == (On(axis="dp", index=1),)


def test_axes_are_listed_once_in_order_of_first_use():
    m = parse_mapping("chunk(0, tp) | replicate(dp) | chunk(1, 4, 0) | chunk(1, tp) | on(pp, 0)")
    assert m.axes == ("tp", "dp", "pp")


def test_an_error_on_the_second_line_points_at_the_offending_token():
    e = syntax_error("chunk(0, dp)\n| chunk(1 tp)")
    assert (e.line, e.column) == (2, 11)
    assert e.expected == "')', ','"
    assert "line 2, column 11" in str(e)
    # The excerpt is the offending line, with a caret under the column.
    assert str(e).endswith("  | chunk(1 tp)\n            ^")


def test_an_unfinished_multi_line_expression_is_reported_after_its_last_token():
    e = syntax_error("chunk(0, dp) |\n  chunk(1,\n   tp\n\n")
    assert (e.line, e.column) == (3, 6)
    assert "')'" in e.expected and "','" in e.expected
    assert "end of mapping expression" in str(e)


def test_a_missing_pipe_between_operations_says_a_pipe_was_expected():
    e = syntax_error("chunk(0, tp)\n  chunk(1, dp)")
    assert (e.line, e.column) == (2, 3)
    assert e.expected == "'|'"


def test_a_fractional_number_is_reported_at_its_decimal_point():
    e = syntax_error("chunk(0, 1.5)")
    assert (e.line, e.column) == (1, 11)


def test_syntax_errors_are_value_errors_and_mapping_errors():
    e = syntax_error("chunk(")
    assert isinstance(e, ValueError)
    assert isinstance(e, MappingError)
    assert e.text == "chunk("


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("shard(0, tp)", 1, 1),
        ("chunk(0, tp) | Chunk(1, tp)", 1, 16),
        ("chunk(0, tp) |\n   transpose(0, 1)", 2, 4),
    ],
)
def test_an_unknown_operation_is_named_with_its_position_and_the_known_ones(text, line, column):
    e = syntax_error(text)
    assert (e.line, e.column) == (line, column)
    assert "unknown mapping operation" in str(e)
    assert e.expected == "one of chunk, flatten, on, pad, range, replicate, slice, split"


@pytest.mark.parametrize(
    ("text", "usage"),
    [
        ("chunk(0, [1])", "chunk(dim, axis) or chunk(dim, parts, index)"),
        ("chunk(tp, 0)", "chunk(dim, axis) or chunk(dim, parts, index)"),
        ("chunk(0, 4, 1, 0)", "chunk(dim, axis) or chunk(dim, parts, index)"),
        ("chunk(0)", "chunk(dim, axis) or chunk(dim, parts, index)"),
        ("split(0, tp, 4)", "split(dim, axis, [size, ...])"),
        ("split(0, 2, [1, 1])", "split(dim, axis, [size, ...])"),
        ("slice(0, tp, 3)", "slice(dim, start, stop)"),
        ("pad(dp, 3)", "pad(dim, size)"),
        ("flatten(0)", "flatten()"),
        ("range(0)", "range(start, stop)"),
        ("range([0, 1])", "range(start, stop)"),
        ("replicate(0)", "replicate(axis)"),
        ("replicate()", "replicate(axis)"),
        ("on(0, dp)", "on(axis, index)"),
    ],
)
def test_arguments_of_the_wrong_kind_are_reported_with_the_operations_usage(text, usage):
    e = syntax_error("replicate(dp) |\n  " + text)
    assert (e.line, e.column) == (2, 3)
    assert e.expected == usage
    assert "wrong arguments" in str(e)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("chunk(-1, tp)", "dim must be >= 0"),
        ("chunk(0, 4, 4)", "chunk index 4 is outside 0..3"),
        ("chunk(0, 0, 0)", "outside"),
        ("split(0, tp, [2, -1])", "split sizes must be >= 0"),
        ("slice(0, 5, 3)", "need 0 <= start <= stop"),
        ("slice(0, -1, 3)", "need 0 <= start <= stop"),
        ("range(4, 2)", "need 0 <= start <= stop"),
        ("pad(0, -1)", "pad size must be >= 0"),
        ("on(dp, -1)", "on() index must be >= 0"),
    ],
)
def test_out_of_range_values_are_reported_at_their_operation(text, why):
    e = syntax_error("flatten() | " + text)
    assert (e.line, e.column) == (1, 13)
    assert why in str(e)
    assert e.expected.startswith(text.split("(")[0])


def test_the_grammar_passes_larks_strict_mode():
    """The runtime parser skips lark's strict checks (a tenth of a second or more per process);
    this is where they run: no two terminals of mapping.lark collide, no conflicts."""
    import lark

    from anyshard.ucl.mapping import _grammar

    lark.Lark(_grammar(), parser="lalr", propagate_positions=True, strict=True)
