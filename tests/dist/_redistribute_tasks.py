"""Task functions run on every rank by the harness: `anyshard.redistribute` between layouts,
checked bit-exact against torch's own gather (DTensor.full_tensor) and the UCL reference."""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import anyshard
from anyshard.api import collectives as coll
from anyshard.api.redistribute import _describe_side, plan_redistribution

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _layouts import TP_PLAN, Toy, _flat, full, train_state  # noqa: E402
from _ucl_tasks import CFG, _locals  # noqa: E402


def _tensors(state) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _flat(state) if isinstance(v, torch.Tensor)}


def layouts_task(src_layout: str, dst_layout: str, seed: int, inflight: int) -> dict:
    """Redistribute a trained state (model and AdamW) from one layout to another on the same
    ranks; every tensor's full value is compared with the source's."""
    src = train_state(src_layout, seed)
    dst = train_state(dst_layout, seed + 1)  # other values, the destination's placements
    dst["meta"] = {}
    plan = anyshard.redistribute(src, dst, max_inflight_bytes=inflight, strict=True)
    want, got = _tensors(src), _tensors(dst)
    assert sorted(want) == sorted(got)
    for k in sorted(want):
        a, b = full(want[k]), full(got[k])
        assert a.dtype == b.dtype and torch.equal(a, b), f"{k} differs"
    assert dst["meta"] == {"step": 1, "layout": src_layout}
    me = dist.get_rank()
    return {
        "tensors": len(want),
        "sent": plan.sent_bytes(me),
        "received": plan.received_bytes(me),
        "largest": max(
            (sum(m.nbytes for m in g) for v in plan.messages.values() for g in v), default=0
        ),
    }


def plan_digest_task(src_layout: str, dst_layout: str) -> str:
    """The whole plan, every rank's part together, as each rank computes it from the exchanged
    descriptions; checks that its own part is the one it plans alone."""
    src, dst = train_state(src_layout, 1), train_state(dst_layout, 2)
    me = dist.get_rank()
    s = _describe_side(src, None, None, None, me, True, "source")
    d = _describe_side(dst, None, None, None, me, True, "destination")
    descs = coll.all_gather_json({"src": s.desc, "dst": d.desc, "problems": []})
    plan, _ = plan_redistribution(descs, 1 << 20)
    mine, _ = plan_redistribution(descs, 1 << 20, rank=me)
    assert mine.local == plan.for_rank(me).local
    assert mine.messages == plan.for_rank(me).messages
    return hashlib.sha256(repr((plan.local, sorted(plan.messages.items()))).encode()).hexdigest()


