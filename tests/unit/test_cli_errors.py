"""`anyshard` keeps its exit codes: 2 and one line for what it understands, 3 with "internal
error" and the traceback for anything else; `inspect --json` reports the manifest's version.

Run: python -m pytest tests/unit/test_cli_errors.py -q
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import anyshard
import anyshard.cli
from anyshard import ucl
from anyshard.cli import main
from anyshard.format.manifest import FORMAT_VERSION


def test_an_unexpected_exception_exits_3_with_internal_error_and_its_traceback(
    tmp_path, monkeypatch, capsys
):
    path = str(tmp_path / "ckpt")
    anyshard.save(path, {"w": torch.ones(2)})

    def broken(args):
        raise ZeroDivisionError("a bug deep inside")

    monkeypatch.setattr(anyshard.cli.parser, "inspect_command", broken)
    anyshard.cli.parser.command_parser.cache_clear()  # the parser (built once) holds the command it runs
    assert main(["inspect", path]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ZeroDivisionError: a bug deep inside" in err
    assert "anyshard inspect: internal error" in err
    monkeypatch.undo()
    anyshard.cli.parser.command_parser.cache_clear()  # no later test gets the broken command


def test_an_anyshard_error_stays_one_line_and_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("anyshard inspect: ")


def test_inspect_json_reports_the_format_version_of_the_manifest(tmp_path, capsys):
    plain = str(tmp_path / "plain")
    anyshard.save(plain, {"w": torch.ones(2)})
    spec = 'mesh tp; "w" -> "w" [4] : chunk(0, tp);'
    with_spec = str(tmp_path / "spec")
    ucl.save_local_states(
        with_spec, {0: {"w": torch.ones(2)}, 1: {"w": torch.ones(2)}}, spec=spec, layout={"tp": 2}
    )
    versions = {}
    for name, path in (("plain", plain), ("spec", with_spec)):
        capsys.readouterr()
        assert main(["inspect", path, "--json"]) == 0
        versions[name] = json.loads(capsys.readouterr().out)["format_version"]
        with open(f"{path}/manifest.json") as f:
            assert json.load(f)["format_version"] == versions[name]
    assert versions == {"plain": FORMAT_VERSION, "spec": FORMAT_VERSION}  # all sealed now
    # an older checkpoint is reported as the version it is
    v1 = os.path.join(os.path.dirname(__file__), "..", "golden", "v1")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="unverified"):
        assert main(["inspect", v1, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format_version"] == 1
