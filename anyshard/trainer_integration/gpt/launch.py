"""Launch the trainer on local ranks with warm restarts: torchrun's elastic agent, workers forked.

    python -m anyshard.trainer_integration.gpt.launch --nproc-per-node 4 --max-restarts 1 \\
        --parallel.pp 2 --parallel.dp_shard 2 --train.steps 40

It runs the same agent as ``torchrun`` (``torch.distributed.launcher.api.elastic_launch``: c10d
rendezvous, a restart of the whole group when a rank dies, ``TORCHELASTIC_RESTART_COUNT``, the
same environment for the ranks), with one difference: the ranks are forked from a
``multiprocessing`` forkserver that has imported torch, its distributed packages (FSDP, DTensor,
pipelining, torch._dynamo) and the trainer once, instead of being new interpreters that import
them all again. On 2 CPU cores that import is about 6 s of the 9-10 s a restart costs under
``torchrun``; here a restart takes 3-4 s from the kill to the first step after it
(``python tools/bench_goodput.py`` with ``--launcher torchrun`` or without). The
trainer is the same: ``torchrun ... -m anyshard.trainer_integration.gpt.train`` runs it too.

Options before the trainer's: ``--nproc-per-node N``, ``--max-restarts R``, ``--rdzv-endpoint
HOST:PORT`` (default: a free port on 127.0.0.1), ``--start-when PATH`` (import everything and
start the forkserver now, but the agent only once PATH exists: a relaunch that is to follow a
running job starts warm); every other word goes to the trainer (``--config``, ``--stop-at``,
``--section.key value``).

FT-HSDP: ``--replicas G`` runs G replica groups of ``--nproc-per-node`` ranks, each under its
own elastic agent (so a fault restarts only its group; the agents are forked from the launcher,
which has imported torch and the trainer already), and a torchft lighthouse on 127.0.0.1 that
they all report to (``--heartbeat-ms``: how soon a silent group is dropped).
``--fault REPLICA:RANK:STEP[:MODE]`` kills RANK of group REPLICA at STEP; the k-th ``--fault``
of a group strikes in its k-th attempt (give it ``--max-restarts`` at least that many).
``--group-args REPLICA:OPTIONS`` gives trainer options to one group alone (e.g.
``'1:--parallel.relayout_at 20:tp=2'``: group 1 switches layout at step 20, the others go on).

    python -m anyshard.trainer_integration.gpt.launch --replicas 2 --nproc-per-node 2 \
        --max-restarts 1 --fault 1:1:10 --parallel.dp_shard 2 --ft.heal_layout tp=2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver

from anyshard._compat import DYNAMO_MODULE
from anyshard.trainer_integration.gpt import forked

__all__ = ["PRELOAD", "launch", "launch_replicas", "main", "start_lighthouse"]

# imported once by the forkserver, so that a rank (and a restarted rank) starts with them
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    DYNAMO_MODULE,
    "torch.distributed.checkpoint.state_dict",
    "anyshard.trainer_integration.gpt.train",
    "anyshard.trainer_integration.gpt._preload",
)


def _rank_main(argv: list[str]) -> int:
    from anyshard.trainer_integration.gpt.train import main

    # a forked rank leaves through multiprocessing's os._exit, never interpreter finalization
    return main(argv, hard_exit=False)


def launch(
    nproc: int,
    trainer_args: Sequence[str],
    *,
    max_restarts: int = 0,
    rdzv_endpoint: str = "127.0.0.1:0",
    start_when: str | None = None,
) -> None:
    """Run the trainer on ``nproc`` local ranks; raises torch's ``ChildFailedError`` when the
    group still fails after ``max_restarts`` restarts. ``start_when``: a path whose existence
    starts the agent; until then the forkserver imports `PRELOAD`, so that the ranks start as
    soon as it appears."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    saved = os.environ.get(_TUNABLES)
    try:
        tunables = _rank_env(trainer_args).get(_TUNABLES)
        if tunables is not None:
            os.environ[_TUNABLES] = tunables
        if start_when is not None:
            # the forkserver (with this environment) imports PRELOAD while the launch waits
            forkserver.ensure_running()
            _wait_for(start_when)
        _elastic_launch(nproc, trainer_args, max_restarts, rdzv_endpoint)
    finally:
        if saved is None:
            os.environ.pop(_TUNABLES, None)
        else:
            os.environ[_TUNABLES] = saved


def _wait_for(path: str, poll_s: float = 0.05) -> None:
    """Return once ``path`` exists."""
    while not os.path.exists(path):
        time.sleep(poll_s)


