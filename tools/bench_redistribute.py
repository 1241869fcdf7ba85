"""Live resharding: anyshard.redistribute vs a storage round trip vs DTensor.redistribute vs the
network floor.

4 gloo ranks move bench_reshard's state (``--gib`` GiB fp32 from ``--seed``) from (dp_shard=2,
tp=2) to tp=4 and dp_shard=4, and a ``megatron_gpt`` model from tp=2 x pp=2 to tp=4, by each of
`SYSTEMS` (the floor: the bytes each rank pair exchanges, prepacked, posted at once). After a
warm-up, ``--reps`` rounds in rotated order, measured from a common barrier, checked bit-exact
outside it; bytes received set against the minimum from global offsets.

The cost of the transit checksums (every piece's crc32c computed by its sender and checked by
its receiver, `anyshard.format.transit`): per case, ``--crc-reps`` pairs of redistribute with
the checks on and off (reused plans), alternating (on off, off on, ...), each ``--crc-calls``
calls in a row; the CPU seconds of every rank process (user + sys, all threads) summed over the
ranks, the pair's ratio, and the median of the ratios. With them, the bytes a call checks (what
every rank sends and receives: each is checksummed once at each end, what a rank keeps is not)
and the checks' CPU seconds per GiB checked, the figure to set against crc32c's own speed.

    python tools/bench_redistribute.py --gib 1 --reps 3 --write-docs
    python tools/bench_redistribute.py --quick                 # smoke test: 0.1 GiB, 1 rep
    python tools/bench_redistribute.py --crc-only --crc-reps 5   # the checksums' cost alone
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import shutil
import sys
import tempfile

import benchkit as h
from benchkit import llama

OURS = ("redistribute", "redistribute, new plan")
SYSTEMS = (*OURS, "anyshard-tmpfs", "dcp-tmpfs", "DTensor.redistribute", "floor", "floor+local")
CASES = ("dtensor->tp4", "dtensor->dp4", "megatron tp2xpp2->tp4")
MEGA = CASES[2]
HEADING = "## Live resharding: redistribute vs storage round trips (`tools/bench_redistribute.py`)"
INTRO = """Four ranks move a state into another layout with `anyshard.redistribute` (reused plan, or "new
plan"), against a round trip through tmpfs (anyshard, DCP), `DTensor.redistribute` and the network
floor (the bytes that cross ranks; `floor+local` adds a copy of what each rank holds). Cases: the
state of the reshard benchmark into tp=4 and dp_shard=4; a Megatron GPT (local tensors,
`megatron_gpt` spec) from tp=2 x pp=2 into tp=4. `redistribute` checks every piece that crosses
ranks against its sender's crc32c (on by default); the second table sets the CPU seconds of that
against the same calls without the checks, paired."""
CRC_LIMIT = 1.05  # the checksums' CPU seconds: at most 5% over the transfer's


def megatron_cfg(gib: float) -> dict:
    hid = 1024 if gib >= 0.5 else 512
    ffn, vocab = 4 * hid, 8192
    per_layer = 4 * (2 * hid * hid + hid * hid + hid * hid // 2 + 3 * ffn * hid + 2 * hid)
    layers = max(2, 2 * round((gib * h.GiB - 8 * vocab * hid) / per_layer / 2))
    return dict(hidden=hid, heads=hid // 64, kv_heads=hid // 128, ffn=ffn, vocab=vocab,
                layers=layers)  # fmt: skip


def spec_locals(layout: dict, rank: int, seed: int) -> dict:
    """The local tensors of ``rank`` under the megatron_gpt spec at ``layout`` (ranks
    row-major), filled from seeded logical tensors as the spec's pieces place them."""
    import torch

    from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
    from anyshard.ucl.library import load_spec

    spec = load_spec("megatron_gpt")
    lay = layout_for(spec, layout)
    if rank >= lay.world_size:
        return {}
    out, box = {}, lambda bounds: tuple(slice(*b) for b in bounds)
    for name, t in sorted(compile(spec, lay, coords_of_rank(lay.sizes, rank)).items()):
        out[name] = local = torch.zeros(t.stored_shape)
        for part in t.parts:
            logical = llama.full_tensor(part.logical, part.logical_shape, seed)
            for p in part.shard.pieces:
                n = int(torch.Size(p.array_shape).numel())
                arr = local.view(-1)[p.base : p.base + n].view(p.array_shape)
                arr[box(p.array_box)] = logical[box(p.logical_box)]
    return out


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import anyshard
    from anyshard._compat import compute_local_shape_and_global_offset as box

    spec, seed = llama.model_spec(cfg["gib"]), cfg["seed"]
    meshes, source, targets, expected = llama.states(spec, seed)
    minimum = dict.fromkeys(llama.TARGETS, 0)  # the bytes of a rank's target shards not held
    for _, shape, kind in spec:
        held = box(shape, meshes["src"], llama.placements(kind, llama.MESHES["src"][1]))
        for t in llama.TARGETS:
            need = box(shape, meshes[t], llama.placements(kind, llama.MESHES[t][1]))
            edges = zip(*held, *need, strict=True)  # each dim's (size, offset), held and needed
            both = math.prod(max(0, min(a + m, b + n) - max(a, b)) for m, a, n, b in edges)
            minimum[t] += 4 * (math.prod(need[0]) - both)
    mcfg = megatron_cfg(cfg["gib"])
    m_kw = {"src_spec": "megatron_gpt", "src_layout": {"tp": 2, "pp": 2, **mcfg},
            "dst_spec": "megatron_gpt", "dst_layout": {"tp": 4, **mcfg}}  # fmt: skip
    m_src = spec_locals(m_kw["src_layout"], rank, seed)
    m_want = spec_locals(m_kw["dst_layout"], rank, seed)
    want = {case: expected[case[-3:]] for case in CASES[:2]}
    want[MEGA] = {k: llama.digest(v) for k, v in m_want.items()}
    m_dst = {k: torch.zeros_like(v) for k, v in m_want.items()}
    del m_want
    state_bytes = {"dtensor": sum(v.to_local().numel() * 4 for v in source.values()),
                   "megatron": sum(v.numel() * 4 for v in m_src.values())}  # fmt: skip
    gc.collect()
    shm = [tempfile.mkdtemp(prefix="bench-redistribute-", dir="/dev/shm") if rank == 0 else None]
    dist.broadcast_object_list(shm, src=0)
    shm = shm[0]

    def dst_of(case: str):
        return m_dst if case == MEGA else {k: v.to_local() for k, v in targets[case[-3:]].items()}

    def make(case: str, system: str):
        """(the operation, the dict it fills with its outputs)."""
        mega = case == MEGA
        src, dst, kw = (m_src, m_dst, m_kw) if mega else (source, targets[case[-3:]], {})
        if system in OURS:
            return lambda: anyshard.redistribute(src, dst, **kw, reuse_plan=system == OURS[0]), None
        if system == "anyshard-tmpfs":
            save_kw = {"spec": "megatron_gpt", "layout": kw["src_layout"]} if mega else {}
            load_kw = {"spec": "megatron_gpt", "layout": kw["dst_layout"]} if mega else {}
            path = os.path.join(shm, "anyshard")
            return lambda: (anyshard.save(path, src, **save_kw),
                            anyshard.load(path, dst, **load_kw)), None  # fmt: skip
        if system == "dcp-tmpfs":
            path = os.path.join(shm, "dcp")
            writer, reader = dcp.FileSystemWriter(path), dcp.FileSystemReader(path)
            return lambda: (dcp.save(src, storage_writer=writer),
                            dcp.load(dst, storage_reader=reader)), None  # fmt: skip
        if system == "DTensor.redistribute":  # on the source mesh, to the target's shards
            out, kinds = {}, {n: k for n, _, k in spec}
            on_2x2 = lambda n: llama.placements(kinds[n], llama.MESHES[case[-3:]][1]) * 2  # noqa: E731
            return lambda: out.update({n: v.redistribute(meshes["src"], on_2x2(n))
                                       for n, v in source.items()}), out  # fmt: skip
        plan = anyshard.redistribute(src, dst, **kw)  # the floors: its pair sizes
        ops = []
        for (s, d), msgs in plan.messages.items():
            if rank in (s, d):
                buf = torch.empty(sum(m.nbytes for g in msgs for m in g), dtype=torch.uint8)
                op = dist.P2POp(dist.isend, buf, d) if s == rank else dist.P2POp(dist.irecv, buf, s)
                ops.append(op)
        held = sum(m.nbytes for m in plan.local) if system == "floor+local" else 0
        here, there = torch.ones(held, dtype=torch.uint8), torch.zeros(held, dtype=torch.uint8)

        def floor() -> None:
            reqs = dist.batch_isend_irecv(ops) if ops else []
            there.copy_(here)  # floor+local: one copy of the bytes the rank keeps
            for req in reqs:
                req.wait()

        return floor, None

    def measure(rep: int, case: str, system: str) -> dict | None:
        if case == MEGA and system in ("dcp-tmpfs", "DTensor.redistribute"):  # DTensor cases only
            return None
        fn, out = make(case, system)
        for v in dst_of(case).values():
            v.fill_(-7.25)
        gc.collect()
        dist.barrier()
        rec = h.measure(fn)
        plan = rec.pop("result", None)  # what the operation returns: redistribute's plan
        dist.barrier()
        if out:
            rec["rss_over"] -= sum(v.to_local().numel() * 4 for v in out.values())
        got = {k: v.to_local() for k, v in out.items()} if out else dst_of(case)
        rec["bad"] = [] if system.startswith("floor") else llama.mismatched(got, want[case])[:3]
        if system in OURS:
            mini = None if case == MEGA else minimum[case[-3:]]
            rec.update(received=plan.received_bytes(rank), minimum=mini)
        ranks = [None] * world
        dist.all_gather_object(ranks, rec)
        if rank == 0:
            for sub in ("anyshard", "dcp"):
                shutil.rmtree(os.path.join(shm, sub), ignore_errors=True)
            slowest = max(r["wall_s"] for r in ranks)
            print(f"  rep {rep + 1} {case:24s} {system:22s} {slowest:7.2f} s"
                  + ("  MISMATCH" if any(r["bad"] for r in ranks) else ""), flush=True)  # fmt: skip
        return {"rep": rep, "case": case, "system": system, "ranks": ranks}

    def crc_pairs(case: str) -> list[dict]:
        """``--crc-reps`` pairs of ``--crc-calls`` redistribute calls with the transit checks
        on and off, alternating; checked bit-exact after each."""
        src, dst, kw = (m_src, m_dst, m_kw) if case == MEGA else (source, targets[case[-3:]], {})
        calls = cfg["crc_calls"]

        def run(on: bool) -> None:
            for _ in range(calls):
                anyshard.redistribute(src, dst, **kw, check_transit=on)

        out = []
        run(True), run(False)  # warm: both plans made and kept
        plan = anyshard.redistribute(src, dst, **kw)
        sent = sum(
            m.nbytes for (s, _), v in plan.messages.items() if s == rank for g in v for m in g
        )
        checked = sent + plan.received_bytes(rank)  # checksummed at this end, every call
        for rep in range(cfg["crc_reps"]):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                for v in dst_of(case).values():
                    v.fill_(-7.25)
                gc.collect()
                dist.barrier()
                rec = h.measure(lambda on=on: run(on))
                dist.barrier()
                mine = {"cpu_s": rec["cpu_s"], "wall_s": rec["wall_s"], "checked": checked,
                        "bad": llama.mismatched(dst_of(case), want[case])[:3]}  # fmt: skip
                ranks = [None] * world
                dist.all_gather_object(ranks, mine)
                if rank == 0:
                    cpu = sum(x["cpu_s"] for x in ranks)
                    print(f"  crc pair {rep + 1} {case:24s} {'on ' if on else 'off'} "
                          f"{cpu:6.2f} CPU s" + ("  MISMATCH" if any(x["bad"] for x in ranks)
                                                  else ""), flush=True)  # fmt: skip
                out.append({"rep": rep, "case": case, "crc": on, "ranks": ranks})
        return out

    records = []
    if not cfg["crc_only"]:
        for case, system in itertools.product(CASES, SYSTEMS) if cfg["warmup"] else ():
            measure(-1, case, system)
        records = [r for rep, order in h.rotations(SYSTEMS, cfg["reps"]) for case in CASES
                   for s in order if (r := measure(rep, case, s))]  # fmt: skip
    crc = [r for case in CASES for r in crc_pairs(case)] if cfg["crc_reps"] else []
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shm, ignore_errors=True)
        return {"records": records, "crc": crc, "state_bytes": state_bytes, "megatron": mcfg,
                "crc_calls": cfg["crc_calls"]}  # fmt: skip
    return None


