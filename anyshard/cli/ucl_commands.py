"""``anyshard ucl check`` and ``anyshard ucl explain``: a spec parsed and checked, compiled for
every rank of a layout, or one tensor's placement drawn."""

from __future__ import annotations

import sys

from anyshard.cli.values import Usage, layout_arg, load_spec_arg


def ucl_check(args) -> int:
    from anyshard.errors import UCLError
    from anyshard.ucl.explain import check_layout

    layout = layout_arg(args.layout)
    try:
        spec, where = load_spec_arg(args.file)
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


def ucl_explain(args) -> int:
    from anyshard.errors import UCLError
    from anyshard.ucl.explain import explain

    layout = layout_arg(args.layout)
    try:
        spec, _ = load_spec_arg(args.file)
        print(explain(spec, layout, args.name))
    except UCLError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    except KeyError as e:
        raise Usage(str(e.args[0])) from None
    return 0
