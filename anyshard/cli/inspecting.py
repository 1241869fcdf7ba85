"""``anyshard inspect`` and ``anyshard verify``: a checkpoint's tensors listed, in any format
anyshard reads; an anyshard checkpoint's every shard read again and checked."""

from __future__ import annotations

import json
import sys

from anyshard.cli.values import human
from anyshard.errors import AnyshardError


def inspect_command(args) -> int:
    import anyshard
    from anyshard.loaders.convert import format_of

    with anyshard.open(args.path) as ckpt:
        if format_of(ckpt) != "anyshard":
            return _inspect_other(args, ckpt)
        rows = [ckpt.metadata(name) for name in ckpt.keys()]
        if args.json:
            print(json.dumps(_anyshard_json(ckpt.manifest, rows), indent=2))
        else:
            _print_anyshard(args.path, ckpt.manifest, rows)
    return 0


def _tensor_json(r) -> dict:
    return {
        "name": r.name,
        "shape": list(r.shape),
        "dtype": str(r.dtype).removeprefix("torch."),
        "bytes": r.nbytes,
        "shards": r.num_shards,
    }


def _anyshard_json(m, rows) -> dict:
    return {
        "format": "anyshard",
        "format_version": m.format_version,
        "world_size": m.world_size,
        "meshes": [x.to_json() for x in m.meshes],
        "values": m.values,
        "spec": m.spec.to_json() if m.spec is not None else None,
        "tensors": [{**_tensor_json(r), "mapping": r.mapping} for r in rows],
    }


def _print_anyshard(path: str, m, rows) -> None:
    meshes = "; ".join(
        " x ".join(f"{d}={s}" for d, s in zip(x.dims, x.sizes, strict=True)) for x in m.meshes
    )
    print(f"{path}: anyshard checkpoint, saved by {m.world_size} rank(s); meshes: {meshes}")
    if m.spec is not None:
        layout = ",".join(f"{k}={v}" for k, v in m.spec.layout.items())
        print(f"saved as local tensors under a UCL spec, layout {layout}")
    width = max([len(r.name) for r in rows] + [6])
    print(f"{'tensor':{width}}  {'shape':>16}  {'dtype':9}  {'bytes':>10}  shards  mapping")
    for r in rows:
        dtype = str(r.dtype).removeprefix("torch.")
        print(
            f"{r.name:{width}}  {str(list(r.shape)):>16}  {dtype:9}  {human(r.nbytes):>10}  {r.num_shards:6}  {r.mapping if r.mapping is not None else '(spec)'}"
        )
    print(f"{len(rows)} tensors, {human(sum(r.nbytes for r in rows))}; {len(m.values)} JSON values")


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
                {**_tensor_json(r), **({"file": r.file} if getattr(r, "file", None) else {})}
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
            f"{r.name:{width}}  {str(list(r.shape)):>16}  {dtype:9}  {human(r.nbytes):>10}  {tail}"
        )
    print(f"{len(rows)} tensors, {human(sum(r.nbytes for r in rows))}; {len(values)} values")
    return 0


def verify_command(args) -> int:
    from anyshard.reshard.verify import verify_checkpoint

    try:
        report = verify_checkpoint(args.path)
    except AnyshardError as e:
        print(f"anyshard verify: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.path}: OK — {report.tensors} tensors, {report.shards} shards in {report.files} files, "
        f"{human(report.bytes_checked)} checksummed, every element stored exactly once"
    )
    return 0
