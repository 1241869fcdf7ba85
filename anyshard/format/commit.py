"""The commit: every rank's save report merged into the manifest, then the manifest written last,
exclusively, as the one commit point of a checkpoint.

`anyshard.save`, `anyshard.ucl.save_local_states` and the exporters all build their manifest with
`build_manifest` and commit it with `commit_manifest`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyshard._version import __version__
from anyshard.errors import SaveError
from anyshard.format import storage
from anyshard.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    Ref,
    SpecEntry,
    TensorEntry,
)
from anyshard.format.mesh import MeshEntry
from anyshard.ucl.evaluate import Layout, recorded_layout
from anyshard.ucl.ranks import coverage_problems
from anyshard.ucl.syntax import Spec

__all__ = [
    "DATA_DIR",
    "LIBRARY",
    "ReportedSpec",
    "ReportedTensor",
    "SaveReport",
    "build_manifest",
    "commit_manifest",
    "data_file_name",
    "refuse_committed",
]

DATA_DIR = "data"
LIBRARY = f"anyshard {__version__}"  # the writer, as a manifest records it


def data_file_name(rank: int) -> str:
    """The data file of ``rank``, relative to the checkpoint."""
    return f"{DATA_DIR}/rank-{rank:05d}.safetensors"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportedTensor:
    """A logical tensor as a rank reports it: dtype, global shape, mesh and stored mapping
    (None: the spec says where its shards are)."""

    dtype: str
    shape: tuple[int, ...]
    mesh: MeshEntry
    mapping: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "mesh": self.mesh.to_json(),
            "mapping": self.mapping,
        }

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> ReportedTensor:
        return cls(
            dtype=j["dtype"],
            shape=tuple(j["shape"]),
            mesh=MeshEntry.from_json(j["mesh"]),
            mapping=j["mapping"],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportedSpec:
    """The spec a checkpoint is saved under: its text, its layout (mesh sizes and params) and
    its mesh, ranks in row-major order of the spec's mesh dims."""

    text: str
    layout: dict[str, int]
    mesh: MeshEntry

    @classmethod
    def of(cls, spec: Spec, lay: Layout) -> ReportedSpec:
        return cls(
            text=spec.text or str(spec),
            layout=recorded_layout(spec, lay),
            mesh=MeshEntry.row_major(lay.sizes),
        )

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "layout": dict(self.layout), "mesh": self.mesh.to_json()}

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> ReportedSpec:
        return cls(text=j["text"], layout=dict(j["layout"]), mesh=MeshEntry.from_json(j["mesh"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveReport:
    """What one rank of a save did: its error (the formatted exception), the data file it wrote
    and how many shards it holds, the logical tensors and JSON values it reports, and (rank 0
    of a spec save) the spec."""

    error: str | None = None
    file: str | None = None
    count: int = 0
    tensors: dict[str, ReportedTensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    spec: ReportedSpec | None = None
    refs: dict[str, Ref] = field(default_factory=dict)  # shards held in earlier steps' files

    def to_json(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "file": self.file,
            "count": self.count,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "values": self.values,
            "spec": self.spec.to_json() if self.spec is not None else None,
            "refs": {k: r.to_json() for k, r in self.refs.items()},
        }

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> SaveReport:
        return cls(
            error=j["error"],
            file=j["file"],
            count=j["count"],
            tensors={k: ReportedTensor.from_json(t) for k, t in j["tensors"].items()},
            values=j["values"],
            spec=ReportedSpec.from_json(j["spec"]) if j["spec"] is not None else None,
            refs={k: Ref.from_json(r, "a save report") for k, r in j.get("refs", {}).items()},
        )


def build_manifest(reports: Sequence[SaveReport], path: str) -> Manifest:
    """The manifest from every rank's report (rank ``r`` at index ``r``); raises `SaveError` on
    any rank's failure, and when the reports do not hold every logical tensor exactly once."""
    failed = [(r, rep.error) for r, rep in enumerate(reports) if rep.error]
    if failed:
        lines = "\n".join(f"  rank {r}: {e.strip().splitlines()[-1]}" for r, e in failed[:8])
        raise SaveError(
            f"save to {path} failed on {len(failed)} rank(s); nothing was committed:\n{lines}"
        )
    meshes: dict[MeshEntry, int] = {}
    spec = next((rep.spec for rep in reports if rep.spec is not None), None)
    spec_entry = None
    if spec is not None:
        meshes[spec.mesh] = 0
        spec_entry = SpecEntry(text=spec.text, layout=spec.layout, mesh=0)
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    for rep in reports:
        for fqn, t in rep.tensors.items():
            if fqn not in tensors:
                mesh = meshes.setdefault(t.mesh, len(meshes))
                tensors[fqn] = TensorEntry(
                    dtype=t.dtype, shape=t.shape, mesh=mesh, mapping=t.mapping
                )
        for k, v in rep.values.items():
            values.setdefault(k, v)
    manifest = Manifest(
        world_size=len(reports),
        meshes=tuple(meshes),
        files={r: rep.file for r, rep in enumerate(reports) if rep.file},
        tensors=dict(sorted(tensors.items())),
        values=dict(sorted(values.items())),
        library=LIBRARY,
        spec=spec_entry,
        refs={r: dict(rep.refs) for r, rep in enumerate(reports) if rep.refs},
    )
    if spec is not None:
        mesh = manifest.meshes[0]
        problems = coverage_problems(manifest.spec_ranks(), mesh.rank)
        if problems:
            raise SaveError(
                f"save to {path}: under this spec and layout the saved local tensors do not hold "
                "every logical tensor exactly once (a replicate() or on() missing or one too "
                "many?); nothing was committed. `anyshard ucl check SPEC --layout ...` shows "
                "all problems:\n  " + "\n  ".join(problems)
            )
    _check_writers(manifest, reports, path)
    return manifest


def _check_writers(manifest: Manifest, reports: Sequence[SaveReport], path: str) -> None:
    """Every rank wrote exactly the shards the manifest says it holds; else nothing commits."""
    expected = manifest.shards_per_rank().tolist()
    bad = [(r, rep.count, expected[r]) for r, rep in enumerate(reports) if rep.count != expected[r]]
    if bad:
        r, got, want = bad[0]
        raise SaveError(
            f"save to {path}: rank {r} wrote {got} shard(s) but the layouts say it holds {want}; "
            "ranks hold different tensors under the same names (pipeline stages with local layer "
            "names, or a plain tensor that is not the same on every rank?). Name pipeline mesh "
            "dims 'pp' and give every logical tensor one global name. In a process that built "
            "more than one DeviceMesh hierarchy, DTensor's op cache may have put tensors on the "
            "older one: call torch._C._clear_DTensor_sharding_propagator_cache() after building "
            "a mesh and before taking the state dict (docs/api.md)"
        )


def refuse_committed(path: str) -> None:
    """Raise `SaveError` if ``path`` already holds a committed checkpoint."""
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        raise SaveError(
            f"{path} already holds a committed checkpoint; save to a new path (e.g. the next step)"
        )


def commit_manifest(
    path: str, manifest: Manifest, data: bytes | None = None, *, overwrite: bool = False
) -> None:
    """Write ``manifest`` (serialised as ``data``, when given) into ``path``, atomically and
    exclusively: a concurrent save to the same path cannot commit over it (`SaveError`). With
    ``overwrite``, it replaces a committed manifest in one atomic write (readers see the old one
    or the new one, whole)."""
    storage.makedirs(path)  # a save of JSON values only has no data directory
    try:
        storage.write_bytes_atomic(
            storage.join(path, MANIFEST_NAME),
            manifest.dumps() if data is None else data,
            exclusive=not overwrite,
        )
    except FileExistsError:
        raise SaveError(
            f"{path} already holds a committed checkpoint; save to a new path"
        ) from None
