"""PyTorch DCP (torch.distributed.checkpoint) directories as a lazy view, without running code.

DCP's ``.metadata`` is a pickle, and DCP's own reader unpickles it with ``pickle.load``: any
object, any code. This view reads it with an unpickler whose ``find_class`` admits only DCP's
metadata dataclasses and torch's ``Size``, dtypes, layouts and memory formats ("Restricting
Globals" in Python's pickle documentation; torch's weights-only unpickler cannot read the
protocol-4 stream DCP writes); the save plans Megatron-core adds to it are read as inert
placeholders. A crafted metadata file that names anything else is refused.
The data chunks are ``torch.save`` archives, read with ``torch.load(weights_only=True)``, one
whole chunk at a time (the archive format allows no partial read): a region costs the chunks it
overlaps.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch

from anyshard._compat import DCP_PICKLED_PRIVATE, DCP_PLAN_PRIVATE, storage_offset_in_file
from anyshard.api.views import BaseView, StoredShard
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.geometry.boxes import Box, box_runs, box_shape, intersect
from anyshard.loaders._shared import check_file_name, checked_region, not_there

__all__ = ["DCPCheckpointView", "DCPTensorMetadata", "looks_like_dcp"]

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
_ALLOWED_CLASSES = {
    (f"{_DCP}.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
} | {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id may be a path object
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_ALLOWED_CLASSES |= DCP_PICKLED_PRIVATE  # the private ones: memory formats, layouts, offsets


# Records of the save plans that some writers add to the metadata object next to DCP's own fields
# (Megatron-core's torch_dist keeps every rank's plan in ``all_local_plans``, to reuse it). They
# are built as inert placeholders, never as the named classes, and never read.
_PLAN_CLASSES = {
    ("torch.distributed.checkpoint.planner", name)
    for name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
} | {
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}
_PLAN_CLASSES |= DCP_PLAN_PRIVATE


class _PlanRecord:
    """Stands in for an allowlisted save-plan class: takes any arguments and state, keeps none."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if (module, name) in _PLAN_CLASSES:
            return _PlanRecord
        if module == "torch":  # dtypes, layouts and memory formats pickle as torch.<name>
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CorruptCheckpointError(
            f"{self.where}: the DCP metadata names {module}.{name}, which is not part of DCP's "
            "metadata; refusing to load it (it could run code)"
        )


def _where_stored(info, where: str, what: str) -> tuple[str, int, int]:
    """The file, offset and length of DCP's storage info ``info``: a file inside the checkpoint,
    whole non-negative numbers (`CorruptCheckpointError` otherwise)."""
    file = check_file_name(getattr(info, "relative_path", None), f"{where}: the {what}")
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise CorruptCheckpointError(
            f"{where}: the {what} is stored at offset {offset!r:.40}, length {length!r:.40}; "
            "not whole numbers >= 0"
        )
    return file, offset, length


def looks_like_dcp(path: str) -> bool:
    """Whether ``path`` is a directory with DCP's ``.metadata`` file."""
    try:
        return storage.exists(storage.join(path, METADATA))
    except OSError as e:
        return not_there(path, "a PyTorch DCP checkpoint", e)


@dataclass(frozen=True, slots=True)
class DCPTensorMetadata:
    """What `DCPCheckpointView.metadata` says of one tensor; shaped like `TensorMetadata`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[StoredShard, ...]
    mapping: None = None  # DCP describes chunks by offsets, not by a mapping

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Window(io.RawIOBase):
    """A read-only, seekable file object over bytes ``[offset, offset + length)`` of a file:
    what ``torch.load`` reads one chunk's archive through, without a copy of the chunk."""

    def __init__(self, reader: storage.FileReader, offset: int, length: int):
        super().__init__()
        self._reader, self._offset, self._length, self._pos = reader, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        if n:
            # through a buffer of our own: a failed read must not leave a view of the caller's
            # buffer in a traceback that outlives it
            data = bytearray(n)
            self._reader.read_into(self._offset + self._pos, memoryview(data))
            with memoryview(b) as view, view.cast("B") as flat:
                flat[:n] = data
            self._pos += n
        return n


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a chunk's elements lie in its file: C-order from byte ``start`` (a chunk whose
    archive stores it otherwise has ``start`` None and is read whole)."""

    start: int | None


@dataclass(frozen=True, slots=True)
class _Chunk:
    box: Box
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class _Tensor:
    shape: tuple[int, ...]
    torch_dtype: torch.dtype
    chunks: tuple[_Chunk, ...]

    @property
    def dtype(self) -> str:
        """The safetensors dtype code, as anyshard's tensor entries give it."""
        return DTYPE_TO_ST[self.torch_dtype]