def _elastic_launch(
    nproc: int, trainer_args: Sequence[str], max_restarts: int, rdzv_endpoint: str
) -> None:
    """torchrun's elastic agent over ``nproc`` ranks forked from the forkserver."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    elastic_launch(config, entrypoint=_rank_main)(list(trainer_args))


_TUNABLES = "GLIBC_TUNABLES"


def _rank_env(trainer_args: Sequence[str]) -> dict[str, str]:
    """The environment the forkserver, and so every rank, starts with: where the trainer's
    allocator is to be lean (`malloc.wanted`: a memory budget on the host, or ``train.malloc
    = lean``), huge pages for malloc's mappings (`malloc.hugepage_env`; the threshold itself
    is set in the rank). A config that does not load is left to the ranks to report. A
    forkserver is started once per process: a later launch from the same process reuses it
    with the environment it was started with."""
    import torch

    from anyshard.trainer_integration.gpt import malloc
    from anyshard.trainer_integration.gpt.config import trainer_config

    env = dict(os.environ)
    try:
        cfg, _ = trainer_config(trainer_args)
    except (ValueError, OSError):
        return env
    gpu = torch.cuda.is_available()
    lean = malloc.wanted(cfg.train.malloc, cfg.parallel.auto_memory_gib, on_accelerator=gpu)
    return malloc.hugepage_env(env) if lean else env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(
    *, heartbeat_ms: int = 1000, join_ms: int = 100, min_replicas: int = 1
) -> tuple[subprocess.Popen, str]:
    """Start torchft's lighthouse on a free port of 127.0.0.1; returns it and its address.
    A group that stops heartbeating for ``heartbeat_ms`` leaves the quorum; ``join_ms`` is how
    long a quorum waits for heartbeating stragglers."""
    binary = shutil.which("torchft_lighthouse") or os.path.join(
        os.path.dirname(sys.executable), "torchft_lighthouse"
    )
    if not os.path.exists(binary):
        raise FileNotFoundError(
            "torchft_lighthouse not found; install torchft (pip install 'anyshard[demo]' or "
            "pip install torchft)"
        )
    port = _free_port()
    cmd = [binary, "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}"]
    cmd += ["--heartbeat_timeout_ms", str(heartbeat_ms), "--join_timeout_ms", str(join_ms)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=forked.die_with_parent
    )
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(
                    f"torchft_lighthouse did not start on 127.0.0.1:{port}"
                ) from None
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def _run_dir(trainer_args: Sequence[str]) -> str:
    """The trainer's ``run_dir`` among its arguments (the config default when not given)."""
    args = list(trainer_args)
    for i, a in enumerate(args):
        if a == "--run_dir" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--run_dir="):
            return a.split("=", 1)[1]
    from anyshard.trainer_integration.gpt.config import Config

    return Config().run_dir


