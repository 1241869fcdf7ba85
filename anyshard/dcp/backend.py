"""PyTorch DCP storage backends: ``torch.distributed.checkpoint`` saves anyshard checkpoints and
loads any anyshard checkpoint, under any layout.

Trainers that checkpoint through DCP (torchtitan, torchtune, Lightning's FSDP strategies,
Accelerate) take their storage as a `StorageWriter` / `StorageReader`; these two are anyshard's:

>>> import torch, tempfile, torch.distributed.checkpoint as dcp
>>> from anyshard.dcp import AnyshardReader, AnyshardWriter
>>> d = tempfile.mkdtemp() + "/step-1"
>>> state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
>>> dcp.save(state, storage_writer=AnyshardWriter(d), no_dist=True)  # doctest: +ELLIPSIS
Metadata(...)
>>> back = {"w": torch.zeros(2, 3), "step": 0}
>>> dcp.load(back, storage_reader=AnyshardReader(d), no_dist=True)
>>> back["w"][1], back["step"]
(tensor([3., 4., 5.]), 1)

- `AnyshardWriter` writes what every rank holds as it is, into the rank's own safetensors data
  file with its checksums, and commits the JSON manifest last, on the coordinator: an anyshard
  checkpoint that `anyshard.open`, `load`, `verify` and `convert` read. No ``.metadata`` pickle
  is written; non-tensor values are stored as JSON (a value JSON cannot hold is an error that
  names it). The chunks DCP saves of a tensor must tile it as a grid, one chunk per rank, as
  DTensors and plain tensors do.
- `AnyshardReader` presents any anyshard checkpoint (saved by `anyshard.save`, under a UCL spec,
  by `AnyshardWriter`, or converted from DeepSpeed or Megatron) to DCP as one chunk per logical
  tensor; DCP's planner asks for the regions the target holds and the reader reads only those
  bytes, in parallel and verified (a flipped bit is a `ChecksumError`). Nothing is unpickled:
  with DCP's `DefaultLoadPlanner` (and its subclasses) a JSON value is set in the state dict
  directly; another planner's ``load_bytes`` gets a ``torch.save`` of the JSON value, made in
  memory from the manifest.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from anyshard._compat import flatten_state_dict, set_element
from anyshard.api import read_once
from anyshard.api.open import open_checkpoint
from anyshard.api.state import is_json_value, json_roundtrip
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
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.manifest import MANIFEST_NAME, Manifest, MeshEntry, read_manifest
from anyshard.format.steps import remove_unnamed
from anyshard.geometry.boxes import Piece, full_box
from anyshard.reshard.fill import Fill, fill_regions

__all__ = ["AnyshardReader", "AnyshardWriter", "CheckpointExistsError"]

Box = tuple[tuple[int, int], ...]
_DCP_METADATA = ".metadata"  # what FileSystemWriter commits last
# the version of DCP's metadata conventions (its planners read planner_data by it): those of the
# torch that runs, whose planner made the planner_data the writer keeps
_DCP_VERSION = getattr(_dcp_filesystem, "CURRENT_DCP_VERSION", None)


def _path(checkpoint_id: str | os.PathLike | None, who: str) -> str:
    if checkpoint_id is None:
        raise AnyshardError(
            f"{who} needs the checkpoint's path or URL: {who}(path), or checkpoint_id=path"
        )
    return os.fspath(checkpoint_id)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- writer


@dataclass(frozen=True, slots=True)
class _Stored:
    """What the global plan tells one rank to write: the chunks it stores ((fqn, chunk offsets)
    -> the writer that stores it), the empty tensors it stores whole (fqn -> shape), and the data
    file of each of its writers (its own, and one more for each further chunk of one tensor)."""

    chunks: dict[tuple[str, tuple[int, ...]], int]
    empty: dict[str, tuple[int, ...]]
    files: dict[int, str]
    rank: int


@dataclass(frozen=True, slots=True)
class _Placed:
    """A logical tensor as the global plan stores it: dtype, shape, its grid as a UCL mesh and
    mapping, and the ranks that store a shard of it."""

    dtype: str
    shape: tuple[int, ...]
    mesh: MeshEntry
    mapping: str
    writers: tuple[int, ...]


def _intervals(fqn: str, dim: int, n: int, spans: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The chunks' extents along ``dim`` as consecutive parts of ``[0, n)``, or an error."""
    parts = sorted(spans)
    at = 0
    for lo, hi in parts:
        if lo != at:
            break
        at = hi
    else:
        if at == n:
            return parts
    raise AnyshardError(
        f"{fqn}: the chunks DCP saves of it do not tile it as a grid along dim {dim} (extents "
        f"{parts[:8]} of {n}); AnyshardWriter stores tensors sharded as DTensors shard them. Save "
        "this state with anyshard.save, which takes any UCL layout"
    )


