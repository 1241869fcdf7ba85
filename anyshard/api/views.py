"""The view vocabulary: a checkpoint's logical tensors read lazily (`CheckpointView`), their
metadata and where their shards are stored (`TensorMetadata`, `StoredShard`), and slicing that
reads only what it needs (`TensorSlice`)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from anyshard.errors import AnyshardError
from anyshard.format.datafile import DataFileHeader, data_path
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import Box, Piece, full_box
from anyshard.reshard.fill import execute_fills, match_fills
from anyshard.reshard.stored import stored_shards

__all__ = ["BaseView", "CheckpointView", "StoredShard", "TensorMetadata", "TensorSlice"]


@dataclass(frozen=True, slots=True)
class StoredShard:
    rank: int
    file: str
    coords: dict[str, int]
    regions: tuple[Box, ...]  # logical boxes this shard holds


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mapping: str
    shards: tuple[StoredShard, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


_V = TypeVar("_V", bound="BaseView")


class BaseView(abc.ABC):
    """What every view of a checkpoint shares, whatever its format: a context manager whose
    tensors are read whole (`get_tensor`) or sliced lazily (`get_slice`).

    A view gives the names (`keys`, `value_keys`), the JSON values (`get_value`, `values`), a
    tensor's `metadata`, `read_region` (a logical box of a tensor, reading only what it needs),
    and ``_entry(name)``: an object with the tensor's ``shape`` and ``dtype``, what
    `TensorSlice` reports. `close` drops what the view keeps open or cached.
    """

    path: str

    def __enter__(self: _V) -> _V:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a view that keeps nothing open has nothing to do
        """Drop the files, mappings and caches the view keeps; it may still be read after."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Names of the tensors."""

    @abc.abstractmethod
    def value_keys(self) -> list[str]:
        """Names of the JSON values."""

    @abc.abstractmethod
    def get_value(self, name: str) -> Any:
        """The JSON value ``name``."""

    @property
    @abc.abstractmethod
    def values(self) -> dict[str, Any]:
        """Every JSON value, by name."""

    @abc.abstractmethod
    def metadata(self, name: str):
        """Shape, dtype and stored shards of tensor ``name``."""

    @abc.abstractmethod
    def read_region(self, name: str, box: Box) -> torch.Tensor:
        """The logical region ``box`` of tensor ``name``, reading only the bytes it needs (a
        view may also take ``out=``, a tensor to fill instead)."""

    @abc.abstractmethod
    def _entry(self, name: str) -> Any:
        """Tensor ``name``'s ``shape`` and ``dtype`` (a `KeyError` naming the view if unknown)."""

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, whole."""
        return self.read_region(name, full_box(self._entry(name).shape))

    def get_slice(self, name: str) -> TensorSlice:
        """``view.get_slice(name)[...]``: basic indexing, read lazily."""
        return TensorSlice(self, name)


class CheckpointView(BaseView):
    """Read-only view of a committed checkpoint, used like safetensors' ``safe_open``.

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> anyshard.save(d, {"emb": torch.arange(12.0).reshape(4, 3), "lr": 0.1})
    >>> with anyshard.open(d) as ckpt:
    ...     print(ckpt.keys(), ckpt.get_slice("emb")[1:3, 0], ckpt.get_value("lr"))
    ['emb'] tensor([3., 6.]) 0.1
    """

    def __init__(self, path: str, *, threads: int = 8, verify: bool = True):
        self.path = path
        self.manifest = read_manifest(path)
        self._headers: dict[int, DataFileHeader] = {}
        self._threads = threads
        self.verify = verify

    def close(self) -> None:
        self._headers.clear()

    def keys(self) -> list[str]:
        """Names of the logical tensors."""
        return list(self.manifest.tensors)

    def value_keys(self) -> list[str]:
        """Names of the JSON values."""
        return list(self.manifest.values)

    def get_value(self, name: str) -> Any:
        if name not in self.manifest.values:
            raise KeyError(f"{self.path}: no JSON value named {name!r}")
        return self.manifest.values[name]

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.manifest.values)

    def _entry(self, name: str):
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def metadata(self, name: str) -> TensorMetadata:
        entry = self._entry(name)
        shards = []
        for s in stored_shards(self.manifest, name):
            file = self.manifest.files.get(s.rank, "")
            shards.append(
                StoredShard(s.rank, file, s.coords, tuple(p.logical_box for p in s.shard.pieces))
            )
        return TensorMetadata(
            name, entry.shape, ST_TO_DTYPE[entry.dtype], entry.mapping, tuple(shards)
        )

    def read_region(self, name: str, box: Box) -> torch.Tensor:
        """The logical region ``box`` of tensor ``name``, reading only the bytes it needs."""
        entry = self._entry(name)
        shape = tuple(hi - lo for lo, hi in box)
        piece = Piece(0, shape, full_box(shape), tuple(box))
        # the stored shards are checked against the data files' headers before the region is
        # allocated: a manifest's shape is not trusted with memory
        matched = match_fills(self.path, self.manifest, [(name, (piece,))], headers=self._headers)
        out = torch.empty(shape, dtype=ST_TO_DTYPE[entry.dtype])
        execute_fills(matched, [out], threads=self._threads, verify=self.verify)
        return out

    def data_file(self, rank: int) -> str:
        return data_path(self.path, self.manifest, rank)


class TensorSlice:
    """``view.get_slice(name)[...]``: basic indexing (ints, step-1 slices, ...) read lazily."""

    def __init__(self, view: BaseView, name: str):
        self._view, self._name = view, name
        self._entry = view._entry(name)

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype

    def __getitem__(self, index) -> torch.Tensor:
        shape = self._entry.shape
        if not isinstance(index, tuple):
            index = (index,)
        if Ellipsis in index:
            i = index.index(Ellipsis)
            index = index[:i] + (slice(None),) * (len(shape) - len(index) + 1) + index[i + 1 :]
        if len(index) > len(shape):
            raise IndexError(
                f"{self._name}: {len(index)} indices for a tensor of {len(shape)} dims"
            )
        index = index + (slice(None),) * (len(shape) - len(index))
        box, squeeze = [], []
        for d, (ix, n) in enumerate(zip(index, shape, strict=True)):
            if isinstance(ix, int):
                if not -n <= ix < n:
                    raise IndexError(
                        f"{self._name}: index {ix} is out of range for dim {d} of size {n}"
                    )
                ix %= n
                box.append((ix, ix + 1))
                squeeze.append(d)
            elif isinstance(ix, slice):
                start, stop, step = ix.indices(n)
                if step != 1:
                    raise AnyshardError(
                        f"{self._name}: slices with a step are not supported; read with step 1 and slice the result"
                    )
                box.append((start, max(start, stop)))
            else:
                raise TypeError(f"{self._name}: unsupported index {ix!r}")
        out = self._view.read_region(self._name, tuple(box))
        for d in reversed(squeeze):
            out = out.squeeze(d)
        return out
