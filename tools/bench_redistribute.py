"""Live resharding benchmark: anyshard.redistribute vs a storage round trip vs DTensor.redistribute
vs the network floor.

Run (1 GiB fp32 state, 3 repetitions, a few minutes on 2 cores; writes docs/benchmarks.md):

    python tools/bench_redistribute.py --write-docs

Smoke test (0.1 GiB, 1 repetition): ``python tools/bench_redistribute.py --quick``.

What it does, in one run: spawns 4 gloo ranks on CPU (one torch thread each) and builds

* the state of tools/bench_reshard.py (``--gib`` GiB fp32, transformer-like) as DTensors on a
  (dp_shard=2, tp=2) mesh, and targets on a tp=4 mesh and on a dp_shard=4 mesh;
* a Megatron GPT (the shipped ``megatron_gpt`` UCL spec, fused QKV and SwiGLU, padded
  vocabulary) of about the same size as plain local tensors under tp=2 x pp=2, and targets
  under tp=4.

For each case and repetition (systems in rotated order), it times, from a common barrier to the
slowest rank:

* ``redistribute``: ``anyshard.redistribute(src, dst)`` (default ``max_inflight_bytes``, 256 MiB),
  as a repeated call makes it: the plan of the earlier call between the same layouts is reused
  (the ranks exchange digests of their descriptions);
* ``redistribute, new plan``: the same with ``reuse_plan=False``, as a first call makes it: the
  ranks exchange their descriptions and each plans its part;
* ``anyshard-tmpfs``: ``anyshard.save`` of the source to /dev/shm, then ``anyshard.load`` into
  the target;
* ``dcp-tmpfs``: ``dcp.save`` then ``dcp.load`` through /dev/shm (DTensor cases);
* ``DTensor.redistribute``: tensor by tensor, on the source's own (dp_shard, tp) mesh, into the
  placements that give every rank the same shard as the target (``[Shard(d), Shard(d)]`` is
  tp=4's or dp_shard=4's ``Shard(d)``); DTensor cases;
* ``floor``: the bytes each rank pair must exchange, prepacked as one buffer per pair and posted
  at once with ``batch_isend_irecv``;
* ``floor+local``: the same, plus one copy (one flat buffer into another) of as many bytes as the
  rank's target takes from its own source: any redistribution into separate target tensors
  copies them.

Every result is checked bit-exact (BLAKE2b digest of each local shard) outside the timed region.
Bytes: what each rank receives, against the minimum (the bytes of its target that its source
does not already hold, computed from the shards' global offsets, independently of the
planner). Peak RSS over the state: VmHWM (reset before each operation) minus VmRSS just before
it, with source and target already allocated and touched (DTensor.redistribute allocates its
outputs: their bytes are subtracted).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_reshard import (  # noqa: E402
    GiB,
    digest,
    full_tensor,
    model_spec,
    placements_for,
    reset_hwm,
    status_kib,
)
from markdown_section import replace_section  # noqa: E402

WORLD = 4
DOCS_BEGIN = "<!-- bench_redistribute:begin -->"
DOCS_END = "<!-- bench_redistribute:end -->"
OURS = ("redistribute", "redistribute, new plan")
SYSTEMS = (
    "redistribute",
    "redistribute, new plan",
    "anyshard-tmpfs",
    "dcp-tmpfs",
    "DTensor.redistribute",
    "floor",
    "floor+local",
)
CASES = ("dtensor->tp4", "dtensor->dp4", "megatron tp2xpp2->tp4")


def megatron_cfg(gib: float) -> dict:
    h = 1024 if gib >= 0.5 else 512
    ffn, vocab, hd_heads = 4 * h, 8192, h // 64
    per_layer = 4 * (2 * h * h + h * h + h * h // 2 + 2 * ffn * h + ffn * h + 2 * h)  # approx.
    layers = max(2, 2 * round((gib * GiB - 2 * 4 * vocab * h) / per_layer / 2))
    return dict(
        hidden=h, heads=hd_heads, kv_heads=hd_heads // 2, ffn=ffn, vocab=vocab, layers=layers
    )


def spec_locals(cfg: dict, sizes: dict, rank: int):
    """The local tensors of ``rank`` under the megatron_gpt spec at ``sizes`` (ranks row-major),
    filled from deterministic logical tensors, as the spec's pieces place them."""
    import torch

    from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
    from anyshard.ucl.library import load_spec

    spec = load_spec("megatron_gpt")
    lay = layout_for(spec, {**sizes, **cfg})
    if rank >= lay.world_size:
        return {}
    out = {}
    for name, t in sorted(compile(spec, lay, coords_of_rank(lay.sizes, rank)).items()):
        local = torch.zeros(t.stored_shape)
        flat = local.view(-1)
        for part in t.parts:
            logical = full_tensor(part.logical, part.logical_shape)
            for p in part.shard.pieces:
                n = 1
                for s in p.array_shape:
                    n *= s
                arr = flat[p.base : p.base + n].view(p.array_shape)
                arr[tuple(slice(a, b) for a, b in p.array_box)] = logical[
                    tuple(slice(a, b) for a, b in p.logical_box)
                ]
            del logical
        out[name] = local
    return out