class DCPCheckpointView(BaseView):
    """Read-only view of a PyTorch DCP checkpoint directory (same methods as `CheckpointView`).

    Non-tensor entries (DCP stores them as ``torch.save`` bytes) are the JSON-like values,
    read with ``torch.load(weights_only=True)``.
    """

    format = "pytorch-dcp"

    def __init__(self, path: str):
        self.path = path
        where = storage.join(path, METADATA)
        try:
            data = storage.read_bytes(where)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{path}: no DCP checkpoint ({METADATA} missing)"
            ) from None
        try:
            md = _MetadataUnpickler(data, where).load()
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(
                f"{where}: unreadable DCP metadata ({type(e).__name__}: {e})"
            ) from None
        self._tensors: dict[str, _Tensor] = {}
        self._values: dict[str, tuple[str, int, int]] = {}
        # DCP's flatten mapping (flattened key -> the keys and indices it came from), if saved
        self.planner_data: dict[str, tuple[str | int, ...]] = {}
        version = getattr(md, "version", None)
        self.version: str | None = version if isinstance(version, str) else None
        save_id = getattr(getattr(md, "storage_meta", None), "save_id", None)
        self.save_id: str | None = save_id if isinstance(save_id, str) else None
        for k, keys in (getattr(md, "planner_data", None) or {}).items():
            if isinstance(k, str) and isinstance(keys, tuple | list):
                if all(isinstance(x, str | int) and not isinstance(x, bool) for x in keys):
                    self.planner_data[k] = tuple(keys)
        try:
            self._index(md, where)
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(
                f"{where}: malformed DCP metadata ({type(e).__name__}: {e})"
            ) from None
        self._lock = threading.Lock()
        self._cache: tuple[tuple[str, int], torch.Tensor] | None = None
        self._layouts: dict[tuple[str, int], _Layout] = {}
        self._sizes: dict[str, int] = {}

    def _index(self, md, where: str) -> None:
        storage_data = md.storage_data
        by_fqn: dict[tuple[str, tuple | None], Any] = {}
        for key, info in storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpointError(
                    f"{where}: {key.fqn} is stored with transforms {info.transform_descriptors} "
                    "(compression?), which this reader does not undo"
                )
            offset = tuple(key.offset) if key.offset is not None else None
            by_fqn[(key.fqn, offset)] = info
        for fqn, meta in md.state_dict_metadata.items():
            info_of = lambda off, fqn=fqn: by_fqn.get((fqn, off))  # noqa: E731
            if type(meta).__name__ == "BytesStorageMetadata":
                info = info_of(None)
                if info is None:
                    raise CorruptCheckpointError(f"{where}: no storage for value {fqn!r}")
                self._values[fqn] = _where_stored(info, where, f"value {fqn!r}")
                continue
            shape = tuple(int(n) for n in meta.size)
            chunks = []
            for c in meta.chunks:
                off = tuple(int(x) for x in c.offsets)
                info = info_of(off)
                if info is None:
                    raise CorruptCheckpointError(
                        f"{where}: no storage for chunk {list(off)} of {fqn!r}"
                    )
                box = tuple((o, o + int(n)) for o, n in zip(off, c.sizes, strict=True))
                if any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True)):
                    raise CorruptCheckpointError(
                        f"{where}: chunk {list(box)} of {fqn!r} is outside {list(shape)}"
                    )
                chunks.append(_Chunk(box, *_where_stored(info, where, f"chunk of {fqn!r}")))
            self._tensors[fqn] = _Tensor(shape, meta.properties.dtype, tuple(chunks))

    def close(self) -> None:
        self._cache = None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def value_keys(self) -> list[str]:
        return list(self._values)

    def get_value(self, name: str) -> Any:
        if name not in self._values:
            raise KeyError(f"{self.path}: no value named {name!r}")
        file, offset, length = self._values[name]
        data = self._read(file, offset, length)
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # a damaged or hostile record: never more than a refusal
            raise CorruptCheckpointError(
                f"{self._data_path(file)}: value {name!r} is unreadable ({type(e).__name__}: "
                f"{str(e)[:200]})"
            ) from None

    @property
    def values(self) -> dict[str, Any]:
        return {k: self.get_value(k) for k in self._values}

    def _entry(self, name: str) -> _Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def metadata(self, name: str) -> DCPTensorMetadata:
        t = self._entry(name)
        shards = tuple(StoredShard(-1, c.file, {}, (c.box,)) for c in t.chunks)
        return DCPTensorMetadata(name, t.shape, t.torch_dtype, shards)

    def _read(self, file: str, offset: int, length: int) -> bytes:
        path = storage.join(self.path, *file.split("/"))
        try:
            size = self._file_size(file)
            if offset + length > size:  # before allocating what the metadata says
                raise CorruptCheckpointError(
                    f"{path}: the DCP metadata places {length} bytes at offset {offset}, past the "
                    f"end of the file ({size} bytes); the metadata is corrupt or hostile"
                )
            buf = bytearray(length)
            with storage.FileReader(path) as reader:
                reader.read_into(offset, memoryview(buf))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: DCP data file is missing") from None
        except EOFError as e:
            raise CorruptCheckpointError(f"{path}: DCP data file is truncated ({e})") from None
        return bytes(buf)

    def _data_path(self, file: str) -> str:
        return storage.join(self.path, *file.split("/"))

    def _file_size(self, file: str) -> int:
        """The size of data file ``file`` (asked once per file)."""
        with self._lock:
            if file in self._sizes:
                return self._sizes[file]
        try:
            size = storage.size(self._data_path(file))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self._data_path(file)}: DCP data file is missing"
            ) from None
        with self._lock:
            self._sizes[file] = size
        return size

    def _load_chunk(self, name: str, c: _Chunk, *, meta: bool) -> Any:
        """``torch.load(weights_only=True)`` of chunk ``c``'s archive, read through a window on
        its file (``meta``: the tensor's shape and strides only, no data read)."""
        path = self._data_path(c.file)
        try:
            with storage.FileReader(path) as reader:
                window = io.BufferedReader(_Window(reader, c.offset, c.length), 1 << 16)
                return torch.load(window, weights_only=True, map_location="meta" if meta else "cpu")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: DCP data file is missing") from None
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(
                f"{path}: chunk {list(c.box)} of {name!r} is unreadable ({type(e).__name__}: {e})"
            ) from None

    def _checked(self, name: str, c: _Chunk, t: _Tensor, data: Any) -> torch.Tensor:
        if (
            not isinstance(data, torch.Tensor)
            or tuple(data.shape) != box_shape(c.box)
            or data.dtype != t.torch_dtype
        ):
            raise CorruptCheckpointError(
                f"{self.path}/{c.file}: chunk {list(c.box)} of {name!r} is not a {t.torch_dtype} tensor of "
                f"shape {list(box_shape(c.box))}"
            )
        return data

    def _layout(self, name: str, c: _Chunk, t: _Tensor) -> _Layout:
        """Where chunk ``c``'s elements lie: read once from its archive's pickle and zip
        directory (``map_location="meta"``: torch reads the record's offset, not its bytes)."""
        key = (c.file, c.offset)
        with self._lock:
            if key in self._layouts:
                return self._layouts[key]
        size = self._file_size(c.file)
        if c.offset + c.length > size:
            raise CorruptCheckpointError(
                f"{self._data_path(c.file)}: the DCP metadata places chunk {list(c.box)} of "
                f"{name!r} at bytes {c.offset}..{c.offset + c.length}, past the end of the file "
                f"({size} bytes); the metadata is corrupt or hostile"
            )
        m = self._checked(name, c, t, self._load_chunk(name, c, meta=True))
        record = storage_offset_in_file(m)
        start = None
        if m.is_contiguous() and record is not None:
            start = c.offset + record + int(m.storage_offset()) * m.element_size()
        if start is not None and start + m.numel() * m.element_size() > c.offset + c.length:
            raise CorruptCheckpointError(
                f"{self.path}/{c.file}: chunk {list(c.box)} of {name!r} says its data runs past "
                "the chunk's bytes"
            )
        layout = _Layout(start)
        with self._lock:
            self._layouts[key] = layout
        return layout

    def _chunk(self, name: str, c: _Chunk, t: _Tensor) -> torch.Tensor:
        """The whole chunk as a tensor (the last one is kept for the next region of it)."""
        key = (c.file, c.offset)
        with self._lock:
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1]
            self._cache = None  # not two chunks alive at once
        data = self._checked(name, c, t, self._load_chunk(name, c, meta=False))
        with self._lock:
            self._cache = (key, data)
        return data

    def _read_direct(self, c: _Chunk, start: int, local: Box, dest: torch.Tensor) -> None:
        """Fill the contiguous ``dest`` with region ``local`` of a C-order chunk stored from
        byte ``start``: only the bytes of its rows' runs are read."""
        item = dest.element_size()
        if not dest.numel():
            return
        flat = dest.view(-1).view(torch.uint8).numpy().data
        spans, pos = [], 0
        for first, n in box_runs(box_shape(c.box), local):
            spans.append((start + first * item, flat[pos : pos + n * item]))
            pos += n * item
        path = self._data_path(c.file)
        try:
            with storage.FileReader(path) as reader:
                reader.read_scattered(spans)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: DCP data file is missing") from None
        except EOFError as e:
            raise CorruptCheckpointError(f"{path}: DCP data file is truncated ({e})") from None

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` of tensor ``name``, reading the chunks it overlaps."""
        t = self._entry(name)
        box = checked_region(name, box, t.shape)
        if math.prod(box_shape(box)) == 0:
            return torch.empty(box_shape(box), dtype=t.torch_dtype) if out is None else out
        # where each overlapping chunk's bytes lie, checked against its file's real size, before
        # the region is allocated: the metadata's shapes are not trusted with memory
        parts = []
        for c in t.chunks:
            x = intersect(c.box, box) if t.shape else ()
            if x is not None:
                parts.append((c, x, self._layout(name, c, t)))
        dest = torch.empty(box_shape(box), dtype=t.torch_dtype) if out is None else out
        covered = 0
        for c, x, layout in parts:
            local = tuple((lo - clo, hi - clo) for (lo, hi), (clo, _) in zip(x, c.box, strict=True))
            target = dest[
                tuple(slice(lo - blo, hi - blo) for (lo, hi), (blo, _) in zip(x, box, strict=True))
            ]
            if layout.start is None:  # stored with other strides: the whole chunk, then a copy
                target.copy_(self._chunk(name, c, t)[tuple(slice(lo, hi) for lo, hi in local)])
            elif target.is_contiguous():
                self._read_direct(c, layout.start, local, target)
            else:
                part = torch.empty(box_shape(x), dtype=t.torch_dtype)
                self._read_direct(c, layout.start, local, part)
                target.copy_(part)
            covered += math.prod(box_shape(x)) if x else 1
        if covered < math.prod(box_shape(box)):
            raise CorruptCheckpointError(
                f"{self.path}: the chunks of {name!r} cover {covered} of the {math.prod(box_shape(box))} "
                f"elements of region {list(box)}"
            )
        return dest
