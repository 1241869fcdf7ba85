"""``anyshard convert`` and ``anyshard diff``: a checkpoint streamed into another format or
layout, tensor by tensor; two checkpoints, of any formats, compared tensor by tensor."""

from __future__ import annotations

import json
import sys

from anyshard.cli.values import Usage, human, layout_arg, load_spec_arg
from anyshard.errors import AnyshardError


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
        line = f"convert: tensor {k}/{n}, {human(done)} of {human(total)}"
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
            raise Usage(
                f"--rename: {item!r} is not FROM=TO; write e.g. --rename '^model\\.=' "
                "(FROM a regular expression, TO its replacement)"
            )
        try:
            re.compile(src)
        except re.error as e:
            raise Usage(f"--rename: {src!r} is not a regular expression ({e})") from None
        out.append((src, dst))
    return out


def convert_command(args) -> int:
    import re

    from anyshard.format import storage
    from anyshard.loaders import parse_dtype, parse_size
    from anyshard.loaders.convert import convert

    if args.spec is None and args.layout:
        raise Usage("--layout needs --spec (the UCL spec the layout is for)")
    if args.spec is not None and args.to not in (None, "anyshard"):
        raise Usage(
            f"--spec and --layout describe an anyshard target; drop them for --to {args.to}"
        )
    layout = layout_arg(args.layout)
    spec = None
    if args.spec is not None:
        spec, _ = load_spec_arg(args.spec)
    try:
        dtype = parse_dtype(args.dtype)
        max_shard_size = parse_size(args.max_shard_size)
    except AnyshardError as e:
        raise Usage(str(e)) from None
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as e:
            raise Usage(f"--only: {args.only!r} is not a regular expression ({e})") from None
    if not storage.exists(args.src):
        raise Usage(f"{args.src}: no such checkpoint (file or directory)")
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
        f"{report.path}: wrote {report.num_tensors} tensors ({human(report.num_bytes)}) as "
        f"{report.format} in {len(report.files)} file(s): {files}"
    )
    return 0


def diff_command(args) -> int:
    from anyshard.format import storage
    from anyshard.loaders.convert import diff

    try:
        atol = float(args.atol)
        if not atol >= 0:
            raise ValueError
    except ValueError:
        raise Usage(f"--atol: {args.atol!r} is not a number >= 0; write e.g. --atol 1e-3") from None
    args.atol = atol
    for path in (args.a, args.b):
        if not storage.exists(path):
            raise Usage(f"{path}: no such checkpoint (file or directory)")
    report = diff(args.a, args.b, atol=args.atol)
    if args.json:
        print(json.dumps(_diff_json(args, report), indent=2))
    else:
        _print_diff(report, args.atol)
    return 0 if report.equal else 1


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _diff_json(args, report) -> dict:
    return {
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
                "dtype_a": _dtype_name(t.dtype_a),
                "dtype_b": _dtype_name(t.dtype_b),
                "max_abs_diff": t.max_abs,
                "equal": t.equal(args.atol),
            }
            for t in report.tensors
        ],
    }


def _print_diff(report, atol: float) -> None:
    for name in report.only_a:
        print(f"only in A: {name}")
    for name in report.only_b:
        print(f"only in B: {name}")
    for t in report.tensors:
        notes = []
        if t.dtype_a != t.dtype_b:
            notes.append(f"dtype {_dtype_name(t.dtype_a)} vs {_dtype_name(t.dtype_b)}")
        if t.max_abs is None:
            notes.append(f"shape {list(t.shape_a)} vs {list(t.shape_b)}")
        elif t.max_abs > atol:
            notes.append(f"max abs diff {t.max_abs:.6g}")
        if notes:
            state = "same" if t.equal(atol) else "DIFFERS"
            print(f"{state:7}  {t.name}: {'; '.join(notes)}")
    worst = max(
        (t for t in report.tensors if t.max_abs is not None), key=lambda t: t.max_abs, default=None
    )
    worst_text = ""
    if worst is not None and worst.max_abs > 0:
        worst_text = f"; largest difference {worst.max_abs:.6g} ({worst.name})"
    verdict = "equal" if report.equal else "different"
    print(
        f"{verdict} within atol {atol:g}: {len(report.tensors)} tensors compared, "
        f"{len(report.differing)} differ, {len(report.only_a)} only in A, "
        f"{len(report.only_b)} only in B{worst_text}"
    )
