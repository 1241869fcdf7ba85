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

import io
import math
import os
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
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
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from anyshard._compat import flatten_state_dict, set_element
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
    refuse_committed,
)
from anyshard.format.datafile import write_datafile
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.manifest import Manifest, MeshEntry, read_manifest
from anyshard.geometry.boxes import Piece, full_box
from anyshard.reshard.fill import Fill, fill_regions

__all__ = ["AnyshardReader", "AnyshardWriter"]

Box = tuple[tuple[int, int], ...]


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
    """What the global plan tells one rank to write: the chunks it stores (fqn, chunk offsets),
    and the empty tensors it stores whole (fqn -> shape)."""

    chunks: frozenset[tuple[str, tuple[int, ...]]]
    empty: dict[str, tuple[int, ...]]


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


def _place(fqn: str, items: list[tuple[int, WriteItem]]) -> tuple[_Placed, list[tuple[int, tuple]]]:
    """Where the chunks of ``fqn`` (rank, write item) go: its grid, and the (rank, offsets) of
    the chunks that store it (each non-empty chunk once; duplicates dropped)."""
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
    ranks = [grid[cell] for cell in sorted(grid)]
    mesh = (
        MeshEntry.from_rank_grid(dims, sizes, ranks)
        if dims
        else MeshEntry(dims=(), sizes=(), ranks=(ranks[0],))
    )
    mapping = " | ".join(
        f"split({d}, c{d}, [{', '.join(str(hi - lo) for lo, hi in parts[d])}])" for d in split
    )
    if len(set(ranks)) != len(ranks):
        r = next(r for r in ranks if ranks.count(r) > 1)
        raise AnyshardError(
            f"{fqn}: rank {r} saves {ranks.count(r)} chunks of it; AnyshardWriter stores one "
            "chunk of a tensor per rank. Save this state with anyshard.save"
        )
    return _Placed(st, shape, mesh, mapping, tuple(sorted(set(ranks)))), list(boxes.values())


