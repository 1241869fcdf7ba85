"""Smoke runs of benchmarks in tools/ at their smallest settings, as a user runs them: a
subprocess, its exit code, what it prints and the JSON it writes.

Run: python -m pytest tests/e2e/test_bench_tools_trainer.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "tools", name), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_bench_incremental_smallest_setting_reports_every_kind_and_loads_bit_exact(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    out = run_tool(
        "bench_incremental.py",
        *("--roots", "tmpfs", "--dim", "64", "--ffn", "128", "--layers", "2", "--vocab", "256"),
        *("--checkpoints", "3", "--loads", "2", "--seed", "5"),
        *("--json", str(tmp_path / "r.json"), "--write-docs", str(docs)),
    )
    assert "seed 5" in out.stdout
    for kind in ("full", "incremental, frozen", "incremental, hashed"):
        assert f"| tmpfs | {kind} |" in docs.read_text()
    rows = json.loads((tmp_path / "r.json").read_text())
    loads = [r for r in rows if "exact" in r]
    assert len(loads) == 3 * 2 and all(r["exact"] for r in loads)
    runs = {r["system"]: r for r in rows if "saves" in r}
    # a frozen base is written once: later incremental saves write a fraction of a full one
    later = {k: r["saves"][-1]["bytes"] for k, r in runs.items()}
    assert later["incremental, frozen"] < later["full"] / 2
    text = docs.read_text()
    assert "<!-- incremental:begin -->" in text and "--seed 5" in text


def test_bench_autolayout_accuracy_runs_every_layout_and_ranks_them(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    tiny = os.path.join(ROOT, "anyshard", "trainer_integration", "gpt", "tiny.toml")
    run_tool(
        "bench_autolayout.py",
        *("--world", "2", "--steps", "5", "--accuracy-only", "--config", tiny),
        *("--json", str(tmp_path / "r.json"), "--write-docs", str(docs)),
    )
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        from benchkit import spearman
    finally:
        sys.path.pop(0)
    # Spearman's rho by its definition: ranks' Pearson correlation (ties take their mean rank)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert abs(spearman([1, 2, 2, 3], [1, 3, 2, 4]) - 3 / 10**0.5) < 1e-12  # ranks 0 1.5 1.5 3
    rows = json.loads((tmp_path / "r.json").read_text())
    layouts = {r["layout"] for r in rows}
    # tiny.toml on 2 ranks: every valid layout ran once, fixed where it started
    assert layouts >= {"tp=2", "dp_shard=2", "dp_replicate=2", "cp=2", "pp=2"}, layouts
    assert all(r["final_layout"].replace(" x ", ",") == r["layout"] for r in rows), rows
    text = docs.read_text()
    assert "<!-- autolayout_accuracy_2:begin -->" in text and "Spearman" in text
