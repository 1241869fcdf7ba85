"""Task functions for the trainer's resume and elasticity tests: run the training loop on the
pool's ranks with a configuration, return this call's global losses."""

from __future__ import annotations

from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
from anyshard.trainer_integration.gpt.train import run


def train(overrides: list[str]) -> list[float]:
    return run(load_config(TINY_CONFIG, overrides))


def train_with_slow_staging(overrides: list[str], delay_s: float) -> list[float]:
    """`train`, with every staging copy of an async save starting ``delay_s`` late: an optimizer
    step that did not wait for the copy would change what the save holds."""
    import time

    from anyshard.api import async_save

    stage = async_save.stage

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return stage(*args, **kwargs)

    async_save.stage = slow
    try:
        return train(overrides)
    finally:
        async_save.stage = stage
