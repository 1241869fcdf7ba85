"""The benchmark tools' smoke modes, run as a user runs them: a subprocess, the exit code, the
files they write.

Run: python -m pytest tests/e2e/test_bench_tools.py -q
"""

from __future__ import annotations

import json
import os
import re
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


def _bench(tool: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "tools", tool), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_bench_reshard_every_system_saves_and_loads_bit_exact_and_the_floor_reads_the_target(
    tmp_path,
):
    args = "--gib 0.02 --reps 1 --regimes tmpfs --no-warmup".split()
    args += ["--tmpfs-dir", str(tmp_path), "--json", str(tmp_path / "r.json")]
    _bench("bench_reshard.py", *args, "--jsonl", str(tmp_path / "r.jsonl"), timeout=180)
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["op"]: r for r in result["rows"]}
    assert set(rows) == {"save", "load->tp4", "load->dp4"}
    for op in ("load->tp4", "load->dp4"):
        r = rows[op]
        assert all(not r[s]["bad"] for s in ("anyshard", "dcp", "dcp_any")), r
        # the floor reads exactly the bytes the target holds: the counters must see them
        assert r["target_bytes"] <= r["floor"]["rchar"] <= r["target_bytes"] + 4096
    # every save writes at least the rank's share of the state
    assert all(
        rows["save"][s]["wchar"] >= rows["save"]["target_bytes"] for s in ("floor", "anyshard")
    )
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 4 * 4  # operations x systems x ranks, one repetition
    # the checkpoints are removed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-reshard-")] == []


def test_bench_storage_local_async_saves_load_back_bit_exact(tmp_path):
    args = "--parts local --gib 0.03 --tensor-mib 4 --reps 2".split()
    args += ["--disk-dir", str(tmp_path), "--tmpfs-dir", str(tmp_path / "none")]
    _bench(
        "bench_storage.py",
        *args,
        "--json",
        str(tmp_path / "s.json"),
        "--jsonl",
        str(tmp_path / "s.jsonl"),
    )
    summary = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert [r["regime"] for r in summary["local"]] == ["disk"]  # no tmpfs dir: no tmpfs regime
    r = summary["local"][0]
    assert r["bit_exact"] is True
    assert all(len(v) == 2 for v in r["times"].values())
    assert r["first_block"] <= r["first_total"] and r["steady_block"] <= r["steady_total"]
    recs = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    systems = ["first"] * 2 + ["load"] + ["steady"] * 2 + ["sync"] * 2
    assert sorted(x["system"] for x in recs) == systems  # one timed load of the last save
    state_bytes = 8 * (4 << 20)  # eight 4 MiB tensors, and small ones
    assert all(x["wchar"] >= state_bytes for x in recs if x["system"] != "load")
    assert all(x["gib"] * (1 << 30) >= state_bytes for x in recs)  # the state's size, recorded
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-")] == []


def _benchkit():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import benchkit

    return benchkit


def test_harness_meter_counts_the_bytes_written_and_read_and_the_memory_touched(tmp_path):
    h = _benchkit()
    path, data = tmp_path / "f", os.urandom(3 << 20)

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)

    wrote = h.measure(write)
    read = h.measure(lambda: len(path.read_bytes()))
    touched = h.measure(lambda: len(bytearray(64 << 20)))
    assert len(data) <= wrote["wchar"] < len(data) + 4096
    assert len(data) <= read["rchar"] < len(data) + 8192 and read["result"] == len(data)
    assert touched["rss_over"] >= 60 << 20 and touched["rss_peak"] >= touched["rss_over"]
    assert all(r["wall_s"] >= 0 and r["cpu_s"] >= 0 for r in (wrote, read, touched))


def test_harness_run_process_takes_the_childs_counters(tmp_path):
    h = _benchkit()
    code = (
        "import os; b = bytearray(96 << 20); open(os.sys.argv[1], 'wb').write(os.urandom(1 << 20))"
    )
    r = h.run_process([sys.executable, "-c", code, str(tmp_path / "x")], str(tmp_path / "log"))
    assert r["rc"] == 0
    assert r["wchar"] >= 1 << 20 and r["rss_peak"] >= 96 << 20 and r["cpu_s"] > 0


