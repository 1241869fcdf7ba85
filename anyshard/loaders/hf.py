"""Hugging Face safetensors checkpoints as the same lazy view as `anyshard.open`.

A checkpoint is one ``.safetensors`` file, or a directory with ``model.safetensors``, or with
shards listed by ``model.safetensors.index.json`` (its ``weight_map``), or with other
``*.safetensors`` files and no index (their union). Headers are read when first needed, one
bounded prefix read per file, and checked against the file (known dtype, shape x itemsize equal
to the byte length, offsets inside the file and not overlapping): a malformed file raises
`CorruptCheckpointError` naming the file and the tensor. Region reads fetch only the byte ranges
the region covers. Nothing is unpickled.

Run: ``python -m pytest tests/unit/test_loaders_hf.py -q``
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from typing import Any

import torch

from anyshard.api.views import BaseView, StoredShard
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from anyshard.format import storage, strict_json
from anyshard.format.datafile import tensor_bytes
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.geometry.boxes import Box, box_runs, box_shape, full_box
from anyshard.loaders._shared import check_file_name, not_there, split_path

__all__ = [
    "FORMAT",
    "HFCheckpointView",
    "HFTensorMetadata",
    "INDEX_NAME",
    "SINGLE_NAME",
    "looks_like_file",
    "looks_like_hf",
]

FORMAT = "huggingface-safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_FIRST_READ = 64 * 1024  # most headers fit: one read (one GET) per file
_MAX_HEADER = 100_000_000  # safetensors' own limit
# Local reads: byte ranges closer than this are read as one and copied out (fewer syscalls);
# a window of merged ranges is at most _WINDOW bytes, so the bounce buffer stays small.
_GAP = 64 * 1024
_WINDOW = 16 << 20


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a file: safetensors dtype code, shape, absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    file: str  # relative to the checkpoint (the file name for a single-file checkpoint)
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class _Header:
    entries: dict[str, _Entry]  # in the order of their data in the file
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class HFTensorMetadata:
    """What `HFCheckpointView.metadata` says of one tensor; shaped like `TensorMetadata`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    mapping: None = None  # a Hugging Face tensor is stored whole, in one file

    @property
    def shards(self) -> tuple[StoredShard, ...]:
        return (StoredShard(0, self.file, {}, (full_box(self.shape),)),)

    @property
    def num_shards(self) -> int:
        return 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def looks_like_file(path: str) -> bool:
    """Whether ``path`` names a safetensors file or index (by its name alone)."""
    return path.endswith(".safetensors") or path.endswith(".safetensors.index.json")


def looks_like_hf(path: str) -> bool:
    """Whether ``path`` is a safetensors file, an index, or a directory holding either at its
    top level (an anyshard checkpoint keeps its data files under ``data/``)."""
    if looks_like_file(path):
        return True
    try:
        names = storage.listdir(path)
    except OSError as e:
        return not_there(path, "a Hugging Face checkpoint", e)
    return any(looks_like_file(n) for n in names)


