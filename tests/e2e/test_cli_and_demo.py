"""The `anyshard` command and the README's demo, run as a user runs them: the installed console
script in a subprocess for each command, --help and the README's script; the other cases call the
script's function in this process (tests/cli_runner.py), sparing each an interpreter's start-up."""

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_runner import cli

import anyshard

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run(*args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "step-7")
    anyshard.save(
        path,
        {
            "model": {
                "w": torch.arange(12.0).reshape(3, 4),
                "b": torch.ones(2, dtype=torch.bfloat16),
            },
            "step": 7,
        },
    )
    return path


def test_inspect_lists_tensors_with_shape_dtype_and_shards(ckpt):
    out = run("anyshard", "inspect", ckpt)
    assert out.returncode == 0, out.stderr
    assert "model.w" in out.stdout and "[3, 4]" in out.stdout and "float32" in out.stdout
    assert "2 tensors" in out.stdout


def test_inspect_json_is_machine_readable(ckpt):
    out = cli("inspect", ckpt, "--json")
    data = json.loads(out.stdout)
    assert {t["name"]: t["shape"] for t in data["tensors"]} == {"model.b": [2], "model.w": [3, 4]}
    assert data["values"] == {"step": 7}


def test_verify_passes_a_good_checkpoint_and_fails_a_corrupt_one_with_exit_1(ckpt):
    assert cli("verify", ckpt).returncode == 0
    data = os.path.join(ckpt, "data", os.listdir(os.path.join(ckpt, "data"))[0])
    with open(data, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    out = run("anyshard", "verify", ckpt)
    assert out.returncode == 1
    assert "checksum" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_checkpoint_is_exit_2_with_one_line_on_stderr(tmp_path):
    out = cli("inspect", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no such checkpoint" in out.stderr


def test_help_shows_examples():
    out = run("anyshard", "verify", "--help")
    assert out.returncode == 0 and "examples:" in out.stdout


def test_the_readme_demo_saves_and_reshards_bit_exact():
    out = run(sys.executable, os.path.join(ROOT, "examples", "reshard_demo.py"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded under tp4 on 4 ranks: all 4 tensors bit-exact" in out.stdout
    assert "loaded in 1 process as plain tensors: bit-exact" in out.stdout
