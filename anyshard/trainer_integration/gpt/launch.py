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
HOST:PORT`` (default: a free port on 127.0.0.1); every other word goes to the trainer
(``--config``, ``--stop-at``, ``--section.key value``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import uuid
from collections.abc import Sequence

__all__ = ["PRELOAD", "launch", "main"]

# imported once by the forkserver, so that a rank (and a restarted rank) starts with them
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch._dynamo",
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
) -> None:
    """Run the trainer on ``nproc`` local ranks; raises torch's ``ChildFailedError`` when the
    group still fails after ``max_restarts`` restarts."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multiprocessing.set_forkserver_preload(list(PRELOAD))
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


def main(argv: Sequence[str] | None = None) -> int:
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
    args, trainer_args = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch(
            args.nproc_per_node,
            trainer_args,
            max_restarts=args.max_restarts,
            rdzv_endpoint=args.rdzv_endpoint,
        )
    except ChildFailedError as e:
        print(f"launch: the trainer failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
