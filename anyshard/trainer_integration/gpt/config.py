"""Configuration of the reference GPT trainer: typed sections, a TOML file, command-line overrides.

Precedence, lowest first: the defaults below (sized so a step takes about a second on 2 CPU cores
with 2 to 4 ranks), the TOML file (tables ``[model]``, ``[parallel]``, ``[train]``,
``[checkpoint]``, ``[fault]``, ``[ft]`` and the top-level key ``run_dir``), the overrides
(``--train.steps 10`` or ``--train.steps=10``), and last the environment variable
``ANYSHARD_FAULT="rank:step[:mode]"`` (e.g. ``1:7:sigkill``), which sets the fault to inject
without editing the config, so a test or a shell can crash one run of an unchanged command, and
``ANYSHARD_SLOW="rank:factor[:from_step]"`` (e.g. ``1:2:50``), which makes one rank a straggler.
`Config.validate` checks that the sizes fit the parallel layout, all problems at once.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/gpt/config.py``
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from anyshard.format import storage

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
]

FAULT_ENV = "ANYSHARD_FAULT"
SLOW_ENV = "ANYSHARD_SLOW"
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
_FAULT_MODES = ("sigkill", "raise")


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or conflicts with another."""


# Frozen so a config handed to every rank cannot drift; change one with dataclasses.replace.
# (No slots: on Python 3.10 a frozen dataclass with slots does not unpickle, and spawn pickles.)
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The transformer: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int = 256  # token ids; 256 covers the byte tokenizer
    dim: int = 256  # width of the residual stream
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads; head_dim = dim // n_heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention); divides n_heads
    ffn_dim: int = 768  # hidden size of the SwiGLU MLP (of each expert when n_experts > 0)
    max_seq_len: int = 128  # longest sequence the RoPE tables cover
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    tie_embeddings: bool = False  # share the token embedding with the output projection
    n_experts: int = 0  # 0: a dense MLP; > 0: a mixture of experts in every layer
    top_k: int = 2  # experts each token is routed to, when n_experts > 0
    init_std: float = 0.02  # standard deviation of the normal initialisation of weights


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of the device mesh, one per axis; their product is the world size."""

    pp: int = 1  # pipeline stages; each holds n_layers // pp layers
    dp_replicate: int = 1  # data-parallel replicas (the replicate axis of HSDP)
    dp_shard: int = 1  # data-parallel shards (FSDP2)
    ep: int = 1  # expert parallel: experts split over ep ranks, which also see different data
    cp: int = 1  # context parallel: each sequence split over cp ranks
    tp: int = 1  # tensor parallel: heads and the ffn hidden size split over tp ranks
    pp_schedule: str = "1F1B"  # pipeline schedule: "1F1B" or "GPipe"
    microbatches: int = 2  # microbatches per step on each pipeline, when pp > 1
    # "STEP:dim=n,dim=n": after STEP steps, switch the running job to that layout over the same
    # ranks (dims left out are 1), moving its state over the network (anyshard.redistribute)
    relayout_at: str | None = None
    # "off": train under these degrees (on another number of ranks, an elastic job's, refuse);
    # "start": measure, trial the layouts the cost model predicts faster, switch to the fastest
    # if it pays (`autolayout.Scheduler`), also when the job runs on another number of ranks
    # than these degrees multiply to (it then starts from the model's best); "online": that,
    # then re-plan when step times drift and give a slow data rank a smaller share.
    # true and false (older configs) read as "start" and "off".
    auto: str = "off"
    auto_trials: int = 2  # layouts trialled besides the running one
    auto_trial_steps: int = 3  # steps measured per layout (plus one that warms it up)
    auto_margin: float = 0.25  # a switch must pay back its measured cost x (1 + margin)
    # memory a rank may use (GiB): layouts whose counted parameters, gradients, optimizer state
    # and activations exceed it are never chosen; None: the accelerator's, else this host's
    # memory shared by its ranks
    auto_memory_gib: float | None = None

    def __post_init__(self) -> None:
        legacy = {"true": "start", "false": "off", "yes": "start", "no": "off"}
        mode = str(self.auto).lower()
        object.__setattr__(self, "auto", legacy.get(mode, mode))

    def relayout(self) -> tuple[int, ParallelConfig] | None:
        """The step and layout of ``relayout_at``; `ConfigError` when it does not parse.

        >>> ParallelConfig(pp=2, dp_shard=2, relayout_at="20:tp=2,dp_shard=2").relayout()[1].dims()
        (('pp', 1), ('dp_replicate', 1), ('dp_shard', 2), ('ep', 1), ('cp', 1), ('tp', 2))
        """
        if self.relayout_at is None:
            return None
        text = self.relayout_at.strip()
        try:
            step_text, layout_text = text.split(":", 1)
            sizes = {}
            for item in layout_text.split(","):
                name, value = (x.strip() for x in item.split("="))
                if name not in MESH_ORDER or name in sizes:
                    raise ValueError(name)
                sizes[name] = int(value)
            step = int(step_text)
        except ValueError:
            raise ConfigError(
                f"parallel.relayout_at {text!r}: expected STEP:dim=n[,dim=n...] with dims among "
                f"{', '.join(MESH_ORDER)}, e.g. 20:tp=2,dp_shard=2"
            ) from None
        layout = dataclasses.replace(
            self, **{**dict.fromkeys(MESH_ORDER, 1), **sizes}, relayout_at=None
        )
        return step, layout

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the six degrees."""
        return math.prod(size for _, size in self.dims())

    @property
    def dp_size(self) -> int:
        """The number of ranks that see different data: dp_replicate * dp_shard * ep."""
        return self.dp_replicate * self.dp_shard * self.ep

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The (axis name, degree) pairs in mesh order, outermost first.

        >>> ParallelConfig(dp_shard=2, tp=2).dims()
        (('pp', 1), ('dp_replicate', 1), ('dp_shard', 2), ('ep', 1), ('cp', 1), ('tp', 2))
        """
        return tuple((name, getattr(self, name)) for name in MESH_ORDER)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation: AdamW with linear warmup then cosine decay, over fixed-size batches."""

    steps: int = 30  # optimizer steps of the run
    seq_len: int = 128  # tokens per training sequence
    global_batch: int = 48  # sequences per optimizer step, over all data-parallel ranks
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    warmup_steps: int = 5  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0  # seeds the initialisation and the order of the data
    log_every: int = 1  # log the loss every this many steps
    # the least time a step takes, in seconds (0: no pacing): a small model standing in for a
    # larger one's step time, so that a group's restart lands while the others still train
    min_step_s: float = 0.0
    # how the ranks' C allocator returns freed memory (`gpt.malloc`): "lean" (each freed block
    # of 1 MiB or more at once, so that RSS follows the tensors a memory budget counts),
    # "default" (glibc as it is) or "auto" (lean where parallel.auto_memory_gib is set)
    malloc: str = "auto"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often the trainer saves through `anyshard.trainer_integration.Checkpointer`."""

    root: str = "runs/demo/ckpt"  # directory or URL holding step-NNNNNNNNN checkpoints
    every_steps: int = 5  # save every this many steps
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted
    async_: bool = False  # save in the background while training continues
    # with async_: the staging copy also runs in the background, during forward and backward;
    # only an optimizer step that would modify a tensor not copied yet waits for it
    stage_in_background: bool = True
    local_dir: str | None = None  # tiered mode: save to this local directory, then upload to root
    storage: str = "local"  # "local" (a file system) or "s3" (an S3-compatible object store)
    # a save that fails (a full disk, a storage error): "skip" logs it and trains on, trying
    # again at the next interval, "raise" stops the job
    on_error: str = "skip"
    max_failures: int = 3  # with on_error = "skip": failed saves in a row that stop the job


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """A crash to inject, to test resuming; ANYSHARD_FAULT="rank:step[:mode]" overrides it."""

    kill_rank: int | None = None  # the rank that fails; None injects nothing
    kill_step: int | None = None  # it fails at the start of this step
    mode: str = "sigkill"  # "sigkill" (the process dies at once) or "raise" (an exception)
    only_first_attempt: bool = True  # fail only in the first attempt, not after a restart
    # a straggler (ANYSHARD_SLOW="rank:factor[:from_step]"): from step slow_from on, global rank
    # slow_rank's transformer blocks take slow_factor times their compute time, forward and
    # backward (on CPU its thread's CPU time: waits for other ranks are not compute); it sleeps
    # the difference as each ends, where a slow device's compute would be
    slow_rank: int | None = None
    slow_factor: float = 1.0
    slow_from: int = 0


@dataclass(frozen=True, kw_only=True)
class FtConfig:
    """FT-HSDP on torchft: the job is ``replicas`` replica groups, each its own launch with the
    ``parallel`` layout inside and gradients averaged across groups every step. A group that
    fails restarts alone and heals from a healthy group (`anyshard.redistribute`, any layout)."""

    replicas: int = 1  # replica groups; 1 runs without torchft
    replica: int = 0  # this group's index in [0, replicas) (the launcher sets it)
    min_replicas: int = 1  # the job steps only while at least this many groups take part
    lighthouse: str = ""  # the torchft lighthouse, http://HOST:PORT (the launcher starts one)
    # "dim=n,...": the layout a group takes when it restarts after a fault (same world size),
    # so that it heals into another layout than the healthy groups'
    heal_layout: str | None = None
    timeout_s: float = 30.0  # collectives, quorums and heals across groups
    # a job's first step waits up to this long for every group to be in its quorum (groups that
    # start a little apart otherwise run the first steps short-handed); 0: it does not wait
    wait_all_s: float = 0.0
    # after a step that lost the other of two groups, train its share before the next quorum,
    # while the lighthouse notices the loss (costs one more set of gradients in memory)
    head_start: bool = True
    # log a digest of the whole logical state after each heal (both sides) and at the end:
    # a check that heals are bit-identical; it gathers every tensor
    check_heals: bool = False


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run: the six sections and where the logs go."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    run_dir: str = "runs/demo"  # where logs go

    def validate(self) -> None:
        """Raise `ConfigError` listing every value that conflicts with another, with a fix.

        >>> Config().validate()
        >>> try:
        ...     Config(model=ModelConfig(n_kv_heads=3)).validate()
        ... except ConfigError as e:
        ...     print(e)  # doctest: +NORMALIZE_WHITESPACE
        invalid configuration:
          - model.n_heads (4) is not divisible by model.n_kv_heads (3): each key/value head
            serves a group of query heads; set n_kv_heads to one of 1, 2, 4
        """
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


_SECTIONS = ("model", "parallel", "train", "checkpoint", "fault", "ft")

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
        **dict.fromkeys(("kill_rank", "slow_rank", "slow_from"), "[0, inf)"),
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
    ("fault", "mode", _FAULT_MODES),
]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


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
            f"{_divisors(m.n_heads)}"
        )
    if m.dim % m.n_heads:
        problems.append(
            f"model.dim ({m.dim}) is not divisible by model.n_heads ({m.n_heads}); "
            f"set n_heads to one of {_divisors(m.dim)}"
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


def _split_problems(m: ModelConfig, p: ParallelConfig) -> list[str]:
    """Sizes that a mesh axis splits evenly: layers over pp, heads and ffn over tp, experts over ep."""
    problems = []
    for key, degree, what in [
        ("n_layers", "pp", "each pipeline stage holds the same number of layers"),
        ("n_heads", "tp", "tensor parallelism splits the attention heads"),
        ("n_kv_heads", "tp", "tensor parallelism splits the key/value heads"),
        ("ffn_dim", "tp", "tensor parallelism splits the MLP hidden size"),
    ]:
        size, n = getattr(m, key), getattr(p, degree)
        if size % n:
            problems.append(
                f"model.{key} ({size}) is not divisible by parallel.{degree} ({n}): {what}; "
                f"set {degree} to one of {_divisors(size)} or {key} to a multiple of {n}"
            )
    if p.ep > 1 and m.n_experts == 0:
        problems.append(
            f"parallel.ep ({p.ep}) > 1 needs a mixture of experts, but model.n_experts is 0; "
            f"set n_experts to a multiple of {p.ep}, or ep = 1"
        )
    elif m.n_experts % p.ep:
        problems.append(
            f"model.n_experts ({m.n_experts}) is not divisible by parallel.ep ({p.ep}): each "
            f"expert-parallel rank holds the same number of experts; set n_experts to a "
            f"multiple of {p.ep}"
        )
    return problems


def _batch_problems(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> list[str]:
    problems = []
    if t.global_batch % p.dp_size:
        problems.append(
            f"train.global_batch ({t.global_batch}) is not divisible by the data-parallel degree "
            f"dp_replicate * dp_shard * ep = {p.dp_replicate} * {p.dp_shard} * {p.ep} = "
            f"{p.dp_size}; set global_batch to a multiple of {p.dp_size}"
        )
    elif p.pp > 1 and (t.global_batch // p.dp_size) % p.microbatches:
        local = t.global_batch // p.dp_size
        problems.append(
            f"the per-rank batch global_batch / {p.dp_size} = {local} is not divisible by "
            f"parallel.microbatches ({p.microbatches}) with pp = {p.pp}; set microbatches to "
            f"one of {_divisors(local)}"
        )
    if p.pp > 1 and p.pp_schedule == "1F1B" and p.microbatches < p.pp:
        problems.append(
            f"parallel.microbatches ({p.microbatches}) is below parallel.pp ({p.pp}), which the "
            f"1F1B schedule needs; set microbatches >= {p.pp} or pp_schedule = 'GPipe'"
        )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        problems.append(
            f"train.seq_len ({t.seq_len}) is not divisible by 2 * parallel.cp ({2 * p.cp}): "
            f"context parallelism splits each sequence into 2 * cp balanced chunks; set "
            f"seq_len to a multiple of {2 * p.cp}"
        )
    if t.seq_len > m.max_seq_len:
        problems.append(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            f"set max_seq_len >= {t.seq_len} or a shorter seq_len"
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
            f"set it below {p.world_size} ({SLOW_ENV}=rank:factor[:from_step])"
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


def _problems(cfg: Config) -> list[str]:
    """Every rule the config breaks, sorted; the rules between values once the ranges hold."""
    problems = _range_problems(cfg)
    if not problems:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        problems += _model_problems(m) + _split_problems(m, p) + _batch_problems(m, p, t)
        problems += _fault_problems(cfg.fault, p, t)
        problems += _relayout_problems(cfg)
        problems += _ft_problems(cfg)
    return sorted(problems)


def heal_parallel(cfg: Config) -> ParallelConfig | None:
    """The layout of ``ft.heal_layout`` (dims left out are 1); None when it is not set."""
    if cfg.ft.heal_layout is None:
        return None
    found = dataclasses.replace(cfg.parallel, relayout_at=f"1:{cfg.ft.heal_layout}").relayout()
    return None if found is None else found[1]


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
            for x in _split_problems(cfg.model, heal) + _batch_problems(cfg.model, heal, t)
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
        for x in _split_problems(m, p)
        + _batch_problems(m, p, t)
        + _range_problems(dataclasses.replace(cfg, parallel=p))
    ]
    return problems


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(tp: Any) -> tuple[type, bool]:
    """The scalar type of a field and whether it is optional (``X | None``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0], True) if args else (tp, False)