def _tensor_data(item: WriteItem) -> TensorWriteData:
    td = item.tensor_data
    assert td is not None  # DCP plans every tensor write with its chunk and properties
    return td


class _Writers:
    """Writer numbers: a rank's own (its rank), and past the world one more for each further
    chunk of one tensor the rank holds (its k-th chunk of any tensor goes to its k-th writer, a
    data file of its own, since a data file holds one shard of each tensor)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.extra: dict[tuple[int, int], int] = {}  # (rank, k >= 1) -> writer

    def of(self, rank: int, k: int) -> int:
        if k == 0:
            return rank
        return self.extra.setdefault((rank, k), self.world + len(self.extra))


def _place(
    fqn: str, items: list[tuple[int, WriteItem]], writers: _Writers
) -> tuple[_Placed, list[tuple[int, tuple, int]]]:
    """Where the chunks of ``fqn`` (rank, write item) go: its grid over writers, and the (rank,
    offsets, writer) of the chunks that store it (each non-empty chunk once; duplicates
    dropped)."""
    td = _tensor_data(items[0][1])
    shape = tuple(int(n) for n in td.size)
    dtype = td.properties.dtype
    if dtype not in DTYPE_TO_ST:
        raise AnyshardError(f"{fqn}: dtype {dtype} has no safetensors name; cast it to save it")
    st = DTYPE_TO_ST[dtype]
    if math.prod(shape) == 0:  # nothing to store but the shape: the first writer stores it whole
        rank = min(r for r, _ in items)
        mesh = MeshEntry(dims=(), sizes=(), ranks=(rank,))
        return _Placed(st, shape, mesh, "", (rank,)), []
    boxes: dict[Box, tuple[int, tuple]] = {}
    for rank, item in items:
        c = _tensor_data(item).chunk
        offsets = tuple(int(o) for o in c.offsets)
        box = tuple((o, o + int(s)) for o, s in zip(offsets, c.sizes, strict=True))
        if any(lo == hi for lo, hi in box):
            continue  # an empty chunk (uneven sharding) holds nothing
        boxes.setdefault(box, (rank, offsets))
    parts = [_intervals(fqn, d, n, {box[d] for box in boxes}) for d, n in enumerate(shape)]
    cells = math.prod(len(p) for p in parts)
    index = [{span: i for i, span in enumerate(p)} for p in parts]
    grid: dict[tuple[int, ...], int] = {}
    for box, (rank, _) in boxes.items():
        grid[tuple(index[d][span] for d, span in enumerate(box))] = rank
    if len(boxes) != cells or len(grid) != cells:
        raise AnyshardError(
            f"{fqn}: DCP saves {len(boxes)} distinct chunks of it, which do not tile it as a "
            f"grid of {[len(p) for p in parts]} parts; save this state with anyshard.save"
        )
    split = [d for d, p in enumerate(parts) if len(p) > 1]
    dims = tuple(f"c{d}" for d in split)
    sizes = tuple(len(parts[d]) for d in split)
    held: dict[int, int] = defaultdict(int)  # rank -> chunks of this tensor placed so far
    writer_of: dict[tuple[int, ...], int] = {}
    for cell in sorted(grid):
        writer_of[cell] = writers.of(grid[cell], held[grid[cell]])
        held[grid[cell]] += 1
    ranks = [writer_of[cell] for cell in sorted(grid)]
    mesh = (
        MeshEntry.from_rank_grid(dims, sizes, ranks)
        if dims
        else MeshEntry(dims=(), sizes=(), ranks=(ranks[0],))
    )
    mapping = " | ".join(
        f"split({d}, c{d}, [{', '.join(str(hi - lo) for lo, hi in parts[d])}])" for d in split
    )
    stored = [
        (rank, offsets, writer_of[tuple(index[d][span] for d, span in enumerate(box))])
        for box, (rank, offsets) in boxes.items()
    ]
    return _Placed(st, shape, mesh, mapping, tuple(sorted(set(ranks)))), stored


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
        self._placed: dict[str, _Placed] = {}
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
        self.path = _path(self.path, "AnyshardWriter")
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
        root = _path(self.path, "AnyshardWriter")
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
        writers = _Writers(len(plans))
        self._placed = {}
        for fqn, items in by_fqn.items():
            placed, stored = _place(fqn, items, writers)
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
                t = torch.empty(stored.empty[fqn], dtype=_tensor_data(item).properties.dtype)
                info = {"writer": own}
            else:
                offsets = tuple(int(o) for o in _tensor_data(item).chunk.offsets)
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
        root = _path(self.path, "AnyshardWriter")
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
        return _done(results)

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
                    placed[fqn] = _Placed("U8", (int(data["length"]),), mesh, "", (writer,))
        for fqn, p in placed.items():
            tensor = ReportedTensor(dtype=p.dtype, shape=p.shape, mesh=p.mesh, mapping=p.mapping)
            reports[p.writers[0]].tensors[fqn] = tensor
        reports[0] = replace(reports[0], values={**values, **reports[0].values})
        root = _path(self.path, "AnyshardWriter")
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


# --------------------------------------------------------------------------- reader


class AnyshardReader(StorageReader):
    """DCP storage reader of any anyshard checkpoint at ``path`` (a directory or URL).

    ``dcp.load(state, storage_reader=AnyshardReader(path))`` fills ``state`` (tensors or
    DTensors of any layout) reading only the regions each rank holds, with ``threads`` parallel
    reads; ``verify=False`` skips the checksums (reading exactly the needed bytes).

    With ``read_once`` (default: from an object store, when DCP loads on more than one rank of
    the default process group), a region several ranks need (data-parallel replicas) is read by
    one of them and sent to the others (`anyshard.api.read_once`), as DCP's coordinator plans
    it from every rank's requests. ``bytes_read``: what this rank read in its last load.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        _extension_registry: Any = None,
        *,
        threads: int = 8,
        verify: bool = True,
        read_once: bool | None = None,
    ) -> None:
        super().__init__()  # _extension_registry decodes stream transforms, which anyshard
        # never writes (AnyshardWriter refuses _extensions): there is nothing for it to decode
        self.path = None if path is None else os.fspath(path)
        self.threads = threads
        self.verify = verify
        self.read_once = read_once
        self.bytes_read = 0
        self.load_id = str(uuid.uuid4())  # as DCP's readers: one per load, in storage_meta
        self._manifest: Manifest | None = None
        self._dcp: Any = None  # the view of a checkpoint FileSystemWriter wrote
        self._headers: dict = {}
        self._values: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._manifest, self._dcp, self._headers = None, None, {}
        self.load_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        path = os.fspath(checkpoint_id)
        return storage.exists(storage.join(path, MANIFEST_NAME)) or storage.exists(
            storage.join(path, _DCP_METADATA)
        )

    def read_metadata(self) -> Metadata:
        """DCP's view of the checkpoint: every logical tensor as one chunk, every JSON value as
        bytes (nothing pickled is read: there is none)."""
        self.path = _path(self.path, "AnyshardReader")
        if not storage.exists(storage.join(self.path, MANIFEST_NAME)) and storage.exists(
            storage.join(self.path, _DCP_METADATA)
        ):
            return self._read_dcp_metadata()
        manifest = self._manifest = read_manifest(self.path)
        md: dict[str, Any] = {}
        for fqn, entry in manifest.tensors.items():
            size = torch.Size(entry.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=ST_TO_DTYPE[entry.dtype]),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        for fqn in manifest.byte_values:
            md[fqn] = BytesStorageMetadata()
        self._values = _dcp_values(manifest.values)
        for name in self._values:
            md[name] = BytesStorageMetadata()
        # DCP's flatten mapping as the writer had it; a name it does not cover stays as it is
        planner_data = {k: manifest.planner_data.get(k, (k,)) for k in md}
        return Metadata(
            state_dict_metadata=md,
            planner_data=planner_data,
            storage_data={},
            storage_meta=StorageMeta(
                checkpoint_id=self.path, save_id=manifest.save_id or None, load_id=self.load_id
            ),
            version=_DCP_VERSION,
        )

    def _read_dcp_metadata(self) -> Metadata:
        """A checkpoint FileSystemWriter wrote: its ``.metadata`` read by anyshard's allowlisting
        unpickler (`DCPCheckpointView`), never by ``pickle.load``."""
        view = self._dcp = open_checkpoint(_path(self.path, "AnyshardReader"))
        md: dict[str, Any] = {}
        for fqn in view.keys():
            meta = view.metadata(fqn)
            size = torch.Size(meta.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=meta.dtype),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        for name in view.value_keys():
            md[name] = BytesStorageMetadata()
        saved = getattr(view, "planner_data", {})
        planner_data = {k: saved.get(k, (k,)) for k in md}
        return Metadata(
            state_dict_metadata=md,
            planner_data=planner_data,
            storage_data={},
            storage_meta=StorageMeta(
                checkpoint_id=self.path,
                save_id=getattr(view, "save_id", None),
                load_id=self.load_id,
            ),
            version=getattr(view, "version", None),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None and self._dcp is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        return replace(plan, storage_data={"global_rank": rank})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """With read once (coordinator): who reads each region that several ranks request, and
        who receives it, in each rank's plan."""
        manifest, n = self._manifest, len(plans)
        once = self.read_once
        if once is None:
            once = storage.is_url(_path(self.path, "AnyshardReader"))
        ranks = [(p.storage_data or {}).get("global_rank") for p in plans]
        # the default group, rank for rank: point-to-point messages and the agreement on errors
        # go over it (DCP does not tell a reader its process group)
        whole = dist.is_available() and dist.is_initialized() and dist.get_world_size() == n
        if not (once and manifest is not None and n > 1 and whole and ranks == list(range(n))):
            return plans
        needs = [
            sorted(
                {
                    (r.storage_index.fqn, _box_of(r))
                    for r in p.items
                    if r.type != LoadItemType.BYTE_IO
                }
            )
            for p in plans
        ]
        assigned = read_once.assign(needs, manifest)
        return [
            replace(
                p,
                storage_data={
                    "once": [a for a in assigned if a.reader == me or me in a.receivers],
                },
            )
            for me, p in enumerate(plans)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._dcp is not None:
            return self._read_dcp_data(plan, planner, self._dcp)
        manifest = self._manifest
        assert manifest is not None, "read_metadata first"
        once = (plan.storage_data or {}).get("once")
        fills: list[Fill] = []
        committed: list[tuple[Any, torch.Tensor]] = []
        raw: list[tuple[Any, torch.Tensor, str]] = []  # bytes values: (request, buffer, type)
        try:
            self._plan_fills(plan, planner, manifest, fills, committed, raw)
        except Exception as e:
            if once is None:
                raise
            fills, committed, raw = [], [], []
            self.bytes_read = read_once.fill_once(
                _path(self.path, "AnyshardReader"), manifest, [], once, dist.get_rank(),
                list(range(dist.get_world_size())), error=e,
            )  # fmt: skip
        path = _path(self.path, "AnyshardReader")
        if once is not None:
            tensors = [f for f in fills if f.fqn not in manifest.byte_values]
            self.bytes_read = read_once.fill_once(
                path, manifest, tensors, once, dist.get_rank(), list(range(dist.get_world_size())),
                threads=self.threads, verify=self.verify, headers=self._headers,
            )  # fmt: skip
            fills = [f for f in fills if f.fqn in manifest.byte_values]
        elif fills:
            self.bytes_read = 0
        if fills:
            done = fill_regions(
                path,
                manifest,
                fills,
                headers=self._headers,
                threads=self.threads,
                verify=self.verify,
            )
            self.bytes_read += done.bytes_read
        for req, dest in committed:
            planner.commit_tensor(req, dest)
        for req, buf, kind in raw:
            data = buf.numpy().tobytes()
            _set_value(planner, req, io.BytesIO(data) if kind == "BytesIO" else data)
        return _done(None)

    def _plan_fills(self, plan, planner, manifest, fills, committed, raw) -> None:
        """This rank's fills: the tensors its requests resolve to, the raw bytes values it
        reads, and the values it sets from the manifest."""
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO and fqn in manifest.byte_values:
                buf = torch.empty(manifest.tensors[fqn].shape, dtype=torch.uint8)
                n = buf.numel()
                if n:
                    fills.append(Fill(fqn, buf, (Piece(0, (n,), ((0, n),), ((0, n),)),)))
                raw.append((req, buf, manifest.byte_values[fqn]))
                continue
            if req.type == LoadItemType.BYTE_IO:
                _set_value(planner, req, self._values[fqn])
                continue
            dest = planner.resolve_tensor(req).detach()
            lengths = tuple(int(n) for n in req.lengths)
            box = tuple(
                (int(o), int(o) + n) for o, n in zip(req.storage_offsets, lengths, strict=True)
            )
            if dest.shape != lengths:
                raise AnyshardError(
                    f"{req.dest_index.fqn}: the planner resolved a target of shape "
                    f"{list(dest.shape)} for a read of {list(lengths)}"
                )
            fills.append(
                Fill(req.storage_index.fqn, dest, (Piece(0, lengths, full_box(lengths), box),))
            )
            committed.append((req, dest))

    def _read_dcp_data(self, plan: LoadPlan, planner: LoadPlanner, view) -> Future[None]:
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                try:
                    value = view.get_value(fqn)
                except AnyshardError as e:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise AnyshardError(
                        f"{fqn}: {first.split(' is unreadable')[0]} cannot be read without "
                        "running its pickle: AnyshardReader reads the values FileSystemWriter "
                        "pickled with torch.load(weights_only=True), which runs no code and admits "
                        "tensors, numbers, strings and containers of them (not io.BytesIO or other "
                        "objects). Load it with FileSystemReader if you trust the file"
                    ) from None
                _set_value(planner, req, value)
                continue
            dest = planner.resolve_tensor(req).detach()
            lengths = tuple(int(n) for n in req.lengths)
            box = tuple(
                (int(o), int(o) + n) for o, n in zip(req.storage_offsets, lengths, strict=True)
            )
            if dest.is_contiguous():
                view.read_region(fqn, box, out=dest)
            else:
                dest.copy_(view.read_region(fqn, box))
            planner.commit_tensor(req, dest)
        return _done(None)


def _box_of(req) -> Box:
    lengths = tuple(int(n) for n in req.lengths)
    return tuple((int(o), int(o) + n) for o, n in zip(req.storage_offsets, lengths, strict=True))


def _dcp_values(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON values under their names and also under the names DCP's planner flattens them
    into (``meta`` -> ``meta.step``, ``optim.param_groups`` -> ``optim.param_groups.0.lr``):
    `anyshard.save` stores a container without tensors as one value, DCP asks for its leaves."""
    flat, _ = flatten_state_dict(values)
    return {**flat, **values}


def _set_value(planner: LoadPlanner, req, value: Any) -> None:
    """Hand DCP's planner a JSON value without unpickling anything read from storage."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    fqn = req.dest_index.fqn
    if isinstance(planner, DefaultLoadPlanner):
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    buf = io.BytesIO()
    torch.save(value, buf)  # the JSON value, serialised here for a planner that wants bytes
    buf.seek(0)
    planner.load_bytes(req, buf)