def _rank_value(rank: int, world: int, base: int) -> int:
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, rank + base)
    return sum(out)


def _rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    import torch.distributed as dist

    dist.barrier()  # would wait for rank 1 forever


def test_harness_run_ranks_gathers_and_names_a_failed_rank():
    h = _benchkit()
    assert h.run_ranks(_rank_value, 2, 10) == [21, 21]
    try:
        h.run_ranks(_rank_fails, 2)
    except RuntimeError as e:
        assert "rank 1 of _rank_fails" in str(e) and "rank one refuses" in str(e)
    else:
        raise AssertionError("a failed rank must raise")


def test_harness_paired_alternates_and_records_each_measurement(tmp_path):
    h = _benchkit()
    order: list[str] = []
    rec = h.Records(str(tmp_path / "m.jsonl"), "t")
    systems = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    out = h.paired(systems, 4, check=lambda name: name == "a", records=rec, part="x")
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [r["exact"] for r in out["a"]] == [True] * 4 and len(out["b"]) == 4
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all(x["part"] == "x" and "rchar" in x for x in lines)
    assert h.fmt_spread([3.0, 1.0, 2.0]) == "2.00 [1.00-3.00]" and h.fmt_spread([1.0]) == "1.00"


def test_harness_write_section_replaces_only_its_markers(tmp_path):
    h = _benchkit()
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\nintro\n\n## Tool\n\ntail\n")
    h.write_section(str(doc), "tool", ["one"], heading="## Tool")
    h.write_section(str(doc), "tool", ["two"], heading="## Tool")
    h.write_section(str(doc), "other", ["three"])
    text = doc.read_text()
    assert text == (
        "# B\n\nintro\n\n## Tool\n\n<!-- tool:begin -->\ntwo\n<!-- tool:end -->\ntail\n\n"
        "<!-- other:begin -->\nthree\n<!-- other:end -->\n"
    )
    cmd = h.rerun_command("tools/x.py", ["--quick", "--write-docs", "p.md", "--reps", "2"])
    assert cmd == "python tools/x.py --quick --reps 2 --write-docs"


def test_goodput_profile_rebuilds_the_shipped_profile_and_predicts_held_out_runs(tmp_path):
    """The runs behind the shipped profile (tests/fixtures/goodput: bench_goodput's and
    bench_storage's JSON lines) give that profile again, and the simulator predicts each held-out
    set of runs (other fault counts, interval, sync saves, the elastic mode) within 10%."""
    fix = os.path.join(ROOT, "tests", "fixtures", "goodput")
    docs = tmp_path / "benchmarks.md"
    args = ["--calibrate", f"{fix}/cal.jsonl", f"{fix}/heal.jsonl"]
    args += ["--storage", f"{fix}/storage.jsonl"]
    args += ["--held-out", f"{fix}/held.jsonl", f"{fix}/held_sync.jsonl"]
    args += ["--out", str(tmp_path / "p.json"), "--seeds", "2", "--plot", str(tmp_path / "e.svg")]
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "goodput_profile.py"), *args,
         "--write-docs", str(docs)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    with open(
        os.path.join(ROOT, "anyshard", "trainer_integration", "planning", "failure_profile.json")
    ) as f:
        shipped = json.load(f)
    rebuilt = json.loads((tmp_path / "p.json").read_text())
    assert {k: v for k, v in rebuilt.items() if k != "source"} == {
        k: v for k, v in shipped.items() if k != "source"
    }
    assert rebuilt["source"]["workload"] == shipped["source"]["workload"]
    held = [ln for ln in docs.read_text().splitlines() if ", faults at steps " in ln]
    assert len(held) == 4  # restart async and sync, FT-HSDP, elastic
    errors = [float(x) for ln in held for x in re.findall(r"\| ([+-]\d+\.\d)% ", ln + " ")]
    assert len(errors) == 8 and all(abs(e) < 10 for e in errors), held
    assert (tmp_path / "e.svg").stat().st_size > 10_000