def _last_step(run_dir: str) -> int:
    """The last step ``run_dir/losses.jsonl`` logs (0 before the first)."""
    try:
        with open(os.path.join(run_dir, "losses.jsonl"), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def _faults_by_group(faults: Sequence[str], replicas: int) -> dict[int, list[str]]:
    """``faults`` (REPLICA:RANK:STEP[:MODE]) as each group's RANK:STEP[:MODE] list."""
    per_group: dict[int, list[str]] = {}
    for f in faults:
        head, _, rest = f.partition(":")
        if not head.isdigit() or not rest or not 0 <= int(head) < replicas:
            raise ValueError(
                f"--fault {f!r}: expected REPLICA:RANK:STEP[:MODE], REPLICA < {replicas}"
            )
        per_group.setdefault(int(head), []).append(rest)
    return per_group


def _start_agent(cmd: list[str], env: dict[str, str]) -> subprocess.Popen | forked.Forked:
    """Start a group's agent, ``cmd`` (python -m `forked.LAUNCH` ...), in a session of its own
    that receives SIGTERM when this process dies: forked from this process where
    `forked.fork_is_safe`, else as a new interpreter."""
    return forked.start_launcher(cmd, env, main, new_session=True)


class _Groups:
    """The replica groups of a job, each an elastic agent (``commands[g]``, forked from this
    process where `forked.fork_is_safe`) in a session of its own, so that a lost node's agent and
    ranks are killed at once; ``faults[g]`` are the faults of group g, the k-th striking in its
    k-th attempt."""

    def __init__(self, commands: Mapping[int, list[str]], faults: Mapping[int, list[str]]):
        self.commands, self.faults = commands, faults
        self.procs = {g: self.start(g) for g in commands}

    def start(self, g: int) -> subprocess.Popen | forked.Forked:
        """Launch group ``g`` (again)."""
        env = dict(os.environ)
        env.pop("ANYSHARD_FAULT", None)
        env.pop("ANYSHARD_FAULTS", None)
        if g in self.faults:  # the k-th fault of a group strikes in its k-th attempt
            env["ANYSHARD_FAULTS"] = ",".join(self.faults[g])
        return _start_agent(self.commands[g], env)

    def lose(self, g: int, step: int, run_dir: str) -> bool:
        """Lose group ``g``'s node at ``step``: SIGKILL its agent and ranks, and log the fault
        in its ``fault.json``. False where the group had already ended."""
        proc = self.procs[g]
        if proc.poll() is not None:
            return False
        os.killpg(proc.pid, signal.SIGKILL)  # the node is lost: its agent and ranks at once
        proc.wait()
        event = {"time": time.time(), "step": step, "rank": None, "mode": "node lost"}
        with open(os.path.join(run_dir, f"replica-{g}", "fault.json"), "a") as f:
            f.write(json.dumps(event) + "\n")
        print(f"launch: replica group {g} lost at step {step}", file=sys.stderr, flush=True)
        return True

    def kill(self) -> None:
        """SIGKILL the groups still running."""
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _supervise(
    groups: _Groups, run_dir: str, lose: Sequence[tuple[int, int, float | None]]
) -> dict[int, int]:
    """Wait for every group to end, losing groups and bringing them back as ``lose`` says
    (`launch_replicas`); returns each group's exit code."""
    procs = groups.procs
    pending = sorted(lose, key=lambda x: x[1])
    returns: list[tuple[float, int]] = []
    while any(p.poll() is None for p in procs.values()) or returns:
        step = max((_last_step(os.path.join(run_dir, f"replica-{g}")) for g in procs), default=0)
        while pending and step >= pending[0][1]:
            g, _, back = pending.pop(0)
            if groups.lose(g, step, run_dir) and back is not None:
                returns.append((time.time() + back, g))
        for when, g in list(returns):
            if time.time() >= when:
                returns.remove((when, g))
                procs[g] = groups.start(g)
                print(f"launch: replica group {g} back", file=sys.stderr, flush=True)
        time.sleep(0.1)
    return {g: p.wait() for g, p in procs.items()}


def launch_replicas(
    replicas: int,
    nproc: int,
    trainer_args: Sequence[str],
    *,
    max_restarts: int = 0,
    faults: Sequence[str] = (),
    heartbeat_ms: int = 1000,
    lose: Sequence[tuple[int, int, float | None]] = (),
    min_replicas: int = 1,
    join_ms: int = 100,
    group_args: Mapping[int, Sequence[str]] | None = None,
) -> int:
    """FT-HSDP: ``replicas`` groups of ``nproc`` ranks, each under its own elastic agent (a
    process of its own), with a torchft lighthouse; ``faults`` are REPLICA:RANK:STEP[:MODE].
    ``lose`` holds (REPLICA, STEP, BACK_S): once the job logs STEP, that group's agent and ranks
    are SIGKILLed together (a lost node: the others go on, smaller), and BACK_S seconds later
    it is launched again and rejoins (None: it stays away). The job steps only while at least
    ``min_replicas`` groups are in its quorum (a MIN:MAX job of ``min_replicas`` to ``replicas``
    groups). ``group_args`` maps a group to trainer options for it alone, after the shared
    ones (``--parallel.relayout_at 20:tp=2``: that group switches layout in the run). Returns 0
    when every group finished, else 1."""
    group_args = dict(group_args or {})
    if any(not 0 <= g < replicas for g in group_args):
        raise ValueError(
            f"--group-args: a REPLICA below {replicas} expected, got {sorted(group_args)}"
        )
    per_group = _faults_by_group(faults, replicas)
    lighthouse, address = start_lighthouse(
        heartbeat_ms=heartbeat_ms, join_ms=join_ms, min_replicas=min_replicas
    )
    run_dir = _run_dir(trainer_args)
    head = [sys.executable, "-m", forked.LAUNCH]
    head += ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    tail = ["--ft.lighthouse", address, "--ft.min_replicas", str(min_replicas)]
    commands = {
        g: [*head, *trainer_args, *group_args.get(g, ())]
        + ["--ft.replicas", str(replicas), "--ft.replica", str(g), *tail]
        for g in range(replicas)
    }
    groups = _Groups(commands, per_group)
    try:
        codes = _supervise(groups, run_dir, lose)
    finally:
        groups.kill()
        lighthouse.kill()
        lighthouse.wait()
    return 0 if all(c == 0 for c in codes.values()) else 1


def _parser() -> argparse.ArgumentParser:
    """The launcher's options (every other word goes to the trainer)."""
    p = argparse.ArgumentParser(
        prog="python -m anyshard.trainer_integration.gpt.launch",
        description="Run the reference trainer on local ranks under torch's elastic agent, "
        "the ranks forked from a process that has imported torch (warm restarts).",
        epilog="Other options go to the trainer, e.g. --parallel.tp 2 --train.steps 40.",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks to run (default 1)")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="restarts of the group after a failure"
    )
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:0", help="rendezvous HOST:PORT")
    p.add_argument(
        "--start-when",
        metavar="PATH",
        help="import and start the forkserver now, the agent once PATH exists (a relaunch "
        "that follows a running job)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="FT-HSDP: replica groups of --nproc-per-node ranks, each restarted alone (torchft)",
    )
    _replica_options(p)
    return p


def _replica_options(p: argparse.ArgumentParser) -> None:
    """The options of an FT-HSDP job (``--replicas``)."""
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="REPLICA:RANK:STEP[:MODE]",
        help="with --replicas: kill RANK of group REPLICA at STEP; a group's k-th --fault "
        "strikes in its k-th attempt",
    )
    p.add_argument(
        "--lose-group",
        action="append",
        default=[],
        metavar="REPLICA:STEP[:BACK_S]",
        help="with --replicas: SIGKILL group REPLICA's agent and ranks (a lost node) once the "
        "job logs STEP; launch it again BACK_S seconds later",
    )
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="with --replicas: the fewest groups the job steps with (default 1)",
    )
    p.add_argument(
        "--heartbeat-ms",
        type=int,
        default=1000,
        help="with --replicas: the lighthouse drops a group silent this long (default 1000)",
    )
    p.add_argument(
        "--join-ms",
        type=int,
        default=100,
        help="with --replicas: how long a new quorum waits for groups that still heartbeat but "
        "have not asked to join (default 100)",
    )
    p.add_argument(
        "--group-args",
        action="append",
        default=[],
        metavar="REPLICA:OPTIONS",
        help="with --replicas: trainer options for group REPLICA alone, after the shared ones, "
        "e.g. '1:--parallel.relayout_at 20:tp=2' (that group switches layout at step 20)",
    )


