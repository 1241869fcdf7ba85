"""Megatron-LM legacy checkpoints (``mp_rank_XX[_YYY]/model_optim_rng.pt``) as a logical view.

Each file holds one (tensor, pipeline) rank's local tensors under Megatron's local names (fused
QKV, fused gate/up, padded vocabulary, layers numbered per stage). A UCL spec (by default the
shipped ``megatron_gpt``) says how they map to the logical tensors; the view reads a logical
region from the ranks that hold it. Files are read with ``torch.load(weights_only=True)``: no
code runs (Megatron's ``args`` namespace cannot be restored that way and is not read; pass the
model sizes in ``layout``). One rank's file is kept in memory at a time.

Layout on disk (Megatron-LM's ``get_checkpoint_name``)::

    ROOT/latest_checkpointed_iteration.txt
    ROOT/iter_0000100/mp_rank_00/model_optim_rng.pt          # pp = 1: mp_rank_{tp:02d}
    ROOT/iter_0000100/mp_rank_01_002/model_optim_rng.pt      # pp > 1: mp_rank_{tp:02d}_{pp:03d}
"""

from __future__ import annotations

import io
import math
import re
import threading
from typing import Any

import torch

from anyshard.api.views import BaseView, StoredShard
from anyshard.errors import AnyshardError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Box, box_numel, box_shape
from anyshard.loaders._shared import checked_region, rank_grid
from anyshard.reshard.executor import piece_view
from anyshard.reshard.stored import index_spec
from anyshard.ucl.evaluate import coords_of_rank, layout_for
from anyshard.ucl.library import load_spec

__all__ = ["MegatronCheckpointView", "megatron_file_name"]

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def megatron_file_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """The file of a (tp, pp) rank under an ``iter_*`` directory, as Megatron-LM names it."""
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return f"{rank_dir}/model_optim_rng.pt"


class _Tensor:
    __slots__ = ("dtype", "shape", "sources", "torch_dtype")

    def __init__(self, shape, torch_dtype, sources):
        self.shape, self.torch_dtype, self.sources = shape, torch_dtype, sources
        self.dtype = DTYPE_TO_ST[torch_dtype]


