"""The run's logs and the measures they carry: rank 0 appends one JSON line per step to
``run_dir/losses.jsonl`` and one per event (start, relayout, heal, save failure, end, ...) to
``run_dir/events.jsonl``; the restart attempt, the layout's name, and the RSS figures of the
``memory`` and ``end`` events."""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

from anyshard.trainer_integration.checkpointer import Checkpointer
from anyshard.trainer_integration.gpt.config import Config


def attempt() -> int:
    """Which attempt of the group this is (torchrun's restart count; 0 at first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def layout_name(cfg: Config) -> str:
    p = cfg.parallel
    parts = [f"{d}={getattr(p, d)}" for d in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")]
    return " ".join(x for x in parts if not x.endswith("=1")) or "single"


def _since_process_start(now: float) -> float | None:
    """Seconds from this process's start (Linux's /proc) to ``now``; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return now - (boot + ticks / os.sysconf("SC_CLK_TCK"))


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def log_event(run_dir: str, record: dict) -> None:
    """Append ``record`` to the run's ``events.jsonl``."""
    append(os.path.join(run_dir, "events.jsonl"), record)


def status_bytes(field: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in bytes; -1 where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":")), -1)
    except OSError:
        return -1


def rss_mark() -> int:
    """This process's RSS now, its peak reset to it (/proc/self/clear_refs); -1 where the
    kernel keeps either from us, so that the memory event is not logged."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return status_bytes("VmRSS")


def start_event(layout: str, restored, times: tuple, chosen, fault_file: str) -> dict:
    """The ``start`` event, logged at the first step: ``times`` is (the run's start, the
    seconds building the model took, the seconds restoring took); a fault the previous
    attempt logged in ``fault_file`` gets its recovery time and lost steps (and is marked
    recovered)."""
    started, build_s, restore_s = times
    event = {
        "event": "start",
        "layout": layout,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "attempt": attempt(),
        "time": time.time(),
        "pid": os.getpid(),
        "restored_step": restored,
        "startup_to_first_step_s": time.time() - started,
        # where a start goes: process start to `run` (imports, process group), building the
        # model, restoring the checkpoint
        "process_to_run_s": _since_process_start(started),
        "build_s": build_s,
        "restore_s": restore_s,
    }
    if chosen is not None:
        event["layout_reasons"] = list(chosen.reasons)
    if os.path.exists(fault_file):
        last = [json.loads(x) for x in open(fault_file)][-1]
        if last["time"] < started + 1e-9 and not last.get("recovered"):
            event["recovery_s"] = time.time() - last["time"]
            event["lost_steps"] = last["step"] - (restored or 0)
            append(fault_file, {**last, "recovered": True, "time": last["time"]})
    return event


def log_failed_saves(cfg: Config, ckpt: Checkpointer, rank: int) -> None:
    """Rank 0 prints and logs (a ``save_failed`` event) each checkpoint save the Checkpointer
    skipped (``checkpoint.on_error = "skip"``) since the last call."""
    new, ckpt.failures = ckpt.failures, []
    for f in new if rank == 0 else ():
        print(
            f"checkpoint of step {f['step']} failed, training goes on and the next save tries "
            f"again (checkpoint.max_failures = {cfg.checkpoint.max_failures} in a row stop the "
            f"job): {f['error']}",
            flush=True,
        )
        log_event(cfg.run_dir, {"event": "save_failed", **f})
