"""Task functions: torch.distributed.checkpoint with anyshard's storage backends (AnyshardWriter,
AnyshardReader) on FSDP2 x TP training state; every check is against torch's own full tensors."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _layouts import _flat, full, train_state
from safetensors.torch import load_file, save_file

import anyshard
from anyshard.dcp import AnyshardReader, AnyshardWriter


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def dcp_save_task(layout: str, ckpt: str, truth_dir: str, seed: int) -> list[str]:
    """Save a trained state with dcp.save through AnyshardWriter; rank 0 keeps torch's full
    tensors as the oracle. Returns the files the checkpoint holds."""
    state = train_state(layout, seed)
    dcp.save(state, storage_writer=AnyshardWriter(ckpt))
    tensors = {k: full(v).contiguous() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
    if dist.get_rank() == 0:
        os.makedirs(truth_dir, exist_ok=True)
        save_file(tensors, os.path.join(truth_dir, "truth.safetensors"))
    dist.barrier()
    return sorted(
        os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs
    )


def dcp_async_save_task(
    layout: str, ckpt: str, seed: int, kind: str = "thread", target: str = "tp4"
) -> int:
    """dcp.async_save through AnyshardWriter (in a thread, or with ``kind`` "process" in DCP's
    background process) while the training state changes under it: the checkpoint holds the
    state as it was at the call (torch's full tensors, taken before), and dcp.load reads it back
    into another layout. Returns the tensors checked."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = train_state(layout, seed)
    before = {k: full(v).clone() for k, v in _flat(state) if isinstance(v, torch.Tensor)}
    future = dcp.async_save(
        state,
        storage_writer=AnyshardWriter(ckpt),
        async_checkpointer_type=AsyncCheckpointerType[kind.upper()],
    )
    for _, v in _flat(state):  # the caller may modify its tensors once async_save returns
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            (v.to_local() if hasattr(v, "to_local") else v).add_(1000.0)
    future.result()
    dist.barrier()
    with anyshard.open(ckpt) as view:
        for k, t in before.items():
            assert torch.equal(view.get_tensor(k), t), (
                f"{k}: the checkpoint is not the state at the call"
            )
    loaded = train_state(target, seed + 1)
    dcp.load(loaded, storage_reader=AnyshardReader(ckpt))
    checked = 0
    for k, v in _flat(loaded):
        if isinstance(v, torch.Tensor):
            assert torch.equal(full(v), before[k]), f"{k} differs after dcp.load"
            checked += 1
    return checked


def dcp_load_task(layout: str, ckpt: str, truth_dir: str, seed: int) -> dict[str, int]:
    """dcp.load through AnyshardReader into ``layout``: every tensor bit-exact against the
    oracle, the values as saved; returns this rank's bytes read and the bytes its targets hold."""
    state = train_state(layout, seed + 1)  # other values, the target layout's placements
    state["meta"] = {"step": 0, "layout": "?"}
    needed = sum(
        (v.to_local() if hasattr(v, "to_local") else v).nbytes
        for _, v in _flat(state)
        if isinstance(v, torch.Tensor)
    )
    before = _io()["rchar"]
    dcp.load(state, storage_reader=AnyshardReader(ckpt))
    read = _io()["rchar"] - before
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    checked = 0
    for k, v in _flat(state):
        if isinstance(v, torch.Tensor):
            got = full(v)
            assert got.dtype == truth[k].dtype and torch.equal(got, truth[k]), f"{k} differs"
            checked += 1
    assert checked == len(truth), (checked, len(truth))
    assert state["meta"] == {"step": 1, "layout": "fsdp2_tp2"}, state["meta"]
    groups = state["optim"]["param_groups"]
    assert groups[0]["lr"] == 0.01 and list(groups[0]["betas"]) == [0.9, 0.999], groups
    return {"read": read, "needed": needed}


def one_process_load(ckpt: str, truth_dir: str) -> int:
    """Rank 0 alone: dcp.load (no process group) into whole tensors."""
    truth = load_file(os.path.join(truth_dir, "truth.safetensors"))
    state = {k: torch.full_like(t, 7) for k, t in truth.items()}
    dcp.load(state, storage_reader=AnyshardReader(ckpt), no_dist=True)
    for k, t in truth.items():
        assert torch.equal(state[k], t), k
    with anyshard.open(ckpt) as view:  # anyshard's own reader agrees
        for k, t in truth.items():
            assert torch.equal(view.get_tensor(k), t), k
        assert view.get_value("meta.step") == 1
    return len(truth)


def spec_dcp_load_task(ckpt: str, seed: int) -> int:
    """dcp.load through AnyshardReader of a checkpoint saved by anyshard.save under the
    megatron_gpt spec, into logical tensors sharded Shard(0) over 4 ranks: bit-exact against
    the logical tensors the saved local ones were cut from."""
    from _ucl_tasks import logical
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    truth = logical(seed)
    state = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for k, t in truth.items()}
    state["iteration"] = 0
    dcp.load(state, storage_reader=AnyshardReader(ckpt))
    for k, t in truth.items():
        assert torch.equal(state[k].full_tensor(), t), k
    assert state["iteration"] == 12
    return len(truth)


