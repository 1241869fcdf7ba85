"""Writing a benchmark's section into docs/benchmarks.md, shared by the tools in this folder."""

from __future__ import annotations

import os
import sys


def replace_section(
    path: str, begin: str, end: str, lines: list[str], *, heading: str | None = None
) -> None:
    """Write ``lines`` between the markers ``begin`` and ``end`` into the markdown file ``path``.

    An existing section between the markers is replaced in place. Otherwise the section goes
    right under ``heading`` where the file has that line, else at the end (after ``heading``
    when one is given). A missing file starts as ``# Benchmarks``.
    """
    text = "\n".join([begin, *lines, end])
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) :]
    elif heading is not None and heading in old:
        at = old.index(heading) + len(heading)
        new = old[:at] + "\n\n" + text + "\n" + old[at:].lstrip("\n")
    elif heading is not None:
        new = old.rstrip("\n") + "\n\n\n" + heading + "\n\n" + text + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(new)


def rerun_command(tool: str) -> str:
    """The command line that reproduces this run of ``tool`` (a file in tools/) and writes its
    section: ``python tools/NAME ARGS --write-docs``."""
    cmd = f"python tools/{os.path.basename(tool)} " + " ".join(sys.argv[1:])
    return cmd.replace(" --write-docs", "").strip() + " --write-docs"
