"""Megatron-core ``dist_checkpointing`` checkpoints (the ``torch_dist`` backend) as a lazy view.

Megatron-core writes a directory (under ``iter_NNNNNNN/`` of a Megatron-LM run, whose
``latest_checkpointed_iteration.txt`` names the iteration)::

    metadata.json       {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                         "common_backend": "torch", "common_backend_version": 1}
    common.pt           torch.save of the state that is not sharded (iteration, scheduler, args)
    .metadata           a PyTorch DCP checkpoint of the ShardedTensors, by their sharded key
    __R_T.distcp        (rank R, writer thread T)

The tensors are DCP tensors named by Megatron's sharded keys (``decoder.layers.mlp.
linear_fc1.weight``, a model's layers stacked on a leading dim; optimizer state under
``optimizer.state.exp_avg.<key>`` and the like); only the main replica of each shard is stored.
ShardedObjects (``rng_state/shard_0.1_1.8``) are DCP byte entries holding a ``torch.save`` list.

Distributed-optimizer shards written by megatron-core < 0.14 hold a ``flattened_range`` of a
chunk: DCP stores such a tensor of global shape ``[X, Y, Z]``, chunked ``[x, y, z]``, as
``[X/x, Y/y, Z/z, x*y*z]`` (one row per chunk of the grid, each chunk flattened, its ranges along
the last dim) and records the original shape in the metadata's ``mcore_data`` under
``nd_reformulated_orig_global_shape``. This view presents the original tensor and maps a region
back to the flat ranges that hold it. (megatron-core >= 0.14 refuses ``flattened_range``.)

Nothing runs code: ``.metadata`` is read by `DCPCheckpointView`'s allowlisting unpickler, the
chunks, the objects and ``common.pt`` with ``torch.load(weights_only=True)``. A ``common.pt``
that holds other objects (Megatron-LM stores its ``args`` namespace there) is not read: the view
warns, lists it in ``skipped`` and serves the tensors. Entries of ``common.pt`` and objects that
are JSON values become values; tensors in ``common.pt`` are tensors.

Run: ``python -m pytest tests/unit/test_loaders_megatron_dist.py -q``
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from anyshard.api.state import is_json_value, json_roundtrip
from anyshard.api.views import StoredShard
from anyshard.errors import AnyshardError, CheckpointNotFoundError, CorruptCheckpointError
from anyshard.format import storage, strict_json
from anyshard.geometry.boxes import Box, box_numel, box_shape, full_box, intersect
from anyshard.loaders._shared import checked_region, not_there
from anyshard.loaders.dcp import METADATA, DCPCheckpointView, DCPTensorMetadata, _Chunk, _Tensor
from anyshard.loaders.megatron import MegatronCheckpointView
from anyshard.loaders.torchsave import LoadedFile, load_weights_only

__all__ = ["FORMAT", "MegatronDistView", "looks_like_megatron_dist"]

FORMAT = "megatron-torch-dist"
CONFIG = "metadata.json"
COMMON = "common.pt"


def looks_like_megatron_dist(path: str) -> bool:
    """Whether ``path`` (a checkpoint directory, or a run's root with
    ``latest_checkpointed_iteration.txt``) has Megatron-core's ``metadata.json``."""
    try:
        doc = strict_json.loads(storage.read_bytes(storage.join(_checkpoint_dir(path), CONFIG)))
    except OSError as e:
        return not_there(path, "a Megatron-core torch_dist checkpoint", e)
    except (ValueError, CorruptCheckpointError):  # no JSON, or a tracker naming no iteration
        return False
    return isinstance(doc, dict) and "sharded_backend" in doc


def _checkpoint_dir(path: str) -> str:
    return MegatronCheckpointView._iteration_dir(path)


def _read_config(ckpt: str) -> dict[str, Any]:
    where = storage.join(ckpt, CONFIG)
    try:
        doc = strict_json.loads(storage.read_bytes(where))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{ckpt}: no Megatron-core distributed checkpoint ({CONFIG} missing)"
        ) from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object, found {doc!r}")
    backend = doc.get("sharded_backend")
    if backend != "torch_dist":
        raise AnyshardError(
            f"{where}: sharded_backend is {backend!r}; this reader reads Megatron-core's "
            "'torch_dist' checkpoints only. Re-save it with Megatron-core "
            "(dist_checkpointing.load, then save with sharded_strategy=('torch_dist', 1))"
        )
    problems = []
    if doc.get("sharded_backend_version", 1) != 1:
        problems.append(f"sharded_backend_version {doc['sharded_backend_version']!r} (known: 1)")
    if doc.get("common_backend", "torch") != "torch":
        problems.append(f"common_backend {doc['common_backend']!r} (known: 'torch')")
    if problems:
        raise AnyshardError(f"{where}: unknown {'; '.join(problems)}")
    return doc


