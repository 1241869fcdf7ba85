"""Whether a layout is valid for the trainer's model and batch: the mesh splits every size it
splits evenly, and the batch divides over the data-parallel ranks, the microbatches and the
context-parallel chunks. `config.validate` applies these rules to the configured layout
(`config.checks`), `candidates.candidate_layouts` to every layout of a world.

>>> from anyshard.trainer_integration.gpt.config import ModelConfig, ParallelConfig
>>> split_problems(ModelConfig(), ParallelConfig(tp=2))
[]
>>> split_problems(ModelConfig(), ParallelConfig(pp=3))[0].split(":")[0]
'model.n_layers (4) is not divisible by parallel.pp (3)'
"""

from __future__ import annotations

from anyshard.trainer_integration.gpt.config.schema import ModelConfig, ParallelConfig, TrainConfig

__all__ = ["batch_problems", "divisors", "split_problems"]


def divisors(n: int) -> str:
    """The divisors of ``n``, as a fix offers them.

    >>> divisors(12)
    '1, 2, 3, 4, 6, 12'
    """
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def split_problems(m: ModelConfig, p: ParallelConfig) -> list[str]:
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
                f"set {degree} to one of {divisors(size)} or {key} to a multiple of {n}"
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


def batch_problems(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> list[str]:
    """What keeps the batch from splitting over ``p``: the data-parallel degree, the microbatches
    of a pipeline, the chunks of context parallelism, and the model's longest sequence."""
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
            f"one of {divisors(local)}"
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
