"""Goodput of the reference trainer with injected faults: recovery, stalls, lost steps, heals.

Each of ``--modes`` (`MODES`: (a) a whole-group restart, (b) and (c) FT-HSDP heals into the same
or another layout, (d) an elastic 4 -> 2 -> 4) runs ``--steps`` steps without faults and with one
per ``--fault-every`` steps, ``--reps`` pairs in alternating order. Goodput: steps x the pair's
fault-free median step over the job's wall time. Healthy ranks restarted per fault: the rank
processes alive at the fault whose forkserver or agent starts new ranks before the next, less the
rank it killed. ``--heal-gib``: the heal rate of an fp32 state between two 2-rank groups.

    python tools/bench_goodput.py --reps 3 --write-docs
    python tools/bench_goodput.py --modes restart --steps 8 --fault-every 8 --heal-gib 0 \\
        --config anyshard/trainer_integration/gpt/tiny.toml    # smoke test; other words: trainer
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from functools import partial

import benchkit as h
from benchkit.trainer_runs import free_port, median_step, train

# title, ranks, mesh dim of 2, heal layout, a lost node. restart: 4 ranks under the elastic agent,
# rank 3 SIGKILLed; the others: 2 replica groups x 2 ranks, group 1's rank 1 SIGKILLed (elastic:
# its node lost for --back-s) and group 1 alone restarts and heals from group 0; the (c) modes
# also pair a fault-free run whose group 1 switches layout at the first fault's step
MODES = {
    "restart": ("(a) whole-group restart", "4: pp=2 x dp_shard=2", None, None, False),
    "ft": ("(b) heal, same layout", "2 x 2 (dp_shard=2)", "dp_shard", None, False),
    "ft-relayout": ("(c) heal into tp=2", "2 x 2 (dp_shard=2)", "dp_shard", "tp=2", False),
    "ft-relayout-dp": ("(c) tp=2, heal into dp_shard=2", "2 x 2 (tp=2)", "tp", "dp_shard=2", False),
    "elastic": ("(d) elastic 4 -> 2 -> 4", "2 x 2 (dp_shard=2)", "dp_shard", None, True),
}
PER_FAULT = [  # label, key, format: per fault of every faulty run
    ("recovery, kill -> first step after restart (s)", "recovery_s", ".1f"),
    ("restart: process start -> run / build / restore", "phases", ""),
    ("steps lost per fault (redone after restoring)", "lost_steps", ""),
    ("healthy ranks restarted per fault (alive at it in a group that restarts)",
     "healthy_restarted", ""),
    ("healthy group's stall per fault (s)", "healthy_stall_s", ".2f"),
    ("heal source, layout", "heal", ""),
    ("bytes moved per heal (MiB)", "heal_mib", ".1f"),
    ("heal time, quorum + transfer (s)", "heal_s", ".2f"),
    ("heal bit-identical (state digests)", "heal_bit_identical", ""),
]  # fmt: skip


def job(args, mode: str, kind: str, run_dir: str) -> dict:
    """One run of ``mode``: ``kind`` "clean" (no fault), "faulty", or "switch" (no fault, group
    1 switching to the heal layout at the first fault's step)."""
    _, _, dim, heal, lose = MODES[mode]
    opts = ["--train.steps", str(args.steps), "--checkpoint.keep_last", "2", *args.trainer]
    steps, restarts = (args.fault_steps if kind == "faulty" else []), len(args.fault_steps)
    if mode == "restart":
        opts = ["--parallel.pp", "2", "--parallel.dp_shard", "2", *opts]
        run = train(run_dir, opts, nproc=4, restarts=restarts, launcher=args.launcher,
                    faults=",".join(f"3:{s}" for s in steps))  # fmt: skip
        per = [dict(next((e for e in run["events"] if "recovery_s" in e and e["time"] > f["time"]),
                         {})) for f in run["faults"]]  # fmt: skip
        for x in (x for x in per if x):
            x["phases"] = f"{x.get('process_to_run_s') or float('nan'):.1f} / {x['build_s']:.1f}"
            x["phases"] += f" / {x['restore_s']:.1f} s"
    else:
        opts = ["--replicas", "2", "--heartbeat-ms", str(args.heartbeat_ms), *opts]
        opts += [f"--parallel.{dim}", "2", *(["--ft.heal_layout", heal] if heal and steps else [])]
        for s in steps:
            opts += ["--lose-group", f"1:{s}:{args.back_s:g}"] if lose else ["--fault", f"1:1:{s}"]
        if kind == "switch":
            opts += ["--group-args", f"1:--parallel.relayout_at {args.fault_steps[0]}:{heal}"]
        run = train(run_dir, opts, nproc=2, restarts=restarts)
        if kind != "faulty":
            return run
        from anyshard.trainer_integration.demos.ft_demo import summarize

        run["summary"] = summarize(run_dir, "elastic" if lose else "ft-hsdp")
        per = run["summary"]["faults"]
        for x in per:
            x["heal"] = f"{x['heal_source']}, {x['heal_layout']}"
            x["heal_mib"] = x["heal_bytes"] and x["heal_bytes"] / h.MiB
    # per fault, the healthy ranks restarted: those alive at it whose parent (forkserver or
    # agent) starts new ranks before the next fault, less the rank it killed
    times = [f["time"] for f in run["faults"]] + [float("inf")]
    for x, f, t0, t1 in zip(per, run["faults"], times, times[1:], strict=False):
        again = {parent for first, _, parent in run["ranks"] if t0 < first <= t1}
        alive = [p for first, last, p in run["ranks"] if first <= t0 <= last + 0.5]
        x["healthy_restarted"] = sum(p in again for p in alive) - (f["rank"] is not None)
    return {**run, "per_fault": per}


def mode_rows(args, runs: dict[str, list[dict]]) -> list[list[str]]:
    """One row per figure, one column per mode; each figure over every pair of runs."""

    def both(fn, form: str):  # no fault / with faults
        return lambda m, ps: " / ".join(
            h.fmt_spread([fn(p, k) for p in ps], form) for k in ("clean", "faulty"))  # fmt: skip

    def ratio(base: str):
        return lambda m, ps: h.fmt_spread(
            [100 * p[base]["wall_s"] / p["faulty"]["wall_s"] for p in ps], ".1f") if base in ps[0] else "-"  # fmt: skip

    def each(key: str, form: str, m: str, ps: list[dict]) -> str:  # "faults of run 1; of run 2 ..."
        got = [", ".join(f"{x[key]:{form}}" for x in p["faulty"]["per_fault"]
                         if x.get(key) is not None) for p in ps]  # fmt: skip
        return "; ".join(r or "-" for r in got) if any(got) else "-"

    def healthy(m: str, ps: list[dict]) -> str:
        s = [p["faulty"].get("summary") for p in ps]
        return "; ".join(f"{x['healthy_restarts']} / {x['lost_steps']} / "
                         f"{x.get('rescued_steps', 0)}" for x in s if x) or "-"  # fmt: skip

    start = lambda r: next(e for e in r["events"] if e["event"] == "start")  # noqa: E731
    what = {"restart": "rank 3", "elastic": "group 1's node"}
    figures = [
        ("ranks (replica groups x ranks)", lambda m, ps: MODES[m][1]),
        ("faults at steps", lambda m, ps: f"{args.fault_steps} ({what.get(m, 'group 1 rank 1')})"),
        ("wall time, no fault / with faults (s)", both(lambda p, k: p[k]["wall_s"], ".1f")),
        ("median step, no fault / with faults (ms)", both(lambda p, k: 1e3 * median_step(p[k]), ".0f")),
        ("start-up to first step, no fault / with faults (s)",
         both(lambda p, k: start(p[k])["startup_to_first_step_s"], ".1f")),
        ("steps run in all, no fault / with faults", both(lambda p, k: len(p[k]["losses"]), ".0f")),
        ("CPU s of the job, no fault / with faults", both(lambda p, k: p[k]["cpu_s"], ".0f")),
        ("goodput, no fault / with faults (%)",
         both(lambda p, k: 100 * args.steps * median_step(p["clean"]) / p[k]["wall_s"], ".1f")),
        ("goodput with faults / without, paired (%)", ratio("clean")),
        ("goodput with faults / fault-free run switching layout at the first fault's step (%)",
         ratio("switch")),
        *((label, partial(each, key, form)) for label, key, form in PER_FAULT),
        ("healthy group's restarts / steps it redid / steps it saved", healthy),
    ]  # fmt: skip
    return [[label, *(fn(m, ps) for m, ps in runs.items())] for label, fn in figures]


def _heal_rank(rank: int, world: int, gib: float, frm: str, into: str, ports: list[int]):
    """Ranks 0-1: the source group, holding ``gib`` GiB of fp32 state laid out ``frm``; ranks
    2-3: the healer, receiving it laid out ``into`` (dp_shard=2: rows, tp=2: columns)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from anyshard.trainer_integration.heal import AnyshardTransport
    from anyshard.ucl.library import preload

    preload()  # as the trainer's ranks have it: the launcher's forkserver builds the parsers
    role, g, port = ("source", "healer")[rank // 2], rank % 2, ports[rank // 2]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "g"))["g"]
    cols = int((into if role == "healer" else frm) == "tp=2")
    # 64 MiB tensors; the healer's hold other values, written as a trainer's are when it builds
    # its model: the first touch of fresh pages is no part of a heal
    state = {f"w{i}": DTensor.from_local(
        torch.full((2048 * (1 + cols), 4096 // (1 + cols)), float(i) if role == "source" else -1.0),
        mesh, [Shard(cols)], shape=(4096, 4096), stride=(4096, 1))
        for i in range(max(1, int(gib * h.GiB / 4 / 4096**2)))}  # fmt: skip
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=g == 0, wait_for_workers=False)
    tr = AnyshardTransport(state=lambda: {"default": state}, replica_id=role, group_rank=g,
                           group_world_size=2, store_addr="127.0.0.1", store_port=port,
                           timeout=timeout)  # fmt: skip
    metas = [None] * world
    dist.all_gather_object(metas, tr.metadata())
    out = None
    if role == "source":
        sd = {"user": {"default": state}, "torchft": {"step": 1, "batches_committed": 2}}
        tr.send_checkpoint([1], 1, sd, timeout)
    else:
        time.sleep(0.2)  # the source in send_checkpoint
        out = h.measure(lambda: tr.recv_checkpoint(0, metas[g], 1, timeout) and None)
        out["ok"] = all(bool((v.to_local() == int(k[1:])).all()) for k, v in state.items())
        out["gib"] = len(state) * 4 * 4096**2 / h.GiB
    dist.barrier()
    del store
    return out


def heal_rates(args, records: h.Records) -> list[list[str]]:
    """Heal of each pair of layouts in fresh processes, ``--heal-reps`` times in rotated order;
    its time: the slower healer rank's."""
    pairs = [("dp_shard=2", "dp_shard=2"), ("dp_shard=2", "tp=2"), ("tp=2", "dp_shard=2")]
    got: dict = {f"{frm} -> {into}": [] for frm, into in pairs}
    for rep, order in h.rotations(pairs, args.heal_reps):
        for frm, into in order:
            heal = f"{frm} -> {into}"
            out = h.run_ranks(_heal_rank, 4, args.heal_gib, frm, into, [free_port(), free_port()])
            if not all(r["ok"] for r in out[2:]):
                raise SystemExit(f"heal {heal}: the healed state differs from the source")
            rec = {"wall_s": max(r["wall_s"] for r in out[2:]), "gib": out[2]["gib"]}
            got[heal].append(records.add(rec, heal=heal, rep=rep))
    return [[heal, f"{recs[0]['gib']:.2f}", h.fmt_spread([r["wall_s"] for r in recs]),
             f"{h.median_of(recs, 'wall_s') / recs[0]['gib']:.2f}"]
            for heal, recs in got.items()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fault-every", type=int, default=50, help="a fault mid-way in every N steps")
    p.add_argument("--sync", dest="async_", action="store_false", help="synchronous checkpoints")
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps (2)")
    how = "restart mode: warm (forked ranks, as the demo runs) or torchrun (new interpreters)"
    p.add_argument("--launcher", choices=["warm", "torchrun"], default="warm", help=how)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--back-s", type=float, default=5.0, help="elastic: seconds a lost node is away")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="FT-HSDP: lighthouse timeout")
    p.add_argument("--heal-gib", type=float, default=1.0, help="heal-rate state size (0: skip)")
    p.add_argument("--heal-reps", type=int, default=3, help="repetitions of the heal-rate run")
    p.add_argument("--reps", type=int, default=1, help="pairs (fault-free, faulty) of each mode")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (initialisation, data)")
    args, args.trainer = p.parse_known_args(argv)
    modes = [m for m in h.words(p, "--modes", args.modes, [*MODES, "none"]) if m != "none"]
    args.trainer += ["--checkpoint.every_steps", str(args.every), "--train.seed", str(args.seed)]
    args.trainer += ["--checkpoint.async_", "true"] if args.async_ else []
    args.fault_steps = list(range(args.fault_every // 2, args.steps, args.fault_every))
    records, load, runs = h.Records(args.jsonl, "goodput"), h.RunLoad(), {}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        for rep in range(args.reps):
            for mode in modes:
                kinds = ["clean", "faulty", *(["switch"] if MODES[mode][3] else [])]
                pair = {}
                for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
                    pair[kind] = job(args, mode, kind, os.path.join(tmp, f"{mode}-{kind}-{rep}"))
                    records.add(pair[kind], mode=mode, kind=kind, rep=rep, steps=args.steps,
                                every=args.every, sync=not args.async_)  # fmt: skip
                    print(f"{mode} {kind} {rep + 1}: {pair[kind]['wall_s']:.1f} s", flush=True)
                runs.setdefault(mode, []).append(pair)
    blocks = []
    if runs:
        head = ["", *(MODES[m][0] for m in runs)]
        blocks += [f"Faults and goodput, median [min-max] of {args.reps} pair(s), each run in "
                   "order (runs separated by ';'):", (head, mode_rows(args, runs))]  # fmt: skip
    if args.heal_gib > 0:
        head = ["replica state", "GiB", f"s: median [min-max] of {args.heal_reps}", "s per GiB"]
        rows = heal_rates(args, records)
        blocks += ["Heal rate (2 replica groups x 2 ranks, fp32 state):", (head, rows)]
    ckpt = "an async" if args.async_ else "a sync"
    run = (f"{args.steps} steps, {ckpt} checkpoint every {args.every}, faults at steps "
           f"{args.fault_steps}, launcher {args.launcher}, heartbeat {args.heartbeat_ms} ms, "
           f"trainer seed {args.seed}, trainer options {' '.join(args.trainer)}")  # fmt: skip
    h.report(args, argv, __file__, "goodput", run, blocks, load, data=records.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
