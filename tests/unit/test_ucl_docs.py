"""docs/ucl.md runs as written: every ```python block is a doctest.

Each block runs with fresh globals; ``SPEC`` holds the text of the last ```ucl block above it, so
that the spec a reader sees is the spec the example parses.

    python -m pytest tests/unit/test_ucl_docs.py -q
"""

from __future__ import annotations

import doctest
import os
import re

from anyshard.ucl.check import OPS

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "ucl.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
SECTIONS = (*OPS, "fuse", "interleave", "bucket", "alias")


def _blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line number of the fence) of every fenced block, in order."""
    return [(m[1], m[2], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def _run_python_blocks(text: str) -> tuple[int, list[str]]:
    """Run every python block as a doctest; the number of examples run and the failures."""
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures, spec, examples = [], None, 0
    for lang, body, line in _blocks(text):
        if lang == "ucl":
            spec = body
            continue
        if lang != "python":
            continue
        globs = {"__name__": "ucl_md"} if spec is None else {"__name__": "ucl_md", "SPEC": spec}
        test = parser.get_doctest(body, globs, f"docs/ucl.md:{line}", DOC, line)
        out: list[str] = []
        result = runner.run(test, out=out.append, clear_globs=True)
        examples += result.attempted
        if result.failed:
            failures.append("".join(out))
    return examples, failures


def test_every_python_example_in_docs_ucl_md_runs_and_prints_what_it_shows():
    examples, failures = _run_python_blocks(open(DOC).read())
    assert not failures, "\n".join(failures)
    assert examples >= len(OPS), examples


def test_every_python_block_is_a_doctest():
    blocks = [body for lang, body, _ in _blocks(open(DOC).read()) if lang == "python"]
    assert blocks
    assert all(body.lstrip().startswith(">>>") for body in blocks)


def test_every_primitive_and_combinator_has_a_section_with_an_example():
    text = open(DOC).read()
    fences = [m.span() for m in FENCE.finditer(text)]
    headings = [
        h
        for h in re.finditer(r"^#{2,4} (.+)$", text, re.MULTILINE)
        if not any(a <= h.start() < b for a, b in fences)  # not a comment in a ucl block
    ]
    missing = []
    for name in SECTIONS:
        i = next((i for i, h in enumerate(headings) if re.search(rf"`{name}`", h[1])), None)
        if i is None:
            missing.append(name)
            continue
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        if "```python" not in text[headings[i].end() : end]:
            missing.append(f"{name} (no example)")
    assert not missing, missing
