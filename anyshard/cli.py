"""The ``anyshard`` command: inspect and verify checkpoints.

Exit codes: 0 ok, 1 a problem found (verify), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import sys

from anyshard.errors import AnyshardError

__all__ = ["main"]

_EXAMPLES = {
    "inspect": "examples:\n  anyshard inspect /ckpt/step-001000\n  anyshard inspect /ckpt/step-001000 --json",
    "verify": "examples:\n  anyshard verify /ckpt/step-001000",
}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _inspect(args) -> int:
    import anyshard

    with anyshard.open(args.path) as ckpt:
        rows = [ckpt.metadata(name) for name in ckpt.keys()]
        m = ckpt.manifest
        if args.json:
            out = {
                "format": "anyshard",
                "format_version": 1,
                "world_size": m.world_size,
                "meshes": [x.to_json() for x in m.meshes],
                "values": m.values,
                "tensors": [
                    {
                        "name": r.name,
                        "shape": list(r.shape),
                        "dtype": str(r.dtype).removeprefix("torch."),
                        "bytes": r.nbytes,
                        "shards": r.num_shards,
                        "mapping": r.mapping,
                    }
                    for r in rows
                ],
            }
            print(json.dumps(out, indent=2))
            return 0
        meshes = "; ".join(
            " x ".join(f"{d}={s}" for d, s in zip(x.dims, x.sizes, strict=True)) for x in m.meshes
        )
        print(
            f"{args.path}: anyshard checkpoint, saved by {m.world_size} rank(s); meshes: {meshes}"
        )
        width = max([len(r.name) for r in rows] + [6])
        print(f"{'tensor':{width}}  {'shape':>16}  {'dtype':9}  {'bytes':>10}  shards  mapping")
        for r in rows:
            dtype = str(r.dtype).removeprefix("torch.")
            print(
                f"{r.name:{width}}  {str(list(r.shape)):>16}  {dtype:9}  {_human(r.nbytes):>10}  {r.num_shards:6}  {r.mapping}"
            )
        print(
            f"{len(rows)} tensors, {_human(sum(r.nbytes for r in rows))}; {len(m.values)} JSON values"
        )
    return 0


def _verify(args) -> int:
    from anyshard.format.verify import verify_checkpoint

    try:
        report = verify_checkpoint(args.path)
    except AnyshardError as e:
        print(f"anyshard verify: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.path}: OK — {report.tensors} tensors, {report.shards} shards in {report.files} files, "
        f"{_human(report.bytes_checked)} checksummed, every element stored exactly once"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="anyshard", description="Inspect and verify anyshard checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors",
        epilog=_EXAMPLES["inspect"],
        formatter_class=fmt,
    )
    s.add_argument("path", help="checkpoint directory or URL")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=_inspect)
    s = sub.add_parser(
        "verify",
        help="re-read every shard: checksums and coverage",
        epilog=_EXAMPLES["verify"],
        formatter_class=fmt,
    )
    s.add_argument("path", help="checkpoint directory or URL")
    s.set_defaults(run=_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except AnyshardError as e:
        print(f"anyshard {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
