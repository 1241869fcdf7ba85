"""Hugging Face Accelerate's FSDP checkpoints through anyshard (`anyshard_checkpoints`) against
Accelerate's own path (DCP's FileSystemWriter / FileSystemReader): ``save_state``, ``load_state``
in the same layout (FSDP2 on 2 ranks) and ``load_state`` under another layout (FSDP2 on 1 rank).

Two gloo ranks prepare an MLP of ``--mib`` MiB of fp32 parameters under FSDP2 (Accelerate on CPU,
its FSDP plugin forced as the tests do), take one AdamW step, save and load once with each
system untimed (first calls' imports), and then, ``--reps`` times in alternating order, save
with each system and load the checkpoint back (its files evicted from the page cache first),
each load checked bit-exact against the saved state. One rank then loads each system's
checkpoint under FSDP2 on a world of 1, alternating, checked bit-exact the same way. Time: the
slowest rank from a common barrier; CPU seconds and /proc/self/io bytes summed over the ranks.

    flock /tmp/anyshard-bench.lock python tools/bench_accelerate.py --write-docs
    python tools/bench_accelerate.py --quick                   # smoke test
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import benchkit as h

SYSTEMS = ("anyshard", "Accelerate (DCP)")
PHASES = ("save_state, 2 ranks", "load_state, 2 ranks", "load_state, 2 ranks -> 1 rank")
HEADING = "## Hugging Face Accelerate: save_state and load_state through anyshard "
HEADING += "(`tools/bench_accelerate.py`)"
INTRO = """Accelerate 1.15's FSDP checkpointing (FSDP2, `SHARDED_STATE_DICT`) of an MLP and its AdamW
state, on CPU with gloo: `save_state` and `load_state` inside `anyshard_checkpoints` against
Accelerate's own DCP path, alternating, each load checked bit-exact; the relaid-out load is FSDP2
on 1 rank from the 2-rank checkpoint. Bytes are /proc/self/io counters summed over ranks (they
include Accelerate's own small files, the same for both); the checkpoint's size is the model and
optimizer parts on disk."""
DIM = 1024


def _accelerator() -> Any:
    """An Accelerator on CPU with its FSDP2 plugin (SHARDED_STATE_DICT) in force: on CPU,
    Accelerate keeps MULTI_CPU and drops the plugin unless its state is set."""
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # fmt: skip
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # both states: each AcceleratorState() copies PartialState's distributed_type over its own
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _prepared(mib: int, seed: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    accelerator = _accelerator()
    torch.manual_seed(seed)
    layers = max(1, mib * (1 << 20) // (DIM * DIM * 4))
    model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _full_state(model: Any, optimizer: Any) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        t = torch.as_tensor(t)
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().clone()

    out = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for name, state in get_optimizer_state_dict(model, optimizer)["state"].items():
        out.update({f"{key}.{name}": full(v) for key, v in state.items()})
    return out


def _equal(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k].view(-1), b[k].view(-1)) for k in a)


def _checkpoint_call(system: str, accelerator: Any, fn: Any) -> Any:
    from anyshard.dcp.accelerate import anyshard_checkpoints

    if system == SYSTEMS[0]:
        with anyshard_checkpoints(accelerator):
            return fn()
    return fn()


def _evict(path: str) -> None:
    """Make the files under ``path`` cold, each on its own (fsync, then fadvise DONTNEED): not
    the whole machine's page cache, which other processes on a shared host are using."""
    for d, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _parts_bytes(path: str) -> int:
    return sum(h.du(os.path.join(path, p)) for p in ("pytorch_model_fsdp_0", "optimizer_0"))


def _two_ranks(rank: int, world: int, root: str, mib: int, reps: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    accelerator, model, optimizer = _prepared(mib, seed=0)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    saved = _full_state(model, optimizer)
    if rank == 0:
        save_file(saved, os.path.join(root, "reference.safetensors"))
    for system in SYSTEMS:  # warm-up, untimed: first calls' imports and allocations
        warm = os.path.join(root, "warm-up", system.split()[0])
        _checkpoint_call(system, accelerator, lambda: accelerator.save_state(warm))  # noqa: B023
        _checkpoint_call(system, accelerator, lambda: accelerator.load_state(warm))  # noqa: B023
    out = []
    for rep, order in h.rotations(SYSTEMS, reps):
        for system in order:
            path = os.path.join(root, system.split()[0])

            def fresh(path: str = path) -> None:
                shutil.rmtree(path, ignore_errors=True)

            save = h.measure_ranks(
                lambda: _checkpoint_call(system, accelerator, lambda: accelerator.save_state(path)),  # noqa: B023
                before=fresh,
            )
            size = _parts_bytes(path)
            with torch.no_grad():  # the load has to put every parameter back
                for p in model.parameters():
                    p.zero_()
            load = h.measure_ranks(
                lambda: _checkpoint_call(system, accelerator, lambda: accelerator.load_state(path)),  # noqa: B023
                before=lambda: _evict(path),  # noqa: B023
            )
            exact = torch.tensor(int(_equal(_full_state(model, optimizer), saved)))
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            for phase, recs in ((PHASES[0], save), (PHASES[1], load)):
                out.append({"phase": phase, "system": system, "rep": rep, "ranks": recs,
                            "exact": bool(exact) if phase == PHASES[1] else None,
                            "size": size})  # fmt: skip
    return out if rank == 0 else []


def _one_rank(rank: int, world: int, root: str, mib: int, reps: int) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    accelerator, model, optimizer = _prepared(mib, seed=1)
    reference = load_file(os.path.join(root, "reference.safetensors"))
    for system in SYSTEMS:  # warm-up, untimed
        warm = os.path.join(root, "warm-up", system.split()[0])
        _checkpoint_call(system, accelerator, lambda: accelerator.load_state(warm))  # noqa: B023
    out = []
    for rep, order in h.rotations(SYSTEMS, reps):
        for system in order:
            path = os.path.join(root, system.split()[0])
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load = h.measure_ranks(
                lambda: _checkpoint_call(system, accelerator, lambda: accelerator.load_state(path)),  # noqa: B023
                before=lambda: _evict(path),  # noqa: B023
            )
            exact = _equal(_full_state(model, optimizer), reference)
            out.append({"phase": PHASES[2], "system": system, "rep": rep, "ranks": load,
                        "exact": exact, "size": _parts_bytes(path)})  # fmt: skip
    return out


def _sum(recs: list[dict], key: str) -> float:
    return sum(r[key] for r in recs)


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__, reps=3, quick={"mib": 8, "reps": 1})
    ap.add_argument("--mib", type=int, default=64, help="fp32 parameters, MiB (AdamW adds 2x)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    args = ap.parse_args(argv)
    records, load = h.Records(args.jsonl, "accelerate"), h.RunLoad()
    root = tempfile.mkdtemp(prefix="bench-accelerate-", dir=args.dir)
    try:
        got = h.run_ranks(_two_ranks, 2, root, args.mib, args.reps)[0]
        got += h.run_ranks(_one_rank, 1, root, args.mib, args.reps)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows, ratio_rows = [], []
    for phase in PHASES:
        by: dict[str, dict[int, dict]] = {s: {} for s in SYSTEMS}
        for r in got:
            if r["phase"] != phase:
                continue
            recs = r["ranks"]
            flat = {"wall_s": max(x["wall_s"] for x in recs), "cpu_s": _sum(recs, "cpu_s"),
                    **{k: _sum(recs, k) for k in h.IO_KEYS}, "size": r["size"],
                    "exact": r["exact"]}  # fmt: skip
            by[r["system"]][r["rep"]] = records.add(flat, phase=phase, system=r["system"],
                                                    rep=r["rep"])  # fmt: skip
        for system in SYSTEMS:
            mine = list(by[system].values())
            exact = {m["exact"] for m in mine}
            rows.append([phase, system,
                         h.fmt_spread([m["wall_s"] for m in mine]),
                         h.fmt_spread([m["cpu_s"] for m in mine]),
                         h.fmt_spread([m["wchar"] / h.MiB for m in mine], ".1f"),
                         h.fmt_spread([m["rchar"] / h.MiB for m in mine], ".1f"),
                         f"{mine[0]['size'] / h.MiB:.1f}",
                         "-" if exact == {None} else ("yes" if exact == {True} else "NO")])  # fmt: skip
        base, ours = by[SYSTEMS[1]], by[SYSTEMS[0]]
        ratio_rows.append([phase,
                           h.fmt_spread([ours[k]["wall_s"] / base[k]["wall_s"] for k in ours]) + "x",
                           h.fmt_spread([ours[k]["cpu_s"] / base[k]["cpu_s"] for k in ours]) + "x"])  # fmt: skip
    head = ["phase", "system", "wall s (slowest rank)", "CPU s (all ranks)",
            "written MiB (wchar)", "read MiB (rchar)", "checkpoint MiB", "bit-exact"]  # fmt: skip
    ratio_head = ["phase", "anyshard / Accelerate wall (paired)", "anyshard / Accelerate CPU"]
    layers = max(1, args.mib * (1 << 20) // (DIM * DIM * 4))
    run = (f"{layers} x Linear({DIM}, {DIM}) fp32 ({layers * DIM * DIM * 4 / h.MiB:.0f} MiB of "
           f"parameters, AdamW), FSDP2; median [min-max] of {args.reps}, alternating; "
           f"accelerate {h.version('accelerate')}")  # fmt: skip
    h.report(args, argv, __file__, "accelerate", run, [(head, rows), (ratio_head, ratio_rows)],
             load, heading=HEADING, intro=INTRO, dirs={"checkpoints": args.dir},
             data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