def flat_range_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[Box, int]]:
    """The flat (C-order) range ``[lo, hi)`` of a tensor of ``shape`` as boxes, each a
    contiguous run of it: ``(box, flat start)``, in order; at most ``2 * len(shape) - 1``.

    >>> flat_range_boxes(3, 10, (3, 4))  # row 0 from col 3, row 1 whole, row 2 to col 2
    [(((0, 1), (3, 4)), 3), (((1, 2), (0, 4)), 4), (((2, 3), (0, 2)), 8)]
    """
    if lo >= hi:
        return []
    if not shape:
        return [((), 0)]
    inner = math.prod(shape[1:])
    rest = full_box(shape[1:])
    if inner == 0:
        return []
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        base = first * inner
        return [
            (((first, first + 1), *sub), base + start)
            for sub, start in flat_range_boxes(lo - base, hi - base, shape[1:])
        ]
    out: list[tuple[Box, int]] = []
    if lo % inner:  # a partial first row
        out += [
            (((first, first + 1), *sub), first * inner + start)
            for sub, start in flat_range_boxes(lo - first * inner, inner, shape[1:])
        ]
        first += 1
    end = last + 1 if hi % inner == 0 else last  # rows [first, end) are whole
    if end > first:
        out.append((((first, end), *rest), first * inner))
    if hi % inner:  # a partial last row
        out += [
            (((last, last + 1), *sub), last * inner + start)
            for sub, start in flat_range_boxes(0, hi - last * inner, shape[1:])
        ]
    return out


@dataclass(frozen=True, slots=True)
class _Flat:
    """A tensor stored reformulated: ``stored`` is ``[*grid, prod(local)]``."""

    shape: tuple[int, ...]  # the tensor's own
    local: tuple[int, ...]  # one chunk of the grid
    stored: _Tensor

    def pieces(self, c: _Chunk) -> list[tuple[Box, int]]:
        """The logical boxes the stored chunk ``c`` holds, with their offsets into it."""
        origin = [lo * n for (lo, _), n in zip(c.box[:-1], self.local, strict=True)]
        a, b = c.box[-1]
        return [
            (
                tuple((o + lo, o + hi) for o, (lo, hi) in zip(origin, box, strict=True)),
                start - a,
            )
            for box, start in flat_range_boxes(a, b, self.local)
        ]


