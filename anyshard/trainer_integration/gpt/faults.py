"""Injected faults: which rank dies at which step of which attempt, and the death itself (a
SIGKILL, or an exception), logged in ``run_dir/fault.json`` for the next attempt's ``start``
event to measure its recovery."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

from anyshard.trainer_integration.checkpointer import Checkpointer
from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.events import append, attempt


@dataclasses.dataclass(frozen=True)
class Fault:
    """The fault to inject in this attempt: ``rank`` dies at ``step`` (``mode``: "sigkill" or
    "raise") if ``armed``."""

    rank: int | None
    step: int | None
    mode: str
    armed: bool

    @classmethod
    def planned(cls, cfg: Config) -> Fault:
        """The fault of this attempt.

        ``fault.*`` (or ANYSHARD_FAULT=rank:step[:mode]) strikes on the first attempt only
        (unless ``only_first_attempt`` is false); ANYSHARD_FAULTS="rank:step[:mode],..." is a
        schedule whose k-th entry strikes on attempt k, for runs that fail repeatedly (torchrun
        --max-restarts).
        """
        schedule = os.environ.get("ANYSHARD_FAULTS", "").strip()
        if schedule:
            entries = [e.split(":") for e in schedule.split(",") if e.strip()]
            if attempt() >= len(entries):
                return cls(None, None, "sigkill", False)
            e = entries[attempt()]
            return cls(int(e[0]), int(e[1]), e[2] if len(e) > 2 else "sigkill", True)
        f = cfg.fault
        armed = f.kill_step is not None and (attempt() == 0 or not f.only_first_attempt)
        return cls(f.kill_rank, f.kill_step, f.mode, armed)

    def strike(self, step: int, rank: int, ckpt: Checkpointer, fault_file: str) -> None:
        """Die here if this is the fault's step and rank: log it in ``fault_file``, then SIGKILL
        this process (or raise)."""
        if not (self.armed and step == self.step and rank == self.rank):
            return
        ckpt.wait(collective=False)  # this rank alone: no collective with the others
        append(fault_file, {"time": time.time(), "step": step, "rank": rank, "mode": self.mode})
        if self.mode == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