def mib(n: float) -> str:
    return f"{n / h.MiB:.0f}"


def summary(data: dict, inflight: int) -> tuple[list[list], list[tuple]]:
    """The table's rows (case by case, system by system) and the target checks."""
    got: dict[tuple[str, str], list] = {}
    for r in data["records"]:
        got.setdefault((r["case"], r["system"]), []).append(r["ranks"])
    times = {k: [max(x["wall_s"] for x in r) for r in recs] for k, recs in got.items()}
    med = {k: h.median(v) for k, v in times.items()}
    rows, checks, limit = [], [], inflight + 64 * h.MiB
    check = lambda what, ok, detail: checks.append((f"{label}: {what}", ok, detail))  # noqa: E731
    for case, system in sorted(got, key=lambda k: (CASES.index(k[0]), SYSTEMS.index(k[1]))):
        recs, t, recv = got[(case, system)], med[(case, system)], "-"
        rss = max(x["rss_over"] for r in recs for x in r)
        if system in OURS:
            last, label = recs[-1], case if system == OURS[0] else f"{case} (new plan)"
            recv = " / ".join(mib(x["received"]) for x in last)
            if all(x["minimum"] is not None for x in last):
                recv += " (minimum " + " / ".join(mib(x["minimum"]) for x in last) + ")"
                x = sum(y["received"] for y in last) / max(1, sum(y["minimum"] for y in last))
                check("bytes received <= 1.02x the minimum", x <= 1.02, f"{x:.3f}x")
            trip, fl, fll = (med[(case, s)] for s in ("anyshard-tmpfs", "floor", "floor+local"))
            what = ">= 3x faster than anyshard's tmpfs round trip"
            check(what, trip / t >= 3, f"{trip / t:.1f}x")
            if (dt := med.get((case, "DTensor.redistribute"))) is not None:  # DTensor cases
                check("no slower than DTensor.redistribute", t <= dt, f"{t / dt:.2f}x its time")
            check("<= 1.5x the floor", t <= 1.5 * fl, f"{t / fl:.2f}x ({t / fll:.2f}x floor+local)")
            what = "peak RSS over the state <= max_inflight_bytes + 64 MiB"
            check(what, rss <= limit, f"{mib(rss)} MiB (limit {mib(limit)})")
        bad = " MISMATCH" if any(x["bad"] for r in recs for x in r) else ""
        cpu = h.fmt_spread([sum(x["cpu_s"] for x in r) for r in recs], ".1f")
        rows.append([case, system, h.fmt_spread(times[(case, system)]) + bad,
                     f"{t / med[(case, OURS[0])]:.2f}x", cpu, mib(max(0, rss)), recv])  # fmt: skip
    return rows, checks


