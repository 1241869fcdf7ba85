"""Memory benchmark: converting a DCP checkpoint with ``anyshard convert`` vs DCP's own
``dcp_to_torch_save``, peak RSS and wall time, each in a fresh process.

Run (the full benchmark, 3-5 minutes on 2 cores, ~7.5 GiB of free disk under ``--dir``;
writes the table into docs/benchmarks.md):

    python tools/bench_convert_memory.py --write-docs

Smoke test (0.1 GiB, well under a minute):

    python tools/bench_convert_memory.py --quick

What it does, in one run, per source layout (``--layouts``):

1. Builds a GPT-shaped fp32 state of at least ``--gib`` GiB (the reference trainer's names:
   ``tok_embeddings.weight`` and ``output.weight`` of ``--largest-mib`` MiB each, the largest
   tensors; per layer wq/wk/wv/wo, w1/w2/w3 and two norms; a final norm), every tensor drawn
   from its own seeded generator, and saves it with ``torch.distributed.checkpoint.save``:

   * ``sharded``: from 4 gloo ranks (torch.multiprocessing, spawn) holding DTensors on a
     (dp_shard=2, tp=2) mesh as FSDP2 over TP holds them: column-parallel weights and the
     embeddings ``[Shard(0), Shard(0)]``, row-parallel ``[Shard(0), Shard(1)]``, norms
     ``[Shard(0), Replicate()]``; every DCP chunk is a quarter of its tensor (norms a half);
   * ``whole``: from one process (``dcp.save(..., no_dist=True)``), as a single-device or DDP
     job saves it: every tensor is one chunk.

2. Converts that checkpoint, each conversion in its own fresh ``python`` process:

   * ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(src,
     out.pt)``, the peer;
   * ``anyshard -> hf``: ``anyshard convert SRC DST --to hf``;
   * ``anyshard -> anyshard``: ``anyshard convert SRC DST --to anyshard`` (one plain rank);
   * ``anyshard -> anyshard gpt``: ``anyshard convert SRC DST --to anyshard --spec gpt
     --layout pp=1,dp=2,tp=2,...`` (every rank's files of that layout).

   The anyshard runs call the console script's entry point, ``anyshard.cli.main(argv)``. Each
   child imports what its conversion needs (for anyshard also
   ``torch.distributed.checkpoint.metadata``, which reading DCP's pickled metadata imports),
   records its VmRSS (the baseline), converts, and records VmHWM (the peak, imports included)
   and the conversion's wall time; the parent also takes the child's ``ru_maxrss`` from
   ``os.wait4`` (the parent never imports torch, so that figure, which starts from the parent's
   RSS at fork, is the child's own). Both raw peak and peak minus baseline are reported; the
   target, ``2 x largest tensor + 256 MiB``, is checked against both.

3. Verifies every output, one tensor at a time, outside the measured processes: the
   ``torch.save`` file (loaded with ``mmap=True, weights_only=True``) against the tensors
   regenerated from their seeds, and the Hugging Face files (``safetensors.safe_open``) and the
   anyshard checkpoints (``anyshard.open``) against the ``torch.save`` file, so that neither a
   wrong conversion nor a wrong oracle can pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from datetime import datetime, timezone

from markdown_section import replace_section

# this checkout's library, whether or not (and wherever) it is installed
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 1 << 20
GiB = 1 << 30
SAVE_WORLD = 4  # the sharded layout: (dp_shard=2, tp=2)
TARGET_SLACK_MIB = 256  # the target: peak RSS <= 2 x largest tensor + this
LAYOUTS = ("sharded", "whole")
TOOLS = ("dcp", "hf", "anyshard", "anyshard_gpt")
TOOL_LABELS = {
    "dcp": "DCP dcp_to_torch_save",
    "hf": "anyshard convert --to hf",
    "anyshard": "anyshard convert --to anyshard",
    "anyshard_gpt": "anyshard convert --to anyshard --spec gpt",
}
DOCS_BEGIN = "<!-- convert_memory:begin -->"
DOCS_END = "<!-- convert_memory:end -->"
DOCS_HEADING = "## Memory of converting a DCP checkpoint (`tools/bench_convert_memory.py`)"


# --------------------------------------------------------------------------- the model


def model_dims(gib: float, largest_mib: int, hidden: int, heads: int, kv_heads: int) -> dict:
    """The gpt spec's parameters for a state of at least ``gib`` GiB whose largest tensors
    (the two vocabulary matrices) are ``largest_mib`` MiB each."""
    ffn = 256 * math.ceil(hidden * 8 / 3 / 256)  # as LLaMA rounds 8/3 x hidden
    vocab = max(64, (largest_mib * MiB // (hidden * 4)) // 64 * 64)
    hd = hidden // heads
    per_layer = 4 * (2 * hidden * heads * hd + 2 * hidden * kv_heads * hd + 3 * ffn * hidden)
    per_layer += 4 * 2 * hidden
    fixed = 4 * (2 * vocab * hidden + hidden)
    layers = max(1, math.ceil((gib * GiB - fixed) / per_layer))
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn": ffn,
        "vocab": vocab,
        "layers": layers,
    }


def model_shapes(d: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind): kind is how tp shards it: ``col`` dim 0, ``row`` dim 1, ``norm``
    replicated."""
    h, hd, ffn = d["hidden"], d["hidden"] // d["heads"], d["ffn"]
    q, kv = d["heads"] * hd, d["kv_heads"] * hd
    out = [("tok_embeddings.weight", (d["vocab"], h), "col")]
    for i in range(d["layers"]):
        p = f"layers.{i}."
        out += [
            (p + "attention_norm.weight", (h,), "norm"),
            (p + "attention.wq.weight", (q, h), "col"),
            (p + "attention.wk.weight", (kv, h), "col"),
            (p + "attention.wv.weight", (kv, h), "col"),
            (p + "attention.wo.weight", (h, q), "row"),
            (p + "ffn_norm.weight", (h,), "norm"),
            (p + "feed_forward.w1.weight", (ffn, h), "col"),
            (p + "feed_forward.w3.weight", (ffn, h), "col"),
            (p + "feed_forward.w2.weight", (h, ffn), "row"),
        ]
    out += [("norm.weight", (h,), "norm"), ("output.weight", (d["vocab"], h), "col")]
    return out


