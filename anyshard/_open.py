"""``anyshard.open``: a lazy, read-only view of a checkpoint's logical tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from anyshard._read import Fill, fill_regions
from anyshard.errors import AnyshardError
from anyshard.format.checkpoint import data_path, read_manifest
from anyshard.format.datafile import ST_TO_DTYPE, DataFileHeader
from anyshard.format.stored import stored_shards
from anyshard.reshard.boxes import Box, Piece, full_box

__all__ = ["CheckpointView", "StoredShard", "TensorMetadata", "TensorSlice", "open_checkpoint"]


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


class CheckpointView:
    """Read-only view of a committed checkpoint, used like safetensors' ``safe_open``.

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> anyshard.save(d, {"emb": torch.arange(12.0).reshape(4, 3), "lr": 0.1})
    >>> with anyshard.open(d) as ckpt:
    ...     print(ckpt.keys(), ckpt.get_slice("emb")[1:3, 0], ckpt.get_value("lr"))
    ['emb'] tensor([3., 6.]) 0.1
    """

    def __init__(self, path: str, *, threads: int = 8):
        self.path = path
        self.manifest = read_manifest(path)
        self._headers: dict[int, DataFileHeader] = {}
        self._threads = threads

    def __enter__(self) -> CheckpointView:
        return self

    def __exit__(self, *exc) -> None:
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
        out = torch.empty(shape, dtype=ST_TO_DTYPE[entry.dtype])
        piece = Piece(0, shape, full_box(shape), tuple(box))
        fill_regions(
            self.path,
            self.manifest,
            [Fill(name, out, (piece,))],
            headers=self._headers,
            threads=self._threads,
        )
        return out

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.read_region(name, full_box(self._entry(name).shape))

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, name)

    def data_file(self, rank: int) -> str:
        return data_path(self.path, self.manifest, rank)


class TensorSlice:
    """``view.get_slice(name)[...]``: basic indexing (ints, step-1 slices, ...) read lazily."""

    def __init__(self, view: CheckpointView, name: str):
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


def open_checkpoint(path: str, *, threads: int = 8):
    """Open the checkpoint at ``path`` (a directory, file or URL) for lazy reading.

    The format is detected: a directory with ``manifest.json`` is an anyshard checkpoint
    (`CheckpointView`); a ``.safetensors`` file, a ``*.safetensors.index.json``, or a directory
    holding either and no ``manifest.json`` is a Hugging Face checkpoint
    (`anyshard.loaders.HFCheckpointView`); a directory with DCP's ``.metadata`` is a PyTorch DCP
    checkpoint (`anyshard.loaders.DCPCheckpointView`, read without running code); a directory
    whose ``zarr.json`` is a zarr v3 group is a zarr store (`anyshard.loaders.ZarrView`, as
    `anyshard.loaders.write_zarr` exports); a DeepSpeed ZeRO-1/2/3 checkpoint (``latest`` and
    ``global_step*/*zero_pp_rank_*_optim_states.pt``) or universal checkpoint (``zero/<name>/``)
    is a `anyshard.loaders.DeepSpeedZeroView` / `DeepSpeedUniversalView`; a Megatron-core
    ``torch_dist`` directory (``metadata.json``) a `anyshard.loaders.MegatronDistView`; a
    ``torch.save`` file (``.pt``, ``.pth``, ``.bin``) or a directory with ``pytorch_model.bin``
    (or its index) a `anyshard.loaders.TorchSaveView`, read only with
    ``torch.load(weights_only=True)``. Anything else
    raises as for an anyshard checkpoint.
    """
    from anyshard.errors import CheckpointNotFoundError
    from anyshard.loaders import hf, torchsave

    if hf.looks_like_file(path):  # no request needed to tell
        return hf.HFCheckpointView(path)
    if torchsave.looks_like_file(path):
        return torchsave.TorchSaveView(path)
    try:
        return CheckpointView(path, threads=threads)
    except CheckpointNotFoundError:
        from anyshard.loaders import dcp, deepspeed, megatron_dist, zarr_store

        # DeepSpeed's and Megatron's markers (``latest`` naming a step folder of DeepSpeed's
        # files, ``metadata.json``) first: such a directory may hold other files too. A root holding both kinds (converted in place): the
        # ZeRO files are the training state.
        if deepspeed.looks_like_deepspeed_zero(path):
            return deepspeed.DeepSpeedZeroView(path)
        if deepspeed.looks_like_deepspeed_universal(path):
            return deepspeed.DeepSpeedUniversalView(path)
        if megatron_dist.looks_like_megatron_dist(path):  # a DCP directory too: before it
            return megatron_dist.MegatronDistView(path)
        if hf.looks_like_hf(path):
            return hf.HFCheckpointView(path)
        if dcp.looks_like_dcp(path):
            return dcp.DCPCheckpointView(path)
        if zarr_store.looks_like_zarr(path):
            return zarr_store.ZarrView(path)
        if torchsave.looks_like_torch_save(path):
            return torchsave.TorchSaveView(path)
        raise
