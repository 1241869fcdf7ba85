"""Every parallelism of the reference trainer, composed on one DeviceMesh.

Mesh dims, slowest first: ``pp, dp_replicate, dp_shard, ep, cp, tp`` (size-1 dims included).

- **dp_shard** (with **ep** and **cp**, whose ranks also see different tokens): FSDP2
  ``fully_shard`` of every block and of the root, over those dims flattened into one; with
  **dp_replicate**, HSDP on the 2-D mesh (dp_replicate, that flattened dim).
- **tp**: DTensor tensor parallelism, column-parallel wq/wk/wv/w1/w3/output, row-parallel
  wo/w2, vocabulary-parallel embedding, sequence parallel for the norms.
- **pp**: torch.distributed.pipelining, layers split evenly over stages, GPipe or 1F1B.
- **cp**: the sequence split over ranks; keys and values gathered with autograd-aware
  collectives (torch's ``context_parallel`` has no CPU kernels).
- **ep**: experts sharded over ep ranks (DTensor ``Shard(0)``), tokens dispatched by all-to-all.
  With tp, each expert is also split along its hidden dim over tp (the router replicated):
  every tp rank routes the same tokens and the partial expert outputs are summed over tp.

Every rank builds the whole model from one seed, then keeps and shards its part, so all layouts
start from the same logical weights.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from anyshard._compat import clear_dtensor_sharding_cache, flatten_mesh
from anyshard.trainer_integration.gpt.config import ModelConfig, ParallelConfig
from anyshard.trainer_integration.gpt.model import GPT, MoE, ParallelContext, build_model

__all__ = ["Parallel", "TrainStep", "build", "setup_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass
class Parallel:
    """The layout of this rank: mesh, coordinates and the groups the trainer uses."""

    cfg: ParallelConfig
    mesh: object  # DeviceMesh over MESH_DIMS
    coords: dict[str, int]
    ctx: ParallelContext = field(default_factory=ParallelContext)

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that see different samples (dp x ep)."""
        c, p = self.coords, self.cfg
        return (c["dp_replicate"] * p.dp_shard + c["dp_shard"]) * p.ep + c["ep"]

    @property
    def data_size(self) -> int:
        return self.cfg.dp_replicate * self.cfg.dp_shard * self.cfg.ep

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.cfg.pp - 1


def forget_cached_placements() -> None:
    """Empty DTensor's cache of each op's output placements.

    torch keys that cache by the input meshes' values, so once a process has built a second
    mesh hierarchy (a relayout, a restart in the same process), an op on a new DTensor (detach,
    zeros_like) can return one on an equal submesh of the older hierarchy, whose root is the
    older root (torch 2.13). anyshard describes a tensor through its mesh's root, and the older
    root places it wrongly: the trainer empties the cache whenever it builds a mesh and, once
    it has built more than one (`forget_older_placements`), before it takes DCP's state dict."""
    clear_dtensor_sharding_cache()


_meshes_built = 0  # mesh hierarchies `setup_mesh` has built in this process


def forget_older_placements() -> None:
    """`forget_cached_placements`, where this process has built more than one mesh hierarchy
    (and ops on the older one may have filled the cache since). With one hierarchy, emptying
    the cache costs the next op on every DTensor its placement propagation again (DCP's state
    dict took 6-15 ms instead of 2-6 ms, 4 ranks on 2 cores) and saves nothing."""
    if _meshes_built > 1:
        forget_cached_placements()


