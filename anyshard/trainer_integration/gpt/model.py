"""A GPT-style decoder: token embedding, RMSNorm, rotary attention with grouped key/value heads,
a SwiGLU MLP or a mixture of experts with top-k routing, tied or untied output.

Layers live in a ``ModuleDict`` keyed by their global index, so a pipeline stage that keeps only
some of them still names every parameter globally (``layers.5.attention.wq.weight``). The code
reads sizes from the tensors it gets, so the same modules run whole or tensor-parallel (local
heads), with the sequence split over context-parallel ranks (`ParallelContext`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from anyshard._compat import all_gather_single_autograd, all_to_all_single_autograd
from anyshard.trainer_integration.gpt.config import ModelConfig

__all__ = ["GPT", "ParallelContext", "build_model"]


@dataclass
class ParallelContext:
    """What the modules need to know about the parallel layout at run time."""

    cp_group: object = None  # ranks that split the sequence
    cp_rank: int = 0
    cp_size: int = 1
    ep_group: object = None  # ranks that split the experts
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: object = None  # ranks that split each expert's hidden dim (tensor parallel)
    tp_size: int = 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, seq, heads, head_dim] at ``positions`` [seq]."""
    hd = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = positions.float()[:, None] * freqs[None, :]  # [seq, hd/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.theta = cfg.rope_theta
        self.ctx = ctx
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        q = self.wq(x).view(b, s, -1, hd)  # local heads under tensor parallelism
        k = self.wk(x).view(b, s, -1, hd)
        v = self.wv(x).view(b, s, -1, hd)
        ctx = self.ctx
        positions = torch.arange(s) + ctx.cp_rank * s
        q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
        if ctx.cp_size > 1:  # context parallel: every rank attends to the keys of all chunks
            k = _gather_seq(k, ctx)
            v = _gather_seq(v, ctx)
        k_pos = torch.arange(k.shape[1])
        mask = positions[:, None] >= k_pos[None, :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, seq, hd]
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _gather_seq(t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """All chunks of the sequence, in order, with gradients flowing back to their owners."""
    # gathers along dim 0; move the sequence there and back
    seq_first = t.transpose(0, 1).contiguous()
    full = all_gather_single_autograd(seq_first, gather_dim=0, group=ctx.cp_group)
    return full.transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """``n`` SwiGLU experts stacked: w1, w3 [n, hidden, dim], w2 [n, dim, hidden]. Under
    expert parallelism the parameters are DTensors sharded on dim 0 over the ep mesh dim."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))

    def local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for w in (self.w1, self.w2, self.w3):
            out.append(w.to_local() if hasattr(w, "to_local") else w)
        return tuple(out)

    def run(self, x: torch.Tensor, expert: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Each row of ``x`` through its local expert ``expert - first``."""
        w1, w2, w3 = self.local()
        # x * 0, not zeros: the output stays connected to x (and to the weights) even when
        # this rank received no token for its experts, so that every rank runs the same
        # backward collectives (the all-to-alls' backward) in the same order
        out = x * 0 + 0 * (w1.sum() + w2.sum() + w3.sum())
        for e in range(count):
            rows = (expert == first + e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            h = x[rows]
            y = (F.silu(h @ w1[e].t()) * (h @ w3[e].t())) @ w2[e].t()
            out = out.index_put((rows,), y)
        return out


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradients of the tensor-parallel ranks (each saw
    only its slice of the experts' hidden dim): Megatron's "f"."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sums the tensor-parallel ranks' partial outputs; backward is the identity (every rank
    gets the whole gradient): Megatron's "g"."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MoE(nn.Module):
    """Top-k routing over ``n_experts`` SwiGLU experts; with expert parallelism, tokens travel
    to the rank holding their expert and back by all-to-all. Under tensor parallelism every
    rank routes the same (whole) tokens and holds a slice of each expert's hidden dim: the
    experts' partial outputs are summed over the tp ranks before they are weighted."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        super().__init__()
        self.n_experts, self.top_k, self.ctx = cfg.n_experts, cfg.top_k, ctx
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        w = self.router.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # replicated over tp
        probs = F.softmax(F.linear(tokens, w).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        flat_expert = chosen.reshape(-1)  # [tokens * k]
        tp = self.ctx.tp_size > 1
        rows = (_CopyToTP.apply(tokens, self.ctx.tp_group) if tp else tokens).repeat_interleave(
            self.top_k, dim=0
        )
        if self.ctx.ep_size == 1:
            out = self.experts.run(rows, flat_expert, 0, self.n_experts)
        else:
            out = self._dispatch(rows, flat_expert)
        if tp:
            out = _ReduceFromTP.apply(out, self.ctx.tp_group)
        out = (out.view(-1, self.top_k, shape[-1]) * weights[..., None]).sum(1)
        return out.view(shape)

    def _dispatch(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        ctx = self.ctx
        per_rank = self.n_experts // ctx.ep_size
        dest = expert // per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=ctx.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ctx.ep_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        their_expert = torch.empty(sum(recv), dtype=expert.dtype)
        dist.all_to_all_single(
            their_expert, expert[order].contiguous(), recv, send, group=ctx.ep_group
        )
        their_rows = all_to_all_single_autograd(rows[order].contiguous(), recv, send, ctx.ep_group)
        done = self.experts.run(their_rows, their_expert, ctx.ep_rank * per_rank, per_rank)
        back = all_to_all_single_autograd(done, send, recv, ctx.ep_group)
        return torch.empty_like(back).index_put((order,), back)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, ctx)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg, ctx) if cfg.n_experts else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it (``tok_embeddings``, ``norm`` and
    ``output`` are None where the stage lacks them)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None):
        super().__init__()
        ctx = ctx or ParallelContext()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(cfg, ctx) for i in range(cfg.n_layers)}
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def keep_stage(self, stage: int, stages: int) -> None:
        """Keep only the layers of pipeline ``stage`` (of ``stages``, split evenly), the
        embedding on the first stage and the norm and output on the last."""
        per = self.cfg.n_layers // stages
        keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
        for name in list(self.layers):
            if name not in keep:
                del self.layers[name]
        if stage != 0:
            self.tok_embeddings = None
        if stage != stages - 1:
            self.norm = None
            self.output = None


@torch.no_grad()
def _init(model: GPT, cfg: ModelConfig, seed: int) -> None:
    """Deterministic initialisation of the whole model, the same on every rank and layout."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            p.normal_(0.0, cfg.init_std / math.sqrt(2 * cfg.n_layers), generator=g)
        else:
            p.normal_(0.0, cfg.init_std, generator=g)


def build_model(cfg: ModelConfig, seed: int, ctx: ParallelContext | None = None) -> GPT:
    """The full model, initialised from ``seed`` (parallelise it afterwards)."""
    model = GPT(cfg, ctx)
    _init(model, cfg, seed)
    return model
