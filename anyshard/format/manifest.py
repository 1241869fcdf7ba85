"""The manifest: the JSON document whose presence commits a checkpoint.

It grows with the number of tensors, not tensors x ranks: each tensor's mapping is stored once,
parameterised by mesh coordinates; byte offsets and checksums live in the data files' headers.

An incremental checkpoint (version 3) also lists, per rank, the stored shards it does not hold
in its own data file but references in a data file of an earlier step of the same root (a
sibling directory): that file's path relative to the checkpoint (``../STEP/data/FILE``, nothing
else is accepted), the shard's byte offsets there and its SHA-256.

Since version 4 every manifest is sealed: it begins ``{"format":"anyshard-checkpoint",
"format_version":4,"crc32c":"<crc>"`` where <crc> is the crc32c of the manifest's bytes
as written with "00000000" there (`anyshard.format.checksum.seal`); a reader checks it before
parsing anything. Versions 1-3 (unsealed) still load, with a warning that their metadata is
unverified.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from anyshard.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    FormatVersionError,
    StorageError,
)
from anyshard.format import storage, strict_json
from anyshard.format.checksum import check_seal, is_digest, seal
from anyshard.format.manifest_checks import (
    MAX_BYTES,
    byte_values_of,
    check_meshes,
    check_tensors,
    data_files,
    planner_data_of,
)
from anyshard.format.mesh import MeshEntry
from anyshard.format.strict_json import (
    FieldError,
    field_dict,
    field_int,
    field_list,
    field_name,
    field_str,
)
from anyshard.ucl.mapping import Mapping, parse_mapping
from anyshard.ucl.ranks import RankTensors, compile_every_rank

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "Ref",
    "SpecEntry",
    "TensorEntry",
    "is_sha256",
    "read_manifest",
]

FORMAT_NAME = "anyshard-checkpoint"
# written: 4 (sealed: the manifest's own crc32c); read: also 3 (references), 2 (a spec), 1
FORMAT_VERSION = 4
MANIFEST_NAME = "manifest.json"
KNOWN_VERSIONS = (1, 2, 3, 4)
SEALED_SINCE = 4
MAX_WORLD_SIZE = 1 << 24  # ranks a manifest may name: 16 Mi, a thousand times today's largest jobs
_SEAL_START = f'{{"format":"{FORMAT_NAME}","format_version":'.encode()
_SEAL_PREFIX = _SEAL_START + f'{FORMAT_VERSION},"crc32c":"'.encode()  # what is written


def _seal_prefix(data: bytes) -> bytes | None:
    """The seal's prefix ``data`` begins with (any version's digits), or None: unsealed."""
    m = re.match(rb'[0-9]{1,6},"crc32c":"', data[len(_SEAL_START) : len(_SEAL_START) + 20])
    if not data.startswith(_SEAL_START) or m is None:
        return None
    return data[: len(_SEAL_START) + m.end()]


def _format_version(j: Any, where: str, sealed: bool) -> int:
    """The format_version of manifest JSON ``j``: a version this anyshard reads, sealed if and
    only if that version is."""
    if not isinstance(j, dict) or j.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{where}: not an anyshard manifest (format={j.get('format') if isinstance(j, dict) else None!r:.60})"
        )
    version = j.get("format_version")
    if type(version) is not int:  # bool is an int to Python, not to JSON
        raise CorruptCheckpointError(
            f"{where}: format_version {version!r:.60} is not an integer; the manifest is corrupt"
        )
    if version not in KNOWN_VERSIONS:
        raise FormatVersionError(
            f"{where}: format_version {version!r} is not one this anyshard reads "
            f"({', '.join(map(str, KNOWN_VERSIONS))}); upgrade anyshard to read it"
        )
    if (version >= SEALED_SINCE) != sealed or (not sealed and "crc32c" in j):
        # a sealed version must begin with its seal, and an earlier one has none: either
        # way bytes of the manifest's beginning were changed
        raise ChecksumError(
            f"{where}: the manifest's checksum is missing or damaged (format_version "
            f"{version}); the file is corrupt. Restore it from a replica or load an earlier "
            "step"
        )
    return version


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """A logical tensor: global shape and dtype, and the mapping of its stored shards.

    Every coordinate tuple of the mapping's mesh dims holds one stored shard, written into the
    data file of the rank at those coordinates (under the key ``fqn``).
    """

    dtype: str
    shape: tuple[int, ...]
    mesh: int
    mapping: str | None  # None: the manifest's spec says where the shards are

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")
        if self.mapping is not None and not isinstance(self.mapping, str):
            raise TypeError(f"mapping {self.mapping!r} is not a string")

    @property
    def parsed(self) -> Mapping:
        if self.mapping is None:
            raise ValueError("the tensor is stored under the manifest's spec, not a mapping")
        return parse_mapping(self.mapping)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "mesh": self.mesh,
            "mapping": self.mapping,
        }

    @classmethod
    def from_json(cls, j: MappingType[str, Any]) -> TensorEntry:
        """From its JSON, every field checked (`FieldError`)."""
        j = field_dict(j, "a tensor entry")
        mapping = j["mapping"]
        return cls(
            dtype=field_str(j["dtype"], "the dtype"),
            shape=tuple(
                field_int(n, "a size", 0, MAX_BYTES) for n in field_list(j["shape"], "the shape")
            ),
            mesh=field_int(j["mesh"], "the mesh number"),
            mapping=None if mapping is None else field_str(mapping, "the mapping"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecEntry:
    """The UCL spec a checkpoint was saved under, with its layout (mesh sizes and params).

    Tensors whose entry has no mapping are stored as the spec's local tensors: the rank at each
    coordinate of the spec's mesh wrote its local tensors, under their local names.
    """

    text: str
    layout: dict[str, int]
    mesh: int

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "layout": dict(self.layout), "mesh": self.mesh}

    @classmethod
    def from_json(cls, j: MappingType[str, Any]) -> SpecEntry:
        """From its JSON, every field checked (`FieldError`)."""
        j = field_dict(j, "the spec")
        layout = {
            field_name(k, "a layout name"): field_int(v, f"layout {k}")
            for k, v in field_dict(j["layout"], "the spec's layout").items()
        }
        return cls(
            text=field_str(j["text"], "the spec text"),
            layout=layout,
            mesh=field_int(j["mesh"], "the spec's mesh number"),
        )


_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# ../<a sibling step directory>/data/<a data file>: the only shape a reference may have
_REF_RE = re.compile(r"^\.\./([A-Za-z0-9_][A-Za-z0-9._-]*)/data/([A-Za-z0-9_][A-Za-z0-9._-]*)$")


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 as headers and manifests record it: 64 lowercase hex."""
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def check_ref_file(name: object, where: str) -> str:
    """``name`` if it is a reference to a data file of a sibling step (``../STEP/data/FILE``);
    else `CorruptCheckpointError`: a reference never leaves the root."""
    if not isinstance(name, str) or not _REF_RE.match(name) or ".." in name[3:].split("/"):
        raise CorruptCheckpointError(
            f"{where}: the reference {name!r:.200} does not name a data file of another step of "
            "the same root (../STEP/data/FILE); refusing to read it (the manifest is corrupt or "
            "was crafted)"
        )
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class Ref:
    """A stored shard held in a data file of an earlier step: ``file`` relative to the
    checkpoint (``../STEP/data/FILE``), its bytes ``[start, stop)`` there, and their content
    hash (``digest``, "ALGORITHM:HEX": xxh3-128, or sha256 as format_version 3 recorded it)."""

    file: str
    start: int
    stop: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offsets": [self.start, self.stop], "hash": self.digest}

    @classmethod
    def from_json(cls, j: Any, where: str) -> Ref:
        j = field_dict(j, "a reference")
        offsets = field_list(j["offsets"], "a reference's offsets")
        if len(offsets) != 2:
            raise FieldError(f"a reference's offsets {offsets!r:.60} are not [start, stop]")
        start, stop = (field_int(x, "a reference offset", 0, MAX_BYTES) for x in offsets)
        if "hash" in j:  # format_version 4
            digest = j["hash"]
            valid = is_digest(digest)
        else:  # format_version 3: a bare SHA-256
            digest = f"sha256:{j['sha256']}"
            valid = is_sha256(j["sha256"])
        if stop < start or not valid:
            raise FieldError(
                f"a reference's offsets {[start, stop]} or hash {digest!r:.80} are invalid"
            )
        return cls(file=check_ref_file(j["file"], where), start=start, stop=stop, digest=digest)


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A checkpoint's manifest (docs/format.md); `Manifest.loads` checks every field."""

    world_size: int
    meshes: tuple[MeshEntry, ...]
    files: dict[int, str]
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    library: str = ""
    spec: SpecEntry | None = None
    # rank -> stored key -> where that shard lies in an earlier step (an incremental save)
    refs: dict[int, dict[str, Ref]] = field(default_factory=dict)
    # stored key -> the Python type of a raw bytes value ("bytes" or "BytesIO"), whose bytes are
    # the 1-d uint8 tensor of that name
    byte_values: dict[str, str] = field(default_factory=dict)
    # a DCP planner's flatten mapping (flattened key -> the path of keys and indices it came from)
    planner_data: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # the id of the save that wrote it (DCP's StorageMeta.save_id), when the writer gave one
    save_id: str = ""
    # the format_version it was read as (a new manifest: the one it is written as)
    read_version: int = field(default=FORMAT_VERSION, repr=False, compare=False)
    _ref_files: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _ref_index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        files = sorted({ref.file for per in self.refs.values() for ref in per.values()})
        object.__setattr__(self, "_ref_files", tuple(files))
        object.__setattr__(self, "_ref_index", {f: i for i, f in enumerate(files)})

    @property
    def format_version(self) -> int:
        """The version this manifest was read as; a new one's, `FORMAT_VERSION` (sealed,
        whatever it holds: versions 1-3 are only read). `dumps` always writes the newest."""
        return self.read_version

    def source_of(self, rank: int, key: str) -> int:
        """Where rank ``rank``'s stored shard ``key`` is read from: ``rank`` (its own data
        file), or, for a referenced shard, a number past the world size naming the referenced
        file (`ref_file_path`)."""
        ref = self.refs.get(rank, {}).get(key)
        if ref is None:
            return rank
        return self.world_size + self._ref_index[ref.file]

    def ref_file_path(self, path: str, source: int) -> str:
        """The referenced data file that source number ``source`` names, for the checkpoint at
        ``path``: in its root (the directory holding ``path``)."""
        file = self._ref_files[source - self.world_size]
        return storage.join(storage.parent(path), *file.split("/")[1:])

    def ref_files(self, path: str) -> list[str]:
        """Every data file of other steps that the checkpoint at ``path`` references."""
        return [storage.join(storage.parent(path), *f.split("/")[1:]) for f in self._ref_files]

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "crc32c": "00000000",  # `dumps` seals it: the crc32c of the manifest's bytes
            "library": self.library,
            "world_size": self.world_size,
            "meshes": [m.to_json() for m in self.meshes],
            "files": {str(r): f for r, f in sorted(self.files.items())},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "values": self.values,
            "metadata": self.metadata,
        }
        if self.spec is not None:
            out["spec"] = self.spec.to_json()
        if self.refs:
            out["refs"] = {
                str(r): {k: ref.to_json() for k, ref in sorted(per.items())}
                for r, per in sorted(self.refs.items())
            }
        if self.byte_values:
            out["bytes"] = dict(sorted(self.byte_values.items()))
        if self.planner_data:
            out["planner_data"] = {k: list(v) for k, v in sorted(self.planner_data.items())}
        if self.save_id:
            out["save_id"] = self.save_id
        return out

    def spec_ranks(self, *, saved: bool = False) -> tuple[RankTensors, ...]:
        """The spec compiled for every coordinate of its mesh (cached by text and layout); with
        ``saved``, only for the ranks that have a data file: what a reader can need, so that
        reading costs what the files hold, never what a layout in the manifest says."""
        if self.spec is None:
            raise ValueError("the manifest has no spec")
        layout = tuple(sorted(self.spec.layout.items()))
        return compile_every_rank(
            self.spec.text, layout, tuple(sorted(self.files)) if saved else None
        )

    def shards_per_rank(self) -> np.ndarray:
        """How many stored shards each rank's data file must hold, in O(tensors + ranks x
        distinct writer patterns): tensors are grouped by mesh and by the coordinates their
        mapping pins (``on()``, or 0 for mesh dims it leaves out)."""
        counts = np.zeros(self.world_size, dtype=np.int64)
        if self.spec is not None:
            mesh = self.meshes[self.spec.mesh]
            for r in self.spec_ranks():
                counts[mesh.rank(r.coords)] += sum(t.written for t in r.tensors.values())
        groups: dict[tuple[int, tuple], int] = {}
        for t in self.tensors.values():
            if t.mapping is None:
                continue
            mesh = self.meshes[t.mesh]
            ops = t.parsed.ops
            pinned = {op.axis: op.index for op in ops if type(op).__name__ == "On"}
            free = {
                op.axis_name
                for op in ops
                if op.axis_name is not None and type(op).__name__ in ("Chunk", "Split")
            }
            index = tuple(
                None if d in free and d not in pinned else pinned.get(d, 0) for d in mesh.dims
            )
            groups[(t.mesh, index)] = groups.get((t.mesh, index), 0) + 1
        grids: dict[int, np.ndarray] = {}
        for (mesh_id, index), n in groups.items():
            grid = grids.setdefault(mesh_id, self.meshes[mesh_id].rank_grid())
            cut = tuple(slice(None) if i is None else i for i in index)
            np.add.at(counts, np.asarray(grid[cut]).reshape(-1), n)
        return counts

    def dumps(self) -> bytes:
        """The manifest's bytes, sealed with their crc32c."""
        data = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=False).encode()
        return seal(data, _SEAL_PREFIX)

    @classmethod
    def loads(cls, data: bytes, where: str) -> Manifest:
        """The manifest ``data`` read from ``where``, checked completely before anything is
        enumerated or allocated from it: `CorruptCheckpointError` (or `FormatVersionError`)
        naming what is wrong. A sealed manifest's checksum is checked first (`ChecksumError`)."""
        prefix = _seal_prefix(data)
        sealed = prefix is not None
        if prefix is not None:
            check_seal(data, prefix, where, "manifest")
        try:
            j = strict_json.loads(data)
        except FieldError as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        version = _format_version(j, where, sealed)
        if not sealed:
            warnings.warn(
                f"anyshard: {where} is format_version {version}, written before manifests were "
                "checksummed: its metadata loads unverified (the tensors' bytes are verified)",
                stacklevel=3,
            )
        try:
            manifest = cls._from_json(j, where)
        except KeyError as e:
            raise CorruptCheckpointError(
                f"{where}: manifest is malformed (the field {e.args[0]!r:.60} is missing)"
            ) from None
        except FieldError as e:
            raise CorruptCheckpointError(f"{where}: manifest is malformed: {e}") from None
        check_tensors(manifest, where)
        object.__setattr__(manifest, "read_version", version)
        return manifest

    @classmethod
    def _from_json(cls, j: dict, where: str) -> Manifest:
        world = field_int(j["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        files = data_files(j, world, where)
        meshes = tuple(MeshEntry.from_json(m) for m in field_list(j["meshes"], "meshes"))
        check_meshes(meshes, world)
        tensors = {
            field_name(k, "a tensor name"): TensorEntry.from_json(v)
            for k, v in field_dict(j["tensors"], "tensors").items()
        }
        spec = j.get("spec")
        refs: dict[int, dict[str, Ref]] = {}
        for r, per in field_dict(j.get("refs", {}), "refs").items():
            if not (r.isascii() and r.isdigit()) or int(r) not in files:
                raise FieldError(f"refs: {r!r:.40} is not a rank with a data file")
            refs[int(r)] = {
                field_str(k, "a referenced key"): Ref.from_json(v, where)
                for k, v in field_dict(per, f"the references of rank {r}").items()
            }
        if refs and j.get("format_version", 0) < 3:
            raise FieldError("references need format_version 3 or later")
        if ("bytes" in j or "planner_data" in j) and j.get("format_version", 0) < 4:
            raise FieldError("bytes values and planner_data need format_version 4 or later")
        byte_values = byte_values_of(j, tensors)
        planner_data = planner_data_of(j)
        return cls(
            world_size=world,
            meshes=meshes,
            files=files,
            tensors=tensors,
            values=field_dict(j.get("values", {}), "values"),
            metadata=field_dict(j.get("metadata", {}), "metadata"),
            library=field_str(j.get("library", ""), "library"),
            spec=SpecEntry.from_json(spec) if spec is not None else None,
            refs=refs,
            byte_values=byte_values,
            planner_data=planner_data,
            save_id=field_str(j.get("save_id", ""), "save_id"),
        )


def read_manifest(path: str) -> Manifest:
    """The manifest of the committed checkpoint at ``path``, checked; clear errors when there is
    no checkpoint, or only an uncommitted one."""
    where = storage.join(path, MANIFEST_NAME)
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError:
        if not storage.exists(path):
            raise CheckpointNotFoundError(f"{path}: no such checkpoint directory") from None
        raise CheckpointNotFoundError(
            f"{path}: not a committed checkpoint (no {MANIFEST_NAME}); an interrupted save? "
            "Load an earlier step, or remove the directory with `anyshard gc`"
        ) from None
    except IsADirectoryError:
        raise CheckpointNotFoundError(f"{where} is a directory, not a manifest") from None
    except StorageError:
        raise
    return Manifest.loads(data, where)