def setup_mesh(pcfg: ParallelConfig) -> Parallel:
    """The world DeviceMesh (torch.distributed must be initialised with the right world size)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = tuple(getattr(pcfg, d) for d in MESH_DIMS)
    if not dist.is_initialized() and math.prod(sizes) == 1:  # a single process: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if math.prod(sizes) != world:
        raise ValueError(
            f"the parallel degrees {dict(zip(MESH_DIMS, sizes, strict=True))} multiply to "
            f"{math.prod(sizes)}, but {world} processes run; launch that many (torchrun "
            "--nproc-per-node) or change the degrees"
        )
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=MESH_DIMS)
    global _meshes_built
    _meshes_built += 1
    forget_cached_placements()
    coords = {d: mesh[d].get_local_rank() for d in MESH_DIMS}
    par = Parallel(pcfg, mesh, coords)
    if pcfg.cp > 1:
        par.ctx.cp_group, par.ctx.cp_rank, par.ctx.cp_size = (
            mesh["cp"].get_group(),
            coords["cp"],
            pcfg.cp,
        )
    if pcfg.tp > 1:
        par.ctx.tp_group, par.ctx.tp_size = mesh["tp"].get_group(), pcfg.tp
    if pcfg.ep > 1:
        par.ctx.ep_group, par.ctx.ep_rank, par.ctx.ep_size = (
            mesh["ep"].get_group(),
            coords["ep"],
            pcfg.ep,
        )
    return par


def _fsdp_mesh(par: Parallel):
    """The mesh FSDP shards over: (dp_shard, ep, cp) flattened, with dp_replicate for HSDP.
    Replicas alone (no dim to shard over) are HSDP over (dp_replicate, dp_shard of size 1):
    every rank holds the whole state and gradients are all-reduced; a 1-D mesh of
    dp_replicate would make FSDP shard the state over the replicas instead."""
    shard_dims = tuple(d for d in ("dp_shard", "ep", "cp") if getattr(par.cfg, d) > 1)
    mesh = par.mesh
    if len(shard_dims) > 1:
        name = "_".join(shard_dims)
        flat = flatten_mesh(mesh[shard_dims], name)
        if par.cfg.dp_replicate == 1:
            return flat
        shard_dims = (name,)
    if par.cfg.dp_replicate > 1 and not shard_dims:
        shard_dims = ("dp_shard",)  # of size 1
    dims = (("dp_replicate",) if par.cfg.dp_replicate > 1 else ()) + shard_dims
    if not dims:
        return None
    with warnings.catch_warnings():  # a 2-D (replicate, flattened shard) mesh for HSDP
        warnings.simplefilter("ignore", UserWarning)
        return mesh[dims]


def _tensor_parallel(model: GPT, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
        if model.cfg.tie_embeddings and "tok_embeddings" in top and "output" in top:
            # each plan gave its module a parameter of its own: tie them again (both split
            # over tp along the vocabulary)
            model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if isinstance(block.feed_forward, MoE):
            # whole tokens in (plain tensors: the MoE sums its tp ranks' partial outputs
            # itself), the sequence split again on the way out
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
            parallelize_module(block, tp_mesh, plan)
            parallelize_module(
                block.feed_forward,
                tp_mesh,
                PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            )
            continue
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
        plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


# each expert's hidden dim: w1, w3 [n, hidden, dim] and w2 [n, dim, hidden]
_EXPERT_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}


def _moe_tensor_parallel(model: GPT, tp_mesh, *, experts: bool) -> None:
    """The router replicated over tp; with ``experts`` (no ep: with ep, `_expert_parallel`
    splits them over both), each expert split along its hidden dim."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for block in model.layers.values():
        moe = block.feed_forward
        moe.router.weight = nn.Parameter(
            distribute_tensor(moe.router.weight.data, tp_mesh, [Replicate()])
        )
        if not experts:
            continue
        for name, dim in _EXPERT_HIDDEN_DIM.items():
            w = getattr(moe.experts, name)
            setattr(
                moe.experts, name, nn.Parameter(distribute_tensor(w.data, tp_mesh, [Shard(dim)]))
            )