def _box(shape, offset, local_shape):
    return tuple((o, o + n) for o, n in zip(offset, local_shape, strict=True))


def _overlap(a, b) -> int:
    n = 1
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        n *= max(0, min(ahi, bhi) - max(alo, blo))
    return n


def worker(rank: int, cfg: dict, store_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import anyshard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    meshes = {
        "src": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")),
        "tp4": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)),
        "dp4": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",)),
    }
    spec = model_spec(cfg["gib"])

    def on_2x2(target: str, kind: str):
        """Placements on the (dp_shard, tp) mesh that give each rank the target's shard."""
        (p,) = placements_for(target, kind)
        return [p, p] if isinstance(p, Shard) else [Replicate(), Replicate()]

    source, targets, expected = {}, {"tp4": {}, "dp4": {}}, {"tp4": {}, "dp4": {}}
    minimum = {"tp4": 0, "dp4": 0}
    for name, shape, kind in spec:
        full = full_tensor(name, shape)
        sp = placements_for("src", kind)
        local = distribute_tensor(full, meshes["src"], sp, src_data_rank=None).to_local()
        source[name] = DTensor.from_local(
            local.clone(),
            meshes["src"],
            sp,
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
        s_shape, s_off = compute_local_shape_and_global_offset(full.shape, meshes["src"], sp)
        for t in targets:
            tp_ = placements_for(t, kind)
            exp = distribute_tensor(full, meshes[t], tp_, src_data_rank=None).to_local()
            expected[t][name] = digest(exp)
            targets[t][name] = DTensor.from_local(
                torch.zeros_like(exp),
                meshes[t],
                tp_,
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            d_shape, d_off = compute_local_shape_and_global_offset(full.shape, meshes[t], tp_)
            held = _overlap(_box(shape, s_off, s_shape), _box(shape, d_off, d_shape))
            minimum[t] += 4 * (exp.numel() - held)
            del exp
        del full, local
    mcfg = megatron_cfg(cfg["gib"])
    m_src = spec_locals(mcfg, {"tp": 2, "pp": 2}, rank)
    m_dst_want = spec_locals(mcfg, {"tp": 4}, rank)
    m_expected = {k: digest(v) for k, v in m_dst_want.items()}
    m_dst = {k: torch.zeros_like(v) for k, v in m_dst_want.items()}
    del m_dst_want
    gc.collect()
    m_layouts = (
        {"src_spec": "megatron_gpt", "src_layout": {"tp": 2, "pp": 2, **mcfg}},
        {"dst_spec": "megatron_gpt", "dst_layout": {"tp": 4, **mcfg}},
    )
    state_bytes = {
        "dtensor": sum(v.to_local().numel() * 4 for v in source.values()),
        "megatron": sum(v.numel() * 4 for v in m_src.values()),
    }
    if rank == 0:
        print(
            f"state: {len(spec)} DTensors, {state_bytes['dtensor'] / 2**20:.0f} MiB per rank; "
            f"megatron_gpt {mcfg}: {state_bytes['megatron'] / 2**20:.0f} MiB on rank 0",
            flush=True,
        )

    shm = tempfile.mkdtemp(prefix="bench-redistribute-", dir="/dev/shm") if rank == 0 else None
    shm = [shm]
    dist.broadcast_object_list(shm, src=0)
    shm = shm[0]
    records = []

    def check(case: str, result) -> list[str]:
        if case == "megatron tp2xpp2->tp4":
            return [k for k, v in m_dst.items() if digest(v) != m_expected[k]]
        t = case.split("->")[1]
        got = result if result is not None else targets[t]
        return [n for n, v in got.items() if digest(v.to_local()) != expected[t][n]]

    def clear(case: str) -> None:
        if case == "megatron tp2xpp2->tp4":
            for v in m_dst.values():
                v.fill_(-7.25)
        else:
            for v in targets[case.split("->")[1]].values():
                v.to_local().fill_(-7.25)

    def run(case: str, system: str):
        """The operation, and the bytes it allocates as its result (DTensor.redistribute)."""
        mega = case.startswith("megatron")
        t = None if mega else case.split("->")[1]
        src, dst = (m_src, m_dst) if mega else (source, targets[t])
        kw_src, kw_dst = m_layouts if mega else ({}, {})
        if system in OURS:
            reuse = system == "redistribute"
            return lambda: anyshard.redistribute(
                src, dst, **kw_src, **kw_dst, reuse_plan=reuse
            ), None
        if system == "anyshard-tmpfs":
            path = os.path.join(shm, "anyshard")

            def trip():
                save_kw = (
                    {"spec": kw_src["src_spec"], "layout": kw_src["src_layout"]} if mega else {}
                )
                load_kw = (
                    {"spec": kw_dst["dst_spec"], "layout": kw_dst["dst_layout"]} if mega else {}
                )
                anyshard.save(path, src, **save_kw)
                anyshard.load(path, dst, **load_kw)

            return trip, None
        if system == "dcp-tmpfs":
            if mega:
                return None, None
            path = os.path.join(shm, "dcp")

            def trip():
                dcp.save(src, storage_writer=dcp.FileSystemWriter(path))
                dcp.load(dst, storage_reader=dcp.FileSystemReader(path))

            return trip, None
        if system == "DTensor.redistribute":
            if mega:
                return None, None
            out = {}
            kinds = {n: k for n, _, k in spec}

            def redist():
                for n, v in source.items():
                    out[n] = v.redistribute(meshes["src"], on_2x2(t, kinds[n]))

            return redist, out
        if system in ("floor", "floor+local"):
            plan = anyshard.redistribute(src, dst, **kw_src, **kw_dst)  # for its pair sizes
            sends, recvs = {}, {}
            for (s, d), msgs in plan.messages.items():
                n = sum(m.nbytes for g in msgs for m in g)
                if s == rank:
                    sends[d] = torch.empty(n, dtype=torch.uint8)
                if d == rank:
                    recvs[s] = torch.empty(n, dtype=torch.uint8)

            held = sum(m.nbytes for m in plan.local) if system == "floor+local" else 0
            here = torch.ones(held, dtype=torch.uint8)
            there = torch.zeros(held, dtype=torch.uint8)

            def floor():
                ops = [dist.P2POp(dist.isend, b, p) for p, b in sends.items()]
                ops += [dist.P2POp(dist.irecv, b, p) for p, b in recvs.items()]
                reqs = dist.batch_isend_irecv(ops) if ops else []
                there.copy_(here)  # floor+local: one copy of the bytes the rank already holds
                for req in reqs:
                    req.wait()

            return floor, None
        raise ValueError(system)

    # an untimed warm-up of every system on the smallest case
    for case in CASES:
        for system in SYSTEMS:
            fn, _ = run(case, system)
            if fn is not None and cfg["warmup"]:
                dist.barrier()
                fn()
                dist.barrier()
                if rank == 0:
                    for sub in ("anyshard", "dcp"):
                        shutil.rmtree(os.path.join(shm, sub), ignore_errors=True)
        if not cfg["warmup"]:
            break
    gc.collect()

    for rep in range(cfg["reps"]):
        order = SYSTEMS[rep % len(SYSTEMS) :] + SYSTEMS[: rep % len(SYSTEMS)]
        for case in CASES:
            for system in order:
                fn, out = run(case, system)
                if fn is None:
                    continue
                clear(case)
                gc.collect()
                dist.barrier()
                rss0 = status_kib("VmRSS")
                hwm_ok = reset_hwm()
                t0 = time.perf_counter()
                plan = fn()
                took = time.perf_counter() - t0
                hwm = status_kib("VmHWM") if hwm_ok else 0
                dist.barrier()
                out_bytes = 0
                if out:
                    out_bytes = sum(v.to_local().numel() * 4 for v in out.values())
                rec = {
                    "time": took,
                    "rss_over": max(0, (hwm - rss0) * 1024 - out_bytes) if hwm_ok else None,
                    "bad": check(case, out)[:3] if not system.startswith("floor") else [],
                }
                if system in OURS:
                    rec["received"] = plan.received_bytes(rank)
                    rec["sent"] = plan.sent_bytes(rank)
                    rec["minimum"] = (
                        None if case.startswith("megatron") else minimum[case.split("->")[1]]
                    )
                gathered = [None] * WORLD
                dist.all_gather_object(gathered, rec)
                if rank == 0:
                    shutil.rmtree(os.path.join(shm, "anyshard"), ignore_errors=True)
                    shutil.rmtree(os.path.join(shm, "dcp"), ignore_errors=True)
                    records.append({"rep": rep, "case": case, "system": system, "ranks": gathered})
                    worst = max(r["time"] for r in gathered)
                    bad = any(r["bad"] for r in gathered)
                    print(
                        f"  rep {rep + 1} {case:24s} {system:22s} {worst:7.2f} s"
                        + ("  MISMATCH" if bad else ""),
                        flush=True,
                    )
                del out, fn
                gc.collect()
                dist.barrier()
    if rank == 0:
        shutil.rmtree(shm, ignore_errors=True)
        with open(out_path, "w") as f:
            json.dump({"records": records, "state_bytes": state_bytes, "megatron": mcfg}, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(data: dict) -> list[dict]:
    rows = []
    for case in CASES:
        for system in SYSTEMS:
            recs = [r for r in data["records"] if r["case"] == case and r["system"] == system]
            if not recs:
                continue
            times = [max(x["time"] for x in r["ranks"]) for r in recs]
            rss = [x["rss_over"] for r in recs for x in r["ranks"] if x["rss_over"] is not None]
            row = {
                "case": case,
                "system": system,
                "time": statistics.median(times),
                "times": times,
                "rss_over": max(rss) if rss else None,
                "bad": sum(bool(x["bad"]) for r in recs for x in r["ranks"]),
            }
            if system in OURS:
                last = recs[-1]["ranks"]
                row["received"] = [x["received"] for x in last]
                row["sent"] = [x["sent"] for x in last]
                row["minimum"] = [x["minimum"] for x in last]
            rows.append(row)
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:.0f}"


def table(rows: list[dict]) -> list[str]:
    out = [
        "| case | system | time (s) | vs redistribute | peak RSS over state (MiB) | bytes received per rank (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base = {r["case"]: r["time"] for r in rows if r["system"] == "redistribute"}
    for r in rows:
        recv = ""
        if r["system"] in OURS:
            recv = " / ".join(_mib(x) for x in r["received"])
            if all(m is not None for m in r["minimum"]):
                recv += " (minimum " + " / ".join(_mib(x) for x in r["minimum"]) + ")"
        ratio = r["time"] / base[r["case"]] if r["case"] in base else float("nan")
        rss = "n/a" if r["rss_over"] is None else _mib(r["rss_over"])
        bad = " **MISMATCH**" if r["bad"] else ""
        spread = f"{min(r['times']):.2f}-{max(r['times']):.2f}"
        out.append(
            f"| {r['case']} | {r['system']} | {r['time']:.2f} ({spread}){bad} | {ratio:.2f}x | {rss} | {recv} |"
        )
    return out


def check_targets(rows: list[dict], inflight: int) -> list[tuple[str, bool, str]]:
    by = {(r["case"], r["system"]): r for r in rows}
    checks = []
    for case, system in ((c, s) for c in CASES for s in OURS):
        ours = by.get((case, system))
        if ours is None:
            continue
        label = case if system == "redistribute" else f"{case} (new plan)"
        trip = by.get((case, "anyshard-tmpfs"))
        if trip:
            x = trip["time"] / ours["time"]
            checks.append(
                (f"{label}: >= 3x faster than anyshard's tmpfs round trip", x >= 3, f"{x:.1f}x")
            )
        dt = by.get((case, "DTensor.redistribute"))
        if dt:
            x = ours["time"] / dt["time"]
            checks.append(
                (f"{label}: no slower than DTensor.redistribute", x <= 1.0, f"{x:.2f}x its time")
            )
        fl = by.get((case, "floor"))
        if fl:
            x = ours["time"] / fl["time"]
            fll = by.get((case, "floor+local"))
            note = f" ({ours['time'] / fll['time']:.2f}x floor+local)" if fll else ""
            checks.append((f"{label}: <= 1.5x the floor", x <= 1.5, f"{x:.2f}x{note}"))
        if all(m is not None for m in ours["minimum"]):
            x = sum(ours["received"]) / max(1, sum(ours["minimum"]))
            checks.append((f"{label}: bytes sent <= 1.02x the minimum", x <= 1.02, f"{x:.3f}x"))
        if ours["rss_over"] is not None:
            limit = inflight + (64 << 20)
            checks.append(
                (
                    f"{label}: peak RSS over the state <= max_inflight_bytes + 64 MiB",
                    ours["rss_over"] <= limit,
                    f"{_mib(ours['rss_over'])} MiB (limit {_mib(limit)})",
                )
            )
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="0.1 GiB, 1 repetition")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.reps = 0.1, 1
    import torch.multiprocessing as mp

    cfg = {"gib": args.gib, "reps": args.reps, "warmup": args.warmup}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        store = os.path.join(tmp, "store")
        start = time.monotonic()
        mp.start_processes(worker, args=(cfg, store, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            data = json.load(f)
    took = time.monotonic() - start
    rows = summarize(data)
    lines = table(rows)
    from anyshard.api.redistribute import DEFAULT_MAX_INFLIGHT_BYTES

    checks = check_targets(rows, DEFAULT_MAX_INFLIGHT_BYTES)
    print("\n".join(lines))
    for name, ok, detail in checks:
        print(f"{'met' if ok else 'NOT MET'}: {name}: {detail}")
    print(f"took {took:.0f} s")
    bad = any(r["bad"] for r in rows)
    if args.write_docs:
        command = (
            "python tools/bench_redistribute.py"
            + (" --quick" if args.quick else f" --gib {args.gib:g} --reps {args.reps}")
            + " --write-docs"
        )
        sb = data["state_bytes"]
        section = [
            "## Live resharding: redistribute vs storage round trips (`tools/bench_redistribute.py`)",
            "",
            f"Command: `{command}` ({datetime.now(timezone.utc).strftime('%Y-%m-%d')}, {took:.0f} s; "
            f"4 gloo ranks on CPU, one torch thread each; median of {args.reps} repetition(s), "
            "slowest rank, spread in brackets).",
            "",
            f"State per rank: {_mib(sb['dtensor'])} MiB of DTensors on a (dp_shard=2, tp=2) mesh (the "
            f"state of `tools/bench_reshard.py`); megatron_gpt {data['megatron']} as plain local tensors, "
            f"{_mib(sb['megatron'])} MiB on rank 0. See the tool's header for the method.",
            "",
            *lines,
            "",
            "Targets:",
            "",
            *[
                f"- {'met' if ok else '**not met**'}: {name}: {detail}"
                for name, ok, detail in checks
            ],
        ]
        replace_section(args.write_docs, DOCS_BEGIN, DOCS_END, section)
        print(f"wrote {args.write_docs}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
