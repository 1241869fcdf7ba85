"""The trainer's launcher (``python -m`` `LAUNCH` ...) started by forking a process that has
imported torch and the trainer already (a new interpreter spends 2-3 s of CPU on that before
the launcher starts anything): the demo's launchers and FT-HSDP's replica groups. The forked
launcher answers as the `subprocess.Popen` of a new interpreter would, and starts as one would:
its own environment, signal handlers, logging, warnings, randomness, and multiprocessing's
forkserver and resource tracker (the parent's belong to the parent: a forkserver inherited from
a test session or the demo is not the child's to wait on, and a lost group's ranks must die with
its session). Its ranks still start from a forkserver of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import IO, NoReturn

Main = Callable[[list[str]], int]  # the launcher's `launch.main`

LAUNCH = "anyshard.trainer_integration.gpt.launch"

# threads that touch only objects of their own, which a forked launcher never uses: a
# multiprocessing queue's feeder (a test session's process pool has some)
_FORK_SAFE_THREADS = frozenset({"QueueFeederThread"})


def die_with_parent() -> None:
    """In a child: receive SIGTERM when its parent dies (Linux), so that no launcher or group
    outlives the process that started it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def fork_is_safe() -> bool:
    """Whether a launcher may be forked from this process rather than started as a new
    interpreter: no other thread started through `threading` is alive but those of
    `_FORK_SAFE_THREADS` (a logging listener, an executor, a pool's handlers could hold a lock
    that the child then waits on forever), this is the main thread (the launcher installs signal
    handlers), and CUDA is not initialized (a forked child cannot use it). The native threads
    that importing torch starts (OpenBLAS's pool, which stops itself around a fork) and torch's
    intra-op pool are not counted: the launcher runs no tensor code, and its ranks start from a
    forkserver that is a new interpreter. Nor is a thread started below `threading`, such as
    pytest-xdist's reader blocked on its channel, which the launcher never touches."""
    if threading.current_thread() is not threading.main_thread():
        return False
    others = {t.name for t in threading.enumerate() if t is not threading.current_thread()}
    if not others <= _FORK_SAFE_THREADS:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def start_launcher(
    cmd: list[str],
    env: dict[str, str],
    main: Main,
    *,
    out: IO[str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen | Forked:
    """Start ``cmd`` with ``env``, its output into ``out`` (else this process's), in a session
    of its own if ``new_session``, receiving SIGTERM when this process dies: forked (`Forked`,
    running ``main``, the launcher's own) where ``cmd`` is the trainer's launcher and
    `fork_is_safe`, else as it is."""
    if cmd[:3] == [sys.executable, "-m", LAUNCH] and fork_is_safe():
        return Forked(cmd[3:], env, main, out=out, new_session=new_session)
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out is not None else None,
        start_new_session=new_session, preexec_fn=die_with_parent,
    )  # fmt: skip


class Forked:
    """``main(argv)`` (the launcher's `launch.main`) in a child forked from this process (see the module docstring); it
    answers as a `subprocess.Popen` does (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``,
    ``returncode``: minus the signal that killed it)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        main: Main,
        *,
        out: IO[str] | None = None,
        new_session: bool = False,
    ):
        sys.stdout.flush()  # else what is buffered here is written twice
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            _run(main, argv, env, out, new_session)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(LAUNCH, timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def _run(
    main: Main, argv: list[str], env: dict[str, str], out: IO[str] | None, new_session: bool
) -> NoReturn:
    """In the forked launcher: the state a new interpreter would start with, then `main`, then
    the exit (never this process's cleanup: its files, atexit handlers and finalizers are the
    parent's)."""
    code = 1
    try:
        if new_session:
            os.setsid()
        die_with_parent()
        if out is not None:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        _as_a_new_interpreter(env)
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 (as an interpreter reports an uncaught error: exit 1)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _as_a_new_interpreter(env: dict[str, str]) -> None:
    """Undo in a forked launcher what its parent (a test session, the demo) may have set up:
    output bound to fds 1 and 2, signal handlers, logging handlers, warning filters, randomness,
    and multiprocessing's forkserver and resource tracker (the launcher starts its own, with its
    environment, in its session, so that losing a group kills its ranks too)."""
    import logging
    import random
    import warnings
    from multiprocessing import process, resource_tracker

    sys.stdout = open(1, "w", buffering=1, closefd=False)  # a caller may have redirected them
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    random.seed()
    old_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if old_fd is not None:  # else the parent's forkserver lives on while this process does
        os.close(old_fd)
    server = forkserver._forkserver = forkserver.ForkServer()
    forkserver.ensure_running = server.ensure_running
    forkserver.get_inherited_fds = server.get_inherited_fds
    forkserver.connect_to_new_process = server.connect_to_new_process
    forkserver.set_forkserver_preload = server.set_forkserver_preload
    old_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if old_fd is not None:
        os.close(old_fd)
    tracker = resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    resource_tracker.ensure_running = tracker.ensure_running
    resource_tracker.register = tracker.register
    resource_tracker.unregister = tracker.unregister
    resource_tracker.getfd = tracker.getfd
    process._children.clear()  # type: ignore[attr-defined]  # the parent's children
