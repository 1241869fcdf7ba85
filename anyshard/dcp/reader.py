"""PyTorch DCP storage reader: ``torch.distributed.checkpoint`` loads any anyshard checkpoint,
under any layout.

`AnyshardReader` presents any anyshard checkpoint (saved by `anyshard.save`, under a UCL spec, by
`AnyshardWriter`, or converted from DeepSpeed or Megatron) to DCP as one chunk per logical
tensor; DCP's planner asks for the regions the target holds and the reader reads only those
bytes, in parallel and verified (a flipped bit is a `ChecksumError`).

Byte values follow DCP's contract, kept safe. DCP's ``StorageReader.read_data`` hands every byte
item to ``planner.load_bytes``. Where the planner overrides ``load_bytes`` (Megatron-Core's load
planner, any custom planner), this reader does the same and the planner's own code decides how to
read the bytes: a stored ``io.BytesIO`` value as its bytes, a JSON value as the ``torch.save`` of
it that DCP's default save planner would have stored, a ``FileSystemWriter`` checkpoint's value
as the bytes in its file. Where it does not (DCP's `DefaultLoadPlanner`, and subclasses that keep
its ``load_bytes``, which unpickles with ``weights_only=False``), the value is set in the state
dict directly: a JSON value as it is, an ``io.BytesIO`` or ``bytes`` value as the same bytes, a
``FileSystemWriter`` checkpoint's value by ``torch.load(weights_only=True)``, refused with its key
if that cannot read it. This module never unpickles with ``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import replace
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from anyshard._compat import flatten_state_dict, set_element
from anyshard.api import read_once
from anyshard.api.open import open_checkpoint
from anyshard.dcp.common import checkpoint_path, completed
from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from anyshard.geometry.boxes import Box, Piece, full_box
from anyshard.reshard.fill import Fill, fill_regions

__all__ = ["AnyshardReader", "overrides_load_bytes"]

_DCP_METADATA = ".metadata"  # what FileSystemWriter commits last
# the version of DCP's metadata conventions (its planners read planner_data by it): those of the
# torch that runs, whose planner made the planner_data the writer keeps
_DCP_VERSION = getattr(_dcp_filesystem, "CURRENT_DCP_VERSION", None)


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
        self.path = checkpoint_path(self.path, "AnyshardReader")
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
        view = self._dcp = open_checkpoint(checkpoint_path(self.path, "AnyshardReader"))
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
            once = storage.is_url(checkpoint_path(self.path, "AnyshardReader"))
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
                checkpoint_path(self.path, "AnyshardReader"), manifest, [], once, dist.get_rank(),
                list(range(dist.get_world_size())), error=e,
            )  # fmt: skip
        path = checkpoint_path(self.path, "AnyshardReader")
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
            if kind == "BytesIO" and overrides_load_bytes(planner):
                planner.load_bytes(req, io.BytesIO(data))  # the stored bytes, as they were
            else:
                _set_value(planner, req, io.BytesIO(data) if kind == "BytesIO" else data)
        return completed(None)

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
                if overrides_load_bytes(planner):
                    # as FileSystemReader does: the bytes in the file, for the planner to read
                    planner.load_bytes(req, io.BytesIO(_stored_bytes(view, fqn)))
                    continue
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
        return completed(None)


def _box_of(req) -> Box:
    lengths = tuple(int(n) for n in req.lengths)
    return tuple((int(o), int(o) + n) for o, n in zip(req.storage_offsets, lengths, strict=True))


def _dcp_values(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON values under their names and also under the names DCP's planner flattens them
    into (``meta`` -> ``meta.step``, ``optim.param_groups`` -> ``optim.param_groups.0.lr``):
    `anyshard.save` stores a container without tensors as one value, DCP asks for its leaves."""
    flat, _ = flatten_state_dict(values)
    return {**flat, **values}


def overrides_load_bytes(planner: LoadPlanner) -> bool:
    """Whether ``planner`` reads byte values with its own ``load_bytes``: any planner that is not
    DCP's `DefaultLoadPlanner`, and a subclass of it that overrides the method (Megatron-Core's
    planner where it does). DCP's own ``load_bytes`` unpickles with ``weights_only=False``; the
    reader never calls that one."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not isinstance(planner, DefaultLoadPlanner):
        return True
    return getattr(type(planner), "load_bytes", None) is not DefaultLoadPlanner.load_bytes


def _stored_bytes(view: Any, fqn: str) -> bytes:
    """A value's bytes as a ``FileSystemWriter`` checkpoint stores them, not unpickled."""
    file, offset, length = view._values[fqn]
    return view._read(file, offset, length)


def _set_value(planner: LoadPlanner, req, value: Any) -> None:
    """Hand DCP's planner a value without unpickling anything read from storage: set directly
    for a planner that keeps DCP's ``load_bytes``; else through its own ``load_bytes``, as the
    ``torch.save`` of the value that DCP's default save planner would have stored."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    fqn = req.dest_index.fqn
    if not overrides_load_bytes(planner):
        assert isinstance(planner, DefaultLoadPlanner)
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    buf = io.BytesIO()
    torch.save(value, buf)  # serialised here, from the manifest, for a planner that reads bytes
    buf.seek(0)
    planner.load_bytes(req, buf)
