"""Configuration of the reference GPT trainer: typed sections, a TOML file, command-line overrides.

Precedence, lowest first: the defaults (`schema`, sized so a step takes about a second on 2 CPU
cores with 2 to 4 ranks), the TOML file (tables ``[model]``, ``[parallel]``, ``[train]``,
``[checkpoint]``, ``[fault]``, ``[ft]`` and the top-level key ``run_dir``), the overrides
(``--train.steps 10`` or ``--train.steps=10``), and last the environment variable
``ANYSHARD_FAULT="rank:step[:mode]"`` (e.g. ``1:7:sigkill``), which sets the fault to inject
without editing the config, so a test or a shell can crash one run of an unchanged command, and
``ANYSHARD_SLOW="rank:factor[:from_step[:until_step]][:mode]"`` (e.g. ``1:2:50`` or
``1:2:15:40:neighbour``), which makes one rank a straggler (modes: `schema.SLOW_MODES`)
(`parsing`). `validate` checks that the sizes fit the parallel layout, all problems at
once (`checks`).

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/gpt/config/``
"""

from anyshard.trainer_integration.gpt.config.checks import validate
from anyshard.trainer_integration.gpt.config.parsing import (
    TINY_CONFIG,
    config_to_dict,
    dump_toml,
    load_config,
    loads_config,
    parse_fault_env,
    trainer_config,
)
from anyshard.trainer_integration.gpt.config.schema import (
    FAULT_ENV,
    MESH_ORDER,
    CheckpointConfig,
    Config,
    ConfigError,
    FaultConfig,
    FtConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    heal_parallel,
)

__all__ = [
    "FAULT_ENV",
    "MESH_ORDER",
    "TINY_CONFIG",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "FaultConfig",
    "FtConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_to_dict",
    "dump_toml",
    "heal_parallel",
    "load_config",
    "loads_config",
    "parse_fault_env",
    "trainer_config",
    "validate",
]
