"""PyTorch DCP storage writer: ``torch.distributed.checkpoint`` saves an anyshard checkpoint.

`AnyshardWriter` writes what every rank holds as it is, into the rank's own safetensors data
file with its checksums, and commits the JSON manifest last, on the coordinator: an anyshard
checkpoint that `anyshard.open`, `load`, `verify` and `convert` read. No ``.metadata`` pickle is
written; non-tensor values are stored as JSON (a value JSON cannot hold is an error that names
it). The chunks DCP saves of a tensor must tile it as a grid, one chunk per rank, as DTensors
and plain tensors do (`anyshard.dcp.placement`).
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from anyshard.api.state import is_json_value, json_roundtrip
from anyshard.dcp.common import checkpoint_path, completed
from anyshard.dcp.placement import Placed, Writers, place_chunks, tensor_data
from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.format.commit import (
    DATA_DIR,
    ReportedTensor,
    SaveReport,
    build_manifest,
    commit_manifest,
    data_file_name,
)
from anyshard.format.datafile import write_datafile
from anyshard.format.manifest import MANIFEST_NAME
from anyshard.format.mesh import MeshEntry
from anyshard.format.steps import remove_unnamed

__all__ = ["AnyshardWriter", "CheckpointExistsError"]


@dataclass(frozen=True, slots=True)
class _Stored:
    """What the global plan tells one rank to write: the chunks it stores ((fqn, chunk offsets)
    -> the writer that stores it), the empty tensors it stores whole (fqn -> shape), and the data
    file of each of its writers (its own, and one more for each further chunk of one tensor)."""

    chunks: dict[tuple[str, tuple[int, ...]], int]
    empty: dict[str, tuple[int, ...]]
    files: dict[int, str]
    rank: int


class AnyshardWriter(StorageWriter, BlockingAsyncStager):
    """DCP storage writer of an anyshard checkpoint at ``path`` (a directory or URL).

    ``dcp.save(state, storage_writer=AnyshardWriter(path))`` (or ``dcp.async_save``): every rank
    writes its chunks into its own data file with their checksums; the coordinator commits
    ``manifest.json`` after every rank has written. Tensors are stored as DCP hands them (one
    chunk per rank, tiling each tensor as a grid); raw ``bytes`` and ``io.BytesIO`` values as
    bytes; other non-tensor values as JSON.

    It takes `FileSystemWriter`'s arguments. ``overwrite`` (default True, as DCP's) replaces a
    checkpoint already committed at ``path`` safely: the new data files take new names, the old
    checkpoint stays whole and loadable until the new manifest replaces its own in one atomic
    write, and then the old files go (those a later incremental step references stay).
    ``overwrite=False`` raises as DCP does. ``thread_count`` sets the writing threads;
    ``single_file_per_rank``, ``sync_files`` and ``per_thread_copy_ahead`` are accepted and
    change nothing (one file per rank, always synced before the commit; nothing is copied
    ahead); ``cache_staged_state_dict`` is `BlockingAsyncStager`'s, as in DCP. Data files are
    safetensors: ``serialization_format`` may be SAFETENSORS, not TORCH_SAVE; stream
    ``_extensions`` (compression) are refused, since a compressed file cannot be read by the byte
    ranges each rank needs.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        threads: int = 4,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if _extensions:
            names = ", ".join(type(e).__name__ for e in _extensions)
            raise AnyshardError(
                f"AnyshardWriter: _extensions ({names}) are not supported: a stream transform "
                "such as compression turns a data file into one stream, which cannot be read by "
                "the byte ranges each rank needs nor verified by checksum blocks. Leave "
                "_extensions unset (or use FileSystemWriter for compressed checkpoints)"
            )
        fmt = getattr(serialization_format, "value", serialization_format)
        if fmt not in (None, "safetensors"):
            raise AnyshardError(
                f"AnyshardWriter: serialization_format={fmt!r} is not supported: anyshard's data "
                "files are safetensors (SerializationFormat.SAFETENSORS), never pickles"
            )
        self.path = None if path is None else os.fspath(path)
        self.threads = threads if thread_count is None else max(1, int(thread_count))
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())  # as DCP's writers: one per save, in storage_meta
        self.rank = 0
        self.is_coordinator = False
        self._placed: dict[str, Placed] = {}
        self._planner_data: dict[str, tuple] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._placed, self._planner_data = {}, {}
        self.save_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.path = checkpoint_path(self.path, "AnyshardWriter")
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        if kwargs.get("use_collectives") is False:
            raise AnyshardError(
                "AnyshardWriter commits one manifest for all ranks, after all have written: "
                "save with use_collectives=True"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Decide, before any byte is written, where each chunk goes, the data files' names and
        how the manifest describes them; refuse a state that the format cannot hold (naming the
        tensor), or a committed checkpoint at the path without ``overwrite``."""
        root = checkpoint_path(self.path, "AnyshardWriter")
        replacing = storage.exists(storage.join(root, MANIFEST_NAME))
        if replacing and not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists and self.overwrite=False: {root} holds a committed "
                "checkpoint. Pass overwrite=True to replace it, or save to another path"
            )
        # a replacement's files take new names: the committed checkpoint stays whole until the
        # new manifest replaces its own
        tag = f"-{uuid.uuid4().hex[:12]}" if replacing else ""
        by_fqn: dict[str, list[tuple[int, WriteItem]]] = defaultdict(list)
        for rank, plan in enumerate(plans):
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    by_fqn[item.index.fqn].append((rank, item))
        chunks: list[dict] = [{} for _ in plans]
        empty: list[dict] = [{} for _ in plans]
        writers = Writers(len(plans))
        self._placed = {}
        for fqn, items in by_fqn.items():
            placed, stored = place_chunks(fqn, items, writers)
            self._placed[fqn] = placed
            for rank, offsets, writer in stored:
                chunks[rank][(fqn, offsets)] = writer
            if not stored:
                empty[placed.writers[0]][fqn] = placed.shape
        stem = [data_file_name(r).removesuffix(".safetensors") for r in range(len(plans))]
        files = [{r: f"{stem[r]}{tag}.safetensors"} for r in range(len(plans))]
        for (rank, k), writer in writers.extra.items():
            files[rank][writer] = f"{stem[rank]}-{k}{tag}.safetensors"
        self._planner_data = {}
        for plan in plans:  # DCP's flatten mapping, kept for loads that rebuild the state dict
            if isinstance(plan.planner_data, dict):
                self._planner_data.update(plan.planner_data)
        return [
            replace(
                plan,
                storage_data=_Stored(chunks[r], empty[r], files[r], r),
            )
            for r, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        stored: _Stored = plan.storage_data
        own = stored.rank
        by_writer: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        results: list[WriteResult] = []
        for item in plan.items:
            fqn = item.index.fqn
            writer = own
            if item.type == WriteItemType.BYTE_IO:
                value = _value_of(planner, item)
                if not isinstance(value, _RawBytes):
                    results.append(WriteResult(item.index, 0, {"value": value}))
                    continue
                t = torch.empty(0, dtype=torch.uint8)
                if value.data:
                    t = torch.frombuffer(bytearray(value.data), dtype=torch.uint8)
                info = {"writer": own, "bytes": value.kind, "length": t.numel()}
            elif fqn in stored.empty:
                t = torch.empty(stored.empty[fqn], dtype=tensor_data(item).properties.dtype)
                info = {"writer": own}
            else:
                offsets = tuple(int(o) for o in tensor_data(item).chunk.offsets)
                if (fqn, offsets) not in stored.chunks:
                    results.append(WriteResult(item.index, 0, {"writer": None}))
                    continue
                writer = stored.chunks[(fqn, offsets)]
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor)
                t = data.detach()
                if t.device.type != "cpu" or not t.is_contiguous():
                    t = t.to("cpu", memory_format=torch.contiguous_format)
                info = {"writer": writer}
            by_writer[writer].append((fqn, t))
            results.append(
                WriteResult(item.index, t.nbytes, {**info, "file": stored.files[writer]})
            )
        root = checkpoint_path(self.path, "AnyshardWriter")
        if by_writer:
            storage.makedirs(storage.join(root, DATA_DIR))
        for writer, shards in sorted(by_writer.items()):
            target = storage.join(root, *stored.files[writer].split("/"))
            try:
                write_datafile(target, shards, threads=self.threads)
            except BaseException:
                with contextlib.suppress(Exception):  # a failed write keeps no partial file
                    if storage.exists(target):
                        storage.remove_file(target)
                raise
        return completed(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator): the manifest from the global plan and what every rank wrote;
        replacing a committed checkpoint, its own manifest in one atomic write, then the old
        checkpoint's data files that nothing references any more."""
        writers = 1 + max(
            [len(results) - 1]
            + [
                r.storage_data["writer"]
                for per in results
                for r in per
                if r.storage_data.get("writer") is not None
            ]
        )
        reports = [SaveReport() for _ in range(writers)]
        values: dict[str, Any] = {}
        byte_values: dict[str, str] = {}
        placed = dict(self._placed)
        for rank_results in results:
            for res in rank_results:
                data = res.storage_data
                fqn = res.index.fqn
                if "value" in data:
                    values.setdefault(fqn, data["value"])
                    continue
                writer = data["writer"]
                if writer is None:
                    continue
                rep = reports[writer]
                reports[writer] = replace(rep, file=data["file"], count=rep.count + 1)
                if "bytes" in data and fqn not in byte_values:
                    byte_values[fqn] = data["bytes"]
                    mesh = MeshEntry(dims=(), sizes=(), ranks=(writer,))
                    placed[fqn] = Placed("U8", (int(data["length"]),), mesh, "", (writer,))
        for fqn, p in placed.items():
            tensor = ReportedTensor(dtype=p.dtype, shape=p.shape, mesh=p.mesh, mapping=p.mapping)
            reports[p.writers[0]].tensors[fqn] = tensor
        reports[0] = replace(reports[0], values={**values, **reports[0].values})
        root = checkpoint_path(self.path, "AnyshardWriter")
        planner_data = self._planner_data or dict(getattr(metadata, "planner_data", None) or {})
        manifest = replace(
            build_manifest(reports, root),
            save_id=self.save_id,
            byte_values=byte_values,
            planner_data={
                k: tuple(v) for k, v in planner_data.items() if k in placed or k in values
            },
        )
        replacing = storage.exists(storage.join(root, MANIFEST_NAME))
        if not replacing:
            commit_manifest(root, manifest)
            return
        commit_manifest(root, manifest, overwrite=True)
        remove_unnamed(root, set(manifest.files.values()))


class CheckpointExistsError(AnyshardError, RuntimeError):
    """A save with ``overwrite=False`` found a committed checkpoint at its path (a RuntimeError,
    as DCP's FileSystemWriter raises)."""


@dataclass(frozen=True, slots=True)
class _RawBytes:
    """A ``bytes`` or ``io.BytesIO`` value to store as its bytes (``kind``: its type's name)."""

    data: bytes
    kind: str


def _value_of(planner: SavePlanner, item: WriteItem) -> Any:
    """The non-tensor value DCP would pickle, as JSON (an error naming it if JSON cannot hold it)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise AnyshardError(
            f"{item.index.fqn}: the planner {type(planner).__name__} does not give the value "
            "itself (lookup_object), only pickled bytes, which anyshard does not store; use "
            "DCP's DefaultSavePlanner or a subclass"
        )
    value = lookup(item.index)
    if isinstance(value, (bytes, bytearray)):
        return _RawBytes(bytes(value), "bytes")
    if isinstance(value, io.BytesIO):
        return _RawBytes(value.getvalue(), "BytesIO")
    if not is_json_value(value):
        raise AnyshardError(
            f"{item.index.fqn}: a value of type {type(value).__qualname__} cannot be stored; "
            "anyshard stores tensors, bytes and JSON values (numbers, strings, lists, dicts) and "
            "never pickles. Convert it to one of those before saving"
        )
    return json_roundtrip(value)