def _type_name(tp: Any) -> str:
    scalar, optional = _scalar(tp)
    name = {bool: "bool (true or false)"}.get(scalar, scalar.__name__)
    return f"{name} or none" if optional else name


def _parse_text(text: str, tp: Any) -> Any:
    """A command-line value as the field's type; raises ValueError if it is not one."""
    scalar, optional = _scalar(tp)
    word = text.strip().lower()
    if optional and word in ("none", "null"):
        return None
    if scalar is bool:
        if word in ("true", "1", "yes"):
            return True
        if word in ("false", "0", "no"):
            return False
        raise ValueError(text)
    return scalar(text)


def _check_toml(value: Any, tp: Any) -> Any:
    """A TOML value as the field's type (an int is a float too); raises ValueError if not."""
    scalar, _ = _scalar(tp)
    if scalar is float and type(value) in (int, float):
        return float(value)
    if scalar is str and type(value) is bool:  # `auto = true` (validation checks the word)
        return "true" if value else "false"
    if type(value) is not scalar:
        raise ValueError(value)
    return value


def _unknown(where: str, what: str, name: str, valid: Sequence[str], among: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return ConfigError(f"{where}: unknown {what}{hint} {among}: {', '.join(valid)}")


def _field_type(section: str | None, key: str, where: str) -> Any:
    """The type of ``section.key`` (``key`` alone for a top-level key); ConfigError if unknown."""
    cls = Config if section is None else _types(Config)[section]
    types = {k: v for k, v in _types(cls).items() if section is not None or k not in _SECTIONS}
    if key not in types:
        if section is None:
            valid = [*_SECTIONS, *types]
            raise _unknown(
                where, f"section or key {key!r}", key, valid, "valid sections and top-level keys"
            )
        raise _unknown(
            where, f"key {key!r} in [{section}]", key, list(types), f"valid keys of [{section}]"
        )
    return types[key]


def _set(values: dict, section: str | None, key: str, value: Any) -> None:
    (values if section is None else values.setdefault(section, {}))[key] = value


def _apply_toml(values: dict, doc: Mapping[str, Any], source: str) -> None:
    for name, table in doc.items():
        if name not in _SECTIONS:
            _field_type(None, name, source)
            _set(
                values, None, name, _converted(_check_toml, table, None, name, f"{source}: {name}")
            )
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name} must be a table ([{name}]), got {table!r}")
        for key, value in table.items():
            _field_type(name, key, f"{source}: [{name}]")
            where = f"{source}: [{name}] {key}"
            _set(values, name, key, _converted(_check_toml, value, name, key, where))


