"""How ``anyshard demo`` launches the trainer, follows it, and runs its scenarios one after
another with no idle gap between them.

`launch_phase` starts one group of ranks under an elastic agent (`Phase`: the restart
scenario's launches, the autolayout one's); `Launch.follow` follows a launcher process, which
is forked from the demo's own (it has imported torch and anyshard already). A scenario is a
generator: it starts its launcher processes, yields while they train (`TRAINED` once its last
step is logged) and returns its summary (None where it failed). `run_in_turn` starts the next
scenario's launch as soon as the one on screen has logged its last step, so that the next
one's start-up (its forkservers importing torch, its rendezvous) runs while the
previous one saves its last checkpoint, shuts down and draws its plot: the previous one's steps
are over, so none of its figures is disturbed. One scenario's output shows at a time; the next
one's lines wait until the previous one's summary is out. `drive` runs one scenario alone.

    >>> def scenario(log):
    ...     log("training")
    ...     yield TRAINED
    ...     return {"ok": True}
    >>> [s for s, _ in run_in_turn([scenario, scenario], print, poll_s=0)]
    training
    training
    [{'ok': True}, {'ok': True}]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from anyshard.trainer_integration.gpt import forked

__all__ = [
    "TRAINED",
    "Launch",
    "Phase",
    "drive",
    "follow_phase",
    "last_step",
    "launch_phase",
    "records",
    "run_in_turn",
]

LAUNCH = forked.LAUNCH

TRAINED = "trained"  # what a scenario yields once its last step is logged

Log = Callable[[str], None]
Scenario = Generator[Any, None, Any]


def records(path: str) -> list[dict]:
    """The JSON lines of ``path`` (none where it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_step(run_dir: str) -> int:
    """The last step ``run_dir/losses.jsonl`` logs (0 before the first)."""
    recs = records(os.path.join(run_dir, "losses.jsonl"))
    return recs[-1]["step"] if recs else 0


class Launch:
    """A launcher process that the demo follows, its output in ``log_path``. The trainer's
    launcher (``cmd`` = python -m `LAUNCH` ...) runs forked from this process where that is
    safe (`forked.start_launcher`); another command runs as it is."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str):
        self._out = open(log_path, "w")
        from anyshard.trainer_integration.gpt.launch import main

        self.proc = forked.start_launcher(cmd, env, main, out=self._out)

    def follow(self, progress: Callable[[], None], trained: Callable[[], bool]) -> Scenario:
        """Yield while the launcher runs (`TRAINED` once ``trained()``), showing ``progress``
        each time; returns its exit code. Closed early (the demo stops, or another scenario
        failed), it stops the launcher and the groups it started."""
        try:
            while self.proc.poll() is None:
                progress()
                yield TRAINED if trained() else None
            progress()
            return self.proc.returncode
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the launcher (and the groups it started) if it still runs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


@dataclass(frozen=True)
class Phase:
    """One launch of a group of ranks under one elastic agent (`launch_phase`)."""

    name: str
    nproc: int
    layout: tuple[str, ...]
    stop_at: int
    fault: str | None  # ANYSHARD_FAULT for this launch
    slow: str | None = None  # ANYSHARD_SLOW for this launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_phase(
    phase: Phase, total: int, run_dir: str, extra: list[str], start_when: str | None = None
) -> Launch:
    """Launch ``phase`` (a group of ``phase.nproc`` ranks under one elastic agent) to train to
    ``phase.stop_at`` of ``total`` steps; ``extra``: more trainer options (the storage's, the
    config). ``start_when``: a path; the launcher imports and starts its forkserver now, and
    its ranks once the path exists (its rendezvous then takes a free port)."""
    # a launch that waits binds its port only when it starts
    where = ["--start-when", start_when] if start_when else [
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", LAUNCH,
        "--nproc-per-node", str(phase.nproc), "--max-restarts", "1",
        *where,
        *phase.layout,
        "--stop-at", str(phase.stop_at),
        "--train.steps", str(total),
        "--checkpoint.every_steps", "2",
        "--checkpoint.async_", "true",
        "--checkpoint.keep_last", "2",
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("ANYSHARD_FAULT", None)
    env.pop("ANYSHARD_SLOW", None)
    if phase.fault:
        env["ANYSHARD_FAULT"] = phase.fault
    if phase.slow:
        env["ANYSHARD_SLOW"] = phase.slow
    env.setdefault("OMP_NUM_THREADS", "1")
    return Launch(cmd, env, os.path.join(run_dir, f"phase-{phase.name}.log"))


def follow_phase(launch: Launch, run_dir: str, stop_at: int | None, log) -> Scenario:
    """Follow a launch of `launch_phase`, printing its losses as they come (those of earlier
    launches into ``run_dir`` are out already), trained once it logs step ``stop_at`` (None:
    a launch that another follows); its exit code."""
    shown = [len(records(os.path.join(run_dir, "losses.jsonl")))]

    def progress() -> None:
        recs = records(os.path.join(run_dir, "losses.jsonl"))
        for r in recs[shown[0] :]:
            log(
                f"  step {r['step']:3d}  loss {r['loss']:.4f}  [{r['layout']}, attempt "
                f"{r['attempt']}]"
            )
        shown[0] = len(recs)

    return launch.follow(progress, lambda: stop_at is not None and last_step(run_dir) >= stop_at)


def drive(scenario: Scenario, poll_s: float = 0.2) -> Any:
    """Run ``scenario`` to its end, alone; what it returns."""
    try:
        while True:
            try:
                next(scenario)
            except StopIteration as e:
                return e.value
            time.sleep(poll_s)
    finally:  # interrupted (Ctrl-C, a caller's deadline): its launches stop with it
        scenario.close()


class _Running:
    """A scenario under way: its generator, and its lines while another one is on screen."""

    def __init__(self, start: Callable[[Log], Scenario], log: Log, shown: bool):
        self.lines: list[str] | None = None if shown else []
        self.log = log
        self.began = time.time()
        self.trained = self.finished = False
        self.summary: Any = None
        self.gen = start(self._log)

    def _log(self, msg: str) -> None:
        if self.lines is None:
            self.log(msg)
        else:
            self.lines.append(msg)

    def show(self) -> None:
        for msg in self.lines or ():
            self.log(msg)
        self.lines = None

    def advance(self) -> None:
        if self.finished:
            return
        try:
            self.trained |= next(self.gen) == TRAINED
        except StopIteration as e:
            self.finished, self.trained, self.summary = True, True, e.value


def run_in_turn(
    scenarios: Sequence[Callable[[Log], Scenario]], log: Log, poll_s: float = 0.2
) -> Generator[tuple[Any, float], None, None]:
    """Run ``scenarios`` (each called with the ``log`` to write to) in turn, the next one
    launched once the one on screen has logged its last step; yields each one's summary and
    its seconds from launch to summary. After a failed one (None) the rest are stopped."""
    todo = list(scenarios)
    shown, nxt = _Running(todo.pop(0), log, shown=True), None
    try:
        while True:
            shown.advance()
            if nxt is not None:
                nxt.advance()
            if shown.finished:
                yield shown.summary, time.time() - shown.began
                if shown.summary is None or not (nxt or todo):
                    return
                shown, nxt = nxt or _Running(todo.pop(0), log, shown=True), None
                shown.show()
            elif shown.trained and nxt is None and todo:
                nxt = _Running(todo.pop(0), log, shown=False)
            else:
                time.sleep(poll_s)
    finally:
        for r in (shown, nxt):
            if r is not None:
                r.gen.close()