def big_save_load_task(ckpt: str) -> dict[str, int]:
    """A 1 MiB tensor saved column-sharded (Shard(1) over 4 ranks) through AnyshardWriter and
    loaded row-sharded (Shard(0)) through AnyshardReader: each rank needs a quarter of every
    stored shard. Returns this rank's bytes read by the load and the bytes its target holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = torch.randn(1024, 256, generator=torch.Generator().manual_seed(11))
    dcp.save({"w": distribute_tensor(w, mesh, [Shard(1)])}, storage_writer=AnyshardWriter(ckpt))
    state = {"w": distribute_tensor(torch.zeros_like(w), mesh, [Shard(0)])}
    before = _io()["rchar"]
    dcp.load(state, storage_reader=AnyshardReader(ckpt))
    read = _io()["rchar"] - before
    assert torch.equal(state["w"].to_local(), distribute_tensor(w, mesh, [Shard(0)]).to_local())
    return {"read": read, "needed": state["w"].to_local().nbytes}


def several_chunks_task(ckpt: str, spec_kind: str) -> dict:
    """A ShardedTensor whose sharding spec places several chunks on one rank (ChunkShardingSpec
    with repeated placements, or an EnumerableShardingSpec), saved through AnyshardWriter, the
    same through FileSystemWriter; both loaded back (as ShardedTensors of the same spec, as a
    DTensor sharded over the ranks, and whole in one process on rank 0), every load bit-exact
    against the tensor each rank built whole. Returns the data files written and bytes checked."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    whole = torch.arange(8.0 * 6).reshape(8, 6) * 3 + 1
    if spec_kind == "chunk":  # rows in 4 chunks, ranks 0, 1, 0, 1
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{i % world}/cpu" for i in range(4)])
    else:  # a 2 x 2 grid of blocks: three on rank 0, the last on rank 1
        spec = EnumerableShardingSpec(
            [
                ShardMetadata([r, c], [4, 3], f"rank:{int(r == 4 and c == 3)}/cpu")
                for r in (0, 4)
                for c in (0, 3)
            ]
        )

    def sharded(fill: torch.Tensor | None):
        st = sharded_tensor.empty(spec, 8, 6)
        for shard in st.local_shards():
            off = shard.metadata.shard_offsets
            size = shard.metadata.shard_sizes
            box = tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))
            shard.tensor.copy_(fill[box] if fill is not None else torch.zeros(size))
        return st

    def gathered(st) -> torch.Tensor:
        out = torch.zeros(8, 6)
        for shard in st.local_shards():
            off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            out[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))] = shard.tensor
        dist.all_reduce(out)
        return out

    held = len(sharded(whole).local_shards())
    assert held >= 2 or spec_kind == "enum", held  # the case under test: several on one rank
    theirs = ckpt + "-fs"
    dcp.save({"w": sharded(whole)}, storage_writer=AnyshardWriter(ckpt))
    dcp.save({"w": sharded(whole)}, storage_writer=FileSystemWriter(theirs))
    for reader in (AnyshardReader(ckpt), FileSystemReader(theirs)):
        back = {"w": sharded(None)}
        dcp.load(back, storage_reader=reader)
        assert torch.equal(gathered(back["w"]), whole), type(reader).__name__
    mesh = init_device_mesh("cpu", (world,))
    n = 8 // world
    into = {"w": DTensor.from_local(torch.zeros(n, 6), mesh, [Shard(0)])}
    dcp.load(into, storage_reader=AnyshardReader(ckpt))
    assert torch.equal(into["w"].to_local(), whole[rank * n : (rank + 1) * n])
    dist.barrier()
    if rank == 0:
        one = {"w": torch.zeros(8, 6)}
        dcp.load(one, storage_reader=AnyshardReader(ckpt), no_dist=True)
        assert torch.equal(one["w"], whole)
        assert torch.equal(anyshard.open(ckpt).get_tensor("w"), whole)
    dist.barrier()
    return {"files": sorted(os.listdir(os.path.join(ckpt, "data"))), "held": held}


def read_once_task(ckpt: str) -> dict:
    """dcp.load of tensors replicated over data parallelism ((dp=2, tp=2): Replicate, Shard)
    through AnyshardReader, read per rank and read once: bytes each rank read, loads checked
    bit-exact against the saved tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    full_w, full_b = torch.randn(512, 256, generator=g), torch.randn(4096, generator=g)
    tp4 = init_device_mesh("cpu", (4,))
    dcp.save(
        {
            "w": distribute_tensor(full_w, tp4, [Shard(0)]),
            "b": distribute_tensor(full_b, tp4, [Shard(0)]),
        },
        storage_writer=AnyshardWriter(ckpt),
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for once in (False, True):
        target = {
            "w": distribute_tensor(torch.zeros(512, 256), mesh, [Replicate(), Shard(1)]),
            "b": distribute_tensor(torch.zeros(4096), mesh, [Replicate(), Shard(0)]),
        }
        reader = AnyshardReader(ckpt, read_once=once)
        dcp.load(target, storage_reader=reader)
        assert torch.equal(target["w"].full_tensor(), full_w), once
        assert torch.equal(target["b"].full_tensor(), full_b), once
        out["once" if once else "each"] = reader.bytes_read
    return out
