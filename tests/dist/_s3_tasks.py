"""Task functions run on every rank by the harness: a DTensor state saved to s3:// under
dp_shard=2 x tp=2 and loaded back under tp=4.

The endpoint reaches each worker as an argument only because the workers start before the
server does; the task puts it where a user would, in the AWS_* environment, before any S3 call.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import anyshard
from anyshard.api.load import load_reporting

# name -> (placements saved under (dp_shard, tp), placements loaded under (tp,)); a tp4 column
# of "w" is a part of each row of a stored shard (strided reads), "emb" is uneven at every level
PLACEMENTS = {
    "w": ((Shard(0), Shard(1)), (Shard(1),)),
    "emb": ((Shard(0), Shard(0)), (Shard(0),)),
    "bias": ((Replicate(), Shard(0)), (Replicate(),)),
    "empty": ((Shard(0), Replicate()), (Shard(1),)),
}


def use_environment(env: dict[str, str]) -> None:
    import s3fs

    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(10, 12, generator=g),
        "emb": torch.randn(13, 8, generator=g).to(torch.bfloat16),
        "bias": torch.randn(7, generator=g),
        "empty": torch.zeros(4, 0, dtype=torch.float16),
        "scale": torch.tensor(0.125, dtype=torch.float64),  # a plain (replicated) 0-d tensor
    }


def save_task(env: dict[str, str], url: str, seed: int) -> int:
    use_environment(env)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    state: dict = {"step": 3}
    for name, t in full_tensors(seed).items():
        placements = PLACEMENTS[name][0] if name in PLACEMENTS else None
        state[name] = distribute_tensor(t, mesh, placements) if placements else t
    anyshard.save(url, state)
    return dist.get_rank()


def load_check_task(env: dict[str, str], url: str, seed: int) -> int:
    use_environment(env)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    full = full_tensors(seed)
    state: dict = {"step": 0}
    for name, t in full.items():
        fill = torch.full_like(t, 7)
        placements = PLACEMENTS[name][1] if name in PLACEMENTS else None
        state[name] = distribute_tensor(fill, mesh, placements) if placements else fill
    anyshard.load(url, state)
    assert state["step"] == 3
    for name, t in full.items():
        got = state[name]
        if isinstance(got, DTensor):
            want = distribute_tensor(t, mesh, got.placements).to_local()
            got = got.to_local()
        else:
            want = t
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name} differs on rank {dist.get_rank()}"
    return len(full)


def _state(mesh, which: int, seed: int) -> dict:
    state: dict = {}
    for name, t in full_tensors(seed).items():
        placements = PLACEMENTS[name][which] if name in PLACEMENTS else None
        state[name] = distribute_tensor(t, mesh, placements) if placements else t
    return state


class _Holder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


def tiered_save_task(env: dict[str, str], root: str, local: str) -> list:
    """Tiered Checkpointer under dp_shard=2 x tp=2: steps to local disk, uploaded to s3."""
    from anyshard.trainer_integration import Checkpointer

    use_environment(env)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    ckpt = Checkpointer(root, every_steps=2, keep_last=1, local_dir=local, async_=True)
    for step in range(1, 5):
        ckpt.save(step, {"train": _Holder(_state(mesh, 0, 100 + step))})
    ckpt.wait()
    return sorted(os.listdir(local))


def tiered_restore_task(env: dict[str, str], root: str, local: str) -> list:
    """A replacement node (no local directory) restores under tp=4 from s3, bit-exact."""
    from anyshard.trainer_integration import Checkpointer

    use_environment(env)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    state = _state(mesh, 1, 0)
    for v in state.values():
        (v.to_local() if isinstance(v, DTensor) else v).zero_()
    target = _Holder(state)
    reader = Checkpointer(root, local_dir=local)
    step = reader.restore_latest({"train": target})
    full = full_tensors(104)
    for name, t in full.items():
        got = target.state[name]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        assert torch.equal(got, t), name
    return [step, reader.restored_from.startswith("s3://")]


def faulty_round_task(env: dict[str, str], url: str, seed: int) -> str:
    """Save and load back through a proxy that injects faults: bit-exact, or a clean error."""
    from anyshard.errors import SaveError, StorageError

    use_environment(env)
    try:
        save_task(env, url, seed)
    except (StorageError, SaveError) as e:
        return f"save failed: {type(e).__name__}"
    try:
        load_check_task(env, url, seed)
    except StorageError as e:
        return f"load failed: {type(e).__name__}"
    return "ok"


def replicated_load_task(env: dict[str, str], url: str, read_once, plain: bool = False) -> int:
    """Save a 1 MiB tensor sharded over 4 ranks to ``url`` (once), then load it replicated on
    every rank (``read_once``: None for the default) as a replicated DTensor, or (``plain``) as
    a plain tensor that every rank passes whole, with a small plain one beside it; check it;
    return the bytes fetched."""
    use_environment(env)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1024, 256, generator=g)
    norm = torch.randn(3, generator=g)  # smaller than the ranks: not split
    if not anyshard.format.storage.exists(f"{url}/manifest.json"):
        dist.barrier()
        anyshard.save(url, {"w": distribute_tensor(full, mesh, [Shard(0)]), "norm": norm})
    if plain:
        state = {"w": torch.zeros_like(full), "norm": torch.zeros(3)}
    else:
        state = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Replicate()])}
        state["norm"] = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
    report = load_reporting(url, state, read_once=read_once)
    w = state["w"] if plain else state["w"].to_local()
    assert torch.equal(w, full), f"rank {dist.get_rank()}: w differs"
    n = state["norm"] if plain else state["norm"].to_local()
    assert torch.equal(n, norm), f"rank {dist.get_rank()}: norm differs"
    return report.bytes_read


def column_split_load_task(env: dict[str, str], url: str, read_once) -> dict:
    """Save w (512 x 2048, rows split over 4 ranks) and a norm to ``url`` (once), then load w
    split by columns over tp=2, replicated over dp=2, and the norm replicated (``read_once``:
    None for the default); check both; the bytes fetched and the tensors received."""
    use_environment(env)
    g = torch.Generator().manual_seed(9)
    full, norm = torch.randn(512, 2048, generator=g), torch.randn(2048, generator=g)
    if not anyshard.format.storage.exists(f"{url}/manifest.json"):
        rows = init_device_mesh("cpu", (4,))
        anyshard.save(url, {"w": distribute_tensor(full, rows, [Shard(0)]), "norm": norm})
        dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {
        "w": distribute_tensor(torch.zeros_like(full), mesh, [Replicate(), Shard(1)]),
        "norm": distribute_tensor(torch.zeros(2048), mesh, [Replicate(), Replicate()]),
    }
    report = load_reporting(url, state, read_once=read_once)
    assert torch.equal(state["w"].full_tensor(), full), f"rank {dist.get_rank()}: w differs"
    assert torch.equal(state["norm"].to_local(), norm), f"rank {dist.get_rank()}: norm differs"
    return {"bytes": report.bytes_read, "forwarded": report.forwarded}
