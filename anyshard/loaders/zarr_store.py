"""Consolidated export: a zarr v3 store, one chunked array per logical tensor, via tensorstore.

`write_zarr` writes a zarr v3 group at ``dst``: one array per tensor (named as the tensor),
chunked into pieces of about ``chunk_size`` bytes along the leading dims, written through
tensorstore's ``zarr3`` driver from the view in chunk-aligned blocks, so at most one block of
one tensor is in memory. The group's attributes keep the source's JSON values under
``"anyshard"``. zarr-python, tensorstore and any zarr v3 reader open it.

bfloat16 has no zarr v3 core data type (zarr-python refuses the group if one array uses the
``bfloat16`` extension), so by default a bfloat16 tensor is stored widened to float32 --
exactly, every bfloat16 value is a float32 -- with its dtype in the array's attributes
(``{"anyshard": {"dtype": "bfloat16"}}``) for readers that want it back; `ZarrView` casts back.
``bf16="bfloat16"`` stores tensorstore's ``bfloat16`` extension type instead (half the bytes;
readable by tensorstore, not by zarr-python).

`ZarrView` reads such a store (or any zarr v3 group of arrays) as the same lazy view as
`anyshard.open`, through tensorstore: region reads touch only the chunks they overlap.

Run: ``python -m pytest tests/unit/test_zarr_export.py -q``
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anyshard.api.views import BaseView, StoredShard
from anyshard.errors import AnyshardError, CheckpointNotFoundError, CorruptCheckpointError
from anyshard.format import storage, strict_json
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.geometry.boxes import Box, box_shape, full_box
from anyshard.loaders._shared import (
    ExportItem,
    ExportReport,
    Progress,
    checked_region,
    export_items,
    not_there,
    parse_size,
    select_names,
)

__all__ = ["ZarrView", "looks_like_zarr", "write_zarr"]

ZARR_JSON = "zarr.json"
FORMAT = "anyshard-zarr-export"
_BLOCK = 64 << 20  # bytes written per tensorstore write, rounded to whole chunks
_CODECS = ("none", "zstd")
# torch dtype -> zarr v3 data type (core types, plus tensorstore's bfloat16 extension)
_ZARR_DTYPES = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.bfloat16: "bfloat16",
}
_FROM_ZARR = {v: k for k, v in _ZARR_DTYPES.items()}


def _ts():
    try:
        import tensorstore
    except ImportError:
        raise AnyshardError("zarr export needs tensorstore: pip install 'anyshard[zarr]'") from None
    return tensorstore


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_ts().bfloat16.numpy_dtype)
    return t.numpy()


def _torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16 and a.dtype != np.float32:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _kvstore(root: str, name: str | None = None) -> dict | str:
    """tensorstore's kvstore spec for ``root`` (or its child ``name``): a local path, or an
    ``s3://`` / ``gs://`` URL; S3's endpoint from ``AWS_ENDPOINT_URL`` when set."""
    path = root.rstrip("/") + ("/" + name if name else "") + "/"
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not storage.is_url(path):
        return {"driver": "file", "path": os.path.abspath(path) + "/"}
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    if scheme in ("s3", "s3a"):
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        if os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
            spec["aws_region"] = os.environ.get("AWS_REGION") or os.environ["AWS_DEFAULT_REGION"]
        return spec
    if scheme == "gs":
        return {"driver": "gcs", "bucket": bucket, "path": key}
    raise AnyshardError(
        f"{root}: tensorstore cannot write to {scheme}:// (use a local path, s3:// or gs://)"
    )


