"""Incremental checkpoints in LoRA fine-tuning: bytes written, save and load times against full
saves, and what the steps on disk hold.

The reference GPT (``anyshard.trainer_integration.gpt``, one process) with a frozen base and
rank-8 LoRA adapters on every attention and MLP projection (wq, wk, wv, wo, w1, w2, w3) is
fine-tuned with AdamW for ``--checkpoints`` steps, saving every step with a
``Checkpointer(root, keep_last=2)`` in three ways over the same training run:

- full: every save writes everything;
- incremental, frozen: ``incremental=True`` with the frozen base's names declared ``frozen``
  (referenced without hashing);
- incremental, hashed: ``incremental=True`` alone (every shard hashed, unchanged ones
  referenced).

Per save: the bytes it wrote (its step directory's files) and its time (sync saves, the first
one included in the table's first row only). Load: ``anyshard.load`` of the last step into a
preallocated state, the median of ``--loads`` runs; every load is checked bit-exact against the
full save's. Disk: what the root holds at the end (``anyshard ls``).

    python tools/bench_incremental.py                 # tmpfs and disk
    python tools/bench_incremental.py --write-docs    # also replace the section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from markdown_section import replace_section, rerun_command  # noqa: E402

import anyshard  # noqa: E402
from anyshard.format.steps import list_steps  # noqa: E402
from anyshard.trainer_integration import Checkpointer  # noqa: E402
from anyshard.trainer_integration.gpt.config import ModelConfig  # noqa: E402
from anyshard.trainer_integration.gpt.model import build_model  # noqa: E402

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- incremental:begin -->", "<!-- incremental:end -->"
TARGETS = {"bytes": 0.05, "save": 0.10, "load": 1.05}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with ``base`` frozen and A, B of rank ``r``."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, g: torch.Generator):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features, generator=g) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def lora_model(cfg: ModelConfig, rank: int) -> nn.Module:
    model = build_model(cfg, seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for layer in model.layers.values():
        for parent in (layer.attention, layer.feed_forward):
            for name in PROJECTIONS:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, LoRALinear(getattr(parent, name), rank, 16.0, g))
    return model


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    optim = {
        f"{names[p]}.{k}": v
        for group in opt.param_groups
        for p in group["params"]
        for k, v in opt.state.get(p, {}).items()
        if isinstance(v, torch.Tensor)
    }
    return {"model": model.state_dict(), "optim": optim, "meta": {"step": step}}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(kind: str, root: str, cfg: ModelConfig, args) -> dict:
    torch.manual_seed(0)
    model = lora_model(cfg, args.rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
    frozen += [f"model.{n}" for n, _ in model.named_buffers()]
    ckpt = Checkpointer(
        root,
        keep_last=2,
        incremental=kind != "full",
        frozen=frozen if kind == "incremental, frozen" else None,
    )
    data = torch.Generator().manual_seed(2)
    saves, written = [], []
    for step in range(1, args.checkpoints + 1):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=data)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = time.perf_counter()
        ckpt.save(step, state_of(model, opt, step))
        saves.append(time.perf_counter() - t)
        written.append(_dir_bytes(os.path.join(root, f"step-{step:09d}")))
    ckpt.wait()
    disk = list_steps(root, refs=True)
    return {
        "saves": saves,
        "written": written,
        "last": os.path.join(root, f"step-{args.checkpoints:09d}"),
        "final": state_of(model, opt, args.checkpoints),
        "disk": [(s.step, s.committed, s.referenced, s.bytes, s.shared) for s in disk],
        "total": sum(s.bytes for s in disk),
    }


def _drop_caches() -> None:
    """Empty the page cache (root only): the next load reads from the device."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def time_loads(runs: dict[str, dict], reps: int, cold: bool = False) -> dict[str, float]:
    """Median time of ``anyshard.load`` of each run's last step, the runs interleaved; every
    load is checked bit-exact against the state the run saved. With ``cold``, the page cache
    is dropped before each load."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    kinds = list(runs)
    targets = {}
    for kind, r in runs.items():  # allocated and touched once: the loads time reading only
        final = r["final"]
        targets[kind] = {
            "model": {k: torch.zeros_like(v) for k, v in final["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in final["optim"].items()},
            "meta": {"step": -1},
        }
    for rep in range(reps):  # each rep starts at another kind: no kind always follows another
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            final, target = runs[kind]["final"], targets[kind]
            if cold:
                _drop_caches()
            t = time.perf_counter()
            anyshard.load(runs[kind]["last"], target)
            times[kind].append(time.perf_counter() - t)
            for part in ("model", "optim"):
                for k, v in final[part].items():
                    if not torch.equal(target[part][k], v):
                        raise SystemExit(f"{kind}: {part}.{k} differs after load")
                    target[part][k].zero_()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--roots", default="tmpfs,disk", help="comma-separated: tmpfs, disk")
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--loads", type=int, default=10)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each load from disk (needs root): loads read the device",
    )
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
    )
    started = time.time()
    bases = {"tmpfs": "/dev/shm", "disk": tempfile.gettempdir()}
    kinds = ["full", "incremental, frozen", "incremental, hashed"]
    results: dict[tuple[str, str], dict] = {}
    for where in args.roots.split(","):
        tmps = {k: tempfile.mkdtemp(prefix="bench-incremental-", dir=bases[where]) for k in kinds}
        try:
            runs = {k: run(k, os.path.join(tmps[k], "ckpt"), cfg, args) for k in kinds}
            loads = time_loads(runs, args.loads, cold=args.cold and where == "disk")
        finally:
            for tmp in tmps.values():
                shutil.rmtree(tmp, ignore_errors=True)
        for kind, r in runs.items():
            r["load"] = loads[kind]
            del r["final"]
            results[(where, kind)] = r
            later = r["saves"][1:]
            print(
                f"{where:6} {kind:22} first save {r['written'][0] / 2**20:7.1f} MiB "
                f"{r['saves'][0]:.3f} s; later saves {statistics.median(r['written'][1:]) / 2**20:7.2f} MiB "
                f"{statistics.median(later):.3f} s; load {r['load']:.3f} s; on disk "
                f"{r['total'] / 2**20:.1f} MiB",
                flush=True,
            )
    took = time.time() - started
    lines = [
        "| storage | saves | first save | later saves: bytes each | / full | time each | / full "
        "| load of the last step | / full | on disk at the end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    for where in args.roots.split(","):
        full = results[(where, "full")]
        fb = statistics.median(full["written"][1:])
        fs = statistics.median(full["saves"][1:])
        for kind in kinds:
            r = results[(where, kind)]
            b, s = statistics.median(r["written"][1:]), statistics.median(r["saves"][1:])
            lines.append(
                f"| {where} | {kind} | {r['written'][0] / 2**20:.1f} MiB, {r['saves'][0]:.2f} s "
                f"| {b / 2**20:.2f} MiB | {b / fb:.1%} | {s * 1000:.0f} ms | {s / fs:.1%} "
                f"| {r['load'] * 1000:.0f} ms | {r['load'] / full['load']:.2f}x "
                f"| {r['total'] / 2**20:.1f} MiB |"
            )
            if kind != "full":
                verdicts.append(
                    f"- {where}, {kind}: bytes {b / fb:.1%} (target <= {TARGETS['bytes']:.0%}: "
                    f"{'met' if b / fb <= TARGETS['bytes'] else 'not met'}), save time "
                    f"{s / fs:.1%} (<= {TARGETS['save']:.0%}: "
                    f"{'met' if s / fs <= TARGETS['save'] else 'not met'}), load "
                    f"{r['load'] / full['load']:.2f}x (<= {TARGETS['load']:.2f}x: "
                    f"{'met' if r['load'] / full['load'] <= TARGETS['load'] else 'not met'})"
                )
    inc = results[(args.roots.split(",")[0], "incremental, frozen")]
    disk = ["| step | state | owns | references |", "| --- | --- | --- | --- |"]
    for step, committed, referenced, owns, shared in inc["disk"]:
        state = "committed" if committed else "kept: referenced" if referenced else "uncommitted"
        disk.append(f"| {step} | {state} | {owns / 2**20:.2f} MiB | {shared / 2**20:.1f} MiB |")
    print("\n".join(lines + [""] + verdicts + [""] + disk))
    if args.write_docs:
        params = sum(v.numel() for v in lora_model(cfg, args.rank).state_dict().values())
        cmd = rerun_command(__file__)
        body = [
            "## Incremental checkpoints in LoRA fine-tuning (`tools/bench_incremental.py`)",
            "",
            f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {took:.0f} s, 2 CPU cores, one "
            f"process). The reference GPT (dim {args.dim}, {args.layers} layers, ffn "
            f"{args.ffn}, vocab {args.vocab}; {params / 1e6:.0f}M parameters, fp32) with a "
            f"frozen base and rank-{args.rank} LoRA adapters on wq, wk, wv, wo, w1, w2, w3, "
            f"AdamW on the adapters; {args.checkpoints} checkpoints, one per step, "
            '`Checkpointer(root, keep_last=2)`, sync saves. "Later saves": the median of '
            "saves 2 and on (bytes: the files of the step's own directory); a full save's time "
            "includes the retention that deletes the step two back (it runs in the background "
            "and the next save waits for it). Load: `anyshard.load` of the last step into a "
            f"preallocated state, median of {args.loads}, the three kinds interleaved in rotating "
            "order, each "
            "checked bit-exact against the trained state.",
            "",
            *lines,
            "",
            *verdicts,
            "",
            f"What the root holds at the end ({args.roots.split(',')[0]}, incremental, frozen): "
            "the first step's directory stays, without its manifest, for the frozen base the "
            "kept steps reference; each kept step owns its adapters and optimizer state.",
            "",
            *disk,
        ]
        replace_section(DOC, BEGIN, END, body)
        print(f"wrote {os.path.relpath(DOC, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