def crc_summary(data: dict) -> tuple[list[list], list[tuple]]:
    """The checksums' table (case by case: CPU seconds of all ranks with the checks and without,
    each pair's ratio, wall seconds) and the target check on the median ratio."""
    rows, checks = [], []
    for case in CASES:
        recs = [r for r in data["crc"] if r["case"] == case]
        if not recs:
            continue
        cpu = {(r["rep"], r["crc"]): sum(x["cpu_s"] for x in r["ranks"]) for r in recs}
        wall = {(r["rep"], r["crc"]): max(x["wall_s"] for x in r["ranks"]) for r in recs}
        reps = sorted({r["rep"] for r in recs})
        ratios = [cpu[(k, True)] / cpu[(k, False)] for k in reps]
        bad = " MISMATCH" if any(x["bad"] for r in recs for x in r["ranks"]) else ""
        on, off = [cpu[(k, True)] for k in reps], [cpu[(k, False)] for k in reps]
        gib = sum(x.get("checked", 0) for x in recs[0]["ranks"]) / h.GiB  # a call, all ranks
        per_gib = [(a - b) / (data["crc_calls"] * gib) for a, b in zip(on, off, strict=True) if gib]
        rows.append([case, h.fmt_spread(on) + bad, h.fmt_spread(off), h.fmt_spread(ratios, ".3f"),
                     f"{gib:.2f}", h.fmt_spread(per_gib, ".3f") if per_gib else "-",
                     h.fmt_spread([wall[(k, True)] for k in reps]),
                     h.fmt_spread([wall[(k, False)] for k in reps])])  # fmt: skip
        x = h.median(ratios)
        checks.append((f"{case}: CPU s with the transit checks <= {CRC_LIMIT}x without "
                       "(median of the pairs)", x <= CRC_LIMIT, f"{x:.3f}x"))  # fmt: skip
    return rows, checks


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=3, quick={"gib": 0.1, "reps": 1})
    p.add_argument("--gib", type=float, default=1.0, help="state size (1 GiB)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--seed", type=int, default=0, help="seeds the state's values")
    p.add_argument(
        "--crc-reps",
        type=int,
        default=5,
        help="pairs of calls with the transit checks on and off (5; 0: none)",
    )
    p.add_argument("--crc-calls", type=int, default=5, help="calls in a row per measurement (5)")
    p.add_argument("--crc-only", action="store_true", help="only the transit checks' pairs")
    args = p.parse_args(argv)
    from anyshard.api.redistribute import DEFAULT_MAX_INFLIGHT_BYTES

    load = h.RunLoad()
    data = h.run_ranks(worker, 4, vars(args))[0]
    rows, checks = summary(data, DEFAULT_MAX_INFLIGHT_BYTES) if data["records"] else ([], [])
    crc_rows, crc_checks = crc_summary(data)
    head = ["case", "system", "time s (slowest rank)", "vs redistribute", "CPU s (all ranks)"]
    head += ["peak RSS over state MiB", "bytes received per rank MiB"]
    n = data["crc_calls"]
    crc_head = [f"case ({n} calls)", "CPU s, checks on", "CPU s, off", "on / off (paired)",
                "GiB checked a call (both ends)", "checks' CPU s per GiB checked",
                "time s, on", "time s, off"]  # fmt: skip
    sb = data["state_bytes"]
    run = (f"4 gloo ranks, one torch thread each; median [min-max] of {args.reps}; seed "
           f"{args.seed}; per rank {mib(sb['dtensor'])} MiB of DTensors on (dp_shard=2, tp=2); "
           f"megatron_gpt {data['megatron']}, {mib(sb['megatron'])} MiB on rank 0; transit "
           f"checks: {args.crc_reps} pairs of {n} calls, median [min-max]")  # fmt: skip
    blocks = [(head, rows) if rows else None, (crc_head, crc_rows) if crc_rows else None,
              h.targets(checks + crc_checks)]  # fmt: skip
    h.report(args, argv, __file__, "bench_redistribute", run, blocks, load, heading=HEADING,
             intro=INTRO, data=data)  # fmt: skip
    bad = any("MISMATCH" in r[2] for r in rows) or any("MISMATCH" in r[1] for r in crc_rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