def _lost_groups(items: Sequence[str], replicas: int) -> list[tuple[int, int, float | None]]:
    """``--lose-group`` REPLICA:STEP[:BACK_S] items as `launch_replicas`'s ``lose``."""
    lose = []
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not 0 <= int(parts[0]) < replicas:
            raise ValueError(
                f"--lose-group {item!r}: expected REPLICA:STEP[:BACK_S], REPLICA < {replicas}"
            )
        back = float(parts[2]) if len(parts) == 3 else None
        lose.append((int(parts[0]), int(parts[1]), back))
    return lose


def _options_by_group(items: Sequence[str]) -> dict[int, list[str]]:
    """``--group-args`` REPLICA:OPTIONS items as each group's trainer options."""
    per_group: dict[int, list[str]] = {}
    for item in items:
        head, _, rest = item.partition(":")
        if not head.isdigit() or not rest.strip():
            raise ValueError(f"--group-args {item!r}: expected REPLICA:OPTIONS")
        per_group.setdefault(int(head), []).extend(shlex.split(rest))
    return per_group


def _main_replicas(args: argparse.Namespace, trainer_args: list[str]) -> int:
    """An FT-HSDP job of ``args.replicas`` groups (`launch_replicas`)."""
    return launch_replicas(
        args.replicas,
        args.nproc_per_node,
        trainer_args,
        max_restarts=args.max_restarts,
        faults=args.fault,
        heartbeat_ms=args.heartbeat_ms,
        lose=_lost_groups(args.lose_group, args.replicas),
        min_replicas=args.min_replicas,
        join_ms=args.join_ms,
        group_args=_options_by_group(args.group_args),
    )


def _main_group(args: argparse.Namespace, trainer_args: list[str]) -> int:
    """A job of one group (`launch`): 1 where it still fails after its restarts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch(
            args.nproc_per_node,
            trainer_args,
            max_restarts=args.max_restarts,
            rdzv_endpoint=args.rdzv_endpoint,
            start_when=args.start_when,
        )
    except ChildFailedError as e:
        print(f"launch: the trainer failed: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args, trainer_args = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.start_when and args.replicas > 1:
        p.error("--start-when is for a single group")
    if args.replicas > 1:
        try:
            return _main_replicas(args, trainer_args)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            p.error(str(e))
    if args.fault:
        p.error("--fault needs --replicas; set ANYSHARD_FAULT=RANK:STEP for a single group")
    if args.group_args:
        p.error("--group-args needs --replicas; give a single group's options as they are")
    return _main_group(args, trainer_args)


if __name__ == "__main__":
    sys.exit(main())
