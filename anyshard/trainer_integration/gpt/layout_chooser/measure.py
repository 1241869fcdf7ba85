"""Timings on the job's own ranks, the steps of `costmodel.calibrate`: square multiplies with
every rank busy, streaming adds, an op's and a DTensor op's dispatch, each collective over
subgroups of the live process group (and what it costs more among ranks busy computing), the
same over subgroups across nodes, one of the model's blocks forward and backward. Call each on
every rank at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.layout_chooser.memory import FLOAT
from anyshard.trainer_integration.planning.step_cost import RING
from anyshard.trainer_integration.planning.topology import span_at

__all__ = [
    "block_s",
    "collective_s",
    "crossing_strides",
    "peer_wait_s",
    "slowest",
    "time_busy",
    "time_calls",
    "time_collectives",
    "time_crossing",
    "time_gemms",
    "time_local",
]


def time_calls(fn, reps: int) -> float:
    """Seconds of one call of ``fn``: the mean of ``reps`` calls after one that warms it up."""
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def time_busy(fn, budget_s: float) -> float:
    """Seconds of one call of ``fn`` while every rank calls it (call on every rank at once):
    each rank calls ``fn`` until ``budget_s`` has passed and at least twice, and counts only
    the calls that ended by then, when no rank had stopped yet; one call when none had."""
    fn()  # warm
    t0 = time.perf_counter()
    ends: list[float] = []
    while len(ends) < 2 or ends[-1] < budget_s:
        fn()
        ends.append(time.perf_counter() - t0)
    done = [t for t in ends if t <= budget_s] or ends[:1]
    return done[-1] / len(done)


def peer_wait_s(burst, group, n: int = 5, pairs: int = 3) -> float:
    """How much longer ``n`` bursts of compute each followed by a small all-reduce in
    ``group`` take than the bursts alone, per all-reduce, with every rank doing the same at
    once (the median of ``pairs`` alternating pairs); the all-reduce's own time included."""
    import torch
    import torch.distributed as dist

    tiny = torch.ones(256)

    def both() -> None:
        burst()
        dist.all_reduce(tiny, group=group)

    extra = []
    for _ in range(pairs):
        dist.barrier()
        alone = time_calls(burst, n)
        dist.barrier()
        extra.append(time_calls(both, n) - alone)
    return max(0.0, sorted(extra)[len(extra) // 2])


def time_gemms(
    sizes: Sequence[int], budget_s: float, barrier: Callable[[], None]
) -> tuple[list[tuple[int, float]], Callable[[], Any]]:
    """Seconds of a square multiply of each of ``sizes`` with every rank multiplying at once,
    and the largest multiply (to time it once more alone)."""
    import torch

    gemm = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        barrier()

        def mm(a=a, b=b):
            return a @ b

        gemm.append((n, time_busy(mm, budget_s / 4)))
    return gemm, mm


def time_local(world: int, barrier: Callable[[], None]) -> tuple[tuple[float, float], float, float]:
    """Streaming adds (bytes, seconds), and the seconds of dispatching an op and a DTensor op
    (on a mesh of every rank; ten ops where there is one rank)."""
    import torch

    big = torch.randn(1 << 22)
    out = torch.empty_like(big)
    barrier()
    stream = (3 * big.numel() * FLOAT, time_calls(lambda: torch.add(big, big, out=out), 5))
    tiny = torch.ones(4)
    op_s = time_calls(lambda: tiny.add(1.0), 500)
    dtensor_op_s = op_s * 10
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        dt = distribute_tensor(torch.ones(world * 4), mesh, [Shard(0)])
        dtensor_op_s = max(op_s, time_calls(lambda: dt.add(1.0), 100))
    return stream, op_s, dtensor_op_s


def time_collectives(
    sizes: Sequence[int],
    message_bytes: Sequence[int],
    gemm: Sequence[tuple[int, float]],
    world: int,
    rank: int,
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """Per "kind/group", a collective's seconds at each of ``message_bytes`` over subgroups of
    ``group`` consecutive ranks, for each of ``sizes``; and per group size, what a collective
    costs among ranks busy computing beyond its time among idle ones (`peer_wait_s`)."""
    import torch
    import torch.distributed as dist

    coll: dict[str, list[tuple[int, float]]] = {}
    wait: dict[str, float] = {}
    # bursts of about 10 ms of multiplies with every rank busy: a step computes that long or
    # longer between two collectives
    n_burst, t_burst = gemm[-2] if len(gemm) > 1 else gemm[-1]
    a_burst, b_burst = torch.randn(n_burst, n_burst), torch.randn(n_burst, n_burst)
    burst_reps = max(1, round(0.01 / max(1e-6, t_burst)))

    def burst() -> None:
        for _ in range(burst_reps):
            a_burst @ b_burst

    for g in sizes:
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        mine = groups[rank // g]
        for kind, points in _time_kinds(g, rank % g, mine, message_bytes).items():
            coll[f"{kind}/{g}"] = points
        # what a collective costs among busy ranks beyond its time among idle ones
        idle = min(coll[f"all_reduce/{g}"])[1]
        wait[str(g)] = max(0.0, peer_wait_s(burst, mine) - idle)
    return coll, wait


def _time_kinds(
    g: int, me: int, group, message_bytes: Sequence[int]
) -> dict[str, list[tuple[int, float]]]:
    """Per kind, a collective's seconds at each of ``message_bytes`` in ``group`` of ``g``
    ranks, this rank its ``me``-th member."""
    return {
        kind: [
            (nbytes, collective_s(kind, max(g, nbytes // FLOAT // g * g), g, me, group))
            for nbytes in message_bytes
        ]
        for kind in (*RING, "send")
    }


def crossing_strides(
    sizes: Sequence[int], world: int, devices_per_node: int
) -> dict[tuple[int, int], int]:
    """Per placement across nodes (group size, members per node) that subgroups of ``sizes``
    members evenly spaced over ``world`` ranks form on nodes of ``devices_per_node`` ranks, the
    smallest spacing (stride) that forms it: the groups `time_crossing` measures.

    >>> crossing_strides([2, 4], 4, 2)  # pairs one node apart; the whole world
    {(2, 1): 2, (4, 2): 1}
    """
    out: dict[tuple[int, int], int] = {}
    for g in sizes:
        for stride in range(1, world // g + 1):
            if world % (g * stride):
                continue
            span = span_at(g, stride, devices_per_node)
            if span.nodes > 1:
                out.setdefault((g, span.per_node), stride)
    return out


def time_crossing(
    sizes: Sequence[int],
    message_bytes: Sequence[int],
    coll: dict[str, list[tuple[int, float]]],
    world: int,
    rank: int,
    devices_per_node: int,
) -> dict[str, list[tuple[int, float]]]:
    """Per "kind/group/per_node", a collective's seconds at each of ``message_bytes`` over
    subgroups whose members sit on several nodes of ``devices_per_node`` ranks, one per
    placement `crossing_strides` finds (members ``stride`` ranks apart; the timings ``coll``
    of consecutive ranks where those cross nodes already). Empty on one node."""
    import torch.distributed as dist

    out: dict[str, list[tuple[int, float]]] = {}
    if world <= devices_per_node:
        return out
    for (g, q), stride in crossing_strides(sizes, world, devices_per_node).items():
        if stride == 1:  # consecutive ranks, measured already
            out.update({f"{k}/{g}/{q}": coll[f"{k}/{g}"] for k in (*RING, "send")})
            continue
        block = g * stride
        members = [
            [b + off + k * stride for k in range(g)]
            for b in range(0, world, block)
            for off in range(stride)
        ]
        groups = [dist.new_group(m) for m in members]  # every rank creates every group
        i = next(i for i, m in enumerate(members) if rank in m)
        timed = _time_kinds(g, members[i].index(rank), groups[i], message_bytes)
        out.update({f"{k}/{g}/{q}": points for k, points in timed.items()})
    return out


def slowest(
    gemm: Sequence[tuple[int, float]], block: float
) -> tuple[list[tuple[int, float]], float]:
    """The slowest rank's multiply and block timings (call on every rank): it paces the step."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([t for _, t in gemm] + [block], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    *slowest, block = mine.tolist()
    return [(n, float(t)) for (n, _), t in zip(gemm, slowest, strict=True)], block


def collective_s(kind: str, n: int, g: int, me: int, group) -> float:
    """Seconds for one ``kind`` collective on ``n`` floats (the whole message) in ``group``."""
    import torch
    import torch.distributed as dist

    whole, part = torch.ones(n), torch.ones(n // g)
    if kind == "all_gather":

        def fn():
            dist.all_gather_into_tensor(whole, part, group=group)
    elif kind == "reduce_scatter":

        def fn():
            dist.reduce_scatter_tensor(part, whole, group=group)
    elif kind == "all_reduce":

        def fn():
            dist.all_reduce(whole, group=group)
    elif kind == "all_to_all":
        out = torch.empty_like(whole)

        def fn():
            dist.all_to_all_single(out, whole, group=group)
    else:  # a pipeline's neighbour exchange: pairs 0 -> 1, 2 -> 3, ... within the group
        peer = me ^ 1
        ranks = dist.get_process_group_ranks(group)

        def fn():
            if peer >= g:
                return
            if me % 2 == 0:
                dist.send(whole, ranks[peer], group=group)
            else:
                dist.recv(whole, ranks[peer], group=group)

    dist.barrier(group=group)
    return time_calls(fn, 5)


def block_s(cfg: Config, world: int, budget_s: float) -> float:
    """Measured seconds of one of the model's blocks (freshly initialised, on this rank's
    device: the CPU), forward and backward at a data-parallel rank's tokens of ``world`` ranks."""
    import torch

    from anyshard.trainer_integration.gpt.model import ParallelContext, TransformerBlock

    seqs = max(1, cfg.train.global_batch // world)
    block = TransformerBlock(cfg.model, ParallelContext())
    x = torch.randn(seqs, cfg.train.seq_len, cfg.model.dim, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return time_busy(step, budget_s)
