"""Incremental checkpoints in LoRA fine-tuning: bytes written, save and load times against full
saves, and what the steps on disk hold.

The reference GPT (one process; weights, rank-``--rank`` LoRA adapters on wq, wk, wv, wo, w1,
w2, w3 and data from ``--seed``) is fine-tuned with AdamW on the adapters, a sync save every
step into ``Checkpointer(root, keep_last=2)``: full, incremental with the base declared
``frozen``, incremental hashing every shard. Per save: its step directory's bytes and the
harness's counters. Loads of the last step into a preallocated state: `benchkit.paired`, each
checked bit-exact (``--cold``: page cache dropped before disk loads). Disk: ``anyshard ls``.

    python tools/bench_incremental.py --dim 2048 --ffn 5632 --write-docs
    python tools/bench_incremental.py --roots tmpfs --dim 64 --ffn 128 --layers 2 --vocab 256 \\
        --checkpoints 3 --loads 1                            # smoke test
"""

from __future__ import annotations

import os
import sys
import tempfile

import benchkit as h
import torch
from torch import nn

TARGETS = {"bytes": 5.0, "save": 10.0, "load": 1.05}  # % of full, % of full, x full
KINDS = ("full", "incremental, frozen", "incremental, hashed")
HEADING = "## Incremental checkpoints in LoRA fine-tuning (`tools/bench_incremental.py`)"


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with ``base`` frozen and A, B of rank ``r``."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, g: torch.Generator):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features, generator=g) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def lora_model(args) -> nn.Module:
    from anyshard.trainer_integration.gpt.config import ModelConfig
    from anyshard.trainer_integration.gpt.model import build_model

    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=8,
                      n_kv_heads=4, ffn_dim=args.ffn, max_seq_len=args.seq)  # fmt: skip
    model = build_model(cfg, seed=args.seed).requires_grad_(False)
    g = torch.Generator().manual_seed(args.seed + 1)
    for layer in model.layers.values():
        for parent in (layer.attention, layer.feed_forward):
            for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, LoRALinear(getattr(parent, name), args.rank, 16.0, g))
    return model


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    optim = {f"{names[p]}.{k}": v for p, st in opt.state.items() for k, v in st.items()
             if isinstance(v, torch.Tensor)}  # fmt: skip
    return {"model": model.state_dict(), "optim": optim, "meta": {"step": step}}


