"""Validation of the trainer's configuration: every rule a value breaks, with a fix.

The ranges of single values come first, since the rules between values divide by them; whether a
layout splits the model and the batch evenly is the layout chooser's rule (`layout_chooser.valid`),
applied here to the configured layout, its relayout and its heal layout.
"""

from __future__ import annotations

import dataclasses
import os

from anyshard.trainer_integration.gpt.config.schema import (
    FAULT_ENV,
    FAULT_MODES,
    MESH_ORDER,
    SLOW_ENV,
    SLOW_MODES,
    Config,
    ConfigError,
    FaultConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    heal_parallel,
)
from anyshard.trainer_integration.gpt.layout_chooser.valid import (
    batch_problems,
    divisors,
    split_problems,
)

# The interval of each number, checked first: the rules between values divide by them.
_RANGES = {
    "model": {
        **dict.fromkeys(("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"), "[1, inf)"),
        **dict.fromkeys(("ffn_dim", "max_seq_len", "top_k"), "[1, inf)"),
        **dict.fromkeys(("norm_eps", "rope_theta", "init_std"), "(0, inf)"),
        "n_experts": "[0, inf)",
    },
    "parallel": {
        **dict.fromkeys((*MESH_ORDER, "microbatches", "auto_trial_steps"), "[1, inf)"),
        "auto_trials": "[0, inf)",
        "auto_margin": "[0, inf)",
        "auto_memory_gib": "(0, inf)",
    },
    "train": {
        **dict.fromkeys(("steps", "seq_len", "global_batch", "log_every"), "[1, inf)"),
        **dict.fromkeys(("warmup_steps", "weight_decay", "grad_clip", "seed"), "[0, inf)"),
        "min_step_s": "[0, inf)",
        **dict.fromkeys(("beta1", "beta2"), "[0, 1)"),
        "min_lr_ratio": "[0, 1]",
        "lr": "(0, inf)",
    },
    "checkpoint": dict.fromkeys(("every_steps", "keep_last", "max_failures"), "[1, inf)"),
    "fault": {  # None: no fault
        **dict.fromkeys(("kill_rank", "slow_rank", "slow_from", "slow_until"), "[0, inf)"),
        "kill_step": "[1, inf)",
        "slow_factor": "[1, inf)",
    },
    "ft": {
        "replicas": "[1, inf)",
        "replica": "[0, inf)",
        "min_replicas": "[1, inf)",
        "timeout_s": "(0, inf)",
    },
}
_CHOICES = [
    ("parallel", "pp_schedule", ("1F1B", "GPipe")),
    ("parallel", "auto", ("off", "start", "online")),
    ("train", "malloc", ("auto", "lean", "default")),
    ("checkpoint", "storage", ("local", "s3")),
    ("checkpoint", "on_error", ("skip", "raise")),
    ("fault", "mode", FAULT_MODES),
    ("fault", "slow_mode", SLOW_MODES),
]


