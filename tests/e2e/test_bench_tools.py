"""The benchmark tools' smoke modes, run as a user runs them: a subprocess, the exit code, the
files they write.

Run: python -m pytest tests/e2e/test_bench_tools.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_convert_memory_quick_measures_and_checks_a_conversion(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "bench_convert_memory.py"),
            "--quick",
            "--layouts",
            "whole",
            "--tools",
            "dcp,hf",
            "--dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "result.json"),
            "--write-docs",
            str(docs),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    tools = result["results"]["whole"]["tools"]
    assert set(tools) == {"dcp", "hf"}
    for r in tools.values():
        assert r["verified"], r["problem"]
        assert r["peak_mib"] >= r["baseline_mib"] > 0
        assert abs(r["maxrss_mib"] - r["peak_mib"]) < 64  # two ways to the same peak
    text = docs.read_text()
    assert "<!-- convert_memory:begin -->" in text and "<!-- convert_memory:end -->" in text
    assert "anyshard convert --to hf" in text and "DCP dcp_to_torch_save" in text
    # the checkpoints and outputs are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks.md", "result.json"]


def test_probe_fork_snapshot_reports_each_round_and_the_medians():
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "probe_fork_snapshot.py"),
            "--gib",
            "0.125",
            "--rounds",
            "2",
            "--child-s",
            "0.05",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("round ") for line in lines) == 2
    assert lines[-1].startswith("medians (0.12 GiB state")


def test_bench_io_paths_quick_checks_every_read_and_writes_its_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "bench_io_paths.py"),
            "--quick",
            "--parts",
            "disk,s3",
            "--disk-dir",
            str(tmp_path),
            "--write-docs",
            str(docs),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = docs.read_text()
    assert "<!-- io_paths:begin -->" in text and "<!-- io_paths:end -->" in text
    rows = [
        line for line in text.splitlines() if line.startswith("| disk") or line.startswith("| s3")
    ]
    assert len(rows) == 2 + 3 + 3  # two writers, three readers on disk and on S3
    assert all(line.split("|")[-2].strip() in ("yes", "-") for line in rows)
    assert sum(line.split("|")[-2].strip() == "yes" for line in rows) == 6