class MegatronCheckpointView(BaseView):
    """A logical view of a Megatron-LM legacy checkpoint (same methods as `CheckpointView`).

    ``path`` is the checkpoint root (``latest_checkpointed_iteration.txt`` picks the iteration)
    or an ``iter_*`` directory. ``layout`` gives the spec's params (model sizes); ``tp`` and
    ``pp`` are read from the directory names. Data-parallel replicas are not stored (``dp=1``).
    """

    format = "megatron-legacy"

    def __init__(self, path: str, *, layout: dict[str, int], spec: Any = "megatron_gpt"):
        self.path = self._iteration_dir(path)
        _, tp, pp = rank_grid(self.path, _RANK_DIR, "mp_rank directories", ("tp", "pp"))
        full_layout = {
            **{k: v for k, v in layout.items() if k not in ("tp", "pp", "dp")},
            "tp": tp,
            "pp": pp,
        }
        self._setup(spec, full_layout, lambda c: megatron_file_name(c["tp"], c["pp"], pp))

    def _setup(self, spec: Any, layout: dict[str, int], file_of) -> None:
        """Compile ``spec`` under ``layout`` for every rank; ``file_of(coords)`` names the file
        of the rank at those coordinates (relative to ``self.path``)."""
        self.spec = load_spec(spec)
        lay = layout_for(self.spec, layout)
        self.layout = layout
        self._index = index_spec(
            self.spec.text or str(self.spec),
            tuple(sorted(layout.items())),
            MeshEntry.row_major(lay.sizes),
        )
        self._files = {r: file_of(coords_of_rank(lay.sizes, r)) for r in range(lay.world_size)}
        self._lock = threading.Lock()
        self._loaded: tuple[int, dict] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.iteration: int | None = None

    @staticmethod
    def _iteration_dir(path: str) -> str:
        tracker = storage.join(path, "latest_checkpointed_iteration.txt")
        if storage.exists(tracker):
            text = storage.read_bytes(tracker).decode().strip()
            if not text.isdigit():
                raise CorruptCheckpointError(f"{tracker}: {text!r} is not an iteration number")
            return storage.join(path, f"iter_{int(text):07d}")
        return path

    def _state(self, rank: int) -> dict:
        """The local tensors of ``rank`` (the last rank's stay in memory, one at a time)."""
        with self._lock:
            if self._loaded is not None and self._loaded[0] == rank:
                return self._loaded[1]
        file = storage.join(self.path, *self._files[rank].split("/"))
        try:
            data = torch.load(
                io.BytesIO(storage.read_bytes(file)), weights_only=True, map_location="cpu"
            )
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{file}: missing") from None
        except Exception as e:
            raise CorruptCheckpointError(
                f"{file}: not loadable with torch.load(weights_only=True) ({type(e).__name__}: {e})"
            ) from None
        local = self._locals(data, file)
        with self._lock:
            self._loaded = (rank, local)
        return local

    def _locals(self, data: Any, file: str) -> dict:
        """The local tensors, by the spec's local names, in one loaded file."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise CorruptCheckpointError(f"{file}: no 'model' state dict in it")
        if self.iteration is None and isinstance(data.get("iteration"), int):
            self.iteration = data["iteration"]
        return data["model"]

    def _local(self, rank: int, key: str) -> torch.Tensor:
        model = self._state(rank)
        t = model.get(key)
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(
                f"{self.path}/{self._files[rank]}: no tensor {key!r}, which the spec gives this rank"
            )
        want = self._index.written[rank][key].stored_shape
        if tuple(t.shape) != want:
            raise CorruptCheckpointError(
                f"{self.path}/{self._files[rank]}: {key!r} has shape {list(t.shape)}, the spec and "
                f"layout {self.layout} give {list(want)}"
            )
        return t

    def keys(self) -> list[str]:
        return sorted(self._index.sources)

    def value_keys(self) -> list[str]:
        return []

    def get_value(self, name: str) -> Any:
        raise KeyError(f"{self.path}: no JSON value named {name!r}")

    @property
    def values(self) -> dict[str, Any]:
        return {}

    def _entry(self, name: str) -> _Tensor:
        if name not in self._index.sources:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        if name not in self._dtypes:
            first = self._index.sources[name][0]
            self._dtypes[name] = self._local(first.rank, first.key).dtype
        return _Tensor(
            self._index.logical_shapes[name], self._dtypes[name], self._index.sources[name]
        )

    def metadata(self, name: str):
        from anyshard.loaders.dcp import DCPTensorMetadata

        t = self._entry(name)
        shards = tuple(
            StoredShard(
                s.rank, self._files[s.rank], s.coords, tuple(p.logical_box for p in s.shard.pieces)
            )
            for s in t.sources
        )
        return DCPTensorMetadata(name, t.shape, t.torch_dtype, shards)

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._entry(name)
        box = checked_region(name, box, t.shape)
        dest = torch.empty(box_shape(box), dtype=t.torch_dtype) if out is None else out
        got = 0
        for s in sorted(t.sources, key=lambda s: s.rank):  # one file in memory at a time
            for p in s.shard.pieces:
                sub = p.restrict(box)
                if sub is None:
                    continue
                src = piece_view(self._local(s.rank, s.key), sub)
                dest[
                    tuple(
                        slice(lo - b, hi - b)
                        for (lo, hi), (b, _) in zip(sub.logical_box, box, strict=True)
                    )
                ] = src
                got += box_numel(sub.logical_box)
        if got != math.prod(box_shape(box)):
            raise AnyshardError(
                f"{name}: the ranks' tensors hold {got} of {math.prod(box_shape(box))} elements of {list(box)}"
            )
        return dest

    def close(self) -> None:
        self._loaded = None
