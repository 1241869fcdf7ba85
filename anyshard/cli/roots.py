"""``anyshard ls`` and ``anyshard gc``: the step directories under a checkpoint root, listed
with their state and sizes; debris of unfinished saves removed."""

from __future__ import annotations

import json
import sys

from anyshard.cli.values import human


def _root_must_exist(root: str) -> None:
    from anyshard.errors import CheckpointNotFoundError
    from anyshard.format import storage

    if not storage.exists(root):
        raise CheckpointNotFoundError(
            f"{root}: no such checkpoint root; pass the directory that holds step-* directories"
        )


def ls_command(args) -> int:
    from anyshard.format.steps import list_steps

    _root_must_exist(args.root)
    listed = list_steps(args.root, refs=True)
    if args.json:
        out = [
            {
                "step": s.step,
                "path": s.path,
                "committed": s.committed,
                "bytes": s.bytes,
                "shared_bytes": s.shared,
                "referenced": s.referenced,
            }
            for s in listed
        ]
        print(json.dumps({"root": args.root, "steps": out}, indent=2))
        return 0
    _print_steps(args.root, listed)
    return 0


def _print_steps(root: str, listed) -> None:
    print(f"{'step':>12}  {'state':11}  {'owns':>10}  {'references':>10}  path")
    for s in listed:
        state = "committed" if s.committed else "referenced" if s.referenced else "uncommitted"
        shared = human(s.shared) if s.shared else "-"
        print(f"{s.step:>12}  {state:11}  {human(s.bytes):>10}  {shared:>10}  {s.path}")
    num_committed = sum(s.committed for s in listed)
    if not listed:
        print(
            f"{root}: no step directories here; ls lists directories named step-<number> "
            "(step-000001000, step-1000), such as anyshard's Checkpointer writes",
            file=sys.stderr,
        )
    held = sum(s.referenced for s in listed)
    print(
        f"{len(listed)} steps ({num_committed} committed, {len(listed) - num_committed} uncommitted"
        + (f", {held} of them kept for the files later steps reference" if held else "")
        + f"), {human(sum(s.bytes for s in listed))}"
    )
    if any(s.shared for s in listed):
        print(
            "owns: the bytes in the step's directory; references: the bytes of unchanged "
            "shards it reads from earlier steps' files (an incremental save)"
        )


def gc_command(args) -> int:
    from anyshard.format.steps import remove_debris, remove_orphans

    _root_must_exist(args.root)
    removed, kept = remove_debris(
        args.root, dry_run=args.dry_run, report_kept=True, stale_after_s=args.stale_after
    )
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        if path in kept:
            print(f"kept {path}: it holds data files that committed steps reference")
        else:
            print(f"{verb} {path}")
    print(
        f"{verb} {len(removed) - len(kept)} uncommitted step(s) older than the newest commit"
        + (f" or untouched for {args.stale_after:g} s" if args.stale_after is not None else "")
        + (f"; kept {len(kept)} whose files committed steps reference" if kept else "")
    )
    if args.stale_after is not None:  # files of committed steps that nothing names any more
        orphans = remove_orphans(args.root, stale_after_s=args.stale_after, dry_run=args.dry_run)
        for path in orphans:
            print(f"{verb} {path}")
        print(f"{verb} {len(orphans)} data file(s) of committed steps that nothing references")
    return 0