def _sub_tp(ranks: list[int], seed: int) -> dict | None:
    """A tp state on the sub-mesh of ``ranks`` (None on the other ranks); every rank takes part
    in creating the mesh's process group."""
    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("tp",))
    if dist.get_rank() not in ranks:
        return None
    torch.manual_seed(seed)
    model = parallelize_module(Toy(), mesh, TP_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.25
    opt.step()
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def shrink_grow_task(seed: int) -> int:
    """fsdp4 -> tp2 on ranks 0, 1 (ranks 2, 3 leave), then back to fsdp4 (they join)."""
    src = train_state("fsdp4", seed)
    src.pop("meta")
    want = {k: full(v) for k, v in _tensors(src).items()}  # collective: before any leave
    small = _sub_tp([0, 1], seed + 1)
    anyshard.redistribute(src, small)
    checked = 0
    if small is not None:  # gathers over the sub-mesh: ranks 0 and 1 only
        for k, v in _tensors(small).items():
            assert torch.equal(full(v), want[k]), f"{k} differs after shrinking"
            checked += 1
    back = train_state("fsdp4", seed + 2)
    back.pop("meta")
    anyshard.redistribute(small, back)  # ranks 2 and 3 join with src=None
    for k, v in _tensors(back).items():
        assert torch.equal(full(v), want[k]), f"{k} differs after growing"
        checked += 1
    return checked


def empty_src_task(seed: int) -> int:
    """Only ranks 0 and 1 hold the source, as whole plain tensors; every rank receives its
    fsdp4 shards (ranks 2 and 3 with an empty source)."""
    me = dist.get_rank()
    state = train_state("fsdp4", seed)
    state.pop("meta")
    want = {k: full(v).clone() for k, v in _tensors(state).items()}
    src = {"t": {k: want[k].clone() for k in want}} if me < 2 else {}
    dst = {"t": train_state("fsdp4", seed + 1)}
    dst["t"].pop("meta")
    dst = {"t": {k: v for k, v in _tensors(dst["t"]).items()}}
    plan = anyshard.redistribute(src, dst)
    for k, v in dst["t"].items():
        assert torch.equal(full(v), want[k]), k
    return plan.sent_bytes(me)


def spec_task(seed: int, src_sizes: dict, dst_sizes: dict) -> int:
    """megatron_gpt local tensors from one layout to another; truth: the UCL reference."""
    me = dist.get_rank()
    src_world = 1
    for n in src_sizes.values():
        src_world *= n
    dst_world = 1
    for n in dst_sizes.values():
        dst_world *= n
    src = _locals(seed, src_sizes, me) if me < src_world else {}
    want = _locals(seed, dst_sizes, me) if me < dst_world else {}
    dst = {k: torch.full_like(v, 7.0) for k, v in want.items()}
    anyshard.redistribute(
        src,
        dst,
        src_spec="megatron_gpt",
        src_layout={**src_sizes, **CFG},
        dst_spec="megatron_gpt",
        dst_layout={**dst_sizes, **CFG},
    )
    for k, v in want.items():
        pad = dst[k] == 7.0  # padding the spec leaves unfilled (the reference zero-fills it)
        assert torch.equal(dst[k].masked_fill(pad & (v == 0), 0.0), v), k
    return len(want)


def error_task(case: str) -> str:
    me = dist.get_rank()
    src = train_state("fsdp4", 1)
    dst = train_state("tp4", 2)
    if case == "missing":
        del src["model"]["up.bias"]
    elif case == "shape" and me == 2:
        dst = {"model": {"up.bias": torch.zeros(3)}}

    def tensors(state) -> dict:
        out = {}
        for k, leaf in anyshard.api.state.flatten_state(state).items():
            v = leaf.value.to_local() if hasattr(leaf.value, "to_local") else leaf.value
            if isinstance(v, torch.Tensor):
                out[k] = v.clone()
        return out

    before = tensors(dst)
    try:
        anyshard.redistribute(src, dst)
    except anyshard.AnyshardError as e:
        after = tensors(dst)  # no byte moved: the destination is as it was
        assert after.keys() == before.keys() and all(
            torch.equal(after[k], before[k]) for k in after
        )
        return str(e)
    return "no error"


def large_moves_task(inflight: int) -> int:
    """Moves large enough to travel as their own messages (not packed): contiguous on one side
    and strided on the other, both ways, in several rounds under a small budget."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from anyshard.api import transfer as module
    from anyshard.api.transfer import DIRECT_MIN_BYTES

    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(11)
    full_w = torch.randn(4096, 512, generator=g)
    rows = distribute_tensor(full_w, mesh, [Shard(0)], src_data_rank=None)
    cols = distribute_tensor(torch.zeros_like(full_w), mesh, [Shard(1)], src_data_rank=None)
    plan = anyshard.redistribute({"w": rows}, {"w": cols}, max_inflight_bytes=inflight)
    assert any(m.nbytes >= DIRECT_MIN_BYTES for v in plan.messages.values() for g in v for m in g)
    assert all(len(v) > 1 for v in plan.messages.values())  # several messages, several rounds
    assert torch.equal(cols.full_tensor(), full_w)
    back = distribute_tensor(torch.zeros_like(full_w), mesh, [Shard(0)], src_data_rank=None)
    anyshard.redistribute({"w": cols}, {"w": back}, max_inflight_bytes=inflight)
    assert torch.equal(back.to_local(), rows.to_local())
    # repeated calls reuse the plan, and from the second repeat the staging buffer kept on CPU
    module._SPARE.clear()
    for k in range(3):
        rows.to_local().add_(k + 1)
        full_w += k + 1
        anyshard.redistribute({"w": rows}, {"w": cols}, max_inflight_bytes=inflight)
        assert torch.equal(cols.full_tensor(), full_w), f"repeat {k}"
        assert len(module._SPARE) == 1
    return len(plan.messages)


def reuse_plan_task(seed: int) -> list[str]:
    """Repeated calls between the same layouts reuse the first call's plan and stay bit-exact
    as the values change; a changed JSON value, or a rank that has no plan kept (a process that
    has just started), plans anew on every rank."""
    from anyshard.api import redistribute as module

    me = dist.get_rank()
    src, dst = train_state("fsdp2_tp2", seed), train_state("tp4", seed + 1)
    events = []
    first = anyshard.redistribute(src, dst)
    for k in range(3):
        for v in _tensors(src).values():
            (v.to_local() if hasattr(v, "to_local") else v).add_(k + 1)
        if k == 1 and me == 2:
            module._PLANS.clear()  # as a newly started rank would have it
        plan = anyshard.redistribute(src, dst)
        events.append("reused" if plan is first else "planned")
        first = plan
        want, got = _tensors(src), _tensors(dst)
        for name in sorted(want):
            assert torch.equal(full(want[name]), full(got[name])), f"{name} differs"
    src["meta"] = {"step": 2, "layout": "fsdp2_tp2"}
    plan = anyshard.redistribute(src, dst)
    events.append("reused" if plan is first else "planned")
    assert dst["meta"] == {"step": 2, "layout": "fsdp2_tp2"}
    return events
