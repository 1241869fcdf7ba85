"""The checks a manifest passes as it is read, beyond each field's own type and range: the files
it names stay inside the checkpoint, its meshes name ranks of its world, its bytes values and
planner data are well formed, and each tensor entry names a known dtype, an existing mesh and a
mapping (or the spec) that describes stored shards over it. `Manifest.loads` runs them, so that a
corrupt or crafted manifest fails with a clear error before anything is enumerated or allocated
from it.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping as MappingType
from typing import Any

from anyshard.errors import CorruptCheckpointError, MappingError, UCLError
from anyshard.format import strict_json
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.mesh import MeshEntry
from anyshard.ucl.lowering import compile_mapping
from anyshard.ucl.mapping import Chunk, On, Split
from anyshard.ucl.ranks import logical_shapes, written_parts

__all__ = [
    "BYTE_VALUE_TYPES",
    "MAX_BYTES",
    "byte_values_of",
    "check_meshes",
    "check_relative",
    "check_tensors",
    "data_files",
    "planner_data_of",
]

MAX_BYTES = (1 << 62) - 1  # a tensor's bytes, at most: what an int64 offset addresses
# the Python types of raw bytes values (manifest field ``bytes``, format_version 4 and later)
BYTE_VALUE_TYPES = ("bytes", "BytesIO")


def check_relative(name: str, where: str) -> str:
    """``name`` if it is a plain relative path inside the checkpoint, else
    `CorruptCheckpointError`: a manifest never names a file outside its checkpoint."""
    if (
        not isinstance(name, str)
        or not name
        or "\\" in name
        or name.startswith("/")
        or "://" in name
        or any(part in ("..", "") for part in name.split("/"))
        or posixpath.normpath(name) != name
    ):
        raise CorruptCheckpointError(
            f"{where}: file name {name!r} points outside the checkpoint; refusing to read it "
            "(the manifest is corrupt or was crafted)"
        )
    return name


def data_files(j: MappingType[str, Any], world: int, where: str) -> dict[int, str]:
    """The manifest's ``files``: a data file's name, inside the checkpoint, for ranks of the world."""
    files = {}
    for r, f in strict_json.field_dict(j["files"], "files").items():
        if not (r.isascii() and r.isdigit()):
            raise strict_json.FieldError(f"files: {r!r:.40} is not a rank")
        files[strict_json.field_int(int(r), "a rank of files", 0, world - 1)] = check_relative(
            strict_json.field_name(f, f"the file of rank {r}"), where
        )
    return files


def check_meshes(meshes: tuple[MeshEntry, ...], world: int) -> None:
    """Each mesh holds distinct ranks of the world of ``world`` ranks (`strict_json.FieldError`)."""
    for i, m in enumerate(meshes):
        lo, hi = m.rank_range()
        if math.prod(m.sizes) > world or lo < 0 or hi >= world:
            raise strict_json.FieldError(
                f"mesh {i} ({dict(zip(m.dims, m.sizes, strict=True))}) has ranks "
                f"{lo}..{hi}, not {math.prod(m.sizes)} distinct ranks of the world of {world}"
            )


def byte_values_of(j: MappingType[str, Any], tensors: MappingType[str, Any]) -> dict[str, str]:
    """The manifest's ``bytes``: each a Python type of `BYTE_VALUE_TYPES`, by the key of the 1-d
    U8 tensor entry (of ``tensors``) that holds its bytes."""
    byte_values = {
        strict_json.field_str(k, "a bytes value's key"): strict_json.field_str(
            v, f"the type of bytes value {k!r:.60}"
        )
        for k, v in strict_json.field_dict(j.get("bytes", {}), "bytes").items()
    }
    for k, kind in byte_values.items():
        t = tensors.get(k)
        if kind not in BYTE_VALUE_TYPES or t is None or t.dtype != "U8" or len(t.shape) != 1:
            raise strict_json.FieldError(
                f"bytes: {k!r:.60} must be one of {BYTE_VALUE_TYPES} stored as a 1-d U8 tensor"
            )
    return byte_values


def planner_data_of(j: MappingType[str, Any]) -> dict[str, tuple[str | int, ...]]:
    """The manifest's ``planner_data``: each flattened key's path of keys and indices."""
    planner_data: dict[str, tuple[str | int, ...]] = {}
    for k, path in strict_json.field_dict(j.get("planner_data", {}), "planner_data").items():
        keys = strict_json.field_list(path, f"the planner_data of {k!r:.60}")
        if not keys or not all(
            isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in keys
        ):
            raise strict_json.FieldError(f"planner_data: {k!r:.60} maps to {keys!r:.60}, not keys")
        planner_data[strict_json.field_str(k, "a planner_data key")] = tuple(keys)
    return planner_data


def check_tensors(manifest, where: str) -> None:
    """Each tensor entry of ``manifest`` (a `Manifest`) names a known dtype, an existing mesh,
    and a mapping over that mesh (or the spec stores it, with that shape)."""
    spec_stored, spec_shapes = _spec_tensors(manifest, where)
    problems: dict[tuple, str | None] = {}  # (mapping, shape, mesh) -> what is wrong, if anything
    for fqn, t in manifest.tensors.items():
        if (
            t.dtype in ST_TO_DTYPE
            and math.prod(t.shape) * ST_TO_DTYPE[t.dtype].itemsize > MAX_BYTES
        ):
            raise CorruptCheckpointError(
                f"{where}: the entry of tensor {fqn!r} is malformed: shape {list(t.shape)} holds "
                "more than 2**62 bytes; the manifest is corrupt or was crafted"
            )
        if t.mapping is None:
            why = _unmapped_problem(fqn, t, manifest.spec, spec_stored, spec_shapes)
        else:
            why = _mapped_problem(t, manifest, problems)
        if why is not None:
            raise CorruptCheckpointError(
                f"{where}: the entry of tensor {fqn!r} is malformed: {why}; the manifest is "
                "corrupt or was written by an incompatible tool"
            )


def _spec_tensors(manifest, where: str) -> tuple[dict, dict]:
    """What the manifest's spec stores, checked against its mesh: by logical name, the spec's
    written parts holding it and its shape under the spec (both empty without a spec)."""
    if manifest.spec is None:
        return {}, {}
    if not 0 <= manifest.spec.mesh < len(manifest.meshes):
        raise CorruptCheckpointError(
            f"{where}: the spec's mesh {manifest.spec.mesh} does not exist"
        )
    mesh = manifest.meshes[manifest.spec.mesh]
    wrong = {d: n for d, n in mesh.axis_sizes.items() if manifest.spec.layout.get(d) != n}
    if wrong or mesh != MeshEntry.row_major(mesh.axis_sizes):
        raise CorruptCheckpointError(
            f"{where}: the spec's mesh {mesh.to_json()} is not its layout's "
            f"{manifest.spec.layout} in row-major rank order; the manifest is corrupt"
        )
    try:
        saved = manifest.spec_ranks(saved=True)
        return written_parts(saved), logical_shapes(saved)
    except (UCLError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{where}: the manifest's spec does not compile for its layout ({e})"
        ) from None


def _unmapped_problem(fqn: str, t, spec, spec_stored: dict, spec_shapes: dict) -> str | None:
    """Why tensor entry ``t``, which has no mapping, cannot be stored under the spec, or None."""
    if spec is None:
        return "it has no mapping and the manifest has no spec"
    if fqn not in spec_stored:
        return "the spec stores no shard of it"
    if spec_shapes.get(fqn) != t.shape:
        return f"shape {list(t.shape)}, but the spec gives {list(spec_shapes[fqn])}"
    if t.dtype not in ST_TO_DTYPE:
        return f"dtype {t.dtype!r} is not one of {', '.join(sorted(ST_TO_DTYPE))}"
    return None


def _mapped_problem(t, manifest, problems: dict[tuple, str | None]) -> str | None:
    """Why tensor entry ``t``, which has a mapping, cannot describe stored shards, or None;
    tensors of one shape share a mapping, checked once (``problems``)."""
    if t.dtype not in ST_TO_DTYPE:
        return f"dtype {t.dtype!r} is not one of {', '.join(sorted(ST_TO_DTYPE))}"
    if not 0 <= t.mesh < len(manifest.meshes):
        return f"mesh {t.mesh} does not exist (the manifest lists {len(manifest.meshes)})"
    key = (t.mapping, t.shape, t.mesh)
    if key not in problems:
        problems[key] = _mapping_problem(t, manifest.meshes[t.mesh], manifest.files)
    return problems[key]


def _mapping_problem(t, mesh: MeshEntry, files: MappingType[int, str]) -> str | None:
    """Why ``t``'s mapping cannot describe its stored shards over ``mesh``, or None: it parses,
    names only the mesh's dims, and lowers for the tensor's shape (at the first coordinate:
    what fits there fits everywhere)."""
    try:
        parsed = t.parsed
    except (ValueError, TypeError) as e:  # MappingSyntaxError is a ValueError
        return f"mapping {t.mapping!r} does not parse ({e})"
    extra = set(parsed.axes) - set(mesh.dims)
    if extra:
        return f"mapping {t.mapping!r} names mesh dim(s) {sorted(extra)} that its mesh lacks"
    pinned = {op.axis for op in parsed.ops if isinstance(op, On)}
    split = {op.axis_name for op in parsed.ops if isinstance(op, (Chunk, Split)) and op.axis_name}
    free = [d for d in mesh.dims if d in split and d not in pinned]
    shards = math.prod(mesh.axis_sizes[d] for d in free)
    if shards > len(files):  # every stored shard, even an empty one, is in a data file
        base = {op.axis: op.index for op in parsed.ops if isinstance(op, On)}
        for i in range(len(files) + 1):  # one of the first len(files) + 1 holders has no file
            coords = dict(base)
            for d in reversed(free):
                i, coords[d] = divmod(i, mesh.axis_sizes[d])
            if mesh.rank(coords) not in files:
                break
        return (
            f"mapping {t.mapping!r} stores {shards} shards in the data files of as many ranks, "
            f"but the manifest names {len(files)} data file(s): no data file for rank "
            f"{mesh.rank(coords)}, which holds one"
        )
    try:
        compile_mapping(parsed, t.shape, mesh.axis_sizes, dict.fromkeys(mesh.dims, 0))
    except MappingError as e:
        return f"mapping {t.mapping!r} does not fit the shape {list(t.shape)} ({e})"
    return None
