"""Memory of converting a DCP checkpoint: ``anyshard convert`` vs DCP's ``dcp_to_torch_save``,
peak RSS and wall time, each conversion in a fresh process.

    python tools/bench_convert_memory.py --write-docs        # smoke test: --quick

3-5 minutes on 2 cores, ~7.5 GiB free under ``--dir``. Per source layout (``--layouts``), a
GPT-shaped fp32 state of at least ``--gib`` GiB saved with ``dcp.save``; each tool (``--tools``)
converts it. The method, as written into the docs, is `METHOD` below.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import benchkit as h
from benchkit import llama

SAVE_WORLD = 4  # the sharded layout: (dp_shard=2, tp=2)
TARGET_SLACK_MIB = 256
LAYOUTS = ("sharded", "whole")
TOOLS = {
    "dcp": "DCP dcp_to_torch_save",
    "hf": "anyshard convert --to hf",
    "anyshard": "anyshard convert --to anyshard",
    "anyshard_gpt": "anyshard convert --to anyshard --spec gpt",
}
HEADING = "## Memory of converting a DCP checkpoint (`tools/bench_convert_memory.py`)"
METHOD = """Method: every conversion runs alone in a fresh `python` process that imports what it
needs (torch and DCP's `format_utils`; torch, `torch.distributed.checkpoint.metadata` (which
reading DCP's pickled metadata imports), `anyshard.loaders` and `anyshard.cli`), records VmRSS
(baseline), converts, and records VmHWM (peak RSS, imports included; the parent's `os.wait4`
ru_maxrss agrees). DCP is `dcp_to_torch_save(src, out.pt)`; anyshard is the console script's entry
point `anyshard.cli.main(['convert', src, dst, '--to', ...])`, the gpt row with `--spec gpt
--layout pp=1,dp=2,tp=2,...`. Wall time is the conversion alone; CPU seconds (user + sys) and bytes
read and written (/proc/PID/io) are the whole child process's, the same counters
(tools/benchkit/) for every tool. Outputs are checked one tensor at a time outside the measured
processes: the `.pt` (`torch.load(mmap=True, weights_only=True)`) against the tensors regenerated
from their seeds, the Hugging Face files (`safe_open`) and anyshard checkpoints (`anyshard.open`)
against the `.pt`. Target: peak RSS <= 2 x largest tensor + 256 MiB, checked on the raw peak and
on peak - baseline."""


def model_dims(gib: float, largest_mib: int, hidden: int, heads: int, kv_heads: int) -> dict:
    """The gpt spec's parameters for at least ``gib`` GiB, the vocabulary matrices of
    ``largest_mib`` MiB each."""
    ffn = 256 * math.ceil(hidden * 8 / 3 / 256)  # as LLaMA rounds 8/3 x hidden
    vocab = max(64, (largest_mib * h.MiB // (hidden * 4)) // 64 * 64)
    w, kv = hidden, kv_heads * (hidden // heads)
    per_layer = 4 * (2 * w * w + 2 * w * kv + 3 * ffn * w + 2 * w)
    layers = max(1, math.ceil((gib * h.GiB - 4 * (2 * vocab * w + w)) / per_layer))
    return dict(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, layers=layers)


def model_shapes(d: dict) -> list[tuple[str, tuple[int, ...], str]]:
    kv = d["kv_heads"] * (d["hidden"] // d["heads"])
    return llama.gpt_shapes(d["hidden"], d["ffn"], d["vocab"], d["layers"], kv, embedding="col")


def save_whole(dst: str, dims: dict) -> None:
    import torch.distributed.checkpoint as dcp

    state = {name: llama.full_tensor(name, shape) for name, shape, _ in model_shapes(dims)}
    dcp.save(state, checkpoint_id=dst, no_dist=True)


def save_rank(rank: int, world: int, dst: str, dims: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, state = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp")), {}
    for name, shape, kind in model_shapes(dims):
        full, pl = llama.full_tensor(name, shape), llama.placements(kind, llama.MESHES["src"][1])
        local = distribute_tensor(full, mesh, pl, src_data_rank=None).to_local().clone()
        kw = {"run_check": False, "shape": full.shape, "stride": full.stride()}
        state[name] = DTensor.from_local(local, mesh, pl, **kw)
    dcp.save(state, checkpoint_id=dst)


def dcp_chunks(path: str) -> tuple[int, int]:
    """(number of tensor chunks, bytes of the largest) in a DCP checkpoint's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    metas = [m for m in md.state_dict_metadata.values() if hasattr(m, "chunks")]
    sizes = [math.prod(c.sizes) * m.properties.dtype.itemsize for m in metas for c in m.chunks]
    return len(sizes), max(sizes)


def child(tool: str, src: str, dst: str, layout_arg: str, result: str) -> int:
    """In the fresh process: import, baseline, convert, peak."""
    import torch  # noqa: F401

    if tool == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    else:
        # what `anyshard convert` imports, before the baseline (reading DCP's pickled metadata
        # imports torch.distributed.checkpoint, ~45 MiB with what it pulls in)
        import torch.distributed.checkpoint.metadata  # noqa: F401

        import anyshard.loaders  # noqa: F401
        from anyshard.cli import main

        argv = ["convert", src, dst, "--to", "hf" if tool == "hf" else "anyshard"]
        argv += ["--spec", "gpt", "--layout", layout_arg] if tool == "anyshard_gpt" else []
    base, t0 = h.status_kib("VmRSS"), time.perf_counter()
    if tool == "dcp":
        dcp_to_torch_save(src, dst)
    elif rc := main(argv):
        raise SystemExit(f"anyshard {' '.join(argv)} exited {rc}")
    wall = time.perf_counter() - t0
    with open(result, "w") as f:
        json.dump({"baseline_kib": base, "hwm_kib": h.status_kib("VmHWM"), "wall_s": wall}, f)
    return 0


def convert(tool: str, src: str, dst: str, layout_arg: str, work: str) -> dict:
    """One conversion in a fresh process: its own figures and the harness's counters of it."""
    result = os.path.join(work, f"result-{tool}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tool, src, dst, layout_arg, result]
    proc = h.run_process(cmd, os.path.join(work, f"log-{tool}.txt"))
    if proc["rc"] != 0:
        raise RuntimeError(f"{tool} conversion failed (exit {proc['rc']}):\n{proc['log']}")
    with open(result) as f:
        r = json.load(f)
    out = {"baseline_mib": r["baseline_kib"] / 1024, "peak_mib": r["hwm_kib"] / 1024}
    out |= {"maxrss_mib": proc["rss_peak"] / h.MiB, "wall_s": r["wall_s"], "out_bytes": h.du(dst)}
    return out | {"process_s": proc["wall_s"], **{k: proc[k] for k in ("cpu_s", *h.IO_KEYS)}}


def verify(tool: str, out: str, pt: str, dims: dict) -> str | None:
    """The ``.pt`` against the tensors regenerated from their seeds (``dcp``), or a conversion's
    output against the ``.pt``, one tensor at a time; None if equal, else what differs."""
    import torch
    from safetensors import safe_open

    import anyshard

    sd = torch.load(pt, mmap=True, weights_only=True)
    if tool == "dcp":
        want = {n: s for n, s, _ in model_shapes(dims)}
        get = lambda n: llama.full_tensor(n, want[n])  # noqa: E731
    elif tool == "hf":
        index = os.path.join(out, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                want = {k: os.path.join(out, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
                want = dict.fromkeys(f.keys(), os.path.join(out, "model.safetensors"))

        def get(n: str):
            with safe_open(want[n], framework="pt") as f:
                return f.get_tensor(n)
    else:
        view = anyshard.open(out)
        want, get = dict.fromkeys(view.keys()), view.get_tensor
    if set(want) != set(sd):
        return f"names differ: {sorted(set(want) ^ set(sd))[:5]}"
    for name in want:
        t = get(name)
        if t.dtype != sd[name].dtype or not torch.equal(t, sd[name]):
            return f"{name} differs" + (" from the saved state" if tool == "dcp" else "")
    return None


def bench_layout(layout: str, dims: dict, tools: list[str], root: str, records: h.Records) -> dict:
    work = tempfile.mkdtemp(prefix=f"bench-convert-{layout}-", dir=root)
    src, pt = os.path.join(work, "dcp"), os.path.join(work, "out.pt")
    layout_arg = "pp=1,dp=2,tp=2," + ",".join(f"{k}={v}" for k, v in dims.items())
    try:
        t0 = time.perf_counter()
        if layout == "sharded":
            h.run_ranks(save_rank, SAVE_WORLD, src, dims)
        else:
            h.in_fresh_process(save_whole, src, dims)
        chunks, largest = h.in_fresh_process(dcp_chunks, src)
        info = {"save_s": time.perf_counter() - t0, "src_bytes": h.du(src), "chunks": chunks}
        info |= {"largest_chunk": largest, "tools": {}}
        gib, mib, took = info["src_bytes"] / h.GiB, largest / h.MiB, info["save_s"]
        print(f"{layout}: DCP checkpoint {gib:.2f} GiB, {chunks} chunks, largest {mib:.0f} MiB "
              f"(saved in {took:.1f} s)", flush=True)  # fmt: skip
        for tool in ["dcp"] + [t for t in tools if t != "dcp"]:  # the .pt is every check's oracle
            dst = pt if tool == "dcp" else os.path.join(work, f"out-{tool}")
            r = convert(tool, src, dst, layout_arg, work)
            r["problem"] = h.in_fresh_process(verify, tool, dst, pt, dims)
            r["verified"] = r["problem"] is None
            if tool in tools:
                info["tools"][tool] = records.add(r, layout=layout, system=tool)
            peak = f"peak {r['peak_mib']:.0f} MiB (ru_maxrss {r['maxrss_mib']:.0f})"
            peak += f", baseline {r['baseline_mib']:.0f} MiB, {r['wall_s']:.1f} s, CPU "
            out = f"{r['cpu_s']:.1f} s; output {r['out_bytes'] / h.GiB:.2f} GiB"
            print(f"  {TOOLS[tool]}: {peak}{out}, {r['problem'] or 'verified'}", flush=True)
            if tool != "dcp":
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return info


def table(results: dict, largest: int) -> tuple[list, list]:
    target = 2 * largest / h.MiB + TARGET_SLACK_MIB
    head = ["source layout", "tool", "peak RSS MiB", "baseline MiB", "peak - baseline MiB"]
    head += ["target MiB", "peak <= target", "peak - baseline <= target", "wall s", "CPU s"]
    head += ["MiB read (rchar)", "MiB written (wchar)", "output checked"]
    rows = []
    for layout, info in results.items():
        for tool, r in info["tools"].items():
            peak, over = r["peak_mib"], r["peak_mib"] - r["baseline_mib"]
            rows.append([layout, TOOLS[tool], f"{peak:.0f}", f"{r['baseline_mib']:.0f}"])
            rows[-1] += [f"{over:.0f}", f"{target:.0f}"]
            rows[-1] += ["pass" if x <= target else "FAIL" for x in (peak, over)]
            rows[-1] += [f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['rchar'] / h.MiB:.0f}"]
            rows[-1] += [f"{r['wchar'] / h.MiB:.0f}", "equal" if r["verified"] else "WRONG"]
    return head, rows


def main(argv: list[str] | None = None) -> int:
    quick = {"gib": 0.1, "largest_mib": 8, "hidden": 512, "heads": 8, "kv_heads": 2}
    p = h.parser(__doc__, quick=quick)
    p.add_argument("--gib", type=float, default=2.25, help="size of the state, at least (2.25 GiB)")
    p.add_argument("--largest-mib", type=int, default=256, help="the vocab matrices (256 MiB)")
    p.add_argument("--hidden", type=int, default=2048, help="model width (2048)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"subset of {','.join(TOOLS)}")
    p.add_argument("--dir", default="/tmp", help="parent directory of the checkpoints")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child)
    layouts = h.words(p, "--layouts", args.layouts, LAYOUTS)
    tools = h.words(p, "--tools", args.tools, TOOLS)
    dims = model_dims(args.gib, args.largest_mib, args.hidden, args.heads, args.kv_heads)
    sizes = [4 * math.prod(s) for _, s, _ in model_shapes(dims)]
    largest, load = max(sizes), h.RunLoad()
    mib, slack = largest / h.MiB, TARGET_SLACK_MIB
    target = f"2 x {mib:.0f} + {slack} = {2 * mib + slack:.0f} MiB"
    state = f"{sum(sizes) / h.GiB:.2f} GiB fp32 in {len(sizes)} tensors ({dims})"
    print(f"state: {state}; largest tensor {mib:.0f} MiB; target peak RSS <= {target}", flush=True)
    records = h.Records(args.jsonl, "convert_memory")
    results = {layout: bench_layout(layout, dims, tools, args.dir, records) for layout in layouts}
    how = {"whole": "`dcp.save(..., no_dist=True)` from one process (every tensor one chunk)"}
    how["sharded"] = f"`dcp.save` from {SAVE_WORLD} gloo ranks holding DTensors on a "
    how["sharded"] += "(dp_shard=2, tp=2) mesh"
    sources = [
        f"- `{layout}`: saved by {how[layout]}; {info['src_bytes'] / h.GiB:.2f} GiB on disk, "
        f"{info['chunks']} chunks, the largest {info['largest_chunk'] / h.MiB:.0f} MiB"
        for layout, info in results.items()
    ]
    run = f"{sum(sizes) / h.GiB:.2f} GiB fp32 in {len(sizes)} tensors, GPT-shaped: hidden "
    run += f"{dims['hidden']}, {dims['layers']} layers, ffn {dims['ffn']}, vocab {dims['vocab']}; "
    run += f"largest tensor {mib:.0f} MiB"
    blocks = ["\n".join(["Source checkpoints:", "", *sources]), METHOD, table(results, largest)]
    data = {"dims": dims, "largest": largest, "results": results}
    h.report(args, argv, __file__, "convert_memory", run, blocks, load, under=HEADING,
             dirs={"files": args.dir}, data=data)  # fmt: skip
    return 1 if any(not r["verified"] for i in results.values() for r in i["tools"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
