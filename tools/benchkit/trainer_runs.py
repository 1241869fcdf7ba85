"""The reference trainer run as a benchmark's job: `train` launches it (its launcher or torchrun,
faults injected through ANYSHARD_FAULTS) and returns the harness's counters of the job with the
losses, events and faults it logged and the rank processes seen; `step_times` of its losses.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from .measure import run_process
from .stats import median


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of ``path`` ([] where it is missing)."""
    return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []


def step_times(losses: list[dict]) -> list[float]:
    """Seconds between consecutive steps of one attempt, from a ``losses.jsonl``."""
    return [b["time"] - a["time"] for a, b in zip(losses, losses[1:], strict=False)
            if a.get("attempt") == b.get("attempt") and b["step"] == a["step"] + 1]  # fmt: skip


def median_step(run: dict) -> float:
    return median(step_times(run["losses"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWatch(threading.Thread):
    """Samples this process's descendants every 0.1 s for the trainer's rank processes (forked
    by a multiprocessing forkserver, or the trainer module under torchrun): ``seen`` maps each
    to [first seen, last seen, the pid of the process that started it]."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen, self.stop = {}, threading.Event()

    def _walk(self, pid: str, up: tuple[bytes, bytes, str]) -> None:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            born = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
            kids = [c for t in os.listdir(f"/proc/{pid}/task") for c in
                    open(f"/proc/{pid}/task/{t}/children").read().split()]  # fmt: skip
        except OSError:
            return
        forked = b"forkserver" in cmd and b"forkserver" in up[0] and b"forkserver" not in up[1]
        if forked or (b"-m\0anyshard.trainer_integration.gpt.train" in cmd
                      and b"torch.distributed.run" not in cmd):  # fmt: skip
            self.seen.setdefault((pid, born), [time.time(), 0.0, up[2]])[1] = time.time()
        for kid in kids:
            self._walk(kid, (cmd, up[0], pid))

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self._walk(str(os.getpid()), (b"", b"", ""))


def train(run_dir: str, args: list[str], *, nproc: int, restarts: int = 0, faults: str = "",
          launcher: str = "warm") -> dict:  # fmt: skip
    """Run the reference trainer, ``nproc`` ranks (per replica group with ``--replicas``), and
    ``args`` (launcher and trainer options); ``faults``: ANYSHARD_FAULTS. The harness's counters
    of the job (`benchkit.run_process`), rank 0's losses and events (of the group that logged
    the most steps), the faults logged and the rank processes seen (`RankWatch`)."""
    cmd = [sys.executable, "-m", "anyshard.trainer_integration.gpt.launch"]
    if launcher == "torchrun":
        cmd[2:] = ["torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]  # fmt: skip
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", str(restarts)]
    cmd += ["-m", "anyshard.trainer_integration.gpt.train"] if launcher == "torchrun" else []
    cmd += ["--run_dir", run_dir, "--checkpoint.root", os.path.join(run_dir, "ckpt"), *args]
    os.environ.pop("ANYSHARD_FAULT", None)
    os.environ.update(OMP_NUM_THREADS="1", ANYSHARD_FAULTS=faults)
    os.makedirs(run_dir, exist_ok=True)
    watch = RankWatch()
    watch.start()
    try:
        run = run_process(cmd, run_dir + ".log")
    finally:
        watch.stop.set()
        watch.join()
    if run["rc"] != 0:  # the first error lines of the whole log (a rank's), then its tail
        with open(run_dir + ".log", errors="replace") as f:
            why = [ln for ln in f if any(k in ln for k in ("what()", "Error", "Fatal"))][:20]
        raise SystemExit(f"{' '.join(cmd)} failed ({run['rc']}):\n{''.join(why)}{run['log']}")
    dirs = (run_dir, *(os.path.join(run_dir, f"replica-{g}") for g in (0, 1)))
    logs = {d: read_jsonl(os.path.join(d, "losses.jsonl")) for d in dirs}
    base = max(dirs, key=lambda d: len(logs[d]))  # a fault-free group may finish the job alone
    faults = [x for d in dirs for x in read_jsonl(os.path.join(d, "fault.json"))]
    run.pop("log")
    return {**run, "losses": logs[base], "events": read_jsonl(os.path.join(base, "events.jsonl")),
            "faults": sorted((x for x in faults if not x.get("recovered")), key=lambda x: x["time"]),
            "ranks": sorted(watch.seen.values())}  # fmt: skip
