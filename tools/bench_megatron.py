"""Megatron-Core checkpoints through anyshard's strategies against Megatron's own ``torch_dist``
format, side by side: save, resume under the same layout, resume under another layout.

Two gloo ranks (CPU) build a GPTModel under tensor parallelism 2 with Adam (one training step, so
the moments are not zeros) and, ``--reps`` times with the systems alternated (A B, B A, ...):
save it through ``dist_checkpointing`` (anyshard: `anyshard.dcp.megatron.save`, nothing pickled;
Megatron: ``sharded_strategy=("torch_dist", 1)``), load it back under tp=2 and under tp=1 x pp=2,
each load checked bit-exact against the saved weights. Megatron's torch_dist runs on CPU through
the test's shims (tests/dist/_megatron_tasks.py: ``torch.cuda.synchronize`` and
``current_device`` stood in for). Time: the slowest rank from a common barrier; CPU: both ranks'
seconds added (torch_dist's writer may write from forked processes, whose CPU is not counted:
the wall time is the fair figure); size: the checkpoint directory on disk.

    flock /tmp/anyshard-bench.lock python tools/bench_megatron.py --write-docs
    python tools/bench_megatron.py --quick                               # smoke test
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import benchkit as h

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS_DIR = os.path.join(HERE, "..", "tests", "dist")
SYSTEMS = ("anyshard", "Megatron torch_dist")
OPS = ("save", "resume tp=2", "resume tp=1 x pp=2")
HEADING = "## Megatron-Core: anyshard's strategies against torch_dist (`tools/bench_megatron.py`)"
INTRO = """A GPTModel (megatron-core 0.16.1, CPU, 2 gloo ranks) with its Adam state saved through
`dist_checkpointing` by anyshard's strategies (`anyshard.dcp.megatron.save`) and by Megatron's
own `torch_dist`, then loaded under the same layout (tp=2) and under another (tp=1 x pp=2), each
load checked bit-exact. Systems alternate within each repetition. Time: the slowest rank from a
common barrier; CPU: both ranks' seconds (torch_dist's writer may write from forked processes,
not counted); size: the checkpoint on disk."""


def _rank(rank: int, world: int, root: str, dims: dict, reps: int) -> list | None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, TASKS_DIR)
    import _megatron_tasks as mt

    for k, v in dims.items():
        setattr(mt, k, v)
    from megatron.core import dist_checkpointing

    import anyshard.dcp.megatron as am

    out = []
    with mt._cpu_shims():
        ps, model, opt = mt._build(2, 1, seed=1)
        mt._step(ps, model, opt, 1)
        saved = mt._full_weights(ps, model)
        sd = mt._sharded(model, opt, 1)
        for rep, order in h.rotations(SYSTEMS, reps):
            for system in order:
                path = os.path.join(root, f"{rep}-{system.split()[0]}")
                if rank == 0:
                    os.makedirs(path)
                dist.barrier()
                if system == "anyshard":
                    save = lambda: am.save(sd, path)  # noqa: B023, E731
                else:
                    save = lambda: dist_checkpointing.save(  # noqa: E731
                        sd,
                        path,  # noqa: B023
                        sharded_strategy=("torch_dist", 1),
                    )
                recs = {"save": h.measure_ranks(save)}
                for op, (tp, pp) in (("resume tp=2", (2, 1)), ("resume tp=1 x pp=2", (1, 2))):
                    ps, model, opt = mt._build(tp, pp, seed=99)
                    target = mt._sharded(model, opt, 1, loading=True)

                    def load(target=target, model=model, opt=opt):
                        state = dist_checkpointing.load(target, path)  # noqa: B023
                        model.load_state_dict(state["model"])
                        opt.load_state_dict(state["optimizer"])

                    recs[op] = h.measure_ranks(load)
                    for name, w in mt._full_weights(ps, model).items():
                        if not torch.equal(w, saved[name]):
                            raise SystemExit(f"{system} {op}: {name} differs on rank {rank}")
                ps, model, opt = mt._build(2, 1, seed=1)
                dist.barrier()
                size = h.du(path)
                for op, ranks in recs.items():
                    out.append({
                        "system": system, "op": op, "rep": rep, "bytes": size,
                        "wall_s": max(r["wall_s"] for r in ranks),
                        "cpu_s": sum(r["cpu_s"] for r in ranks),
                    })  # fmt: skip
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path)
        ps.destroy_model_parallel()
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    quick = {"hidden": 64, "layers": 2, "vocab": 512, "reps": 1}
    ap = h.parser(__doc__, reps=3, quick=quick, dirs=False)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (ffn: 4x)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (even)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory)")
    args = ap.parse_args(argv)
    dims = {"HIDDEN": args.hidden, "FFN": 4 * args.hidden, "LAYERS": args.layers,
            "VOCAB": args.vocab, "HEADS": 8, "SEQ": 64, "BATCH": 2}  # fmt: skip
    records, load = h.Records(args.jsonl, "megatron"), h.RunLoad()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-megatron-") as root:
        got = h.run_ranks(_rank, 2, root, dims, args.reps)[0]
    recs = [records.add(r) for r in got]
    rows = []
    for op in OPS:
        base = {r["rep"]: r for r in recs if r["op"] == op and r["system"] == SYSTEMS[1]}
        for system in SYSTEMS:
            mine = [r for r in recs if r["op"] == op and r["system"] == system]
            rel = [r["wall_s"] / base[r["rep"]]["wall_s"] for r in mine]
            rows.append([op, system, h.fmt_spread([r["wall_s"] for r in mine]),
                         h.fmt_spread(rel) + "x", h.fmt_spread([r["cpu_s"] for r in mine]),
                         h.fmt_spread([r["bytes"] / h.MiB for r in mine], ".1f")])  # fmt: skip
    head = ["operation", "system", "wall s (slowest rank)", "/ torch_dist (paired)",
            "CPU s (both ranks)", "checkpoint MiB"]  # fmt: skip
    params = 2 * args.vocab * args.hidden + args.layers * 12 * args.hidden**2
    run = (f"GPTModel hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} (about "
           f"{params / 1e6:.0f} M parameters, fp32, with Adam's moments); median [min-max] of "
           f"{args.reps}; megatron-core {h.version('megatron-core')}")  # fmt: skip
    h.report(args, argv, __file__, "megatron", run, [(head, rows)], load, heading=HEADING,
             intro=INTRO, data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