def full_tensor(name: str, shape: tuple[int, ...]):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.rand(shape, generator=g)


def nbytes(shape: tuple[int, ...]) -> int:
    return 4 * math.prod(shape)


# --------------------------------------------------------------------------- saving with DCP


def save_worker(rank: int, world: int, store_path: str, dst: str, dims: dict) -> None:
    """One rank of the DCP save (``world`` 1: ``dcp.save(..., no_dist=True)``, whole tensors)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {}
    if world == 1:
        for name, shape, _ in model_shapes(dims):
            state[name] = full_tensor(name, shape)
        dcp.save(state, checkpoint_id=dst, no_dist=True)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
        placements = {
            "col": [Shard(0), Shard(0)],
            "row": [Shard(0), Shard(1)],
            "norm": [Shard(0), Replicate()],
        }
        for name, shape, kind in model_shapes(dims):
            full = full_tensor(name, shape)
            local = distribute_tensor(full, mesh, placements[kind], src_data_rank=None).to_local()
            state[name] = DTensor.from_local(
                local.clone(),  # not a view: the full tensor is freed
                mesh,
                placements[kind],
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            del full, local
        dcp.save(state, checkpoint_id=dst)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker threads can abort the process
    # there after a clean run (pytorch#179291).
    sys.stdout.flush()
    os._exit(0)


def _call(conn, fn, args) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # reported by the parent
        import traceback

        conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def in_process(fn, *args):
    """``fn(*args)`` in a fresh spawned process: the parent never imports torch, so a child's
    ``ru_maxrss`` (which starts from the parent's RSS at fork) is not inflated by it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(child_end, fn, args))
    proc.start()
    child_end.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        ok, value = False, "the process died without a result"
    proc.join()
    if not ok or proc.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} failed (exit {proc.exitcode}): {value}")
    return value