class MegatronDistView(DCPCheckpointView):
    """A view of a Megatron-core ``torch_dist`` checkpoint (same methods as `CheckpointView`).

    ``path`` is the checkpoint directory, or a Megatron-LM run's root (its
    ``latest_checkpointed_iteration.txt`` names the ``iter_*`` directory). ``config`` is
    ``metadata.json``; ``iteration`` is ``common.pt``'s, when it has one.
    """

    format = FORMAT

    def __init__(self, path: str):
        ckpt = _checkpoint_dir(path)
        self.config = _read_config(ckpt)
        if not storage.exists(storage.join(ckpt, METADATA)):
            raise CorruptCheckpointError(
                f"{ckpt}: {CONFIG} names the torch_dist backend but the DCP {METADATA} is missing"
            )
        self._flat: dict[str, _Flat] = {}
        super().__init__(ckpt)
        self.skipped: dict[str, str] = {}
        self._common = self._read_common()
        self._objects: dict[str, Any] | None = None
        clash = sorted(set(self._common.tensors) & set(self._tensors)) + sorted(
            set(self._common.values) & (set(self._tensors) | set(self._values))
        )
        if clash:
            raise CorruptCheckpointError(
                f"{ckpt}: {COMMON} and the sharded state both name {', '.join(clash[:5])}"
            )
        it = self._common.values.get("iteration")
        self.iteration: int | None = it if isinstance(it, int) else None

    def _index(self, md, where: str) -> None:
        super()._index(md, where)
        mcore = getattr(md, "mcore_data", None) or {}
        if not isinstance(mcore, dict):
            raise CorruptCheckpointError(f"{where}: mcore_data is not a dict")
        for key, info in mcore.items():
            shape = (
                info.get("nd_reformulated_orig_global_shape") if isinstance(info, dict) else None
            )
            if shape is not None and key in self._tensors:
                self._flat[key] = self._reformulated(key, tuple(shape), where)

    def _reformulated(self, key: str, shape: tuple, where: str) -> _Flat:
        stored = self._tensors[key]
        grid, n = stored.shape[:-1], stored.shape[-1] if stored.shape else -1
        ok = (
            all(isinstance(s, int) and s >= 0 for s in shape)
            and len(grid) == len(shape)
            and all(g > 0 and s % g == 0 for s, g in zip(shape, grid, strict=True))
        )
        local = tuple(s // g for s, g in zip(shape, grid, strict=True)) if ok else ()
        if not ok or math.prod(local) != n:
            raise CorruptCheckpointError(
                f"{where}: {key!r} is stored flattened as {list(stored.shape)}, which is no grid "
                f"of flattened chunks of its recorded shape {list(shape)}"
            )
        return _Flat(shape, local, stored)

    def _read_common(self) -> LoadedFile:
        where = storage.join(self.path, COMMON)
        try:
            obj, mapped = load_weights_only(where, what=f"Megatron-core {COMMON}")
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{where}: missing (Megatron-core writes it before {CONFIG})"
            ) from None
        except CorruptCheckpointError as e:
            warnings.warn(f"{e}; its values are not read, the tensors are", stacklevel=3)
            self.skipped[COMMON] = str(e)
            return LoadedFile({}, {}, {}, False)
        common = LoadedFile.flatten(obj, "common", where, mapped)
        self.skipped.update(common.skipped)
        return common

    # --- values: common.pt's, and the ShardedObjects that are JSON values ---------------------

    def _object_values(self) -> dict[str, Any]:
        if self._objects is None:
            objects = {}
            for name in self._values:
                try:
                    value = DCPCheckpointView.get_value(self, name)
                except Exception as e:
                    self.skipped[name] = f"not loadable with weights_only=True ({type(e).__name__})"
                    continue
                if isinstance(value, list) and len(value) == 1:
                    value = value[0]  # Megatron saves each object as a one-item list
                if is_json_value(value):
                    objects[name] = json_roundtrip(value)
                else:
                    self.skipped[name] = f"a {type(value).__qualname__}, not a JSON value"
            self._objects = objects
        return self._objects

    def value_keys(self) -> list[str]:
        """Names of the JSON values: ``common.pt``'s, then the ShardedObjects' (read here)."""
        return list(self._common.values) + list(self._object_values())

    def get_value(self, name: str) -> Any:
        if name in self._common.values:
            return self._common.values[name]
        objects = self._object_values()
        if name in objects:
            return objects[name]
        why = f" ({self.skipped[name]})" if name in self.skipped else ""
        raise KeyError(f"{self.path}: no JSON value named {name!r}{why}")

    @property
    def values(self) -> dict[str, Any]:
        return {**self._common.values, **self._object_values()}

    # --- tensors ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._tensors) + list(self._common.tensors)

    def _entry(self, name: str) -> _Tensor:
        if name in self._flat:
            f = self._flat[name]
            return _Tensor(f.shape, f.stored.torch_dtype, ())
        if name in self._common.tensors:
            t = self._common.tensors[name]
            return _Tensor(tuple(t.shape), t.dtype, ())
        return super()._entry(name)

    def metadata(self, name: str) -> DCPTensorMetadata:
        if name in self._flat:
            f = self._flat[name]
            shards = tuple(
                StoredShard(-1, c.file, {}, tuple(box for box, _ in f.pieces(c)))
                for c in f.stored.chunks
            )
            return DCPTensorMetadata(name, f.shape, f.stored.torch_dtype, shards)
        if name in self._common.tensors:
            t = self._common.tensors[name]
            shard = StoredShard(-1, COMMON, {}, (full_box(tuple(t.shape)),))
            return DCPTensorMetadata(name, tuple(t.shape), t.dtype, (shard,))
        return super().metadata(name)

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` of tensor ``name``, reading the chunks it overlaps."""
        if name in self._flat:
            return self._read_flat(name, self._flat[name], box, out)
        if name in self._common.tensors:
            t = self._common.tensors[name]
            box = checked_region(name, box, tuple(t.shape))
            dest = torch.empty(box_shape(box), dtype=t.dtype) if out is None else out
            return dest.copy_(t[tuple(slice(lo, hi) for lo, hi in box)])
        return super().read_region(name, box, out=out)

    def _read_flat(self, name: str, f: _Flat, box, out: torch.Tensor | None) -> torch.Tensor:
        box = checked_region(name, box, f.shape)
        dest = torch.empty(box_shape(box), dtype=f.stored.torch_dtype) if out is None else out
        if dest.numel() == 0:
            return dest
        covered = 0
        for c in f.stored.chunks:
            for piece, start in f.pieces(c):
                x = intersect(piece, box)
                if x is None:
                    continue
                data = self._chunk(name, c, f.stored).reshape(-1)
                run = data[start : start + box_numel(piece)].view(box_shape(piece))
                src = run[
                    tuple(slice(lo - p, hi - p) for (lo, hi), (p, _) in zip(x, piece, strict=True))
                ]
                dest[
                    tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(x, box, strict=True))
                ] = src
                covered += box_numel(x)
        if covered < math.prod(box_shape(box)):
            raise CorruptCheckpointError(
                f"{self.path}: the flattened chunks of {name!r} cover {covered} of the "
                f"{math.prod(box_shape(box))} elements of region {list(box)}"
            )
        return dest
