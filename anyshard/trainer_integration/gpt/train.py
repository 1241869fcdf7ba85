"""The reference training loop: any layout, checkpoints through anyshard, faults and restarts.

Launch with torchrun (one process per rank; gloo on CPU, nccl on CUDA)::

    torchrun --nproc-per-node 4 --max-restarts 1 -m anyshard.trainer_integration.gpt.train \\
        --parallel.dp_shard 2 --parallel.tp 2 --train.steps 20 [--stop-at 10] [--config FILE] \\
        [--relayout-at 10:tp=4]

Each run restores the newest committed checkpoint under ``checkpoint.root`` (whatever layout
saved it), trains to ``train.steps`` and saves every ``checkpoint.every_steps``. A fault
(``fault.kill_rank`` at ``fault.kill_step``, or ANYSHARD_FAULT=rank:step[:mode]) kills a rank
with SIGKILL (or raises) on the first attempt; torchrun restarts the group, which resumes. Rank 0
appends one JSON line per step to ``run_dir/losses.jsonl`` and one per (re)start to
``run_dir/events.jsonl`` (restored step, recovery time, lost steps). ``--relayout-at STEP:LAYOUT``
(``parallel.relayout_at``) switches the running job to another layout over the same ranks after
STEP steps, moving its state over the network with no checkpoint round trip.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from anyshard._compat import REDISTRIBUTE_LOGGER
from anyshard.trainer_integration.gpt.config import Config, trainer_config
from anyshard.trainer_integration.gpt.relayout import relayout
from anyshard.trainer_integration.gpt.state import TrainState, build_training
from anyshard.trainer_integration.gpt.trainer import Trainer

__all__ = ["TrainState", "build_training", "init_distributed", "main", "relayout", "run"]


def init_distributed() -> None:
    """Join the process group that torchrun describes, in a store namespace of its own per
    restart attempt (a restarted group must not meet the keys of the one it replaces)."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"anyshard-attempt-{attempt}/", store),
        rank=rank,
        world_size=world,
    )


def run(cfg: Config, *, max_steps: int | None = None, stop_at: int | None = None) -> list[float]:
    """Train (restoring first) until ``cfg.train.steps`` (or step ``stop_at``, for a job that is
    to be relaunched: the LR schedule still spans ``cfg.train.steps``), for at most ``max_steps``
    steps of this call; returns this call's losses. torch.distributed must be initialised if
    the layout has more than one rank."""
    return Trainer(cfg, max_steps=max_steps, stop_at=stop_at).run()


def _quiet() -> None:
    """Keep torch's advice about its own internals out of the training log."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*flattened dim.*")
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None, *, hard_exit: bool = True) -> int:
    """``python -m anyshard.trainer_integration.gpt.train [--config FILE] [--stop-at N]
    [--relayout-at STEP:LAYOUT] [--section.key value ...]``"""
    cfg, stop_at = trainer_config(list(sys.argv[1:] if argv is None else argv))
    _quiet()
    init_distributed()
    try:
        run(cfg, stop_at=stop_at)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if hard_exit and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # Under torchrun, leave without interpreter finalization: gloo's worker threads can
        # abort a process there after a clean run (pytorch#179291), which torchrun would take
        # for a failure and restart the group.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
