"""The FT-HSDP launcher refuses malformed per-group options before it starts anything."""

from __future__ import annotations

import pytest

from anyshard.trainer_integration.gpt import launch


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--group-args", "1:--train.steps 4"], "--group-args needs --replicas"),
        (["--replicas", "2", "--group-args", "x"], "--group-args 'x': expected REPLICA:OPTIONS"),
        (["--replicas", "2", "--group-args", "1:"], "--group-args '1:': expected REPLICA:OPTIONS"),
        (["--replicas", "2", "--group-args", "5:--x 1"], "a REPLICA below 2 expected, got [5]"),
    ],
)
def test_malformed_group_args_are_refused_with_what_was_expected(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


def test_group_args_reach_only_their_group(monkeypatch, tmp_path):
    """Group 1's options follow the shared ones on its command line; group 0's has none."""
    started: list[list[str]] = []

    class Done:
        returncode = 0
        pid = 0

        def poll(self):
            return 0

        def kill(self):
            pass

        def wait(self):
            return 0

    monkeypatch.setattr(launch, "start_lighthouse", lambda **_: (Done(), "http://127.0.0.1:1"))
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **_: started.append(cmd) or Done())
    shared = ["--run_dir", str(tmp_path), "--train.steps", "4"]
    code = launch.main(
        ["--replicas", "2", "--nproc-per-node", "2", *shared,
         "--group-args", "1:--parallel.relayout_at 2:tp=2"]
    )  # fmt: skip
    assert code == 0 and len(started) == 2
    g0, g1 = started
    assert "--parallel.relayout_at" not in g0
    i = g1.index("--parallel.relayout_at")
    assert g1[i + 1] == "2:tp=2" and g1.index("--train.steps") < i
    assert g1[g1.index("--ft.replica") + 1] == "1"
