"""Task functions run on every rank by the harness: a toy model under several parallel layouts."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import anyshard


class Toy(nn.Module):
    """Sizes chosen not to divide evenly by 4: 10 hidden rows, 13 embedding rows."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 16)
        self.norm = nn.RMSNorm(16)
        self.up = nn.Linear(16, 10)
        self.down = nn.Linear(10, 16, bias=False)

    def forward(self, ids):
        x = self.norm(self.emb(ids))
        return self.down(torch.relu(self.up(x)))


TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def build(layout: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Toy()
    if layout == "fsdp4":
        fully_shard(model, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)))
    elif layout == "fsdp2_tp2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout == "ddp2_tp2":
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    elif layout in ("tp4", "tp2"):
        n = int(layout[2:])
        parallelize_module(model, init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)), TP_PLAN)
    else:
        raise ValueError(layout)
    return model


def train_state(layout: str, seed: int) -> dict:
    model = build(layout, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    for p in model.parameters():  # deterministic gradients with the parameters' own placements
        p.grad = p.detach() * 0.5 + 0.25
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "meta": {"step": 1, "layout": layout}}


def _flat(state, prefix=""):
    for k, v in state.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and any(isinstance(x, (torch.Tensor, dict)) for x in v.values()):
            yield from _flat(v, name)
        else:
            yield name, v


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def _write_truth(tensors: dict, state: dict, truth_dir: str) -> None:
    """Rank 0 keeps the full tensors (torch's own gather) and the JSON values as the oracle."""
    if dist.get_rank() == 0:
        os.makedirs(truth_dir, exist_ok=True)
        save_file(tensors, os.path.join(truth_dir, "truth.safetensors"))
        others = {k: v for k, v in _flat(state) if not isinstance(v, torch.Tensor)}
        with open(os.path.join(truth_dir, "values.json"), "w") as f:
            json.dump(others, f)


def save_task(layout: str, ckpt: str, truth_dir: str, seed: int) -> int:
    state = train_state(layout, seed)
    anyshard.save(ckpt, state)
    tensors = {k: full(v).contiguous() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
    _write_truth(tensors, state, truth_dir)
    return len(tensors)


def load_check_task(layout: str, ckpt: str, truth_dir: str, seed: int) -> int:
    state = train_state(layout, seed)  # other values, the target layout's shapes and placements
    anyshard.load(ckpt, state)
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    with open(os.path.join(truth_dir, "values.json")) as f:
        values = json.load(f)
    checked = 0
    for k, v in _flat(state):
        if isinstance(v, torch.Tensor):
            got = full(v)
            assert got.dtype == truth[k].dtype and torch.equal(got, truth[k]), (
                f"{k} differs after load"
            )
            checked += 1
        else:
            assert json.loads(json.dumps(v)) == values[k], f"{k}: {v!r} != {values[k]!r}"
    assert checked == len(truth), (checked, len(truth))
    return checked


def partial_save_task(ckpt: str) -> str:
    """A Partial DTensor cannot be saved: every rank raises, nothing is committed."""
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    good = distribute_tensor(torch.arange(8.0), mesh, (Shard(0), Shard(0)))
    bad = DTensor.from_local(torch.ones(3), mesh, (Shard(0), Partial()), run_check=False)
    try:
        anyshard.save(ckpt, {"good": good, "bad": bad})
    except anyshard.AnyshardError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("saving a Partial DTensor did not raise")


def one_rank_fails_task(ckpt: str) -> str:
    """A failure on one rank fails the save on every rank and commits nothing."""
    state = {"w": torch.arange(6.0)}
    if dist.get_rank() == 1:
        state["oops"] = {1, 2}  # not JSON
    try:
        anyshard.save(ckpt, state)
    except anyshard.AnyshardError as e:
        return type(e).__name__
    raise AssertionError("the save did not fail")


class _Holder:
    """A Stateful around a state dict (as a trainer's model/optimizer wrappers are)."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


def checkpointer_task(root: str, layout_save: str, layout_load: str) -> list:
    """Save through the Checkpointer under one layout at steps 2, 4, 6 (keep 2), restore under
    another on every rank: the newest step, bit-exact."""
    from anyshard.trainer_integration import Checkpointer

    ckpt = Checkpointer(root, every_steps=2, keep_last=2)
    truth = {}
    for step in range(1, 7):
        state = train_state(layout_save, 100 + step)
        if ckpt.save(step, {"train": _Holder(state)}):
            truth[step] = {
                k: full(v).clone() for k, v in _flat(state) if isinstance(v, torch.Tensor)
            }
    ckpt.wait()  # retention runs in the background after each commit
    target = _Holder(train_state(layout_load, 7))
    restored = Checkpointer(root).restore_latest({"train": target})
    for k, v in _flat(target.state):
        if isinstance(v, torch.Tensor):
            assert torch.equal(full(v), truth[6][k]), k
    dist.barrier()
    return [restored, sorted(os.listdir(root))]


def async_save_task(ckpt: str, truth_dir: str) -> int:
    """An async save on 4 ranks: the state changes right after it returns; the checkpoint holds
    the state as it was, and loads under another layout."""
    state = train_state("fsdp2_tp2", 11)
    tensors = {k: full(v).clone() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
    handle = anyshard.save(ckpt, state, async_=True)
    for _, v in _flat(state):
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).fill_(-3)
    handle.result()
    _write_truth(tensors, state, truth_dir)
    dist.barrier()
    return load_check_task("tp4", ckpt, truth_dir, 5)


def stage_plain_tensors_task(path: str) -> list:
    """Plain tensors that only some ranks hold (a pipeline stage's optimizer step counters):
    ranks 0-1 hold "stage0.*", ranks 2-3 "stage1.*", every rank "shared"."""
    r = dist.get_rank()
    stage = r // 2
    state = {
        f"stage{stage}.step": torch.tensor(float(10 + stage)),
        f"stage{stage}.vec": torch.arange(5.0) + stage,
        "shared": torch.ones(3),
    }
    anyshard.save(path, state)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    anyshard.load(path, back, strict=False)
    return [k for k in state if torch.equal(back[k], state[k])]


def divergent_replicas_task(ckpt: str, check: bool) -> str:
    """A plain tensor whose copies differ between ranks fails the save on every rank, naming it
    (and which ranks agree); with check_replicas=False one copy is saved."""
    rank = dist.get_rank()
    state = {
        "same": torch.arange(6.0),
        "big_same": torch.ones(300_000),  # >= 1 MiB: split among the replicas for writing
        "rng": torch.tensor([0, 0, 1, 1][rank]),  # ranks {0, 1} and {2, 3} agree
        "seen": torch.full((4,), float(rank)),  # every rank its own
    }
    try:
        anyshard.save(ckpt, state, check_replicas=check)
    except anyshard.errors.SaveError as e:
        return str(e)
    return "saved"
