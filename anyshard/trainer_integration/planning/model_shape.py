"""The shape of a transformer (`ModelShape`) read from a Hugging Face ``config.json``
(`model_shape_from_hf`), and what follows from the shape alone: its parameters
(`parameter_count`), the model FLOPs of one token (`model_flops_per_token`) and the FLOPs of one
iteration as Narayanan et al. count them (`sc21_flops_per_iteration`).

Pure: the step-time model takes a shape and prices it; nothing here reads a file.

    >>> llama = model_shape_from_hf({
    ...     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    ...     "hidden_act": "silu", "tie_word_embeddings": False})
    >>> parameter_count(llama)
    8030261248
    >>> model_flops_per_token(llama, seq=8192) / 1e9
    57.91285248
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ModelShape",
    "model_flops_per_token",
    "model_shape_from_hf",
    "parameter_count",
    "sc21_flops_per_iteration",
]

# `hidden_act` values of a gated MLP (SwiGLU, GeGLU: three matrices) and of the plain two-matrix
# MLP of GPT-2/GPT-3-style models.
GATED_ACTS = frozenset({"silu", "swiglu", "swish", "geglu", "gelu_pytorch_tanh_gated"})
PLAIN_ACTS = frozenset({"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "relu"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer, as far as its cost depends on it.

    ``num_experts == 0`` is a dense model; otherwise every layer's MLP is ``num_experts`` routed
    experts of width ``moe_ffn``, ``top_k`` of them used per token, plus ``num_shared_experts``
    experts every token uses (DeepSeek-style). ``head_dim`` defaults to ``hidden // num_heads``.
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int  # the dense MLP's width (unused when every layer is MoE)
    vocab: int
    gated_mlp: bool = True  # three matrices (gate, up, down) or two (up, down)
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    num_shared_experts: int = 0
    tied_embeddings: bool = False
    head_dim: int | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{name} = {getattr(self, name)!r} (expected a positive int)"
            for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn", "vocab")
            if not _positive_int(getattr(self, name))
        ]
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim is None and not problems and self.hidden % self.num_heads:
            problems.append(
                f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}; "
                "give head_dim"
            )
        if self.head_dim is not None and not _positive_int(self.head_dim):
            problems.append(f"head_dim = {self.head_dim!r} (expected a positive int)")
        problems += _moe_problems(self)
        if problems:
            raise ValueError("bad model shape: " + "; ".join(sorted(problems)))

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (``num_heads x head_dim``)."""
        head_dim = self.head_dim if self.head_dim is not None else self.hidden // self.num_heads
        return self.num_heads * head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (or the value) heads together."""
        return self.q_dim // self.num_heads * self.num_kv_heads


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _moe_problems(s: ModelShape) -> list[str]:
    counts = ("num_experts", "top_k", "moe_ffn", "num_shared_experts")
    bad = [
        f"{name} = {getattr(s, name)!r} (expected an int >= 0)"
        for name in counts
        if not isinstance(getattr(s, name), int) or getattr(s, name) < 0
    ]
    if bad or s.num_experts == 0:
        return bad
    if not 1 <= s.top_k <= s.num_experts:
        bad.append(f"top_k {s.top_k} is not within 1..num_experts ({s.num_experts})")
    if s.moe_ffn <= 0:
        bad.append("moe_ffn = 0 with num_experts > 0 (expected each expert's width)")
    return bad


def model_shape_from_hf(config: Mapping[str, Any]) -> ModelShape:
    """The shape of the model a Hugging Face ``config.json`` (already parsed) describes.

    Reads the LlamaConfig keys (``num_key_value_heads`` defaults to the head count,
    ``tie_word_embeddings`` to false, ``hidden_act`` to silu: a gated MLP; ``gelu`` and
    ``gelu_new`` mean the plain two-matrix MLP of GPT-3-style models) and, for a mixture of
    experts, ``num_local_experts`` (Mixtral) or ``n_routed_experts`` (DeepSeek, with
    ``n_shared_experts``), ``num_experts_per_tok`` and ``moe_intermediate_size`` (Mixtral has
    none: its experts are ``intermediate_size`` wide). Not modelled: DeepSeek's latent attention
    and its leading dense layers (every layer is counted as MoE).

    >>> s = model_shape_from_hf({"hidden_size": 64, "num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 1000,
    ...     "hidden_act": "gelu"})
    >>> s.num_kv_heads, s.gated_mlp
    (4, False)
    >>> model_shape_from_hf({"hidden_size": 64})
    Traceback (most recent call last):
    ...
    ValueError: config.json lacks intermediate_size, num_attention_heads, num_hidden_layers, vocab_size (a LlamaConfig-style config is expected)
    """
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    missing = [k for k in required if config.get(k) is None]
    num_experts = _int_key(config, "num_local_experts", "n_routed_experts", default=0)
    if config.get("intermediate_size") is None and not (
        num_experts and config.get("moe_intermediate_size") is not None
    ):
        missing.append("intermediate_size")
    if missing:
        raise ValueError(
            f"config.json lacks {', '.join(sorted(missing))} "
            "(a LlamaConfig-style config is expected)"
        )
    heads = _int_key(config, "num_attention_heads")
    ffn = _int_key(config, "intermediate_size", "moe_intermediate_size")
    return ModelShape(
        num_layers=_int_key(config, "num_hidden_layers"),
        hidden=_int_key(config, "hidden_size"),
        num_heads=heads,
        num_kv_heads=_int_key(config, "num_key_value_heads", default=heads),
        ffn=ffn,
        vocab=_int_key(config, "vocab_size"),
        gated_mlp=_gated(config),
        num_experts=num_experts,
        top_k=_int_key(config, "num_experts_per_tok", default=0) if num_experts else 0,
        moe_ffn=_int_key(config, "moe_intermediate_size", default=ffn) if num_experts else 0,
        num_shared_experts=_int_key(config, "n_shared_experts", default=0) if num_experts else 0,
        tied_embeddings=_bool_key(config, "tie_word_embeddings", default=False),
        head_dim=_int_key(config, "head_dim", default=0) or None,
    )


def _int_key(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    """The first of ``keys`` present (a null counts as absent), checked to be an int >= 0."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.json key {key} = {value!r} (expected an int >= 0)")
        return value
    assert default is not None, keys  # required keys are checked by the caller
    return default


