"""docs/benchmarks.md names commands that run as written, and a section for every benchmark.

Every command in it (``python tools/X.py ...`` and ``anyshard ...``, in inline code or in a
fenced block) names a script that exists, whose ``--help`` exits 0 and lists every ``--flag``
the command uses; every benchmark in tools/ (``bench_*``, ``scale_*``, ``fuzz_*``, ``crash_*``)
has a section whose heading names it. The ``--help`` runs, one per distinct script or
subcommand, go in one interpreter (torch imported once), each as Python runs it from the command
line (``runpy``, as ``__main__``, its folder first on ``sys.path``).

    python -m pytest tests/unit/test_benchmarks_doc.py -q
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
TOOLS = os.path.join(ROOT, "tools")
BENCHMARK_PREFIXES = ("bench_", "scale_", "fuzz_", "crash_")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`([^`]+)`")
_SHELL_OPERATORS = {"|", "||", "&&", ";", "&"}


def commands(text: str) -> list[tuple[str, ...]]:
    """The commands a markdown text names: each line of a fenced block, and each inline code span
    (which may wrap over lines), that starts with ``python tools/`` or ``anyshard``; as words,
    comments and anything after a shell operator or redirection dropped."""
    candidates = [line for block in _FENCE.findall(text) for line in block.splitlines()]
    candidates += [" ".join(span.split()) for span in _INLINE.findall(_FENCE.sub("", text))]
    found = []
    for candidate in candidates:
        try:
            words = shlex.split(candidate, comments=True)
        except ValueError:  # an unbalanced quote: not a command line
            continue
        for i, word in enumerate(words):
            if word in _SHELL_OPERATORS or word.startswith((">", "<", "2>")):
                words = words[:i]
                break
        is_tool = len(words) >= 2 and words[0] == "python" and words[1].startswith("tools/")
        if is_tool or (len(words) >= 2 and words[0] == "anyshard"):
            found.append(tuple(words))
    return found


def flags(command: tuple[str, ...]) -> list[str]:
    """The long options a command uses (``--name`` of ``--name=value`` too)."""
    return [w.split("=", 1)[0] for w in command if w.startswith("--") and len(w) > 2]


def help_argv(command: tuple[str, ...]) -> tuple[str, ...]:
    """The command line that prints the help covering ``command``'s options: the script's
    ``--help``, or for ``anyshard`` the words before the first option (the subcommand and its
    positional arguments) followed by ``--help``."""
    if command[0] == "python":
        return (command[1], "--help")
    words = []
    for word in command[1:]:
        if word.startswith("-"):
            break
        words.append(word)
    return ("-m", "anyshard.cli", *words, "--help")


def option_listed(flag: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def _doc_text() -> str:
    with open(DOC) as f:
        return f.read()


DOC_COMMANDS = sorted(set(commands(_doc_text())))


# runs each command line (a script's path, or -m and a module, then its arguments) as Python
# runs it from the command line; prints one JSON line: [[returncode, stdout, stderr], ...]
_HELP_DRIVER = """
import contextlib, io, json, os, runpy, sys
out = []
for key in json.loads(sys.argv[1]):
    argv, path0, stdout, stderr = list(key), list(sys.path), io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = argv
                    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                    runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code = 1
        stderr.write(f"{type(e).__name__}: {e}")
    finally:
        sys.path[:] = path0
    out.append([code, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(out))
"""


@functools.cache
def _helps() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every distinct help command of the doc's commands, in one interpreter."""
    keys = sorted({help_argv(c) for c in DOC_COMMANDS if c[0] != "python" or _script_exists(c[1])})
    done = subprocess.run(
        [sys.executable, "-c", _HELP_DRIVER, json.dumps(keys)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {
        key: subprocess.CompletedProcess([sys.executable, *key], code, out, err)
        for key, (code, out, err) in zip(keys, results, strict=True)
    }


def _script_exists(path: str) -> bool:
    return os.path.isfile(os.path.join(ROOT, path))


def test_commands_are_found_in_inline_code_fenced_blocks_and_across_line_breaks():
    text = (
        "Run `python tools/a.py --reps 3\n--write-docs` (wrapped), then `anyshard ls ROOT`.\n"
        "Not commands: `anyshard.load`, `tools/a.py`, `python -m x`, `--reps 3`.\n"
        "```bash\n"
        "python tools/b.py --gib 1 --quick=yes   # a comment\n"
        "python tools/c.py --x '1:--not-a-flag 2' | tee out.txt --y\n"
        "echo hello\n"
        "```\n"
    )
    assert sorted(commands(text)) == sorted(
        [
            ("python", "tools/a.py", "--reps", "3", "--write-docs"),
            ("anyshard", "ls", "ROOT"),
            ("python", "tools/b.py", "--gib", "1", "--quick=yes"),
            ("python", "tools/c.py", "--x", "1:--not-a-flag 2"),
        ]
    )
    assert flags(("python", "tools/b.py", "--gib", "1", "--quick=yes")) == ["--gib", "--quick"]
    assert flags(("python", "tools/c.py", "--x", "1:--not-a-flag 2")) == ["--x"]
    assert help_argv(("anyshard", "convert", "SRC", "DST", "--to", "hf")) == (
        "-m",
        "anyshard.cli",
        "convert",
        "SRC",
        "DST",
        "--help",
    )
    assert option_listed("--reps", "  --reps REPS  runs")
    assert not option_listed("--reps", "  --heal-reps N")
    assert not option_listed("--heal", "  --heal-reps N")


def test_the_doc_names_commands_of_tools():
    assert any(c[0] == "python" for c in DOC_COMMANDS), "no `python tools/...` command found"


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: " ".join(c)[:80])
def test_a_command_in_the_doc_runs_with_options_its_help_lists(command):
    if command[0] == "python":
        assert _script_exists(command[1]), f"{command[1]} does not exist"
    key = help_argv(command)
    result = _helps()[key]
    shown = " ".join(key)
    assert result.returncode == 0, f"`python {shown}` exited {result.returncode}:\n{result.stderr}"
    missing = [f for f in flags(command) if not option_listed(f, result.stdout)]
    assert not missing, f"`python {shown}` does not list {missing}, used in: {' '.join(command)}"


def test_every_benchmark_in_tools_has_a_section_naming_it():
    benchmarks = sorted(
        name
        for name in os.listdir(TOOLS)
        if name.endswith(".py") and name.startswith(BENCHMARK_PREFIXES)
    )
    assert benchmarks, "no benchmark scripts found in tools/"
    headings = [line for line in _doc_text().splitlines() if line.startswith("#")]
    without_section = [
        name for name in benchmarks if not any(f"tools/{name}" in h for h in headings)
    ]
    assert not without_section, f"no section in docs/benchmarks.md for {without_section}"
    without_command = [
        name
        for name in benchmarks
        if not any(c[0] == "python" and c[1] == f"tools/{name}" for c in DOC_COMMANDS)
    ]
    assert not without_command, f"no command in docs/benchmarks.md runs {without_command}"


def _slug(title: str) -> str:
    """The anchor a markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_summary_opens_the_document_and_links_every_benchmark_with_its_commit():
    with open(DOC) as f:
        text = f.read()
    titles = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert titles[0] == "Summary", "docs/benchmarks.md opens with the summary table"
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in summary.splitlines() if line.startswith("| [")]
    linked = {re.search(r"\]\(#([^)]+)\)", row).group(1) for row in rows}
    unlinked = [t for t in titles[1:] if _slug(t) not in linked]
    assert not unlinked, f"benchmarks missing from the summary table: {unlinked}"
    anchors = {_slug(t) for t in titles}
    assert linked <= anchors, f"summary links to no section: {sorted(linked - anchors)}"
    no_commit = [row for row in rows if not re.search(r"\| [0-9a-f]{7,40} \|$", row)]
    assert not no_commit, f"summary rows without the commit measured at: {no_commit}"
