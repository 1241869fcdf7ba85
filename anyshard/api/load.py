"""``anyshard.load``: fill a state dict in place, under whatever layout its tensors have."""

from __future__ import annotations

from typing import Any

import torch

from anyshard.api.spec_state import spec_fills
from anyshard.api.state import flatten_state
from anyshard.api.tensor_layout import layout_of
from anyshard.errors import StateDictMismatchError
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import read_manifest
from anyshard.reshard.fill import Fill, fill_regions
from anyshard.ucl.library import load_spec

__all__ = ["load"]


def _key_problems(flat: dict, manifest) -> list[str]:
    stored = set(manifest.tensors) | set(manifest.values)
    missing = sorted(set(flat) - stored)
    unexpected = sorted(stored - set(flat))
    out = []
    if missing:
        out.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        out.append(
            f"in the checkpoint but not in the state dict ({len(unexpected)}): {', '.join(unexpected)}"
        )
    return out


def load(
    path: str,
    state_dict: dict[str, Any],
    *,
    strict: bool = True,
    process_group=None,
    cast: bool = False,
    threads: int = 8,
    spec=None,
    layout: dict[str, int] | None = None,
    coords: dict[str, int] | None = None,
    verify: bool = True,
) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    Tensors may be DTensors on any mesh with any placements, or plain tensors (filled whole);
    each rank reads only the byte ranges its shards overlap. JSON values are replaced. No
    collective is needed: every rank plans and reads on its own.

    With ``spec`` and ``layout`` (see `save`), ``state_dict`` holds this rank's plain local
    tensors as the spec describes them under ``layout``, whatever layout (or spec, or none) the
    checkpoint was saved with; ``coords`` gives the rank's mesh coordinates (default: from its
    rank in the process group, row-major over the spec's mesh dims).

    Every byte filled in is verified: it lies in a checksum block of its data file that was
    read whole and checked (a `ChecksumError` names the file otherwise); a read of part of a
    block widens to the whole block. ``verify=False`` reads only the needed bytes, unchecked.

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> anyshard.save(d, {"w": torch.arange(4.0), "epoch": 3})
    >>> state = {"w": torch.zeros(4), "epoch": 0}
    >>> anyshard.load(d, state)
    >>> state
    {'w': tensor([0., 1., 2., 3.]), 'epoch': 3}
    """
    manifest = read_manifest(path)
    flat = flatten_state(state_dict)
    if spec is not None:
        _load_spec(
            path,
            manifest,
            flat,
            spec,
            layout or {},
            coords,
            process_group,
            strict,
            cast,
            threads,
            verify,
        )
        return
    problems = _key_problems(flat, manifest) if strict else []
    fills: list[Fill] = []
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fqn, leaf in sorted(flat.items()):
        value = leaf.value
        if fqn in manifest.tensors:
            entry = manifest.tensors[fqn]
            if not isinstance(value, torch.Tensor):
                problems.append(
                    f"{fqn}: the checkpoint holds a tensor, the state dict a {type(value).__name__}"
                )
                continue
            if tuple(value.shape) != entry.shape:
                problems.append(
                    f"{fqn}: global shape {list(value.shape)} in the state dict, {list(entry.shape)} in the checkpoint"
                )
                continue
            stored = ST_TO_DTYPE[entry.dtype]
            if value.dtype != stored and not cast:
                problems.append(
                    f"{fqn}: dtype {value.dtype} in the state dict, {stored} in the checkpoint (pass cast=True to convert)"
                )
                continue
            layout = layout_of(fqn, value, process_group, meshes)
            fills.append(Fill(fqn, layout.local, layout.shard().pieces))
        elif fqn in manifest.values:
            if isinstance(value, torch.Tensor):
                problems.append(
                    f"{fqn}: the checkpoint holds a JSON value, the state dict a tensor"
                )
    if problems:
        raise StateDictMismatchError(
            f"{path}: the state dict does not match the checkpoint:\n  " + "\n  ".join(problems)
        )
    fill_regions(path, manifest, fills, threads=threads, verify=verify)
    for fqn, leaf in flat.items():
        if fqn in manifest.values:
            leaf.replace(manifest.values[fqn])


def _load_spec(
    path, manifest, flat, spec, layout, coords, group, strict, cast, threads, verify
) -> None:
    parsed = load_spec(spec)
    fills, problems, value_keys = spec_fills(
        manifest, flat, parsed, layout, coords, group, strict=strict, cast=cast
    )
    for k in value_keys:
        if k not in manifest.values and strict:
            problems.append(f"{k}: a JSON value the checkpoint lacks")
    if problems:
        raise StateDictMismatchError(
            f"{path}: the state dict does not match the checkpoint:\n  " + "\n  ".join(problems)
        )
    fill_regions(path, manifest, fills, threads=threads, verify=verify)
    for k in value_keys:
        if k in manifest.values:
            flat[k].replace(manifest.values[k])
