"""Geometry, the language and the planner stay pure: no torch.distributed, no fsspec, no file I/O.

That purity is what lets the planner be property-tested exhaustively and run on any rank
before a process group exists (docs: STYLE.md, "Pure planning, I/O at the edges"). The UCL
modules read their grammars and the shipped specs, package data, and nothing else.

Run: python -m pytest tests/unit/test_purity.py -q
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Found without importing anyshard, whose __init__ brings in the I/O half and torch.
PACKAGE = Path(importlib.util.find_spec("anyshard").origin).parent
PLANNING = [
    "anyshard.geometry.boxes",
    "anyshard.geometry.runs",
    "anyshard.geometry.shards",
    "anyshard.ucl.arithmetic",
    "anyshard.ucl.check",
    "anyshard.ucl.combine",
    "anyshard.ucl.evaluate",
    "anyshard.ucl.explain",
    "anyshard.ucl.library",
    "anyshard.ucl.lowering",
    "anyshard.ucl.mapping",
    "anyshard.ucl.parser",
    "anyshard.ucl.primitives",
    "anyshard.ucl.ranks",
    "anyshard.ucl.syntax",
    "anyshard.reshard.planner",
    "anyshard.reshard.read_plan",
    "anyshard.reshard.widening",
    "anyshard.reshard.coalesce",
    "anyshard.reshard.exchange",
]
# Modules that reach processes, storage or the file system; the I/O half of anyshard too.
FORBIDDEN = [
    "torch.distributed",
    "fsspec",
    "os",
    "io",
    "shutil",
    "tempfile",
    "mmap",
    "socket",
    "subprocess",
    "anyshard.format",
    "anyshard.reshard.executor",
    "anyshard.reshard.fill",
    "anyshard.reshard.stored",
    "anyshard.api",
]


def source_of(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def imported_names(tree: ast.Module, module: str) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import, resolved against the module's package
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def is_forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN) or name.startswith(
        "anyshard._"
    )


@pytest.mark.parametrize("module", PLANNING)
def test_planning_module_source_imports_nothing_that_does_io(module):
    tree = ast.parse(source_of(module).read_text(), filename=str(source_of(module)))
    bad = sorted({n for n in imported_names(tree, module) if is_forbidden(n)})
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", PLANNING)
def test_planning_module_source_never_calls_open(module):
    tree = ast.parse(source_of(module).read_text())
    calls = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open"
    ]
    assert not calls, f"{module} calls open() at lines {calls}"


# Run in a fresh interpreter: the parent packages are bare namespaces so that their
# __init__ (which imports the I/O half of anyshard) does not run, an import hook refuses the
# forbidden modules, and once the grammar (package data, read once) is loaded every way to
# open a file raises while a whole plan is made. (`import torch` itself loads torch.distributed,
# so this also keeps the planning modules free of torch.)
PROBE = textwrap.dedent(
    """
    import builtins, importlib.abc, io, os, sys, types

    FORBIDDEN = {forbidden!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN) or name.startswith("anyshard._"):
                raise ImportError("planning code imported " + name)
            return None

    sys.meta_path.insert(0, Refuse())
    for name, sub in (
        ("anyshard", ""),
        ("anyshard.geometry", "geometry"),
        ("anyshard.reshard", "reshard"),
        ("anyshard.ucl", "ucl"),
    ):
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join({package!r}, sub)] if sub else [{package!r}]
        sys.modules[name] = pkg

    from anyshard.reshard.planner import match_shards, plan_reads
    from anyshard.reshard.read_plan import StoredShardInfo
    from anyshard.ucl.evaluate import compile
    from anyshard.ucl.library import parse
    from anyshard.ucl.lowering import compile_mapping
    from anyshard.ucl.mapping import parse_mapping
    from anyshard.ucl.ranks import compile_every_rank, coverage_problems

    parse_mapping("flatten()")  # loads the grammars
    parse("mesh tp;")

    def no_files(*args, **kwargs):
        raise AssertionError("planning touched the file system: " + repr(args))

    builtins.open = io.open = os.open = os.listdir = os.scandir = no_files

    shape, src_sizes, dst_sizes = (10, 6), {{"dp": 3, "tp": 2}}, {{"tp": 4}}
    src = parse_mapping("chunk(0, tp) | chunk(0, dp)")
    target = compile_mapping(parse_mapping("chunk(1, tp)"), shape, dst_sizes, {{"tp": 1}})
    rank_of = lambda c: c["dp"] * 2 + c["tp"]
    used = {{}}
    transfers = match_shards("w", 0, target.pieces, src, shape, src_sizes, rank_of, used)
    info = {{k: StoredShardInfo(0, 4 * s[0] * s[1], 4, 0) for k, s in used.items()}}
    plan = plan_reads(transfers, info, [True], verify=False)
    assert plan.bytes_needed == 4 * 10 * 2, plan.bytes_needed
    spec = parse('mesh tp; param h; "w" -> "w" [h, 4] : chunk(0, tp);')
    assert compile(spec, {{"tp": 2, "h": 6}}, {{"tp": 1}})["w"].shape == (3, 4)
    ranks = compile_every_rank(spec.text, (("h", 6), ("tp", 2)))
    assert coverage_problems(ranks, lambda c: c["tp"]) == []
    leaked = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert not leaked, leaked
    print("pure", len(plan.requests))
    """
)


def test_planning_runs_with_io_modules_refused_and_file_access_disabled():
    code = PROBE.format(
        forbidden=[
            "torch.distributed",
            "fsspec",
            "anyshard.format",
            "anyshard.reshard.executor",
            "anyshard.reshard.fill",
            "anyshard.api",
        ],
        package=str(PACKAGE),
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("pure "), proc.stdout


def test_the_probe_notices_a_forbidden_import():
    code = PROBE.format(forbidden=["anyshard.errors"], package=str(PACKAGE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "planning code imported anyshard.errors" in proc.stderr