def _expert_parallel(model: GPT, par: Parallel) -> list[nn.Parameter]:
    """Experts sharded over ep on dim 0 (and, with tp, over tp along their hidden dim)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = par.cfg.tp > 1
    mesh = par.mesh[("ep", "tp")] if tp else par.mesh["ep"]
    params = []
    for block in model.layers.values():
        experts = block.feed_forward.experts
        for name, dim in _EXPERT_HIDDEN_DIM.items():
            placements = [Shard(0), Shard(dim)] if tp else [Shard(0)]
            p = nn.Parameter(distribute_tensor(getattr(experts, name).data, mesh, placements))
            setattr(experts, name, p)
            params.append(p)
    return params


def build(mcfg: ModelConfig, par: Parallel, seed: int) -> tuple[GPT, list[nn.Parameter]]:
    """The model part this rank holds, parallelised; and its expert-parallel parameters."""
    p = par.cfg
    model = build_model(mcfg, seed, par.ctx)
    if p.pp > 1:
        model.keep_stage(par.pp_rank, p.pp)
    if p.tp > 1:
        _tensor_parallel(model, par.mesh["tp"])
    expert_params: list[nn.Parameter] = []
    if mcfg.n_experts and p.tp > 1:
        _moe_tensor_parallel(model, par.mesh["tp"], experts=p.ep == 1)
    if mcfg.n_experts and p.ep > 1:
        expert_params = _expert_parallel(model, par)
    fsdp_mesh = _fsdp_mesh(par)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        ignored = set(expert_params)
        for block in model.layers.values():
            fully_shard(block, mesh=fsdp_mesh, ignored_params=ignored or None)
        fully_shard(model, mesh=fsdp_mesh, ignored_params=ignored or None)
    return model, expert_params


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TrainStep:
    """One optimizer step on this rank's batch; returns the global mean loss (every rank)."""

    def __init__(
        self,
        model: GPT,
        par: Parallel,
        optimizer: torch.optim.Optimizer,
        expert_params: list[nn.Parameter],
        *,
        grad_clip: float = 0.0,
        microbatches: int = 1,
        schedule: str = "1F1B",
    ):
        self.model, self.par, self.optimizer = model, par, optimizer
        self.expert_params = expert_params
        self.grad_clip = grad_clip
        # called between backward and the optimizer step with the model; returns whether to
        # apply the step (FT-HSDP sets it: the cross-group gradient average and commit vote)
        self.replica_sync: Callable[[nn.Module], bool] | None = None
        self.committed = True  # whether the last call applied its optimizer step
        # this data rank's share of the global batch over an even share (uneven shares, set by
        # the layout scheduler): its loss, and so its gradients, weigh that much more in the
        # average over data ranks, which stays the mean over the global batch
        self.weight = 1.0
        # FT-HSDP: keep the gradients of a step the quorum did not commit, so that the next
        # quorum can save it (`resume`) instead of redoing it; the next plain call drops them
        self.keep_uncommitted = False
        self._kept_loss: torch.Tensor | None = None
        # FT-HSDP: gradients and loss of one more share of the kept step, trained ahead
        self._ahead: tuple[list[torch.Tensor | None], torch.Tensor] | None = None
        self.schedule = None
        if par.cfg.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(
                model,
                par.pp_rank,
                par.cfg.pp,
                torch.device("cpu"),
                group=par.mesh["pp"].get_group(),
            )
            kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule.lower()]
            self.schedule = kind(stage, n_microbatches=microbatches, loss_fn=_cross_entropy)
        self._tied_group = None
        if model.cfg.tie_embeddings and par.cfg.pp > 1:
            # the first stage's embedding and the last stage's output are copies of one
            # weight: their gradients are summed between the two stages (every rank creates
            # every pair's group, in the same order)
            ranks = par.mesh.mesh
            me = dist.get_rank()
            for a, b in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist(), strict=True):
                group = dist.new_group([a, b])
                if me in (a, b):
                    self._tied_group = group
        self._expert_group = None
        if expert_params:
            others = tuple(d for d in ("dp_replicate", "dp_shard", "cp") if getattr(par.cfg, d) > 1)
            if others:
                mesh = par.mesh[others]
                if len(others) > 1:
                    mesh = flatten_mesh(mesh, "_".join(others) + "_for_experts")
                self._expert_group = mesh.get_group()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self._kept_loss is not None:  # an uncommitted step that is not being saved
            self.optimizer.zero_grad(set_to_none=True)
            self._kept_loss = None
        self._ahead = None
        return self._finish(self._forward_backward(inputs, targets), keep=self.keep_uncommitted)

    def train_ahead(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Train one more share of the kept, uncommitted step now (FT-HSDP: the share of a
        group that was probably lost during it), into gradients of its own: the kept ones stay
        as they are until `resume` adds them (``ahead=True``) or a plain call drops them."""
        if self._kept_loss is None:
            raise RuntimeError("no uncommitted step's gradients are kept to train ahead of")
        params = [p for p in self.model.parameters() if p.requires_grad]
        own = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss = self._forward_backward(inputs, targets)
            self._ahead = ([p.grad for p in params], loss)
        finally:
            for p, k in zip(params, own, strict=True):
                p.grad = k

    def resume(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        scale: float,
        kept: bool = True,
        ahead: bool = False,
    ) -> float:
        """Save the last step, which the quorum did not commit (FT-HSDP lost a group during
        it): to the gradients it kept (none unless ``kept``: a group that has just healed to
        that step), add those of the share trained ahead (``ahead``, `train_ahead`) and of
        ``batches`` (lost groups' shares of the same batch that this group trains), scale the
        sum, and average, vote and step as a call does. Its loss is the mean over the shares
        this group trained."""
        if kept and self._kept_loss is None:
            raise RuntimeError("no uncommitted step's gradients are kept to resume")
        if ahead and self._ahead is None:
            raise RuntimeError("no share of the uncommitted step was trained ahead")
        if not kept and self._kept_loss is not None:
            self.optimizer.zero_grad(set_to_none=True)
        local = self._kept_loss if kept else torch.zeros((), dtype=torch.float64)
        self._kept_loss = None
        trained_ahead, self._ahead = self._ahead if ahead else None, None
        params = [p for p in self.model.parameters() if p.requires_grad]
        own = [p.grad for p in params]  # what this group kept
        for p in params:
            p.grad = None
        if trained_ahead is not None:  # as if its backward had run first, here
            grads, loss = trained_ahead
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            local = local + loss
        for inputs, targets in batches:
            local = local + self._forward_backward(inputs, targets)
        for p, k in zip(params, own, strict=True):
            g = p.grad
            if k is not None and g is not None:
                k_place, g_place = getattr(k, "placements", None), getattr(g, "placements", None)
                if g_place is not None and g_place != k_place:
                    g = g.redistribute(g.device_mesh, k_place)
                g = k + g
            elif k is not None:
                g = k
            if g is not None:
                g.mul_(scale)
            p.grad = g
        shares = int(kept) + int(trained_ahead is not None) + len(batches)
        return self._finish(local / max(1, shares), keep=False)

    def _finish(self, local: torch.Tensor, *, keep: bool) -> float:
        """Average over the replica groups and vote (FT-HSDP), step the optimizer if the step
        commits; keep the gradients of one that does not if ``keep``. Returns the loss."""
        par = self.par
        self.committed = True
        if self.replica_sync is not None:  # FT-HSDP: average over replica groups, then vote
            self.committed = self.replica_sync(self.model)
        if self.committed:
            self._settle_grads()
            if self.grad_clip > 0:
                self._clip()
            self.optimizer.step()
        if self.committed or not keep:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self._kept_loss = local.clone()
        # the global mean: every data rank's (and cp chunk's) last-stage loss, averaged
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
            holders = par.data_size * par.cfg.cp * par.cfg.tp
            return float(local) / holders
        return float(local)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (gradients accumulate, summed over the tied and
        expert copies); this rank's loss, float64."""
        par = self.par
        if par.cfg.cp > 1:  # this rank's contiguous chunk of the sequence
            n = inputs.shape[1] // par.cfg.cp
            c = par.coords["cp"]
            inputs, targets = inputs[:, c * n : (c + 1) * n], targets[:, c * n : (c + 1) * n]
        inputs, targets = inputs.contiguous(), targets.contiguous()
        local = torch.zeros((), dtype=torch.float64)
        if self.schedule is None:
            loss = _cross_entropy(self.model(inputs), targets)
            if self.weight != 1.0:
                loss = loss * self.weight
            loss.backward()
            local += loss.detach().double()
        else:
            losses: list[torch.Tensor] = []
            if par.pp_rank == 0:
                self.schedule.step(inputs)
            elif par.is_last_stage:
                self.schedule.step(target=targets, losses=losses)
                local += torch.stack([x.detach() for x in losses]).double().mean()
            else:
                self.schedule.step()
        self._sync_tied_grads()
        self._sync_expert_grads()
        return local

    def _tied_param(self) -> nn.Parameter | None:
        if self._tied_group is None:
            return None
        m = self.model
        return m.tok_embeddings.weight if m.tok_embeddings is not None else m.output.weight

    def _sync_tied_grads(self) -> None:
        p = self._tied_param()
        if p is None:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            # under tp the embedding's gradient comes back replicated, its weight split over
            # the vocabulary: both stages must sum the same local part
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(g, group=self._tied_group)

    def _sync_expert_grads(self) -> None:
        """Expert gradients: summed over the data ranks that hold the same experts, divided by
        every data rank (the all-to-all already summed what the ep ranks sent)."""
        if not self.expert_params:
            return
        n = self.par.data_size * self.par.cfg.cp
        for p in self.expert_params:
            if p.grad is None:  # every rank must join the reduction below
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if self._expert_group is not None:
                dist.all_reduce(g, group=self._expert_group)
            g.div_(n)

    def _settle_grads(self) -> None:
        """Give every gradient its parameter's placements: under tp the norms' gradients come
        back as pending sums and the embedding's replicated, and each optimizer op on them
        would redistribute them anew (an all-reduce per op)."""
        for p in self.model.parameters():
            g = p.grad
            if g is not None and hasattr(g, "placements") and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    @torch.no_grad()
    def _clip(self) -> None:
        """Scale the gradients down to a global norm of ``grad_clip``. Each gradient's local sum
        of squares (in float64) goes into the bucket of the mesh dims that split it, and each
        bucket is summed over those dims' groups: a few all-reduces a step, not one per
        parameter (DTensor's ``norm().full_tensor()``)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        tied = self._tied_param()
        # a tied weight's gradient is counted once: by the first stage
        twice = tied.grad if tied is not None and self.model.tok_embeddings is None else None
        device = grads[0].device if grads else torch.device("cpu")
        buckets: dict[tuple[int, ...], tuple[list, torch.Tensor]] = {}
        for g in grads:
            if g is twice:
                continue
            groups: list = []
            if isinstance(g, DTensor):
                if any(p.is_partial() for p in g.placements):  # pending sums: DTensor's way
                    sq = g.norm().full_tensor().double() ** 2
                else:
                    mesh = g.device_mesh
                    # every dim that splits it (FSDP's _StridedShard is not `is_shard()`)
                    split = [i for i, p in enumerate(g.placements) if not p.is_replicate()]
                    groups = [mesh.get_group(i) for i in split]
                    sq = torch.linalg.vector_norm(g.to_local(), dtype=torch.float64) ** 2
            else:
                sq = torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
            key = tuple(id(x) for x in groups)
            if key not in buckets:
                buckets[key] = (groups, torch.zeros((), dtype=torch.float64, device=device))
            buckets[key][1].add_(sq.to(device))
        total = torch.zeros((), dtype=torch.float64, device=device)
        for groups, part in buckets.values():  # the same order on every rank of a stage
            for group in groups:
                dist.all_reduce(part, group=group)
            total += part
        if self.par.cfg.pp > 1:
            dist.all_reduce(total, group=self.par.mesh["pp"].get_group())
        scale = min(1.0, self.grad_clip / (float(total.sqrt()) + 1e-6))
        if scale < 1.0:
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)


def make_optimizer(model: nn.Module, lr: float, betas, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=False
    )


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_ratio`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


StepFn = Callable[[torch.Tensor, torch.Tensor], float]