def _bool_key(config: Mapping[str, Any], key: str, *, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json key {key} = {value!r} (expected true or false)")
    return value


def _gated(config: Mapping[str, Any]) -> bool:
    act = config.get("hidden_act", "silu")
    if act in GATED_ACTS:
        return True
    if act in PLAIN_ACTS:
        return False
    known = ", ".join(sorted(GATED_ACTS | PLAIN_ACTS))
    raise ValueError(f"config.json key hidden_act = {act!r} (expected one of: {known})")


def _layer_matmul_params(s: ModelShape, *, active: bool) -> int:
    """One layer's weight matrices: attention projections, the MLP (the experts a token uses
    when ``active``), the router."""
    attention = s.hidden * (2 * s.q_dim + 2 * s.kv_dim)  # q, o; k, v
    per_mlp = (3 if s.gated_mlp else 2) * s.hidden
    if s.num_experts == 0:
        return attention + per_mlp * s.ffn
    experts = (s.top_k if active else s.num_experts) + s.num_shared_experts
    return attention + per_mlp * s.moe_ffn * experts + s.hidden * s.num_experts


def parameter_count(shape: ModelShape, *, active: bool = False) -> int:
    """Every parameter of the model (only those one token uses, when ``active``).

    Counted: the token embedding, the output head unless tied, each layer's attention
    projections (q, k, v, o), its MLP or experts, the MoE router (``hidden x num_experts``), and
    three norms of ``hidden`` weights each: two per layer (before attention and before the MLP)
    and a final one (RMSNorm, no bias). Not counted: biases (Llama-style models have none; a
    GPT-3-style model's are under 0.1% of it), learned position embeddings (rotary has none).

    >>> tiny = ModelShape(num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, ffn=16, vocab=10)
    >>> # per layer: q, o 8x8 each; k, v 8x4 each; MLP 3x8x16; norms 2x8
    >>> parameter_count(tiny) == 2 * (128 + 64 + 384 + 16) + 2 * 80 + 8
    True
    """
    per_layer = _layer_matmul_params(shape, active=active) + 2 * shape.hidden
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    return shape.num_layers * per_layer + embeddings + shape.hidden


def model_flops_per_token(shape: ModelShape, seq: int) -> int:
    """Model FLOPs of training on one token of a ``seq``-token sequence: forward and backward,
    no recomputation (PaLM's MFU convention, Chowdhery et al. 2022, Appendix B).

    ``6 x N + 12 x num_layers x q_dim x seq``, where N counts the weights a token multiplies:
    each layer's projections, the experts it is routed to (``top_k`` plus shared ones) and the
    router, and the output head (``vocab x hidden``, tied or not); not the embedding lookup nor
    the norms. The second term is attention's two ``seq x seq`` matrix products (scores and the
    weighted sum, 2 x 2 x seq x q_dim FLOPs forward per token and layer, times 3 with backward),
    counted non-causal as PaLM and SC'21 count it: a causal kernel skips about half of them.

    >>> gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24,
    ...                  ffn=4 * 2304, vocab=51200, gated_mlp=False)
    >>> model_flops_per_token(gpt, 2048) * 512 * 2048 == sc21_flops_per_iteration(
    ...     gpt, 512, 2048, recompute=False)
    True
    """
    if not _positive_int(seq):
        raise ValueError(f"seq = {seq!r} (expected a positive int)")
    n = shape.num_layers * _layer_matmul_params(shape, active=True) + shape.vocab * shape.hidden
    return 6 * n + 12 * shape.num_layers * shape.q_dim * seq


def sc21_flops_per_iteration(
    shape: ModelShape, batch: int, seq: int, *, recompute: bool = True
) -> int:
    """FLOPs of one iteration as Narayanan et al. count them (SC'21, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", Eq. 3), for comparing with the
    throughputs of their Table 1, which count the recomputed forward pass.

    With full recomputation (the paper's runs) each layer's forward pass, ``24 B s h^2 +
    4 B s^2 h``, is done four times (forward, recomputation, backward twice), and the logit layer
    adds ``6 B s h V``: ``96 B s l h^2 (1 + s/6h + V/16lh)``. Without it, three times:
    ``72 B s l h^2 (1 + s/6h) + 6 B s h V`` (the logit layer is never recomputed, so its term is
    not ``72 ... V/16lh``). Reads only ``num_layers``, ``hidden`` and ``vocab``: the formula is
    the paper's GPT (plain MLP of width 4h, one key-value head per head, dense); for other
    shapes use `model_flops_per_token`.

    >>> gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24,
    ...                  ffn=4 * 2304, vocab=51200, gated_mlp=False)
    >>> sc21_flops_per_iteration(gpt, batch=512, seq=2048) / 1e15  # SC'21 Table 1, 1.7B row
    15.466830067924992
    """
    for name, value in (("batch", batch), ("seq", seq)):
        if not _positive_int(value):
            raise ValueError(f"{name} = {value!r} (expected a positive int)")
    b, s, l, h, v = batch, seq, shape.num_layers, shape.hidden, shape.vocab  # noqa: E741
    passes = 4 if recompute else 3
    return passes * l * (24 * b * s * h * h + 4 * b * s * s * h) + 6 * b * s * h * v
