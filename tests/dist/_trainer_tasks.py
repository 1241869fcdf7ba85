"""Task functions for the trainer's resume and elasticity tests: run the training loop on the
pool's ranks with a configuration, return this call's global losses."""

from __future__ import annotations

from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
from anyshard.trainer_integration.gpt.train import run


def train(overrides: list[str]) -> list[float]:
    return run(load_config(TINY_CONFIG, overrides))