def _converted(convert, value: Any, section: str | None, key: str, where: str) -> Any:
    tp = _field_type(section, key, where)
    try:
        return convert(value, tp)
    except ValueError:
        default = getattr(Config() if section is None else getattr(Config(), section), key)
        raise ConfigError(
            f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"for example the default, {_toml_value(default) if default is not None else 'none'}"
        ) from None


def _split_overrides(overrides: Sequence[str]) -> list[tuple[str, str | None]]:
    """``--a.b value`` and ``--a.b=value`` as (name, value) pairs; value None when absent."""
    args, pairs, i = list(overrides), [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"expected an override like --train.steps 10 or --train.steps=10, got {arg!r}"
            )
        name, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((name, value))
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((name, args[i + 1]))
            i += 2
        else:
            pairs.append((name, None))
            i += 1
    return pairs


def _apply_overrides(values: dict, overrides: Sequence[str]) -> None:
    for name, text in _split_overrides(overrides):
        section, _, key = name.partition(".") if "." in name else ("", "", name)
        where = f"--{name}"
        if section and section not in _SECTIONS:
            raise _unknown(where, f"section {section!r}", section, _SECTIONS, "valid sections")
        tp = _field_type(section or None, key, where)
        if text is None:  # a bare flag: true for a bool, an error otherwise
            if _scalar(tp)[0] is not bool:
                raise ConfigError(f"{where}: missing value; expected {_type_name(tp)}")
            text = "true"
        value = _converted(_parse_text, text, section or None, key, f"{where} {text}")
        _set(values, section or None, key, value)


