"""Task functions for the reference trainer's parallelism tests: a few optimizer steps on
synthetic token batches under a layout, returning the global losses."""

from __future__ import annotations

import torch

from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
from anyshard.trainer_integration.gpt.train import build_training


def global_batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def losses(overrides: list[str], steps: int = 3) -> list[float]:
    cfg = load_config(TINY_CONFIG, overrides)
    par, _, _, step_fn = build_training(cfg)
    t = cfg.train
    out = []
    per = t.global_batch // par.data_size
    for step in range(steps):
        b = global_batch(step, t.global_batch, t.seq_len, cfg.model.vocab_size)
        mine = b[par.data_rank * per : (par.data_rank + 1) * per]
        out.append(step_fn(mine[:, :-1], mine[:, 1:]))
    return out