class AnyshardWriter(StorageWriter):
    """DCP storage writer of an anyshard checkpoint at ``path`` (a directory or URL).

    ``dcp.save(state, storage_writer=AnyshardWriter(path))`` (or ``dcp.async_save``): every rank
    writes its chunks into ``data/rank-NNNNN.safetensors`` with their checksums; the coordinator
    commits ``manifest.json`` after every rank has written. Tensors are stored as DCP hands them
    (one chunk per rank, tiling each tensor as a grid); non-tensor values as JSON.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, threads: int = 4) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.threads = threads
        self.rank = 0
        self.is_coordinator = False
        self._placed: dict[str, _Placed] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._placed = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self):
        return None

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
        refuse_committed(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Decide, before any byte is written, where each chunk goes and how the manifest
        describes it; refuse a state that the format cannot hold (naming the tensor)."""
        by_fqn: dict[str, list[tuple[int, WriteItem]]] = defaultdict(list)
        for rank, plan in enumerate(plans):
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    by_fqn[item.index.fqn].append((rank, item))
        chunks: list[set] = [set() for _ in plans]
        empty: list[dict] = [{} for _ in plans]
        self._placed = {}
        for fqn, items in by_fqn.items():
            placed, stored = _place(fqn, items)
            self._placed[fqn] = placed
            for rank, offsets in stored:
                chunks[rank].add((fqn, offsets))
            if not stored:
                empty[placed.writers[0]][fqn] = placed.shape
        return [
            replace(plan, storage_data=_Stored(frozenset(chunks[r]), empty[r]))
            for r, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        stored: _Stored = plan.storage_data
        shards: list[tuple[str, torch.Tensor]] = []
        results: list[WriteResult] = []
        file = data_file_name(self.rank)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                value = _value_of(planner, item)
                results.append(WriteResult(item.index, 0, {"value": value}))
                continue
            if fqn in stored.empty:
                t = torch.empty(stored.empty[fqn], dtype=_tensor_data(item).properties.dtype)
                shards.append((fqn, t))
            else:
                offsets = tuple(int(o) for o in _tensor_data(item).chunk.offsets)
                if (fqn, offsets) not in stored.chunks:
                    results.append(WriteResult(item.index, 0, {"file": None}))
                    continue
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor)
                t = data.detach()
                if t.device.type != "cpu" or not t.is_contiguous():
                    t = t.to("cpu", memory_format=torch.contiguous_format)
                shards.append((fqn, t))
            results.append(WriteResult(item.index, t.nbytes, {"file": file}))
        if shards:
            root = _path(self.path, "AnyshardWriter")
            storage.makedirs(storage.join(root, DATA_DIR))
            write_datafile(storage.join(root, *file.split("/")), shards, threads=self.threads)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: the manifest from the global plan and what every rank wrote (coordinator)."""
        reports = [SaveReport() for _ in results]
        values: dict[str, Any] = {}
        for rank, rank_results in enumerate(results):
            for res in rank_results:
                data = res.storage_data
                if "value" in data:
                    values.setdefault(res.index.fqn, data["value"])
                elif data["file"] is not None:
                    rep = reports[rank]
                    reports[rank] = replace(rep, file=data["file"], count=rep.count + 1)
        for fqn, placed in self._placed.items():
            rank = placed.writers[0]
            tensor = ReportedTensor(
                dtype=placed.dtype, shape=placed.shape, mesh=placed.mesh, mapping=placed.mapping
            )
            reports[rank].tensors[fqn] = tensor
        reports[0] = replace(reports[0], values={**values, **reports[0].values})
        root = _path(self.path, "AnyshardWriter")
        commit_manifest(root, build_manifest(reports, root))


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
    if not is_json_value(value):
        raise AnyshardError(
            f"{item.index.fqn}: a value of type {type(value).__qualname__} cannot be stored; "
            "anyshard stores tensors and JSON values (numbers, strings, lists, dicts) and never "
            "pickles. Convert it to one of those before saving"
        )
    return json_roundtrip(value)


# --------------------------------------------------------------------------- reader


class AnyshardReader(StorageReader):
    """DCP storage reader of any anyshard checkpoint at ``path`` (a directory or URL).

    ``dcp.load(state, storage_reader=AnyshardReader(path))`` fills ``state`` (tensors or
    DTensors of any layout) reading only the regions each rank holds, with ``threads`` parallel
    reads; ``verify=False`` skips the checksums (reading exactly the needed bytes).
    """

    def __init__(
        self, path: str | os.PathLike | None = None, *, threads: int = 8, verify: bool = True
    ) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.threads = threads
        self.verify = verify
        self._manifest: Manifest | None = None
        self._headers: dict = {}
        self._values: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._manifest, self._headers = None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        path = os.fspath(checkpoint_id)
        return storage.exists(storage.join(path, "manifest.json"))

    def read_metadata(self) -> Metadata:
        """DCP's view of the checkpoint: every logical tensor as one chunk, every JSON value as
        bytes (nothing pickled is read: there is none)."""
        self.path = _path(self.path, "AnyshardReader")
        manifest = self._manifest = read_manifest(self.path)
        md: dict[str, Any] = {}
        for fqn, entry in manifest.tensors.items():
            size = torch.Size(entry.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=ST_TO_DTYPE[entry.dtype]),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        self._values = _dcp_values(manifest.values)
        for name in self._values:
            md[name] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, storage_data={})

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self._manifest
        assert manifest is not None, "read_metadata first"
        fills: list[Fill] = []
        committed = []
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                _set_value(planner, req, self._values[req.storage_index.fqn])
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
        if fills:
            fill_regions(
                _path(self.path, "AnyshardReader"),
                manifest,
                fills,
                headers=self._headers,
                threads=self.threads,
                verify=self.verify,
            )
        for req, dest in committed:
            planner.commit_tensor(req, dest)
        return _done(None)


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