def parse_fault_env(text: str) -> dict[str, Any]:
    """The `FaultConfig` fields that ANYSHARD_FAULT="rank:step[:mode]" sets; {} when empty.

    Without a mode the configured one stays.

    >>> parse_fault_env("1:7:sigkill")
    {'kill_rank': 1, 'kill_step': 7, 'mode': 'sigkill'}
    >>> parse_fault_env("0:3")
    {'kill_rank': 0, 'kill_step': 3}
    """
    text = text.strip()
    if not text:
        return {}
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in _FAULT_MODES):
            raise ValueError(text)
        fault: dict[str, Any] = {"kill_rank": int(parts[0]), "kill_step": int(parts[1])}
    except ValueError:
        raise ConfigError(
            f"{FAULT_ENV}={text!r}: expected rank:step[:mode] with mode one of "
            f"{', '.join(_FAULT_MODES)}, e.g. {FAULT_ENV}=1:7:sigkill"
        ) from None
    return fault | ({"mode": parts[2]} if len(parts) == 3 else {})


def parse_slow_env(text: str) -> dict[str, Any]:
    """The `FaultConfig` fields that ANYSHARD_SLOW="rank:factor[:from_step]" sets; {} when empty.

    >>> parse_slow_env("1:2.5:40")
    {'slow_rank': 1, 'slow_factor': 2.5, 'slow_from': 40}
    >>> parse_slow_env("0:2")
    {'slow_rank': 0, 'slow_factor': 2.0}
    """
    text = text.strip()
    if not text:
        return {}
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError(text)
        slow: dict[str, Any] = {"slow_rank": int(parts[0]), "slow_factor": float(parts[1])}
        if len(parts) == 3:
            slow["slow_from"] = int(parts[2])
    except ValueError:
        raise ConfigError(
            f"{SLOW_ENV}={text!r}: expected rank:factor[:from_step] (a global rank, a factor "
            f">= 1, the first slow step), e.g. {SLOW_ENV}=1:2:50"
        ) from None
    return slow