def save_dcp(layout: str, dst: str, dims: dict, work: str) -> float:
    """Save the state with DCP, in ``SAVE_WORLD`` gloo ranks (``sharded``) or one process."""
    import multiprocessing as mp

    world = SAVE_WORLD if layout == "sharded" else 1
    store = os.path.join(work, f"store-{layout}")
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [
        ctx.Process(target=save_worker, args=(rank, world, store, dst, dims))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    bad = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if bad:
        raise RuntimeError(f"DCP save failed: (rank, exit code) {bad}")
    return time.perf_counter() - t0


def dcp_chunks(path: str) -> tuple[int, int]:
    """(number of tensor chunks, bytes of the largest) in a DCP checkpoint's metadata (read
    with DCP's own reader: the checkpoint is this run's)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    sizes = [
        math.prod(c.sizes) * m.properties.dtype.itemsize
        for m in md.state_dict_metadata.values()
        for c in getattr(m, "chunks", ())
    ]
    return len(sizes), max(sizes)


# --------------------------------------------------------------------------- one conversion


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def child(tool: str, src: str, dst: str, layout_arg: str, result: str) -> int:
    """Runs in a fresh process: import, baseline, convert, peak."""
    import torch  # noqa: F401

    if tool == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def run() -> None:
            dcp_to_torch_save(src, dst)
    else:
        # what `anyshard convert` imports, before the baseline; reading DCP's pickled metadata
        # imports torch.distributed.checkpoint (~45 MiB with what it pulls in, sympy among it)
        import torch.distributed.checkpoint.metadata  # noqa: F401

        import anyshard.loaders  # noqa: F401
        from anyshard.cli import main

        argv = ["convert", src, dst, "--to", "hf" if tool == "hf" else "anyshard"]
        if tool == "anyshard_gpt":
            argv += ["--spec", "gpt", "--layout", layout_arg]

        def run() -> None:
            rc = main(argv)
            if rc:
                raise SystemExit(f"anyshard {' '.join(argv)} exited {rc}")

    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    out = {"baseline_kib": base, "hwm_kib": _status_kib("VmHWM"), "wall_s": wall}
    with open(result, "w") as f:
        json.dump(out, f)
    return 0


def measure(tool: str, src: str, dst: str, layout_arg: str, work: str) -> dict:
    """One conversion in a fresh process; the child's figures and its ru_maxrss."""
    result = os.path.join(work, f"result-{tool}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tool, src, dst, layout_arg, result]
    t0 = time.perf_counter()
    with open(os.path.join(work, f"log-{tool}.txt"), "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} conversion failed (exit {proc.returncode}):\n{text[-4000:]}")
    with open(result) as f:
        r = json.load(f)
    return {
        "baseline_mib": r["baseline_kib"] / 1024,
        "peak_mib": r["hwm_kib"] / 1024,
        "maxrss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "wall_s": r["wall_s"],
        "process_s": process_s,
        "out_bytes": _du(dst),
    }


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# --------------------------------------------------------------------------- verification


def _hf_tensors(path: str) -> dict[str, str]:
    """name -> file of a Hugging Face directory (the index, or the one file)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    one = os.path.join(path, "model.safetensors")
    with safe_open(one, framework="pt") as f:
        return dict.fromkeys(f.keys(), one)


def verify_pt(pt: str, dims: dict) -> str | None:
    """The torch.save file against the tensors regenerated from their seeds; None if equal."""
    import torch

    sd = torch.load(pt, mmap=True, weights_only=True)
    names = {n for n, _, _ in model_shapes(dims)}
    if set(sd) != names:
        return f"names differ: {sorted(set(sd) ^ names)[:5]}"
    for name, shape, _ in model_shapes(dims):
        if not torch.equal(sd[name], full_tensor(name, shape)):
            return f"{name} differs from the saved state"
    return None


def verify_against_pt(tool: str, out: str, pt: str) -> str | None:
    """A conversion's output against the torch.save file, one tensor at a time."""
    import torch
    from safetensors import safe_open

    import anyshard

    sd = torch.load(pt, mmap=True, weights_only=True)
    if tool == "hf":
        files = _hf_tensors(out)
        if set(files) != set(sd):
            return f"names differ: {sorted(set(files) ^ set(sd))[:5]}"
        for name, file in files.items():
            with safe_open(file, framework="pt") as f:
                t = f.get_tensor(name)
            if t.dtype != sd[name].dtype or not torch.equal(t, sd[name]):
                return f"{name} differs"
        return None
    with anyshard.open(out) as view:
        if set(view.keys()) != set(sd):
            return f"names differ: {sorted(set(view.keys()) ^ set(sd))[:5]}"
        for name in view.keys():
            t = view.get_tensor(name)
            if t.dtype != sd[name].dtype or not torch.equal(t, sd[name]):
                return f"{name} differs"
    return None


# --------------------------------------------------------------------------- one layout


def bench_layout(layout: str, dims: dict, tools: list[str], root: str, log) -> dict:
    work = tempfile.mkdtemp(prefix=f"bench-convert-{layout}-", dir=root)
    src = os.path.join(work, "dcp")
    layout_arg = "pp=1,dp=2,tp=2," + ",".join(f"{k}={v}" for k, v in dims.items())
    try:
        save_s = save_dcp(layout, src, dims, work)
        num_chunks, largest_chunk = in_process(dcp_chunks, src)
        info = {
            "save_s": save_s,
            "src_bytes": _du(src),
            "chunks": num_chunks,
            "largest_chunk": largest_chunk,
            "tools": {},
        }
        log(
            f"{layout}: DCP checkpoint {info['src_bytes'] / GiB:.2f} GiB, {num_chunks} chunks, "
            f"largest {largest_chunk / MiB:.0f} MiB (saved in {save_s:.1f} s)"
        )
        pt = os.path.join(work, "out.pt")
        outs = {"dcp": pt, "hf": "out-hf", "anyshard": "out-anyshard", "anyshard_gpt": "out-gpt"}
        order = ["dcp"] + [t for t in tools if t != "dcp"]  # the .pt is every check's oracle
        for tool in order:
            dst = outs[tool] if tool == "dcp" else os.path.join(work, outs[tool])
            r = measure(tool, src, dst, layout_arg, work)
            if tool == "dcp":
                problem = in_process(verify_pt, pt, dims)
            else:
                problem = in_process(verify_against_pt, tool, dst, pt)
            r["verified"] = problem is None
            r["problem"] = problem
            if tool in tools:
                info["tools"][tool] = r
            log(
                f"  {TOOL_LABELS[tool]}: peak {r['peak_mib']:.0f} MiB (ru_maxrss "
                f"{r['maxrss_mib']:.0f}), baseline {r['baseline_mib']:.0f} MiB, "
                f"{r['wall_s']:.1f} s; output {r['out_bytes'] / GiB:.2f} GiB, "
                + ("verified" if problem is None else f"WRONG: {problem}")
            )
            if tool != "dcp":
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return info


# --------------------------------------------------------------------------- report


def table(results: dict, largest: int, markdown: bool) -> str:
    target = 2 * largest / MiB + TARGET_SLACK_MIB
    head = [
        "source layout",
        "tool",
        "peak RSS MiB",
        "baseline MiB",
        "peak - baseline MiB",
        "target MiB",
        "peak <= target",
        "peak - baseline <= target",
        "wall s",
        "output checked",
    ]
    rows = []
    for layout, info in results.items():
        for tool, r in info["tools"].items():
            rows.append(
                [
                    layout,
                    TOOL_LABELS[tool],
                    f"{r['peak_mib']:.0f}",
                    f"{r['baseline_mib']:.0f}",
                    f"{r['peak_mib'] - r['baseline_mib']:.0f}",
                    f"{target:.0f}",
                    "pass" if r["peak_mib"] <= target else "FAIL",
                    "pass" if r["peak_mib"] - r["baseline_mib"] <= target else "FAIL",
                    f"{r['wall_s']:.1f}",
                    "equal" if r["verified"] else "WRONG",
                ]
            )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / (1 << 20)


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    return kind


def _git_state() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "anyshard"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    if head.returncode != 0:
        return "commit unknown"
    changed = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    state = (
        "library files as committed"
        if not changed
        else "library files modified in the work tree: " + ", ".join(changed[:6])
    )
    return f"commit {head.stdout.strip()} ({state})"


def write_docs(path: str, section_lines: list[str]) -> None:
    replace_section(path, DOCS_BEGIN, DOCS_END, section_lines, heading=DOCS_HEADING)


def docs_section(
    command: str, results: dict, dims: dict, largest: int, root: str, note: str, code: str
):
    from importlib.metadata import version

    shapes = model_shapes(dims)
    total = sum(nbytes(s) for _, s, _ in shapes)
    layouts = []
    for layout, info in results.items():
        how = (
            f"saved by `dcp.save` from {SAVE_WORLD} gloo ranks holding DTensors on a "
            "(dp_shard=2, tp=2) mesh"
            if layout == "sharded"
            else "saved by `dcp.save(..., no_dist=True)` from one process (every tensor one chunk)"
        )
        layouts.append(
            f"- `{layout}`: {how}; {info['src_bytes'] / GiB:.2f} GiB on disk, "
            f"{info['chunks']} chunks, the largest {info['largest_chunk'] / MiB:.0f} MiB"
        )
    return [
        f"Command: `{command}` ({datetime.now(timezone.utc).strftime('%Y-%m-%d')}; "
        f"{total / GiB:.2f} GiB fp32 in {len(shapes)} tensors, GPT-shaped: hidden "
        f"{dims['hidden']}, {dims['layers']} layers, ffn {dims['ffn']}, vocab {dims['vocab']}; "
        f"largest tensor {largest / MiB:.0f} MiB).",
        "",
        "Machine and run:",
        "",
        f"- CPU: {os.cpu_count()} cores ({_cpu_model()}), {_mem_gib():.0f} GiB RAM, Linux "
        f"{platform.release()}, Python {platform.python_version()}, torch {version('torch')}",
        f"- files: `{root}` on {fs_type(root)}",
        f"- anyshard: {code}",
        f"- {note}",
        "",
        "Source checkpoints:",
        "",
        *layouts,
        "",
        "Method: every conversion runs alone in a fresh `python` process that imports what it "
        "needs (torch and DCP's `format_utils`; torch, `torch.distributed.checkpoint.metadata` "
        "(which reading DCP's pickled metadata imports), `anyshard.loaders` and `anyshard.cli`), "
        "records VmRSS (baseline), converts, and records VmHWM (peak RSS, imports included; "
        "the parent's `os.wait4` ru_maxrss agrees). DCP is `dcp_to_torch_save(src, out.pt)`; "
        "anyshard is the console script's entry point `anyshard.cli.main(['convert', src, dst, "
        "'--to', ...])`, the gpt row with `--spec gpt --layout pp=1,dp=2,tp=2,...`. Wall time "
        "is the conversion alone. Outputs are checked one tensor at a time outside the measured "
        "processes: the `.pt` (`torch.load(mmap=True, weights_only=True)`) against the tensors "
        "regenerated from their seeds, the Hugging Face files (`safe_open`) and anyshard "
        "checkpoints (`anyshard.open`) against the `.pt`. Target: peak RSS <= 2 x largest "
        f"tensor + {TARGET_SLACK_MIB} MiB, checked on the raw peak and on peak - baseline.",
        "",
        table(results, largest, markdown=True),
    ]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Peak RSS and wall time of converting a DCP checkpoint: anyshard convert "
        "(to Hugging Face, to anyshard) vs DCP's dcp_to_torch_save, each in a fresh process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gib", type=float, default=2.25, help="size of the state, at least, GiB")
    p.add_argument(
        "--largest-mib", type=int, default=256, help="size of the largest tensors (vocab), MiB"
    )
    p.add_argument("--hidden", type=int, default=2048, help="model width")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"subset of {','.join(TOOLS)}")
    p.add_argument("--dir", default="/tmp", help="parent directory of the checkpoints")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: --gib 0.1 --largest-mib 8 --hidden 512"
    )
    p.add_argument(
        "--write-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="PATH",
        help="write the table and method into this markdown file (section replaced in place)",
    )
    p.add_argument("--json", default=None, help="also write the raw measurements to this file")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child)
    if args.quick:
        args.gib, args.largest_mib, args.hidden, args.heads, args.kv_heads = 0.1, 8, 512, 8, 2
    layouts = [x for x in args.layouts.split(",") if x]
    tools = [x for x in args.tools.split(",") if x]
    if not set(layouts) <= set(LAYOUTS) or not set(tools) <= set(TOOLS) or not layouts:
        p.error(f"--layouts: a subset of {LAYOUTS}; --tools: a subset of {TOOLS}")

    dims = model_dims(args.gib, args.largest_mib, args.hidden, args.heads, args.kv_heads)
    shapes = model_shapes(dims)
    total = sum(nbytes(s) for _, s, _ in shapes)
    largest = max(nbytes(s) for _, s, _ in shapes)
    target = 2 * largest / MiB + TARGET_SLACK_MIB

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(
        f"state: {total / GiB:.2f} GiB fp32 in {len(shapes)} tensors ({dims}); largest tensor "
        f"{largest / MiB:.0f} MiB; target peak RSS <= 2 x {largest / MiB:.0f} + "
        f"{TARGET_SLACK_MIB} = {target:.0f} MiB"
    )
    t_start, cpu0, load0 = time.time(), _busy_cpu_s(), os.getloadavg()[0]
    code_before = _git_state()
    results = {layout: bench_layout(layout, dims, tools, args.dir, log) for layout in layouts}
    wall = time.time() - t_start
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = resource.getrusage(resource.RUSAGE_SELF)
    used = kids.ru_utime + kids.ru_stime + ours.ru_utime + ours.ru_stime
    foreign = max(0.0, _busy_cpu_s() - cpu0 - used)
    note = (
        f"run took {wall:.0f} s; CPU busy time of other processes on the machine during it: "
        f"{foreign:.0f} s of {wall * (os.cpu_count() or 1):.0f} core-seconds; load average "
        f"before: {load0:.1f}, after: {os.getloadavg()[0]:.1f}"
    )
    log(f"\n{note}\n")
    log(table(results, largest, markdown=False))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dims": dims, "largest": largest, "results": results}, f, indent=1)
    if args.write_docs:
        command = "python tools/bench_convert_memory.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        code = _git_state()
        if code != code_before:  # someone committed or edited the library during the run
            code = f"at the start {code_before}; at the end {code}"
        section = docs_section(command.strip(), results, dims, largest, args.dir, note, code)
        write_docs(args.write_docs, section)
        log(f"\nwrote {args.write_docs}")
    wrong = [r for info in results.values() for r in info["tools"].values() if not r["verified"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