def _inside(value: float, interval: str) -> bool:
    low, high = (float(x) for x in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    return above and (value <= high if interval[-1] == "]" else value < high)


def _range_problems(cfg: Config) -> list[str]:
    problems = []
    for section, intervals in _RANGES.items():
        for key, interval in intervals.items():
            value = getattr(getattr(cfg, section), key)
            if value is not None and not _inside(value, interval):
                problems.append(f"{section}.{key} must be in {interval}; got {value!r}")
    for section, key, valid in _CHOICES:
        value = getattr(getattr(cfg, section), key)
        if value not in valid:
            problems.append(
                f"{section}.{key} must be one of {', '.join(map(repr, valid))}; got {value!r}"
            )
    return problems


def _model_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.n_heads % m.n_kv_heads:
        problems.append(
            f"model.n_heads ({m.n_heads}) is not divisible by model.n_kv_heads ({m.n_kv_heads}): "
            f"each key/value head serves a group of query heads; set n_kv_heads to one of "
            f"{divisors(m.n_heads)}"
        )
    if m.dim % m.n_heads:
        problems.append(
            f"model.dim ({m.dim}) is not divisible by model.n_heads ({m.n_heads}); "
            f"set n_heads to one of {divisors(m.dim)}"
        )
    elif (m.dim // m.n_heads) % 2:
        problems.append(
            f"the head size model.dim / model.n_heads ({m.dim} / {m.n_heads} = "
            f"{m.dim // m.n_heads}) is odd, and RoPE rotates pairs; make dim / n_heads even"
        )
    if m.vocab_size < 256:
        problems.append(
            f"model.vocab_size ({m.vocab_size}) is below 256, the byte tokenizer's ids; set it >= 256"
        )
    if m.n_experts and m.top_k > m.n_experts:
        problems.append(
            f"model.top_k ({m.top_k}) exceeds model.n_experts ({m.n_experts}); "
            f"set top_k to at most {m.n_experts}"
        )
    return problems


def _fault_problems(f: FaultConfig, p: ParallelConfig, t: TrainConfig) -> list[str]:
    if (f.kill_rank is None) != (f.kill_step is None):
        return [
            f"fault.kill_rank ({f.kill_rank}) and fault.kill_step ({f.kill_step}) must be set "
            f"together; set both (or {FAULT_ENV}=rank:step) or neither"
        ]
    problems = []
    if f.slow_rank is not None and f.slow_rank >= p.world_size:
        problems.append(
            f"fault.slow_rank ({f.slow_rank}) is not a rank of the world of {p.world_size}; "
            f"set it below {p.world_size} ({SLOW_ENV}=rank:factor[:from_step[:until_step]])"
        )
    if f.slow_until is not None and f.slow_until <= f.slow_from:
        problems.append(
            f"fault.slow_until ({f.slow_until}) must come after fault.slow_from ({f.slow_from}); "
            f"set it above {f.slow_from} or leave it out (slow to the end)"
        )
    if f.slow_rank is not None and f.slow_mode == "neighbour":
        if not hasattr(os, "sched_setaffinity"):
            problems.append(
                "fault.slow_mode = 'neighbour' pins each rank to a core (os.sched_setaffinity), "
                "which this platform lacks; use mode 'sleep' or 'compute'"
            )
        if f.slow_factor != round(f.slow_factor) or f.slow_factor < 2:
            problems.append(
                f"fault.slow_factor ({f.slow_factor}) with slow_mode 'neighbour' is the number of "
                f"processes sharing the slow rank's core, itself included: set a whole number >= 2"
            )
    if f.kill_rank is not None and f.kill_rank >= p.world_size:
        problems.append(
            f"fault.kill_rank ({f.kill_rank}) is not a rank of the world of {p.world_size}; "
            f"set it below {p.world_size}"
        )
    if f.kill_step is not None and f.kill_step > t.steps:
        problems.append(
            f"fault.kill_step ({f.kill_step}) is after the last step (train.steps = {t.steps}), "
            f"so it never fires; set it to at most {t.steps}"
        )
    return problems


def config_problems(cfg: Config) -> list[str]:
    """Every rule the config breaks, sorted; the rules between values once the ranges hold."""
    problems = _range_problems(cfg)
    if not problems:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        problems += _model_problems(m) + split_problems(m, p) + batch_problems(m, p, t)
        problems += _fault_problems(cfg.fault, p, t)
        problems += _relayout_problems(cfg)
        problems += _ft_problems(cfg)
    return sorted(problems)


def validate(cfg: Config) -> None:
    """Raise `ConfigError` listing every value that conflicts with another, with a fix.

    >>> validate(Config())
    >>> try:
    ...     validate(Config(model=ModelConfig(n_kv_heads=3)))
    ... except ConfigError as e:
    ...     print(e)  # doctest: +NORMALIZE_WHITESPACE
    invalid configuration:
      - model.n_heads (4) is not divisible by model.n_kv_heads (3): each key/value head
        serves a group of query heads; set n_kv_heads to one of 1, 2, 4
    """
    problems = config_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _ft_problems(cfg: Config) -> list[str]:
    f, p, t = cfg.ft, cfg.parallel, cfg.train
    problems = []
    if f.min_replicas > f.replicas:
        problems.append(
            f"ft.min_replicas ({f.min_replicas}) exceeds ft.replicas ({f.replicas}): the job "
            f"would never step; set it to at most {f.replicas}"
        )
    if f.replica >= f.replicas:
        problems.append(
            f"ft.replica ({f.replica}) is not a group of ft.replicas ({f.replicas}); "
            f"set it below {f.replicas}"
        )
    if f.replicas > 1:
        if p.dp_replicate > 1:
            problems.append(
                f"parallel.dp_replicate ({p.dp_replicate}) and ft.replicas ({f.replicas}) are "
                "both set: under torchft the replica groups are the replicate dimension; set "
                "dp_replicate = 1"
            )
        if t.global_batch % (f.replicas * p.dp_size):
            problems.append(
                f"train.global_batch ({t.global_batch}) is not divisible by ft.replicas * "
                f"the data-parallel degree = {f.replicas} * {p.dp_size}; set it to a multiple "
                f"of {f.replicas * p.dp_size}"
            )
    try:
        heal = heal_parallel(cfg)
    except ConfigError as e:
        text = str(e).replace("parallel.relayout_at '1:", "ft.heal_layout '")
        text = text.replace("STEP:dim=n", "dim=n").replace("e.g. 20:", "e.g. ")
        return problems + [text]
    if heal is not None:
        where = f"ft.heal_layout ({f.heal_layout})"
        if heal.world_size != p.world_size:
            problems.append(
                f"{where} has {heal.world_size} ranks, a group {p.world_size}: torchft reduces "
                "across groups rank by rank, so every group has the same number of ranks"
            )
        if heal != dataclasses.replace(p, relayout_at=None) and max(heal.pp, p.pp) > 1:
            problems.append(
                f"{where} differs from the configured layout and one of them has pipeline "
                f"stages (pp={max(heal.pp, p.pp)}): gradients are averaged across groups of "
                "differing layouts only without pipeline stages; choose both without pp, or "
                "heal into the same layout"
            )
        problems += [
            f"{where}: {x}"
            for x in split_problems(cfg.model, heal) + batch_problems(cfg.model, heal, t)
        ]
    return problems


def _relayout_problems(cfg: Config) -> list[str]:
    try:
        found = cfg.parallel.relayout()
    except ConfigError as e:
        return [str(e)]
    if found is None:
        return []
    step, p = found
    where = f"parallel.relayout_at ({cfg.parallel.relayout_at})"
    problems = []
    if cfg.parallel.auto in ("start", "online") and cfg.ft.replicas == 1:
        problems.append(
            f"{where} and parallel.auto = {cfg.parallel.auto!r} both switch the layout; set "
            "parallel.auto = 'off' to switch at a fixed step, or drop relayout_at"
        )
    if p.world_size != cfg.parallel.world_size:
        problems.append(
            f"{where} has {p.world_size} ranks, the job {cfg.parallel.world_size}: a relayout "
            "keeps the ranks; its degrees must multiply to the same world size"
        )
    if not 0 < step < cfg.train.steps:
        problems.append(f"{where}: the step must lie in [1, train.steps) = [1, {cfg.train.steps})")
    f = cfg.ft
    if f.replicas > 1:  # one group changes layout while the others go on in theirs
        if max(p.pp, cfg.parallel.pp) > 1:
            problems.append(
                f"{where}: under FT-HSDP a group that changes layout averages its gradients "
                f"with groups of another layout, which works only without pipeline stages "
                f"(pp={max(p.pp, cfg.parallel.pp)}); choose both layouts without pp"
            )
        if cfg.train.global_batch % (f.replicas * p.dp_size):
            problems.append(
                f"{where}: train.global_batch ({cfg.train.global_batch}) is not divisible by "
                f"ft.replicas * its data-parallel degree = {f.replicas} * {p.dp_size}; set it "
                f"to a multiple of {f.replicas * p.dp_size}"
            )
    m, t = cfg.model, cfg.train
    problems += [
        f"{where}: {x}"
        for x in split_problems(m, p)
        + batch_problems(m, p, t)
        + _range_problems(dataclasses.replace(cfg, parallel=p))
    ]
    return problems