def _build(values: dict) -> Config:
    sections = {name: _types(Config)[name](**values.pop(name, {})) for name in _SECTIONS}
    return Config(**sections, **values)


def loads_config(
    text: str,
    overrides: Sequence[str] = (),
    *,
    source: str = "<string>",
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Like `load_config`, from TOML text; ``source`` names it in error messages.

    >>> loads_config("[train]\\nsteps = 10\\n", ["--parallel.tp=2"], environ={}).train.steps
    10
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    values: dict[str, Any] = {}
    _apply_toml(values, doc, source)
    _apply_overrides(values, overrides)
    environ = os.environ if environ is None else environ
    values.setdefault("fault", {}).update(parse_fault_env(environ.get(FAULT_ENV, "")))
    values["fault"].update(parse_slow_env(environ.get(SLOW_ENV, "")))
    cfg = _build(values)
    cfg.validate()
    return cfg


TINY_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.toml")
"""A shipped configuration a tenth of the default's size (a step in about 0.1 s on 2 CPU
cores), for tests and quick checks: ``load_config(TINY_CONFIG, overrides)``."""


def trainer_config(argv: Sequence[str]) -> tuple[Config, int | None]:
    """The config of the trainer's command line (`train.main`) and its ``--stop-at`` step:
    ``--config FILE``, ``--stop-at N`` and ``--relayout-at STEP:LAYOUT`` (the config's
    ``parallel.relayout_at``) taken out, the other words overrides (`load_config`)."""
    argv, path, stop_at = list(argv), None, None
    for flag in ("--config", "--stop-at", "--relayout-at"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 == len(argv):
                raise ConfigError(f"{flag} needs a value")
            value, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
            if flag == "--config":
                path = value
            elif flag == "--stop-at":
                try:
                    stop_at = int(value)
                except ValueError:
                    raise ConfigError(f"--stop-at {value!r}: expected a step number") from None
            else:
                argv += ["--parallel.relayout_at", value]
    return load_config(path, argv), stop_at


def load_config(
    path: str | None = None,
    overrides: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The defaults, then the TOML file at ``path``, then ``overrides``, then ANYSHARD_FAULT.

    ``overrides`` are command-line words: ``["--parallel.tp", "2", "--train.steps=10"]``;
    ``environ`` defaults to ``os.environ``. Raises `ConfigError` (a ValueError) on an unknown
    key, a value of the wrong type, or values that conflict (see `Config.validate`).

    >>> cfg = load_config(None, ["--parallel.dp_shard", "2", "--checkpoint.async_=yes"], environ={})
    >>> cfg.parallel.world_size, cfg.checkpoint.async_
    (2, True)
    """
    text = "" if path is None else storage.read_bytes(path).decode("utf-8")
    return loads_config(text, overrides, source=path or "<defaults>", environ=environ)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested dicts of JSON values, one per section, plus ``run_dir``."""
    return dataclasses.asdict(cfg)


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # the shortest text that reads back as the same float
    chars = (
        _ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value
    )
    return '"' + "".join(chars) + '"'


def dump_toml(cfg: Config) -> str:
    """The config as TOML that `load_config` reads back equal; None values are left out.

    >>> cfg = Config(train=TrainConfig(steps=10))
    >>> loads_config(dump_toml(cfg), environ={}) == cfg
    True
    >>> print(dump_toml(cfg).splitlines()[0])
    run_dir = "runs/demo"
    """
    values = config_to_dict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in _SECTIONS]
    for name in _SECTIONS:
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in values[name].items() if v is not None]
    return "\n".join(lines) + "\n"
