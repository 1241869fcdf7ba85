"""What a benchmark prints and writes: its command line (`parser`), its measurements as JSON
lines (`Records`), tables, and `report`: the run, the machine, the tables, written into a section
of docs/benchmarks.md with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from .measure import ROOT, RunLoad


class Records:
    """Measurements of one run; with a path, each also goes there as one JSON line."""

    def __init__(self, path: str | None, bench: str):
        self.path, self.bench, self.rows = path, bench, []
        if path:
            open(path, "w").close()

    def add(self, rec: dict, **labels: Any) -> dict:
        """Keep ``rec`` with ``labels`` (system, rep, ...) and write its line; returns ``rec``."""
        self.rows.append({"bench": self.bench, **labels, **rec})
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(self.rows[-1], default=str) + "\n")
        return rec


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool) -> str:
    """A table: markdown, or right-aligned text columns under a rule."""
    body = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x[i]) for x in [list(head), *body]) for i in range(len(head))]
    lines = [list(head), ["-" * w for w in widths], *body]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def write_section(path: str, name: str, lines: list[str], *, heading: str | None = None) -> None:
    """Write ``lines`` between ``<!-- name:begin -->`` and ``<!-- name:end -->`` into the markdown
    file ``path``: in place of the existing section; else right under ``heading`` where the file
    has it, else at the end (after ``heading`` when given). A missing file starts as
    ``# Benchmarks``. Prints ``wrote PATH``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = "\n".join([begin, *lines, end])
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) :]
    elif heading is not None and heading in old:
        at = old.index(heading) + len(heading)
        new = old[:at] + "\n\n" + text + "\n" + old[at:].lstrip("\n")
    else:
        head = "\n\n\n" + heading if heading is not None else ""
        new = old.rstrip("\n") + head + "\n\n" + text + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(new)
    print(f"\nwrote {path}")


def rerun_command(tool: str, argv: Sequence[str] | None = None) -> str:
    """``python tools/NAME ARGS --write-docs``: the command that reproduces this run of
    ``tool`` (a file in tools/) and writes its section (a path given to --write-docs left out)."""
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if not (skip and not a.startswith("-")) and not a.startswith("--write-docs"):
            args.append(a)
        skip = a == "--write-docs"
    return " ".join(["python", f"tools/{os.path.basename(tool)}", *args, "--write-docs"])


class _Parser(argparse.ArgumentParser):
    """Applies ``quick`` (the options ``--quick`` sets) to what it parses."""

    quick: dict = {}

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = super().parse_known_args(args, namespace)
        if getattr(ns, "quick", False):
            vars(ns).update(self.quick)
        return ns, extra


def parser(
    doc: str, reps: int = 0, quick: dict | None = None, dirs: bool = False, records: bool = True
) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with the flags the benchmarks share:
    ``--reps`` (default ``reps``), ``--quick`` (sets the options in ``quick``), ``--disk-dir``
    and ``--tmpfs-dir`` (``dirs``), ``--write-docs [PATH]`` and (``records``) ``--json PATH``,
    ``--jsonl PATH``."""
    p = _Parser(description=doc.split("\n\n")[0])
    if reps:
        p.add_argument("--reps", type=int, default=reps, help=f"repetitions ({reps}; median kept)")
    if quick:
        p.quick = quick
        sets = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items())
        p.add_argument("--quick", action="store_true", help=f"smoke test: {sets}")
    if dirs:
        p.add_argument("--disk-dir", default="/tmp", help="(parent) directory on the real disk")
        p.add_argument("--tmpfs-dir", default="/dev/shm", help="(parent) directory on tmpfs")
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", metavar="PATH")
    if records:
        p.add_argument("--json", default=None, help="also write the results to this JSON file")
        p.add_argument("--jsonl", default=None, help="also write one JSON line per measurement")
    return p


def regime_dirs(args: argparse.Namespace, names: Sequence[str]) -> dict[str, str]:
    """``--disk-dir`` and ``--tmpfs-dir`` of the regimes in ``names`` whose directory exists."""
    dirs = {"disk": args.disk_dir, "tmpfs": args.tmpfs_dir}
    return {r: dirs[r] for r in names if r in dirs and os.path.isdir(dirs[r])}


def words(p: argparse.ArgumentParser, flag: str, text: str, allowed=None) -> list[str]:
    """The comma-separated words of a flag's ``text``; ``p.error`` where there is none, or one
    not in ``allowed``."""
    got = [w.strip() for w in text.split(",") if w.strip()]
    if not got or (allowed is not None and not set(got) <= set(allowed)):
        p.error(f"{flag}: one or more of {','.join(allowed or ['...'])}, not {text!r}")
    return got


def report(args, argv, tool: str, name: str, run: str, blocks: list, load: RunLoad, *,
           heading=None, intro=None, under=None, dirs=None, machine=(), data=None):  # fmt: skip
    """Print ``run``, ``blocks`` (lines, and ``(head, rows)`` tables) and ``load``'s note; with
    ``--write-docs`` the docs section ``name`` (a new one ``under`` that heading): ``heading``,
    ``intro``, the command that reproduces the run (`rerun_command` of ``argv``) with its date and
    ``run``, the machine (`machine_lines` of ``dirs``, ``machine``, the note) and the blocks in
    markdown; with ``--json``, ``data``."""
    note, blocks = load.note(), [b for b in blocks if b]
    text = [b if isinstance(b, str) else table(*b, markdown=False) for b in blocks]
    print("\n\n".join([run, *machine, *text, note]), flush=True)
    if args.write_docs:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        section = [line for x in (heading, intro) if x for line in (x, "")]
        section += [f"Command: `{rerun_command(tool, argv)}` ({date}, {run}).", "", "Machine:", ""]
        section += [*machine_lines(dirs), *machine, f"- {note}", ""]
        md = [b if isinstance(b, str) else table(*b, markdown=True) for b in blocks]
        write_section(args.write_docs, name, section + "\n\n".join(md).split("\n"), heading=under)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)


def version(dist: str) -> str:
    """The installed version of a distribution, or ``?``."""
    from importlib.metadata import version as v

    try:
        return v(dist)
    except Exception:
        return "?"


def fs_type(path: str) -> str:
    """``TYPE (DEVICE on MOUNT)`` of the file system holding ``path``."""
    best, kind, real = "", "?", os.path.realpath(path)
    with open("/proc/mounts") as f:
        for dev, mnt, fs, *_ in (line.split() for line in f):
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{fs} ({dev} on {mnt})"
    return kind


def git_state() -> str:
    """The commit of the library measured, and which of its files differ from it."""

    def git(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", ROOT, *words], capture_output=True, text=True)

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "anyshard")
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    changed = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    state = f"library files modified in the work tree: {', '.join(changed[:6])}{more}"
    state = state if changed else "library files as committed"
    return f"commit {head.stdout.strip()} ({state})" if head.returncode == 0 else "commit unknown"


def machine_lines(dirs: dict[str, str] | None = None) -> list[str]:
    """Markdown bullets: CPU, memory, kernel, Python, torch; each named directory's file
    system; the library's commit."""
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / (1 << 20)
    lines = [
        f"- CPU: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {version('torch')}"
    ]
    lines += [f"- {name}: `{d}` on {fs_type(d)}" for name, d in (dirs or {}).items()]
    return lines + [f"- anyshard: {git_state()}"]
