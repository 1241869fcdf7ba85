"""docs/dcp.md runs as written: every ```python block is a doctest (the multi-process and
Lightning scripts are ```text blocks; tests/dist/test_dcp_backend.py and test_lightning.py run
the same calls).

    python -m pytest tests/unit/test_dcp_docs.py -q
"""

from __future__ import annotations

import doctest
import os
import re
import warnings

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "dcp.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def test_every_python_example_in_docs_dcp_md_runs_and_prints_what_it_shows():
    text = open(DOC).read()
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    failures, examples = [], 0
    for m in FENCE.finditer(text):
        if m[1] != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        test = parser.get_doctest(m[2], {"__name__": "dcp_md"}, f"docs/dcp.md:{line}", DOC, line)
        out: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notice that it runs without a process group
            result = runner.run(test, out=out.append, clear_globs=True)
        examples += result.attempted
        if result.failed:
            failures.append("".join(out))
    assert not failures, "\n".join(failures)
    assert examples >= 8, examples
