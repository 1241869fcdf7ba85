"""The trainer's configuration as typed sections: one frozen dataclass per TOML table.

Validation of the values against each other is in `checks` (`checks.validate` runs it), reading
and writing TOML in `parsing`.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/gpt/config/``
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

FAULT_ENV = "ANYSHARD_FAULT"
SLOW_ENV = "ANYSHARD_SLOW"
# how ANYSHARD_SLOW makes its rank slow (`FaultConfig.slow_mode`)
SLOW_MODES = ("sleep", "compute", "data", "neighbour")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
FAULT_MODES = ("sigkill", "raise")


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
    # if it pays (`layout_chooser.scheduler.Scheduler`), also when the job runs on another number of ranks
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
    # pin each rank to a core of its own (the local rank's of the cores it may run on), as a
    # job with a device per rank has; a "neighbour" straggler (fault.slow_mode) pins them too
    pin_cores: bool = False


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
    # a straggler (ANYSHARD_SLOW="rank:factor[:from_step[:until_step]][:mode]"): from step
    # slow_from until step slow_until (None: to the end), global rank slow_rank runs slow_factor
    # times slower, the way slow_mode says (`SLOW_MODES`, docs/trainer.md): "sleep", its
    # transformer blocks sleep (factor - 1) times their compute as each forward and backward
    # ends, and after loading its batch it sleeps (factor - 1) times its work outside the blocks
    # in the step before; "compute", the same amounts computed for real (extra multiplies);
    # "data", its data loading takes (factor - 1) times its whole own work of the step before;
    # "neighbour", every rank is pinned to a core of its own and factor - 1 busy processes
    # share the slow rank's core
    slow_rank: int | None = None
    slow_factor: float = 1.0
    slow_from: int = 0
    slow_until: int | None = None
    slow_mode: str = "sleep"


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


def heal_parallel(cfg: Config) -> ParallelConfig | None:
    """The layout of ``ft.heal_layout`` (dims left out are 1); None when it is not set."""
    if cfg.ft.heal_layout is None:
        return None
    found = dataclasses.replace(cfg.parallel, relayout_at=f"1:{cfg.ft.heal_layout}").relayout()
    return None if found is None else found[1]
