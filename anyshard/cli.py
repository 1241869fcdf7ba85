"""The ``anyshard`` command: inspect, verify, convert and diff checkpoints, list and clean
checkpoint roots, check and explain UCL specs.

Exit codes: 0 ok, 1 a problem or difference found (verify, diff), 2 bad usage or input (one
line on stderr), 3 an internal error: a bug in anyshard, printed with its traceback to report.
Run: ``anyshard --help``, ``anyshard ls /ckpt``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from anyshard.errors import AnyshardError

__all__ = ["main"]

_EXAMPLES = {
    "inspect": "examples:\n  anyshard inspect /ckpt/step-001000\n  anyshard inspect /ckpt/step-001000 --json",
    "verify": "examples:\n  anyshard verify /ckpt/step-001000",
    "ls": "examples:\n  anyshard ls /ckpt\n  anyshard ls s3://bucket/run1 --json",
    "gc": "examples:\n  anyshard gc /ckpt --dry-run\n  anyshard gc s3://bucket/run1\n"
    "  anyshard gc /ckpt --stale-after 3600   # also a killed job's newer, unfinished steps",
    "convert": "examples:\n"
    "  anyshard convert /ckpt/step-001000 ./hf                    # anyshard -> Hugging Face\n"
    "  anyshard convert ./hf ./hf-bf16 --to hf --dtype bf16 --max-shard-size 2GB\n"
    "  anyshard convert ./hf /ckpt/tp2 --spec hf_llama --layout tp=2,hidden=4096,heads=32,"
    "kv_heads=8,ffn=11008,vocab=32000,layers=32\n"
    "  anyshard convert ./hf /ckpt/plain                          # one plain rank, no spec\n"
    "  anyshard convert /ckpt/step-001000 ./hf --only '^model\\.' --rename '^model\\.=model.model.'\n"
    "  anyshard convert /ckpt/step-001000 ./dcp --to dcp           # for torch.distributed.checkpoint\n"
    "  anyshard convert /ckpt/step-001000 ./export.zarr --to zarr  # consolidated zarr v3 store",
    "diff": "examples:\n  anyshard diff /ckpt/step-001000 ./hf\n"
    "  anyshard diff ./hf ./hf-bf16 --atol 1e-2\n  anyshard diff a b --json",
    "ucl check": "examples:\n  anyshard ucl check my_model.ucl\n"
    "  anyshard ucl check megatron_gpt --layout pp=2,dp=2,tp=2,hidden=4096,heads=32,kv_heads=8,"
    "ffn=11008,vocab=32000,layers=32",
    "ucl explain": "examples:\n  anyshard ucl explain megatron_gpt --layout tp=2,hidden=64,heads=4,"
    "ffn=128,vocab=100,layers=2 model.layers.0.self_attn.q_proj.weight",
}


class _Usage(Exception):
    """Bad command-line input: one line on stderr, exit code 2."""


def _layout_arg(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        try:
            if not eq or not key.strip():
                raise ValueError
            out[key.strip()] = int(value)
        except ValueError:
            raise _Usage(
                f"--layout: {item!r} is not NAME=INT; write e.g. --layout tp=2,pp=2,hidden=64"
            ) from None
    return out


def _load_spec_arg(name: str):
    from pathlib import Path

    from anyshard.ucl.library import SPEC_DIR, parse, shipped_specs

    p = Path(name)
    if p.is_file():
        return parse(p.read_text()), str(p)
    if name in shipped_specs():
        return parse((SPEC_DIR / f"{name}.ucl").read_text()), f"{name} (shipped)"
    raise _Usage(
        f"{name}: no such file, and not a shipped spec (shipped: {', '.join(shipped_specs())})"
    )


# Commands that other packages (or anyshard's own reference trainer, ``demo``) add to the CLI:
# an entry point ``NAME = "module:main"``, where ``main(argv) -> int`` parses its own options.
COMMANDS_GROUP = "anyshard.commands"


@functools.cache  # the installed entry points: read once per process
def _plugin_commands() -> dict[str, object]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


@functools.cache
def _summary(module: str) -> str:
    """The first line of ``module``'s docstring, read without importing it."""
    import ast
    import importlib.util

    try:
        origin = importlib.util.find_spec(module).origin
        with open(origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, AttributeError, OSError, SyntaxError, ValueError):
        doc = ""
    return doc.strip().splitlines()[0].split(": ", 1)[-1].rstrip(".") if doc.strip() else module