class HFCheckpointView(BaseView):
    """Read-only view of a Hugging Face safetensors checkpoint, used like `CheckpointView`.

    >>> import torch, tempfile, anyshard
    >>> from safetensors.torch import save_file
    >>> d = tempfile.mkdtemp()
    >>> save_file({"emb": torch.arange(12.0).reshape(4, 3)}, d + "/model.safetensors")
    >>> with anyshard.open(d) as ckpt:
    ...     print(ckpt.format, ckpt.keys(), ckpt.get_slice("emb")[1:3, 0])
    huggingface-safetensors ['emb'] tensor([3., 6.])
    """

    format = FORMAT

    def __init__(self, path: str):
        self.path = path
        self.index: dict[str, Any] | None = None  # the index document, when there is one
        self.index_name = ""
        self._root, self._files, self._weight_map = self._find(path)
        self._headers: dict[str, _Header] = {}
        self._readers: dict[str, storage.FileReader] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # bytes read from the files for tensor data (not headers)

    # --- finding the files ------------------------------------------------------------------

    def _find(self, path: str) -> tuple[str, list[str], dict[str, str] | None]:
        if path.endswith(".safetensors.index.json"):
            root, name = split_path(path)
            return (root, *self._read_index(root, name))
        if path.endswith(".safetensors"):
            root, name = split_path(path)
            if not storage.exists(path):
                raise CheckpointNotFoundError(f"{path}: no such safetensors file")
            return root, [name], None
        try:
            names = storage.listdir(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint directory") from None
        except (OSError, StorageError) as e:
            raise CheckpointNotFoundError(f"{path}: not a checkpoint directory ({e})") from None
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if INDEX_NAME in indexes or len(indexes) == 1:
            return (
                path,
                *self._read_index(path, INDEX_NAME if INDEX_NAME in indexes else indexes[0]),
            )
        if len(indexes) > 1:
            raise CheckpointNotFoundError(
                f"{path}: holds several indexes ({', '.join(indexes)}) and no {INDEX_NAME}; "
                "open the index you mean by its path"
            )
        if SINGLE_NAME in names:
            return path, [SINGLE_NAME], None
        files = [n for n in names if n.endswith(".safetensors")]
        if not files:
            raise CheckpointNotFoundError(
                f"{path}: neither an anyshard checkpoint (no manifest.json) nor a Hugging Face "
                f"one (no {INDEX_NAME}, no *.safetensors)"
            )
        return path, files, None

    def _read_index(self, root: str, name: str) -> tuple[list[str], dict[str, str]]:
        where = storage.join(root, name)
        try:
            doc = strict_json.loads(storage.read_bytes(where))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where}: no such index file") from None
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise CorruptCheckpointError(
                f'{where}: expected an object with a "weight_map" of tensor name -> file name'
            )
        files = []
        for tensor, file in weight_map.items():
            check_file_name(file, f"{where} (tensor {tensor!r})")
            if file not in files:
                files.append(file)
        self.index, self.index_name = doc, name
        return sorted(files), dict(weight_map)

    # --- headers -----------------------------------------------------------------------------

    def _file_path(self, file: str) -> str:
        return storage.join(self._root, *file.split("/")) if self._root else file

    def _reader(self, file: str) -> storage.FileReader:
        with self._lock:
            r = self._readers.get(file)
            if r is None:
                try:
                    r = storage.FileReader(self._file_path(file))
                except FileNotFoundError:
                    raise CorruptCheckpointError(self._missing(file)) from None
                self._readers[file] = r
            return r

    def _missing(self, file: str) -> str:
        by = f"listed in {self.index_name}" if self._weight_map is not None else "expected"
        return (
            f"{self._file_path(file)}: the file is missing ({by}); the checkpoint was copied "
            "incompletely or files were deleted"
        )

    def _header(self, file: str) -> _Header:
        h = self._headers.get(file)
        if h is None:
            h = _read_header(self._file_path(file), file, self._reader(file))
            self._headers[file] = h
        return h

    def _entry(self, name: str) -> _Entry:
        if self._weight_map is not None:
            file = self._weight_map.get(name)
            if file is None:
                raise KeyError(f"{self.path}: no tensor named {name!r}")
            e = self._header(file).entries.get(name)
            if e is None:
                raise CorruptCheckpointError(
                    f"{self._file_path(file)}: {self.index_name} says it holds tensor {name!r}, "
                    "but its header does not list it; the index does not belong to these files"
                )
            return e
        for file in self._files:
            e = self._header(file).entries.get(name)
            if e is not None:
                return e
        raise KeyError(f"{self.path}: no tensor named {name!r}")

    # --- the view ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    @property
    def files(self) -> list[str]:
        """The safetensors files of the checkpoint, relative to it."""
        return list(self._files)

    def keys(self) -> list[str]:
        """Names of the tensors: the index's order, else each file's data order, files sorted."""
        if self._weight_map is not None:
            return list(self._weight_map)
        names: dict[str, str] = {}
        for file in self._files:
            for name in self._header(file).entries:
                if name in names:
                    raise CorruptCheckpointError(
                        f"{self.path}: tensor {name!r} is in both {names[name]} and {file}; "
                        "without an index the checkpoint is ambiguous"
                    )
                names[name] = file
        return list(names)

    def value_keys(self) -> list[str]:
        """A Hugging Face checkpoint holds no JSON values (see `metadata()`)."""
        return []

    def get_value(self, name: str) -> Any:
        raise KeyError(
            f"{self.path}: no JSON value named {name!r} (Hugging Face checkpoints have none)"
        )

    @property
    def values(self) -> dict[str, Any]:
        return {}

    def metadata(self, name: str | None = None):
        """With ``name``: its `HFTensorMetadata` (shape, dtype, file). Without: the files'
        ``__metadata__`` (a str -> str dict; the first file's value wins), as
        ``safe_open(...).metadata()`` gives it."""
        if name is not None:
            e = self._entry(name)
            return HFTensorMetadata(name, e.shape, ST_TO_DTYPE[e.dtype], e.file)
        out: dict[str, str] = {}
        for file in self._files:
            for k, v in self._header(file).metadata.items():
                out.setdefault(k, v)
        return out

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` of tensor ``name``, reading only the byte ranges it covers; into
        ``out`` (a CPU tensor of the region's shape and the tensor's dtype) when given."""
        e = self._entry(name)
        box = tuple((int(lo), int(hi)) for lo, hi in box)
        if len(box) != len(e.shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, e.shape, strict=True)
        ):
            raise IndexError(f"{name}: region {list(box)} is outside its shape {list(e.shape)}")
        dtype = ST_TO_DTYPE[e.dtype]
        shape = box_shape(box)
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu":
                raise ValueError(
                    f"{name}: out must be a CPU {dtype} tensor of shape {list(shape)}, got "
                    f"{out.dtype} {list(out.shape)} on {out.device}"
                )
            if not out.is_contiguous():
                out.copy_(self.read_region(name, box))
                return out
        dest = torch.empty(shape, dtype=dtype) if out is None else out
        size = dtype.itemsize
        spans = [(e.start + off * size, n * size) for off, n in box_runs(e.shape, box)]
        if math.prod(shape):
            self._read_spans(e.file, spans, tensor_bytes(dest))
        return dest

    def _read_spans(self, file: str, spans: list[tuple[int, int]], dest: memoryview) -> None:
        """Fill ``dest`` with the byte ranges ``spans`` (in file order), one after another."""
        reader = self._reader(file)
        try:
            if reader.fd is None:  # a URL: storage coalesces near ranges into few GETs
                pos, out = 0, []
                for off, n in spans:
                    out.append((off, dest[pos : pos + n]))
                    pos += n
                reader.read_scattered(out)
                self.bytes_read += pos
                return
            self.bytes_read += _read_local(reader, spans, dest)
        except FileNotFoundError:
            raise CorruptCheckpointError(self._missing(file)) from None
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{self._file_path(file)}: the file is truncated ({e}); it was copied incompletely"
            ) from None


def _read_local(reader: storage.FileReader, spans: list[tuple[int, int]], dest: memoryview) -> int:
    """Read ``spans`` into consecutive parts of ``dest``: ranges closer than `_GAP` share one
    read into a bounce buffer (a column slice is thousands of short ranges); returns the bytes
    read."""
    done, pos, i = 0, 0, 0
    bounce = bytearray()
    while i < len(spans):
        start, n = spans[i]
        stop, j = start + n, i
        while (
            j + 1 < len(spans)
            and spans[j + 1][0] - stop <= _GAP
            and spans[j + 1][0] + spans[j + 1][1] - start <= _WINDOW
        ):
            j += 1
            stop = spans[j][0] + spans[j][1]
        if j == i:
            reader.read_into(start, dest[pos : pos + n])
            pos += n
        else:
            if len(bounce) < stop - start:
                bounce = bytearray(stop - start)
            window = memoryview(bounce)[: stop - start]
            reader.read_into(start, window)
            for off, m in spans[i : j + 1]:
                dest[pos : pos + m] = window[off - start : off - start + m]
                pos += m
        done += stop - start
        i = j + 1
    return done


def _read_header(path: str, file: str, reader: storage.FileReader) -> _Header:
    """Parse and check one file's header; `CorruptCheckpointError` naming the file on a defect."""
    try:
        size = storage.size(path)
        prefix = reader.read_prefix(_FIRST_READ)
        if len(prefix) < 8:
            raise CorruptCheckpointError(
                f"{path}: {len(prefix)} bytes, shorter than the 8-byte header length of a "
                "safetensors file; the file is truncated or not safetensors"
            )
        (n,) = struct.unpack("<Q", prefix[:8])
        if n > _MAX_HEADER or 8 + n > size:
            raise CorruptCheckpointError(
                f"{path}: header length {n} does not fit (file of {size} bytes, at most "
                f"{_MAX_HEADER}); the file is truncated or not safetensors"
            )
        if 8 + n <= len(prefix):
            raw = bytes(prefix[8 : 8 + n])
        else:
            buf = bytearray(n)
            reader.read_into(8, memoryview(buf))
            raw = bytes(buf)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: the file is missing") from None
    except EOFError as e:
        raise CorruptCheckpointError(
            f"{path}: the file is truncated inside its header ({e})"
        ) from None
    try:
        header = strict_json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise TypeError(f"the header is a JSON {type(header).__name__}, not an object")
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{path}: the header is not a JSON object ({type(e).__name__}: {e}); the file is "
            "corrupt or not safetensors"
        ) from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptCheckpointError(
            f"{path}: __metadata__ must map strings to strings, found {meta!r:.200}"
        )
    entries = _entries(path, file, header, base=8 + n, size=size)
    return _Header(entries=entries, metadata=meta)


def _entries(path: str, file: str, header: dict, *, base: int, size: int) -> dict[str, _Entry]:
    out: list[tuple[str, _Entry]] = []
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
            ints = isinstance(shape, list) and all(
                type(x) is int and x >= 0 for x in (*shape, begin, end)
            )
        except (KeyError, TypeError, ValueError) as ex:
            raise CorruptCheckpointError(
                f"{path}: the header entry of tensor {name!r} is malformed ({type(ex).__name__}: "
                f"{ex}); expected dtype, shape and data_offsets"
            ) from None
        if not isinstance(dtype, str) or dtype not in ST_TO_DTYPE:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype!r}, not one anyshard reads "
                f"({', '.join(ST_TO_DTYPE)})"
            )
        if not ints or begin > end:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has shape {shape!r} and data_offsets {[begin, end]!r}; "
                "expected non-negative integers with start <= stop"
            )
        want = math.prod(shape) * ST_TO_DTYPE[dtype].itemsize
        if end - begin != want:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} is {dtype} {shape}, {want} bytes, but its data_offsets "
                f"{[begin, end]} span {end - begin}; the file is corrupt"
            )
        if base + end > size:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} ends at byte {base + end}, past the end of the file "
                f"({size} bytes); the file is truncated"
            )
        out.append((name, _Entry(dtype, tuple(shape), file, base + begin, base + end)))
    out.sort(key=lambda item: (item[1].start, item[1].stop))
    for (a, ea), (b, eb) in zip(out, out[1:], strict=False):
        if eb.start < ea.stop:
            raise CorruptCheckpointError(
                f"{path}: the data of tensors {a!r} and {b!r} overlap (bytes {ea.start}-{ea.stop} "
                f"and {eb.start}-{eb.stop}); the file is corrupt"
            )
    return dict(out)