def train(kind: str, root: str, args) -> dict:
    from anyshard.format.steps import list_steps
    from anyshard.trainer_integration import Checkpointer

    model = lora_model(args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
    frozen += [f"model.{n}" for n, _ in model.named_buffers()]
    ckpt = Checkpointer(root, keep_last=2, incremental=kind != "full",
                        frozen=frozen if kind == "incremental, frozen" else None)  # fmt: skip
    data, saves = torch.Generator().manual_seed(args.seed + 2), []
    for step in range(1, args.checkpoints + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=data)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec = h.measure(lambda s=step: ckpt.save(s, state_of(model, opt, s)) and None)
        saves.append({**rec, "bytes": h.du(os.path.join(root, f"step-{step:09d}"))})
    ckpt.wait()
    disk = [(s.step, s.committed, s.referenced, s.bytes, s.shared)
            for s in list_steps(root, refs=True)]  # fmt: skip
    last = os.path.join(root, f"step-{args.checkpoints:09d}")
    return {"saves": saves, "last": last, "final": state_of(model, opt, args.checkpoints),
            "disk": disk, "total": sum(d[3] for d in disk)}  # fmt: skip


def loads(runs: dict, where: str, args, records: h.Records) -> dict[str, list[dict]]:
    """`benchkit.paired` loads of each kind's last step into a preallocated zeroed state."""
    import anyshard

    targets = {k: {p: {n: torch.zeros_like(v) for n, v in r["final"][p].items()}
                   for p in ("model", "optim")} for k, r in runs.items()}  # fmt: skip

    def before(kind: str) -> None:
        for part in targets[kind].values():
            for v in part.values():
                v.zero_()
        if args.cold and where == "disk":
            h.drop_cache(os.path.dirname(runs[kind]["last"]))

    def exact(kind: str) -> bool:
        final, got = runs[kind]["final"], targets[kind]
        return all(torch.equal(got[p][n], v) for p in got for n, v in final[p].items())

    meta = {"step": -1}
    systems = {k: lambda k=k: anyshard.load(runs[k]["last"], {**targets[k], "meta": meta})
               for k in runs}  # fmt: skip
    return h.paired(systems, args.loads, before=before, check=exact, records=records, root=where)


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__)
    ap.add_argument("--roots", default="tmpfs,disk", help="comma-separated: tmpfs, disk (/tmp)")
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    for name, default in (("dim", 1024), ("layers", 8), ("ffn", 2816), ("vocab", 32000)):
        ap.add_argument(f"--{name}", type=int, default=default, help=f"model {name} ({default})")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--loads", type=int, default=10, help="loads of each kind (median shown)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before disk loads")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, adapters and data")
    args = ap.parse_args(argv)
    if args.checkpoints < 2:
        ap.error("--checkpoints: at least 2 (the first save is shown apart)")
    torch.set_num_threads(2)
    roots = h.words(ap, "--roots", args.roots, h.BASES)
    records, load, results = h.Records(args.jsonl, "incremental"), h.RunLoad(), {}
    for where in roots:
        with tempfile.TemporaryDirectory(
            prefix="bench-incremental-", dir=h.BASES[where], ignore_cleanup_errors=True
        ) as tmp:
            runs = {k: train(k, os.path.join(tmp, str(i)), args) for i, k in enumerate(KINDS)}
            for kind, recs in loads(runs, where, args, records).items():
                if not all(r["exact"] for r in recs):
                    raise SystemExit(f"{where}, {kind}: a load differs from the trained state")
                runs[kind].update(loads=recs, final=None)
                records.add({k: v for k, v in runs[kind].items() if k != "final"}, root=where,
                            system=kind)  # fmt: skip
                results[(where, kind)] = runs[kind]
    head = ["storage", "saves", "first save", "later saves: MiB each", "/ full", "ms each"]
    head += ["/ full", "load of the last step ms", "/ full", "on disk at the end MiB"]
    rows, checks, full = [], [], {}
    for (where, kind), r in results.items():
        (first, *later), m = r["saves"], {"load": h.median_of(r["loads"], "wall_s")}
        m |= {"bytes": h.median_of(later, "bytes"), "save": h.median_of(later, "wall_s")}
        full = m if kind == "full" else full  # KINDS[0]: every kind's baseline
        got = {k: v / full[k] * (1 if k == "load" else 100) for k, v in m.items()}
        rows.append([where, kind, f"{first['bytes'] / h.MiB:.1f} MiB, {first['wall_s']:.2f} s",
                     f"{m['bytes'] / h.MiB:.2f}", f"{got['bytes']:.1f}%",
                     f"{m['save'] * 1e3:.0f}", f"{got['save']:.1f}%", f"{m['load'] * 1e3:.0f}",
                     f"{got['load']:.2f}x", f"{r['total'] / h.MiB:.1f}"])  # fmt: skip
        if kind != "full":
            checks += [(f"{where}, {kind}: {x} <= {t:g}{'x' if x == 'load' else '%'} of full",
                        got[x] <= t, f"{got[x]:.2f}") for x, t in TARGETS.items()]  # fmt: skip
    disk = []
    for step, committed, referenced, owns, shared in results[(roots[0], KINDS[1])]["disk"]:
        state = "committed" if committed else "kept: referenced" if referenced else "uncommitted"
        disk.append([step, state, f"{owns / h.MiB:.2f}", f"{shared / h.MiB:.1f}"])
    params = sum(v.numel() for v in lora_model(args).state_dict().values())
    run = (f"dim {args.dim}, {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}: "
           f"{params / 1e6:.0f}M parameters, LoRA rank {args.rank}; {args.checkpoints} "
           f"checkpoints; later saves: median of saves 2 and on; loads: median of {args.loads}"
           f"{', page cache dropped on disk' if args.cold else ''}; seed {args.seed}")  # fmt: skip
    blocks = [(head, rows), h.targets(checks)]
    blocks += [f"What the root holds at the end ({roots[0]}, {KINDS[1]}):"]
    blocks += [(["step", "state", "owns MiB", "references MiB"], disk)]
    h.report(args, argv, __file__, "incremental", run, blocks, load, heading=HEADING,
             dirs={r: h.BASES[r] for r in roots}, data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
