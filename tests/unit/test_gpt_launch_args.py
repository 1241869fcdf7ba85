"""The FT-HSDP launcher refuses malformed per-group options before it starts anything."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from anyshard.trainer_integration.gpt import forked, launch


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


def test_group_args_and_faults_reach_only_their_group(monkeypatch, tmp_path):
    """Group 1's options follow the shared ones on its command line and its fault is in its
    environment; group 0's has neither, and a fault set for the launcher reaches no group."""
    started: list[tuple[list[str], dict[str, str]]] = []

    class Done:
        returncode = 0
        pid = 0

        def poll(self):
            return 0

        def kill(self):
            pass

        def wait(self):
            return 0

    monkeypatch.setenv("ANYSHARD_FAULT", "0:1")
    monkeypatch.setattr(launch, "start_lighthouse", lambda **_: (Done(), "http://127.0.0.1:1"))

    def start_agent(cmd, env):
        started.append((cmd, env))
        return Done()

    monkeypatch.setattr(launch, "_start_agent", start_agent)
    shared = ["--run_dir", str(tmp_path), "--train.steps", "4"]
    code = launch.main(
        ["--replicas", "2", "--nproc-per-node", "2", *shared, "--fault", "1:1:3",
         "--group-args", "1:--parallel.relayout_at 2:tp=2"]
    )  # fmt: skip
    assert code == 0 and len(started) == 2
    (g0, env0), (g1, env1) = started
    assert g0[:3] == g1[:3] == [sys.executable, "-m", "anyshard.trainer_integration.gpt.launch"]
    assert "--parallel.relayout_at" not in g0
    i = g1.index("--parallel.relayout_at")
    assert g1[i + 1] == "2:tp=2" and g1.index("--train.steps") < i
    assert g1[g1.index("--ft.replica") + 1] == "1"
    assert g0[g0.index("--nproc-per-node") + 1] == "2" and g0[g0.index("--ft.replica") + 1] == "0"
    assert "ANYSHARD_FAULTS" not in env0 and env1["ANYSHARD_FAULTS"] == "1:3"
    assert "ANYSHARD_FAULT" not in env0 and "ANYSHARD_FAULT" not in env1
    assert env0["PATH"] == os.environ["PATH"]


def test_an_agent_is_not_forked_while_another_thread_runs():
    """A thread that may hold a lock at the fork (here one waiting on an event) sends the
    groups' agents to new interpreters instead."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="listener")
    thread.start()
    try:
        assert not forked.fork_is_safe()
    finally:
        stop.set()
        thread.join()


def test_a_launcher_forked_from_a_process_with_a_forkserver_starts_one_of_its_own():
    """A test session or the demo may run a forkserver already: it is not the forked launcher's
    child, so the launcher must start its own (waiting on the parent's fails with ECHILD)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    parents = ctx.Process(target=os.getpid)
    parents.start()
    parents.join()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            forked._as_a_new_interpreter(dict(os.environ))
            own = ctx.Process(target=os.getpid)
            own.start()
            own.join()
            code = own.exitcode if own.exitcode is not None else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
