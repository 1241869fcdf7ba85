"""The ``anyshard`` command: inspect and verify checkpoints, list and clean checkpoint roots.

Exit codes: 0 ok, 1 a problem found (verify), 2 bad usage or input.
Run: ``anyshard --help``, ``anyshard ls /ckpt``.
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
    "ls": "examples:\n  anyshard ls /ckpt\n  anyshard ls s3://bucket/run1 --json",
    "gc": "examples:\n  anyshard gc /ckpt --dry-run\n  anyshard gc s3://bucket/run1",
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


def _root_must_exist(root: str) -> None:
    from anyshard.errors import CheckpointNotFoundError
    from anyshard.format import storage

    if not storage.exists(root):
        raise CheckpointNotFoundError(
            f"{root}: no such checkpoint root; pass the directory that holds step-* directories"
        )


def _ls(args) -> int:
    from anyshard.format.steps import list_steps

    _root_must_exist(args.root)
    listed = list_steps(args.root)
    if args.json:
        out = [
            {"step": s.step, "path": s.path, "committed": s.committed, "bytes": s.bytes}
            for s in listed
        ]
        print(json.dumps({"root": args.root, "steps": out}, indent=2))
        return 0
    print(f"{'step':>12}  {'state':11}  {'bytes':>10}  path")
    for s in listed:
        state = "committed" if s.committed else "uncommitted"
        print(f"{s.step:>12}  {state:11}  {_human(s.bytes):>10}  {s.path}")
    num_committed = sum(s.committed for s in listed)
    print(
        f"{len(listed)} steps ({num_committed} committed, {len(listed) - num_committed} uncommitted), "
        f"{_human(sum(s.bytes for s in listed))}"
    )
    return 0


def _gc(args) -> int:
    from anyshard.format.steps import remove_debris

    _root_must_exist(args.root)
    removed = remove_debris(args.root, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{verb} {len(removed)} uncommitted step(s) older than the newest commit")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="anyshard", description="Inspect, verify, list and clean anyshard checkpoints."
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
    s = sub.add_parser(
        "ls",
        help="list the step-* checkpoints under a root, committed or not, with sizes",
        epilog=_EXAMPLES["ls"],
        formatter_class=fmt,
    )
    s.add_argument("root", help="directory or URL holding step-* checkpoint directories")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=_ls)
    s = sub.add_parser(
        "gc",
        help="remove debris: uncommitted steps older than the newest committed step",
        description="Remove uncommitted step-* directories older than the newest committed step. "
        "Newer uncommitted steps may be saves in progress and are never touched.",
        epilog=_EXAMPLES["gc"],
        formatter_class=fmt,
    )
    s.add_argument("root", help="directory or URL holding step-* checkpoint directories")
    s.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    s.set_defaults(run=_gc)
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