def _ucl_check(args) -> int:
    from anyshard.errors import UCLError
    from anyshard.ucl.explain import check_layout

    layout = _layout_arg(args.layout)
    try:
        spec, where = _load_spec_arg(args.file)
    except UCLError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    params = ", ".join(
        p.name if p.default is None else f"{p.name}={p.default}" for p in spec.params
    )
    print(
        f"{where}: ok: {len(spec.rules)} rules; mesh ({', '.join(spec.mesh)}); params {params or '-'}"
    )
    if not args.layout:
        return 0
    try:
        report = check_layout(spec, layout)
    except UCLError as e:
        print(f"{args.file}: under --layout {args.layout}: {e}", file=sys.stderr)
        return 1
    print(
        f"layout {args.layout}: {report.ranks} ranks, {report.local_tensors} local tensors, "
        f"{len(report.logical)} logical tensors"
    )
    for problem in report.problems:
        print(f"problem: {problem}", file=sys.stderr)
    if report.problems:
        return 1
    print("every logical tensor is saved exactly once")
    return 0


def _ucl_explain(args) -> int:
    from anyshard.errors import UCLError
    from anyshard.ucl.explain import explain

    layout = _layout_arg(args.layout)
    try:
        spec, _ = _load_spec_arg(args.file)
        print(explain(spec, layout, args.name))
    except UCLError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    except KeyError as e:
        raise _Usage(str(e.args[0])) from None
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _inspect(args) -> int:
    import anyshard
    from anyshard.loaders.convert import format_of

    with anyshard.open(args.path) as ckpt:
        if format_of(ckpt) != "anyshard":
            return _inspect_other(args, ckpt)
        rows = [ckpt.metadata(name) for name in ckpt.keys()]
        m = ckpt.manifest
        if args.json:
            out = {
                "format": "anyshard",
                "format_version": m.format_version,
                "world_size": m.world_size,
                "meshes": [x.to_json() for x in m.meshes],
                "values": m.values,
                "spec": m.spec.to_json() if m.spec is not None else None,
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
        if m.spec is not None:
            layout = ",".join(f"{k}={v}" for k, v in m.spec.layout.items())
            print(f"saved as local tensors under a UCL spec, layout {layout}")
        width = max([len(r.name) for r in rows] + [6])
        print(f"{'tensor':{width}}  {'shape':>16}  {'dtype':9}  {'bytes':>10}  shards  mapping")
        for r in rows:
            dtype = str(r.dtype).removeprefix("torch.")
            print(
                f"{r.name:{width}}  {str(list(r.shape)):>16}  {dtype:9}  {_human(r.nbytes):>10}  {r.num_shards:6}  {r.mapping if r.mapping is not None else '(spec)'}"
            )
        print(
            f"{len(rows)} tensors, {_human(sum(r.nbytes for r in rows))}; {len(m.values)} JSON values"
        )
    return 0


def _inspect_other(args, ckpt) -> int:
    """``inspect`` of a checkpoint in another format (Hugging Face, DCP, DeepSpeed, Megatron,
    zarr, torch.save): its format, files where the view names them, and the tensors."""
    rows = [ckpt.metadata(name) for name in ckpt.keys()]
    values = {k: ckpt.get_value(k) for k in ckpt.value_keys()}
    files = list(getattr(ckpt, "files", None) or [])
    extras = {
        k: getattr(ckpt, k)
        for k in ("index_name", "zero_stage", "memory_mapped")
        if getattr(ckpt, k, None) is not None
    }
    if args.json:
        out = {
            "format": ckpt.format,
            "files": files,
            **extras,
            "values": values,
            "tensors": [
                {
                    "name": r.name,
                    "shape": list(r.shape),
                    "dtype": str(r.dtype).removeprefix("torch."),
                    "bytes": r.nbytes,
                    "shards": r.num_shards,
                    **({"file": r.file} if getattr(r, "file", None) else {}),
                }
                for r in rows
            ],
        }
        if ckpt.format == "huggingface-safetensors":
            out["metadata"] = ckpt.metadata()
        print(json.dumps(out, indent=2, default=str))
        return 0
    where = f", {len(files)} file(s)" if files else ""
    index = f", index {extras['index_name']}" if extras.get("index_name") else ""
    stage = f", ZeRO stage {extras['zero_stage']}" if "zero_stage" in extras else ""
    print(f"{args.path}: format {ckpt.format}{where}{index}{stage}")
    width = max([len(r.name) for r in rows] + [6])
    by_file = all(getattr(r, "file", None) for r in rows)
    last = "file" if by_file else "shards"
    print(f"{'tensor':{width}}  {'shape':>16}  {'dtype':9}  {'bytes':>10}  {last}")
    for r in rows:
        dtype = str(r.dtype).removeprefix("torch.")
        tail = r.file if by_file else f"{r.num_shards:6}"
        print(
            f"{r.name:{width}}  {str(list(r.shape)):>16}  {dtype:9}  {_human(r.nbytes):>10}  {tail}"
        )
    print(f"{len(rows)} tensors, {_human(sum(r.nbytes for r in rows))}; {len(values)} values")
    return 0


def _progress_printer(enabled: bool):
    """Progress on stderr: redrawn in place on a terminal, else a line every few seconds."""
    if not enabled:
        return None
    import time

    tty = sys.stderr.isatty()
    every = 0.2 if tty else 5.0
    last = [0.0]

    def show(k: int, n: int, done: int, total: int) -> None:
        now = time.monotonic()
        if k != n and now - last[0] < every:
            return
        last[0] = now
        line = f"convert: tensor {k}/{n}, {_human(done)} of {_human(total)}"
        if tty:
            print(f"\r{line}", end="\n" if k == n else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    return show


def _rename_arg(items: list[str] | None) -> list[tuple[str, str]]:
    import re

    out = []
    for item in items or ():
        src, eq, dst = item.rpartition("=")  # the last '=': a pattern may hold (?<=...)
        if not eq or not src:
            raise _Usage(
                f"--rename: {item!r} is not FROM=TO; write e.g. --rename '^model\\.=' "
                "(FROM a regular expression, TO its replacement)"
            )
        try:
            re.compile(src)
        except re.error as e:
            raise _Usage(f"--rename: {src!r} is not a regular expression ({e})") from None
        out.append((src, dst))
    return out


def _convert(args) -> int:
    import re

    from anyshard.format import storage
    from anyshard.loaders import parse_dtype, parse_size
    from anyshard.loaders.convert import convert

    if args.spec is None and args.layout:
        raise _Usage("--layout needs --spec (the UCL spec the layout is for)")
    if args.spec is not None and args.to not in (None, "anyshard"):
        raise _Usage(
            f"--spec and --layout describe an anyshard target; drop them for --to {args.to}"
        )
    layout = _layout_arg(args.layout)
    spec = None
    if args.spec is not None:
        spec, _ = _load_spec_arg(args.spec)
    try:
        dtype = parse_dtype(args.dtype)
        max_shard_size = parse_size(args.max_shard_size)
    except AnyshardError as e:
        raise _Usage(str(e)) from None
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as e:
            raise _Usage(f"--only: {args.only!r} is not a regular expression ({e})") from None
    if not storage.exists(args.src):
        raise _Usage(f"{args.src}: no such checkpoint (file or directory)")
    report = convert(
        args.src,
        args.dst,
        to=args.to,
        spec=spec,
        layout=layout,
        dtype=dtype,
        only=args.only,
        rename=_rename_arg(args.rename),
        max_shard_size=max_shard_size,
        progress=_progress_printer(args.progress or sys.stderr.isatty()),
    )
    files = ", ".join(report.files[:3]) + (" ..." if len(report.files) > 3 else "")
    print(
        f"{report.path}: wrote {report.num_tensors} tensors ({_human(report.num_bytes)}) as "
        f"{report.format} in {len(report.files)} file(s): {files}"
    )
    return 0


def _diff(args) -> int:
    from anyshard.format import storage
    from anyshard.loaders.convert import diff

    try:
        atol = float(args.atol)
        if not atol >= 0:
            raise ValueError
    except ValueError:
        raise _Usage(
            f"--atol: {args.atol!r} is not a number >= 0; write e.g. --atol 1e-3"
        ) from None
    args.atol = atol
    for path in (args.a, args.b):
        if not storage.exists(path):
            raise _Usage(f"{path}: no such checkpoint (file or directory)")
    report = diff(args.a, args.b, atol=args.atol)
    if args.json:
        out = {
            "a": args.a,
            "b": args.b,
            "atol": args.atol,
            "equal": report.equal,
            "only_a": report.only_a,
            "only_b": report.only_b,
            "tensors": [
                {
                    "name": t.name,
                    "shape_a": list(t.shape_a),
                    "shape_b": list(t.shape_b),
                    "dtype_a": str(t.dtype_a).removeprefix("torch."),
                    "dtype_b": str(t.dtype_b).removeprefix("torch."),
                    "max_abs_diff": t.max_abs,
                    "equal": t.equal(args.atol),
                }
                for t in report.tensors
            ],
        }
        print(json.dumps(out, indent=2))
        return 0 if report.equal else 1
    for name in report.only_a:
        print(f"only in A: {name}")
    for name in report.only_b:
        print(f"only in B: {name}")
    for t in report.tensors:
        notes = []
        if t.dtype_a != t.dtype_b:
            notes.append(
                f"dtype {str(t.dtype_a).removeprefix('torch.')} vs {str(t.dtype_b).removeprefix('torch.')}"
            )
        if t.max_abs is None:
            notes.append(f"shape {list(t.shape_a)} vs {list(t.shape_b)}")
        elif t.max_abs > args.atol:
            notes.append(f"max abs diff {t.max_abs:.6g}")
        if notes:
            state = "same" if t.equal(args.atol) else "DIFFERS"
            print(f"{state:7}  {t.name}: {'; '.join(notes)}")
    worst = max(
        (t for t in report.tensors if t.max_abs is not None), key=lambda t: t.max_abs, default=None
    )
    worst_text = ""
    if worst is not None and worst.max_abs > 0:
        worst_text = f"; largest difference {worst.max_abs:.6g} ({worst.name})"
    verdict = "equal" if report.equal else "different"
    print(
        f"{verdict} within atol {args.atol:g}: {len(report.tensors)} tensors compared, "
        f"{len(report.differing)} differ, {len(report.only_a)} only in A, "
        f"{len(report.only_b)} only in B{worst_text}"
    )
    return 0 if report.equal else 1


def _verify(args) -> int:
    from anyshard.reshard.verify import verify_checkpoint

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
    print(f"{'step':>12}  {'state':11}  {'owns':>10}  {'references':>10}  path")
    for s in listed:
        state = "committed" if s.committed else "referenced" if s.referenced else "uncommitted"
        shared = _human(s.shared) if s.shared else "-"
        print(f"{s.step:>12}  {state:11}  {_human(s.bytes):>10}  {shared:>10}  {s.path}")
    num_committed = sum(s.committed for s in listed)
    if not listed:
        print(
            f"{args.root}: no step directories here; ls lists directories named step-<number> "
            "(step-000001000, step-1000), such as anyshard's Checkpointer writes",
            file=sys.stderr,
        )
    held = sum(s.referenced for s in listed)
    print(
        f"{len(listed)} steps ({num_committed} committed, {len(listed) - num_committed} uncommitted"
        + (f", {held} of them kept for the files later steps reference" if held else "")
        + f"), {_human(sum(s.bytes for s in listed))}"
    )
    if any(s.shared for s in listed):
        print(
            "owns: the bytes in the step's directory; references: the bytes of unchanged "
            "shards it reads from earlier steps' files (an incremental save)"
        )
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be 0 or more")
    return value


def _gc(args) -> int:
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


def _add_convert(sub, fmt) -> None:
    s = sub.add_parser(
        "convert",
        help="convert a checkpoint to anyshard under a layout, Hugging Face, DCP or zarr",
        description="Convert SRC (any format anyshard reads, detected) into DST, "
        "streaming one tensor at a time. To anyshard, --spec and --layout give the target "
        "layout (every rank's files as if that layout had saved them); without them, one "
        "plain rank.",
        epilog=_EXAMPLES["convert"],
        formatter_class=fmt,
    )
    s.add_argument("src", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("dst", help="new directory or URL (or a .safetensors file with --to hf)")
    s.add_argument(
        "--to",
        choices=["anyshard", "hf", "dcp", "zarr"],
        help="target format: anyshard, hf (Hugging Face safetensors), dcp (PyTorch DCP, "
        "loadable by torch.distributed.checkpoint.load) or zarr (a consolidated zarr v3 store "
        "via tensorstore); default: hf for an anyshard source, anyshard otherwise",
    )
    s.add_argument("--spec", help="UCL spec of the target layout: a .ucl file or a shipped name")
    s.add_argument("--layout", help="mesh sizes and spec params, e.g. tp=2,hidden=64")
    s.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    s.add_argument("--only", metavar="REGEX", help="convert only the tensors whose names match")
    s.add_argument(
        "--rename",
        metavar="FROM=TO",
        action="append",
        help="rename tensors: re.sub(FROM, TO, name); repeat to apply several in order",
    )
    s.add_argument("--max-shard-size", default="5GB", help="Hugging Face shard size (default 5GB)")
    s.add_argument(
        "--progress", action="store_true", help="progress on stderr (default: when a terminal)"
    )
    s.set_defaults(run=_convert)
    s = sub.add_parser(
        "diff",
        help="compare two checkpoints tensor by tensor, across formats",
        description="Per-tensor largest absolute difference between A and B (any formats), "
        "and the names only one holds. Exit 0 when equal within --atol, 1 otherwise.",
        epilog=_EXAMPLES["diff"],
        formatter_class=fmt,
    )
    s.add_argument("a", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("b", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("--atol", default="0", help="allowed absolute difference (default 0: exact)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=_diff)


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """The command line's parser, built once per process (argparse's gettext lookups make
    building it cost more than most commands it runs)."""
    p = argparse.ArgumentParser(
        prog="anyshard",
        description="Inspect, verify, convert, compare, list and clean checkpoints.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors",
        epilog=_EXAMPLES["inspect"],
        formatter_class=fmt,
    )
    s.add_argument(
        "path", help="checkpoint directory or URL (anyshard, or Hugging Face safetensors)"
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=_inspect)
    _add_convert(sub, fmt)
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
        "Newer uncommitted steps may be saves in progress and are left alone, unless "
        "--stale-after is given: then those in which nothing was written for that long go "
        "too (a killed job's), as do data files of committed steps that neither their manifest "
        "nor any other step names and that are as old (a checkpoint replaced in place by a job "
        "killed before its cleanup).",
        epilog=_EXAMPLES["gc"],
        formatter_class=fmt,
    )
    s.add_argument("root", help="directory or URL holding step-* checkpoint directories")
    s.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    s.add_argument(
        "--stale-after",
        type=_seconds,
        metavar="SECONDS",
        help="also remove uncommitted steps newer than the newest commit (or in a root with no "
        "commit) in which nothing was written for SECONDS; take SECONDS above the longest save "
        "(on an object store a file appears when its upload ends, dated from its start)",
    )
    s.set_defaults(run=_gc)
    for name, ep in sorted(_plugin_commands().items()):
        if name not in sub.choices:
            c = sub.add_parser(name, help=_summary(ep.module), add_help=False)
            c.add_argument("args", nargs=argparse.REMAINDER)
            c.set_defaults(run=lambda args, ep=ep: ep.load()(args.args))
    s = sub.add_parser(
        "ucl",
        help="check and explain UCL specs",
        description="Check a UCL spec (a .ucl file or the name of a shipped spec), or explain "
        "where a tensor lives under a layout.",
    )
    ucl_sub = s.add_subparsers(dest="ucl_command", required=True)
    c = ucl_sub.add_parser(
        "check",
        help="parse and check a spec; with --layout, compile it for every rank and check that "
        "every logical tensor is saved exactly once",
        epilog=_EXAMPLES["ucl check"],
        formatter_class=fmt,
    )
    c.add_argument("file", help="a .ucl file or a shipped spec name")
    c.add_argument("--layout", help="mesh sizes and params, e.g. tp=2,pp=2,hidden=64")
    c.set_defaults(run=_ucl_check)
    c = ucl_sub.add_parser(
        "explain",
        help="which rank holds which region of a tensor, as a small text diagram",
        epilog=_EXAMPLES["ucl explain"],
        formatter_class=fmt,
    )
    c.add_argument("file", help="a .ucl file or a shipped spec name")
    c.add_argument("--layout", required=True, help="mesh sizes and params, e.g. tp=2,hidden=64")
    c.add_argument("name", help="a logical tensor name, or a local tensor name")
    c.set_defaults(run=_ucl_explain)
    return p


INTERNAL_ERROR = 3
_BUILTIN = ("convert", "diff", "gc", "inspect", "ls", "ucl", "verify")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in _BUILTIN:
        plugin = _plugin_commands().get(argv[0])
        if plugin is not None:  # its own options, --help included
            return plugin.load()(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. piped into `head`: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (AnyshardError, _Usage) as e:
        print(f"anyshard {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception:  # not an input anyshard understood: a bug, shown in full
        import traceback

        traceback.print_exc()
        print(
            f"anyshard {args.command}: internal error (exit code {INTERNAL_ERROR}); the traceback "
            "above is a bug in anyshard: please report it with the command that raised it",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
