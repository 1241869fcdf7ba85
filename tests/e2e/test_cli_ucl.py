"""`anyshard ucl check` and `anyshard ucl explain`: through the console script's function in
this process (tests/cli_runner.py), and as the installed console script for `--help`."""

import subprocess

import pytest
from cli_runner import cli

from anyshard import ucl
from anyshard.ucl.explain import check_layout

MEG = "pp=2,dp=2,tp=2,hidden=12,heads=6,kv_heads=3,ffn=10,vocab=7,layers=4,vocab_divisor=4"


def run(*args):
    assert args[0] == "anyshard"
    return cli(*args[1:])


def test_check_shipped_spec_under_a_layout():
    out = run("anyshard", "ucl", "check", "megatron_gpt", "--layout", MEG)
    assert out.returncode == 0, out.stderr
    assert "8 ranks" in out.stdout and "39 logical tensors" in out.stdout
    assert "saved exactly once" in out.stdout


def test_check_reports_a_syntax_error_with_line_and_caret(tmp_path):
    f = tmp_path / "bad.ucl"
    f.write_text('mesh tp;\nparam h;\n"w" -> "w" [h] : chunk(0, tp) |;\n')
    out = run("anyshard", "ucl", "check", str(f))
    assert out.returncode == 1
    assert "line 3" in out.stderr and "^" in out.stderr and "Traceback" not in out.stderr


def test_check_finds_a_region_saved_twice_and_one_saved_by_nobody(tmp_path):
    f = tmp_path / "dup.ucl"
    # forgot replicate(dp): every dp rank saves the same shard
    f.write_text('mesh dp, tp;\nparam h;\n"w" -> "w" [h, 4] : chunk(0, tp);\n')
    out = run("anyshard", "ucl", "check", str(f), "--layout", "dp=2,tp=2,h=4")
    assert out.returncode == 1
    assert "saved twice" in out.stderr and "dp=0,tp=0" in out.stderr
    # on() on a coordinate no rank of the slice saves: tp=1's half is saved by nobody
    f.write_text('mesh tp;\nparam h;\n"w" -> "w" [h] : chunk(0, tp) | on(tp, 0);\n')
    out = run("anyshard", "ucl", "check", str(f), "--layout", "tp=2,h=4")
    assert out.returncode == 1 and "2 of its 4 elements" in out.stderr


def test_check_layout_library_call_agrees():
    spec = ucl.parse('mesh dp, tp;\nparam h;\n"w" -> "w" [h, 4] : chunk(0, tp) | replicate(dp);\n')
    assert check_layout(spec, {"dp": 2, "tp": 2, "h": 4}).problems == []


def test_explain_draws_who_saves_which_rows():
    out = run(
        "anyshard",
        "ucl",
        "explain",
        "megatron_gpt",
        "--layout",
        MEG,
        "model.layers.2.self_attn.q_proj.weight",
    )
    assert out.returncode == 0, out.stderr
    grid = [
        ln.strip()
        for ln in out.stdout.splitlines()
        if ln.startswith("    ") and set(ln.strip()) <= set("0123456789")
    ]
    # 3 query groups over tp=2 on stage 1: rank 4 (tp=0) saves 2 groups (8 rows), rank 5 one (4 rows)
    assert grid[:8] == ["4" * 12] * 8 and grid[8:] == ["5" * 12] * 4
    assert "replica" in out.stdout  # the dp=1 copies


@pytest.mark.parametrize(
    "args",
    [
        ("ucl", "check", "no_such_spec"),
        ("ucl", "check", "gpt", "--layout", "tp=two"),
        (
            "ucl",
            "explain",
            "gpt",
            "--layout",
            "hidden=8,heads=2,ffn=4,vocab=5,layers=1",
            "nope.weight",
        ),
        ("ucl", "explain", "gpt", "--layout", "tp=2", "norm.weight"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args):
    out = run("anyshard", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.strip()


def test_help_has_examples():
    for sub in ("check", "explain"):
        out = subprocess.run(
            ["anyshard", "ucl", sub, "--help"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and "examples:" in out.stdout
