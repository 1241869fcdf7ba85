"""The layout chooser of elastic jobs: valid, memory-feasible, close to the configured layout.

Run: python -m pytest tests/unit/test_layouts.py -q
"""

import dataclasses

import pytest

from anyshard.trainer_integration.gpt.config import (
    Config,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    validate,
)
from anyshard.trainer_integration.gpt.layout_chooser.candidates import choose_layout
from anyshard.trainer_integration.gpt.layout_chooser.memory import parameter_count
from anyshard.trainer_integration.gpt.model import build_model


def test_parameter_count_matches_the_built_model():
    for model in (ModelConfig(), ModelConfig(tie_embeddings=True, dim=64, ffn_dim=128)):
        built = build_model(model, 0)
        assert parameter_count(Config(model=model)) == sum(p.numel() for p in built.parameters())


def test_the_configured_layout_is_kept_where_it_fits():
    cfg = Config(parallel=ParallelConfig(dp_shard=2, tp=2))
    choice = choose_layout(cfg, 4, memory_bytes=1 << 30)
    assert choice.parallel == cfg.parallel and "kept it" in choice.reasons


@pytest.mark.parametrize("world", [1, 2, 3, 6, 8])
def test_every_choice_validates_and_keeps_what_it_can(world):
    cfg = Config(
        parallel=ParallelConfig(pp=2, dp_shard=2),
        train=TrainConfig(global_batch=48),
    )
    choice = choose_layout(cfg, world, memory_bytes=1 << 30)
    p = choice.parallel
    assert p.world_size == world
    validate(dataclasses.replace(cfg, parallel=p))  # raises if invalid
    if world % 2 == 0:
        assert p.pp == 2  # the configured pipeline depth survives where it divides the world
    assert "needs 4 ranks" in choice.reasons[0]


def test_memory_rules_out_replication_and_an_impossible_budget_is_explained():
    cfg = Config(parallel=ParallelConfig(dp_replicate=2, dp_shard=2))
    whole = parameter_count(cfg) * 16
    # half the state fits, the whole does not: 2 ranks must shard, not replicate
    choice = choose_layout(cfg, 2, memory_bytes=whole * 3 // 4)
    assert choice.parallel.dp_replicate == 1 and choice.bytes_per_rank <= whole * 3 // 4
    with pytest.raises(ValueError, match="exceeds the .* budget"):
        choose_layout(cfg, 1, memory_bytes=whole // 2)
