"""PyTorch Lightning training on every rank of a pool: an MLP under `ModelParallelStrategy`'s FSDP2
x tensor parallelism, checkpointed by `AnyshardModelParallelStrategy` through ModelCheckpoint."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from anyshard.dcp.lightning import AnyshardModelParallelStrategy

DIM, HIDDEN, GLOBAL_BATCH, BATCHES_PER_EPOCH = 16, 32, 8, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Regression(L.LightningModule):
    """Learns a fixed random linear map; records the global loss (mean over data-parallel ranks)
    of every step, and after a restore the full parameters and AdamW moments it holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MLP()  # the same initial weights on every rank, whatever the layout
        self.losses: list[float] = []
        self.restored: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self.model, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if dp.size() > 1:
            fully_shard(self.model.w1, mesh=dp)
            fully_shard(self.model.w2, mesh=dp)
            fully_shard(self.model, mesh=dp)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(GLOBAL_BATCH * BATCHES_PER_EPOCH, DIM, generator=g)
        y = x @ torch.randn(DIM, DIM, generator=g)
        dp = self.device_mesh["data_parallel"].size()
        return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp, shuffle=False)

    def on_train_start(self) -> None:
        optim = self.trainer.optimizers[0]
        if not optim.state:  # a fresh start, not a restore
            return
        for name, p in self.model.named_parameters():
            self.restored["model." + name] = _full(p)
        osd = get_optimizer_state_dict(self.model, optim)
        for name, state in osd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.restored[f"{key}.model.{name}"] = _full(state[key])

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        total = loss.detach().clone()
        dp = self.device_mesh["data_parallel"]
        dist.all_reduce(total, group=dp.get_group())
        self.losses.append(float(total) / dp.size())
        return loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def fit(dp: int, tp: int, root: str, epochs: int, resume: str | None = None) -> dict:
    """Train for ``epochs`` (resuming from ``resume``) with a checkpoint at every epoch's end
    in ``root`` and in ``root/last.ckpt``; the recorded losses and restored state."""
    world = dist.get_world_size()
    os.environ.update({"LOCAL_RANK": str(dist.get_rank()), "NODE_RANK": "0"})
    torch.manual_seed(0)
    module = Regression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=AnyshardModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, save_last=True)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers and the like
        trainer.fit(module, ckpt_path=resume)
    return {"losses": module.losses, "step": trainer.global_step, "restored": module.restored}
