"""Hugging Face Accelerate training on the ranks of a pool: an MLP prepared under FSDP2 (Accelerate's
``fsdp2_prepare_model``), AdamW, checkpointed by ``Accelerator.save_state`` with and without
`anyshard_checkpoints`, and resumed by ``load_state``.

CPU shim (test only): on CPU, Accelerate keeps ``DistributedType.MULTI_CPU`` and drops the FSDP
plugin (it takes FSDP only for accelerator devices), so `_accelerator` sets the state's
``distributed_type`` to FSDP and its ``fsdp_plugin`` after construction; ``prepare`` then shards
the model with ``fully_shard`` over the gloo ranks, and ``save_state`` / ``load_state`` take
Accelerate's FSDP path as on GPUs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

DIM, HIDDEN, GLOBAL_BATCH, STEPS = 16, 32, 8, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _accelerator() -> Any:
    """An Accelerator on CPU with an FSDP2 plugin (SHARDED_STATE_DICT) in force (the CPU shim)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",  # Accelerate leaves threads alone
    )  # fmt: skip
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # both states: each AcceleratorState() copies PartialState's distributed_type over its own
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so that the pool's next task starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _prepared(seed: int) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    accelerator = _accelerator()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch (the same for any layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = x @ torch.randn(DIM, DIM, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    part = GLOBAL_BATCH // world
    return x[rank * part : (rank + 1) * part], y[rank * part : (rank + 1) * part]


def _train(accelerator: Any, model: nn.Module, optimizer: Any, first: int) -> list[float]:
    """Steps ``first`` .. ``first + STEPS - 1``; the global loss of each."""
    losses = []
    for step in range(first, first + STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The unsharded parameters and AdamW state (moments and step) by name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"param.{n}": _full(p) for n, p in model.named_parameters()}
    osd = get_optimizer_state_dict(model, optimizer)
    for name, state in osd["state"].items():
        for key, value in state.items():
            out[f"{key}.{name}"] = _full(torch.as_tensor(value))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (dtype, shape or any bit), and those only one side has."""
    diff = sorted(set(a) ^ set(b))
    return diff + [k for k in sorted(set(a) & set(b)) if not _bit_equal(a[k], b[k])]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def save_and_resume(root: str) -> dict | None:
    """On 2 ranks: train 3 steps, save_state through anyshard (``root/anyshard``) and through
    Accelerate's own DCP path (``root/stock``), train 3 more (the uninterrupted run); then load
    each checkpoint back into the moved-on model and train the same 3 steps again. Rank 0
    returns the losses, the saved state, and which tensors each load restored differently."""
    from anyshard.dcp.accelerate import anyshard_checkpoints

    try:
        accelerator, model, optimizer = _prepared(seed=0)
        first = _train(accelerator, model, optimizer, 0)
        with anyshard_checkpoints(accelerator):
            accelerator.save_state(os.path.join(root, "anyshard"))
        accelerator.save_state(os.path.join(root, "stock"))
        saved = full_state(model, optimizer)
        uninterrupted = _train(accelerator, model, optimizer, STEPS)
        resumed, differs = {}, {}
        for name, through_anyshard in (
            ("anyshard", True), ("stock", False), ("stock read by anyshard", True)
        ):  # fmt: skip
            path = os.path.join(root, name.split()[0])
            routed = anyshard_checkpoints(accelerator)
            with routed if through_anyshard else contextlib.nullcontext():
                accelerator.load_state(path)
            differs[name] = _same(full_state(model, optimizer), saved)
            resumed[name] = _train(accelerator, model, optimizer, STEPS)
        routed_after = _dcp_names()
    finally:
        _reset_accelerate()
    if dist.get_rank():
        return None
    return {
        "first": first,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "differs": differs,
        "saved": saved,
        "names_after": routed_after,
    }


def resume_on_one_rank(root: str, store: str) -> dict:
    """On a world of 1 (its own gloo group): a fresh model (other initial weights) under FSDP2
    loads the 2-rank run's anyshard checkpoint by ``load_state`` and trains 3 steps; then its
    stock checkpoint loads into the moved-on model. The full state after each load, the losses."""
    from anyshard.dcp.accelerate import anyshard_checkpoints

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        accelerator, model, optimizer = _prepared(seed=7)
        fresh = full_state(model, optimizer)
        with anyshard_checkpoints(accelerator):
            accelerator.load_state(os.path.join(root, "anyshard"))
        through_anyshard = full_state(model, optimizer)
        losses = _train(accelerator, model, optimizer, STEPS)
        accelerator.load_state(os.path.join(root, "stock"))
        return {
            "fresh": fresh,
            "anyshard": through_anyshard,
            "stock": full_state(model, optimizer),
            "next_losses": losses,
        }
    finally:
        _reset_accelerate()
        dist.destroy_process_group()


def _dcp_names() -> list[str]:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import filesystem

    return [
        name
        for name in ("FileSystemWriter", "FileSystemReader")
        if getattr(dist_cp, name) is not getattr(filesystem, name)
    ]