def chunk_shape(shape: tuple[int, ...], itemsize: int, target: int) -> list[int]:
    """Chunks of at most about ``target`` bytes: whole trailing dims, the leading dims cut.

    >>> chunk_shape((1000, 256), 4, 1 << 16)
    [64, 256]
    >>> chunk_shape((4, 1 << 20), 2, 1 << 16)
    [1, 32768]
    """
    chunk = [max(1, n) for n in shape]
    for d in range(len(shape)):
        inner = math.prod(chunk[d + 1 :]) * itemsize
        if inner * chunk[d] <= target:
            break
        if inner <= target:
            chunk[d] = max(1, target // inner)
            break
        chunk[d] = 1
    return chunk


def _write_blocks(item: ExportItem, chunk: list[int]) -> Iterator[Box]:
    """Boxes covering the tensor in whole chunks, about `_BLOCK` bytes each."""
    shape = item.shape
    if not shape or math.prod(shape) == 0:
        yield full_box(shape)
        return
    # the first dim that is cut defines the block rows; dims before it are taken one by one
    d = next((i for i, (c, n) in enumerate(zip(chunk, shape, strict=True)) if c < n), len(shape))
    if d == len(shape):
        yield full_box(shape)
        return
    inner = math.prod(shape[d + 1 :]) * item.dtype.itemsize
    step = max(chunk[d], (_BLOCK // max(inner, 1)) // chunk[d] * chunk[d])
    for outer in np.ndindex(*shape[:d]) if d else [()]:
        head = tuple((i, i + 1) for i in outer)
        for lo in range(0, shape[d], step):
            yield head + ((lo, min(lo + step, shape[d])),) + full_box(shape[d + 1 :])


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or name.startswith("__"):
        raise AnyshardError(
            f"tensor {name!r} cannot be a zarr array name (empty, '.', '..', a '/' or a leading "
            "'__'); rename it with --rename"
        )


def _refuse_existing(dst: str) -> None:
    if storage.exists(storage.join(dst, ZARR_JSON)):
        raise AnyshardError(f"{dst} already holds a zarr store; write to a new path")
    if storage.exists(dst) and storage.listdir(dst):
        raise AnyshardError(f"{dst} is not empty; write the zarr store to a new path")


def write_zarr(
    view,
    dst: str,
    *,
    dtype: torch.dtype | str | None = None,
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    chunk_size: int | str = "16MiB",
    compression: str = "none",
    bf16: str = "float32",
    progress: Progress | None = None,
) -> ExportReport:
    """Write the view as a consolidated zarr v3 store at ``dst`` (a new local directory, or an
    ``s3://`` / ``gs://`` URL through tensorstore's own drivers).

    ``chunk_size`` bounds each chunk's bytes; ``compression`` is ``"none"`` or ``"zstd"``;
    ``bf16`` is ``"float32"`` (default, exact, readable by zarr-python) or ``"bfloat16"``.
    ``dtype``, ``only`` and ``rename`` are as for `write_hf`.

    >>> import torch, tempfile, anyshard, zarr
    >>> from anyshard.loaders import write_zarr
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/ckpt", {"w": torch.arange(6.0).reshape(3, 2), "step": 3})
    >>> with anyshard.open(d + "/ckpt") as view:
    ...     report = write_zarr(view, d + "/export.zarr")
    >>> group = zarr.open_group(d + "/export.zarr", mode="r")
    >>> group["w"][2].tolist(), group.attrs["anyshard"]["values"]
    ([4.0, 5.0], {'step': 3})
    """
    ts = _ts()
    if compression not in _CODECS:
        raise AnyshardError(f"compression {compression!r}: choose one of {', '.join(_CODECS)}")
    if bf16 not in ("float32", "bfloat16"):
        raise AnyshardError(f"bf16={bf16!r}: choose 'float32' or 'bfloat16'")
    target = parse_size(chunk_size)
    items = sorted(export_items(view, only, rename, dtype), key=lambda it: it.target)
    for it in items:
        _check_name(it.target)
    values = {
        target: view.get_value(source)
        for target, source in select_names(view.value_keys(), only, rename).items()
    }
    _refuse_existing(dst)
    storage.makedirs(dst)
    attrs = {"anyshard": {"format": FORMAT, "version": 1, "values": values}}
    group = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    total = sum(it.nbytes for it in items)
    done = [0, 0]
    files = []
    for it in items:
        stored = torch.float32 if it.dtype == torch.bfloat16 and bf16 == "float32" else it.dtype
        if stored not in _ZARR_DTYPES:
            raise AnyshardError(f"{it.target}: {it.dtype} has no zarr data type")
        chunk = chunk_shape(it.shape, stored.itemsize, target)
        codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if compression == "zstd":
            codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
        meta = {
            "shape": list(it.shape),
            "data_type": _ZARR_DTYPES[stored],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "codecs": codecs,
            "attributes": {"anyshard": {"dtype": DTYPE_TO_ST[it.dtype]}},
        }
        try:
            arr = ts.open(
                {"driver": "zarr3", "kvstore": _kvstore(dst, it.target), "metadata": meta},
                create=True,
            ).result()
            for box in _write_blocks(it, chunk):
                block = view.read_region(it.source, box).to(stored).contiguous()
                index = tuple(slice(lo, hi) for lo, hi in box)
                arr[index].write(_numpy(block)).result()
        except ValueError as e:  # tensorstore reports I/O and spec errors as ValueError
            raise AnyshardError(f"{dst}/{it.target}: tensorstore could not write ({e})") from None
        files.append(f"{it.target}/{ZARR_JSON}")
        done[0] += 1
        done[1] += it.nbytes
        if progress is not None:
            progress(done[0], len(items), done[1], total)
    storage.write_bytes_atomic(
        storage.join(dst, ZARR_JSON), (json.dumps(group, indent=2) + "\n").encode()
    )
    return ExportReport(dst, "zarr", (ZARR_JSON, *files), len(items), total)


# --- reading ------------------------------------------------------------------------------------


def looks_like_zarr(path: str) -> bool:
    """A directory whose ``zarr.json`` is a zarr v3 group."""
    try:
        meta = strict_json.loads(storage.read_bytes(storage.join(path, ZARR_JSON)))
    except OSError as e:
        return not_there(path, "a zarr store", e)
    except ValueError:  # zarr.json is not JSON
        return False
    return isinstance(meta, dict) and meta.get("node_type") == "group"


@dataclass(frozen=True, slots=True)
class ZarrTensorMetadata:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[int, ...]

    @property
    def shards(self) -> tuple[StoredShard, ...]:
        return (StoredShard(-1, self.name, {}, (full_box(self.shape),)),)

    @property
    def num_shards(self) -> int:
        n = 1
        for s, c in zip(self.shape, self.chunks, strict=True):
            n *= -(-s // c) if s else 0
        return n

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ZarrView(BaseView):
    """Read-only view of a zarr v3 group of arrays (an `write_zarr` export or any such store),
    through tensorstore; same methods as `anyshard.open`'s view."""

    format = "zarr"

    def __init__(self, path: str):
        self.path = path
        where = storage.join(path, ZARR_JSON)
        try:
            group = strict_json.loads(storage.read_bytes(where))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no zarr store ({ZARR_JSON} missing)") from None
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: not JSON ({e})") from None
        if not isinstance(group, dict) or group.get("node_type") != "group":
            raise CorruptCheckpointError(f"{where}: not a zarr v3 group")
        info = (group.get("attributes") or {}).get("anyshard") or {}
        self._values: dict[str, Any] = dict(info.get("values") or {})
        self._meta: dict[str, tuple[ZarrTensorMetadata, dict]] = {}
        for name in sorted(storage.listdir(path)):
            if name == ZARR_JSON:
                continue
            try:
                meta = strict_json.loads(storage.read_bytes(storage.join(path, name, ZARR_JSON)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except ValueError as e:
                raise CorruptCheckpointError(f"{path}/{name}/{ZARR_JSON}: not JSON ({e})") from None
            if meta.get("node_type") != "array":
                continue
            try:
                stored = _FROM_ZARR[meta["data_type"]]
                attrs = (meta.get("attributes") or {}).get("anyshard") or {}
                dtype = _st_dtype(attrs.get("dtype")) or stored
                shape = tuple(int(n) for n in meta["shape"])
                chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            except (KeyError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{path}/{name}/{ZARR_JSON}: unsupported array metadata ({e})"
                ) from None
            self._meta[name] = (ZarrTensorMetadata(name, shape, dtype, chunks), meta)
        self._open: dict[str, Any] = {}

    def close(self) -> None:
        self._open.clear()

    def keys(self) -> list[str]:
        return list(self._meta)

    def value_keys(self) -> list[str]:
        return sorted(self._values)

    def get_value(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"{self.path}: no value named {name!r}") from None

    @property
    def values(self) -> dict[str, Any]:
        return dict(self._values)

    def metadata(self, name: str) -> ZarrTensorMetadata:
        try:
            return self._meta[name][0]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _array(self, name: str):
        if name not in self._open:
            try:
                self._open[name] = (
                    _ts()
                    .open({"driver": "zarr3", "kvstore": _kvstore(self.path, name)}, open=True)
                    .result()
                )
            except ValueError as e:
                raise CorruptCheckpointError(f"{self.path}/{name}: unreadable ({e})") from None
        return self._open[name]

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` of tensor ``name``, reading the chunks it overlaps."""
        md = self.metadata(name)
        box = checked_region(name, box, md.shape)
        index = tuple(slice(lo, hi) for lo, hi in box)
        try:
            arr = self._array(name)
            data = (arr[index] if index else arr).read().result()
        except ValueError as e:
            raise CorruptCheckpointError(f"{self.path}/{name}: unreadable ({e})") from None
        t = _torch(np.asarray(data), md.dtype).reshape(box_shape(box))
        if out is None:
            return t
        out.copy_(t)
        return out

    def _entry(self, name: str):  # what TensorSlice reads: shape and dtype
        md = self.metadata(name)
        return _SliceEntry(md.shape, DTYPE_TO_ST[md.dtype])


@dataclass(frozen=True, slots=True)
class _SliceEntry:
    shape: tuple[int, ...]
    dtype: str


def _st_dtype(code: object) -> torch.dtype | None:
    from anyshard.format.dtypes import ST_TO_DTYPE

    return ST_TO_DTYPE.get(code) if isinstance(code, str) else None
