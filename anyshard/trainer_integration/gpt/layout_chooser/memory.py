"""What a layout costs in memory per rank: the model's parameters counted from its config,
fp32 parameters, gradients and AdamW's two moments sharded as the layout shards them, the
activations kept for backward, and what a running job holds at most while it switches layout.

>>> from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
>>> state_bytes(Config(), ParallelConfig(dp_shard=2)) * 2 == parameter_count(Config()) * 16
True
"""

from __future__ import annotations

import os

from anyshard.trainer_integration.gpt.config.schema import Config, ParallelConfig

__all__ = [
    "BYTES_PER_PARAMETER",
    "FLOAT",
    "default_budget",
    "memory_per_rank",
    "parameter_count",
    "root_params",
    "state_bytes",
    "switch_memory",
]

FLOAT = 4  # the trainer computes and communicates in fp32

# fp32 parameter, gradient and AdamW's two moments
BYTES_PER_PARAMETER = 16


def parameter_count(cfg: Config) -> int:
    """The model's parameters, from its config (no model is built)."""
    m = cfg.model
    head = m.dim // m.n_heads
    attn = m.dim * m.n_heads * head * 2 + m.dim * m.n_kv_heads * head * 2
    mlp = 3 * m.dim * m.ffn_dim * max(1, m.n_experts) + (m.dim * m.n_experts if m.n_experts else 0)
    layer = attn + mlp + 2 * m.dim
    embed = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    return m.n_layers * layer + embed + m.dim


def default_budget() -> int:
    """Memory one rank may use: the accelerator's, else this host's memory shared by its ranks."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * 0.9)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(total * 0.8 / max(1, local))


def state_bytes(cfg: Config, p: ParallelConfig) -> int:
    """Parameters, gradients and AdamW's two moments per rank, sharded as ``p`` shards them."""
    return parameter_count(cfg) * BYTES_PER_PARAMETER // (p.pp * p.tp * p.dp_shard * p.ep * p.cp)


def root_params(cfg: Config) -> int:
    """Parameters outside the blocks: embeddings, output projection, final norm."""
    m = cfg.model
    return m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim


def memory_per_rank(cfg: Config, p: ParallelConfig) -> int:
    """Bytes a rank holds: fp32 parameters, gradients and AdamW's two moments, sharded as the
    layout shards them; the activations kept for backward (of the microbatches a pipeline
    stage holds at once); the logits; one block gathered whole by FSDP."""
    m, t = cfg.model, cfg.train
    params = parameter_count(cfg)
    state = state_bytes(cfg, p)
    micro = p.microbatches if p.pp > 1 else 1
    tok = t.global_batch // p.dp_size // micro * (t.seq_len // p.cp)
    in_flight = min(micro, p.pp) if p.pp_schedule == "1F1B" and p.pp > 1 else micro
    ffn = m.ffn_dim // p.tp * (m.top_k if m.n_experts else 1)
    per_layer = tok * (10 * m.dim + 4 * ffn + 2 * (m.n_heads // p.tp) * t.seq_len) * FLOAT
    activations = per_layer * (m.n_layers // p.pp) * in_flight
    logits = 3 * tok * m.vocab_size * FLOAT
    gathered = 0
    if p.dp_shard * p.ep * p.cp > 1:
        gathered = 2 * (params - root_params(cfg)) // max(1, m.n_layers) // p.tp * FLOAT
    return int(state + activations + logits + gathered)


def switch_memory(cfg: Config, old: ParallelConfig, new: ParallelConfig) -> int:
    """Bytes a rank holds at most while a running job switches from layout ``old`` to ``new``
    (`train.relayout`): ``old``'s parameters, gradients and AdamW state, kept until the move
    is done; the new layout's model, built whole on every rank before it is sharded, then its
    parameters and AdamW state; and the move's staging buffer (at most
    `redistribute.DEFAULT_MAX_INFLIGHT_BYTES`, nor more than what it moves in). An upper
    bound: the scheduler switches only where it fits the budget.

    >>> from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
    >>> switch_memory(Config(), ParallelConfig(pp=2), ParallelConfig(tp=2)) // 2**20  # MiB
    62
    """
    from anyshard.api.redistribute import DEFAULT_MAX_INFLIGHT_BYTES

    kept = state_bytes(cfg, old)
    held = state_bytes(cfg, new) * (BYTES_PER_PARAMETER - FLOAT) // BYTES_PER_PARAMETER  # no grads
    whole = parameter_count(cfg) * FLOAT
    return int(kept + max(whole, held) + min(DEFAULT_MAX_INFLIGHT_BYTES, held))
