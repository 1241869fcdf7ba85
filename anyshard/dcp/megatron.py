"""Megatron-Core ``dist_checkpointing`` strategies that save and load anyshard checkpoints.

Megatron-Core 0.16 picks its checkpoint format by strategies: a sharded strategy (the tensors,
and Megatron's ShardedObjects where it can) and a common strategy (the rest: iteration, scheduler,
optimizer param groups, ``args``), kept in a registry by ``(backend, version)`` and named in the
checkpoint's ``metadata.json``, so that ``dist_checkpointing.load`` finds the strategy that reads
it. This module registers anyshard's under ``("anyshard", 1)`` when it is imported (importing it
needs megatron-core; ``import anyshard`` does not):

- `AnyshardSaveStrategy` / `AnyshardLoadStrategy` (sharded): Megatron's ShardedTensors go through
  DCP with Megatron's own save and load planners and anyshard's DCP backend
  (`anyshard.dcp.AnyshardWriter` / `AnyshardReader`): every rank writes the main replica of its
  shards into its own data file, with checksums; a load reads only the regions each rank holds,
  under any tensor / pipeline / data-parallel layout. ShardedObjects are stored in the same
  manifest as JSON (tensors inside them as tensors), not as Megatron's ``torch.save`` bytes.
- `AnyshardCommonSaveStrategy` / `AnyshardCommonLoadStrategy` (common): the common state in the
  same manifest, as JSON and tensors, instead of Megatron's pickled ``common.pt``.

Megatron-Core 0.16's ``dist_checkpointing.save`` takes a sharded strategy but refuses any common
strategy (``NotImplementedError: The only supported common strategy is torch``); it always saves
the common state with the registry's ``("torch", 1)`` entry and writes ``common_backend: "torch"``
into ``metadata.json``. So there are two ways to save:

- ``dist_checkpointing.save(sd, path, sharded_strategy=AnyshardSaveStrategy())``: tensors and
  ShardedObjects in anyshard's format, the common state in Megatron's ``common.pt`` (a pickle, as
  Megatron writes it).
- ``anyshard.dcp.megatron.save(sd, path)``: the same call, with the common state in the manifest
  too (no pickle anywhere): for the duration of the call, the registry's ``("torch", 1)`` common
  save entry is anyshard's, and ``metadata.json`` then names ``common_backend: "anyshard"``.

Either loads with Megatron's own ``dist_checkpointing.load(sd, path)`` in a process that imported
this module (``metadata.json`` names the strategies).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing import serialization as _serialization
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.strategies import base as _base
from megatron.core.dist_checkpointing.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from anyshard.api.state import is_json_value
from anyshard.api.views import CheckpointView
from anyshard.dcp.reader import AnyshardReader
from anyshard.dcp.writer import AnyshardWriter
from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.format.manifest import MANIFEST_NAME

__all__ = [
    "BACKEND",
    "COMMON",
    "VERSION",
    "AnyshardCommonLoadStrategy",
    "AnyshardCommonSaveStrategy",
    "AnyshardLoadStrategy",
    "AnyshardSaveStrategy",
    "save",
]

BACKEND, VERSION = "anyshard", 1
COMMON = "megatron.common"  # the manifest's value holding the common state
# a tensor inside a value is stored as "<value name>#<n>": no Megatron key has '#'
_TENSOR_SEP = "#"


class AnyshardSaveStrategy(SaveShardedStrategy):
    """Megatron-Core sharded save strategy writing an anyshard checkpoint (``("anyshard", 1)``).

    ``dist_checkpointing.save(sharded_state_dict, path, sharded_strategy=AnyshardSaveStrategy())``:
    the main replica of every ShardedTensor is written by the rank that holds it, through DCP with
    Megatron's save planner and `AnyshardWriter` (``threads`` writing threads a rank); each
    ShardedObject is stored by its owner as a JSON value named by its unique key (a tensor inside
    it as a tensor). What cannot be stored (an object JSON cannot hold) is an error naming its key.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, threads: int = 4):
        super().__init__(backend, version)
        self.threads = threads

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        path = os.fspath(checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        tensors = {k: v for k, v in flat.items() if isinstance(v[0], ShardedTensor)}
        pyt: dict[str, Any] = mcore_to_pyt_state_dict(tensors, is_loading=False)
        common = _COMMON_STASH.pop(path, None)
        error: AnyshardError | None = None
        try:  # every rank checks what it would store before any rank writes
            for key, objs in flat.items():
                if isinstance(objs[0], ShardedObject):
                    _put_encoded(pyt, key, objs[0].data, f"ShardedObject {key!r}")
            if common is not None:  # the same on every rank; stored by rank 0
                encoded: dict[str, Any] = {}
                _put_encoded(encoded, COMMON, common, "the common state")
                if _rank() == 0:
                    pyt.update(encoded)
        except AnyshardError as e:
            error = e
        _agree(error, path)
        planner = MCoreSavePlanner(flatten_state_dict=False)
        dcp.save(pyt, storage_writer=AnyshardWriter(path, threads=self.threads), planner=planner)


class AnyshardLoadStrategy(LoadShardedStrategy):
    """Megatron-Core sharded load strategy reading an anyshard checkpoint (``("anyshard", 1)``).

    Each rank reads only the regions of the ShardedTensors it holds (any tensor, pipeline or data
    parallel layout: Megatron's load planner asks, `AnyshardReader` reads, verified), and the
    ShardedObjects it asks for. ``dist_checkpointing.load`` picks it from ``metadata.json``.
    """

    def __init__(self, *, threads: int = 8, verify: bool = True) -> None:
        super().__init__()
        self.threads = threads
        self.verify = verify

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> dict:
        path = os.fspath(checkpoint_dir)
        shards = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        validate = [s for s in shards if not s.allow_shape_mismatch]
        mismatch = {s.key: s for s in shards if s.allow_shape_mismatch}
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        tensors = {k: v for k, v in flat.items() if isinstance(v[0], ShardedTensor)}
        pyt: dict[str, Any] = mcore_to_pyt_state_dict(tensors, is_loading=True)
        if pyt:
            planner = MCoreLoadPlanner(
                shapes_validation_sharded_tensors=validate,
                allow_shape_mismatch_sharded_tensors=mismatch,
            )
            reader = AnyshardReader(path, threads=self.threads, verify=self.verify)
            dcp.load(pyt, storage_reader=reader, planner=planner)
        loaded: dict[str, Any] = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
        objects = {k: v for k, v in flat.items() if isinstance(v[0], ShardedObject)}
        if objects:
            view = CheckpointView(path, threads=self.threads, verify=self.verify)
            for key, objs in objects.items():
                if key not in view.manifest.values:
                    raise CheckpointingException(
                        f"{path}: the checkpoint holds no ShardedObject {key!r} (it holds "
                        f"{sorted(_object_keys(view))[:8]})"
                    )
                loaded[key] = [_decoded(view, key) for _ in objs]
        state = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(state, sharded_state_dict)
        return state

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> dict:
        """Each stored ShardedTensor's global shape and dtype, as Megatron's own strategy gives."""
        md = (
            AnyshardReader(os.fspath(checkpoint_dir)).read_metadata()
            if metadata is None
            else metadata
        )
        out = {}
        for key, meta in md.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata) and _TENSOR_SEP not in key:
                empty = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict:
        """The ShardedTensors' metadata and the ShardedObjects stored (without their data)."""
        out = self.load_tensors_metadata(checkpoint_dir)
        view = CheckpointView(os.fspath(checkpoint_dir))
        for key in _object_keys(view):
            obj = ShardedObject.empty_from_unique_key(key)
            out[obj.unique_key] = obj
        return out

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"AnyshardLoadStrategy reads checkpoints of backend {BACKEND!r}, not "
                f"{loaded_backend!r}: load it with Megatron's strategy for that backend"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"AnyshardLoadStrategy reads version {VERSION} of its format, not "
                f"{loaded_version}: use the anyshard release that wrote it"
            )


class AnyshardCommonSaveStrategy(SaveCommonStrategy):
    """Megatron-Core common save strategy: the common state goes into the anyshard manifest that
    `AnyshardSaveStrategy` commits for the same save (as JSON, its tensors as tensors), not into
    ``common.pt``. It hands the state on in memory; `save` installs it for one call, since
    Megatron-Core 0.16's ``dist_checkpointing.save`` takes no common strategy."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION) -> None:
        super().__init__(backend, version)

    def save_common(self, common_state_dict: dict, checkpoint_dir: str | Path) -> None:
        _COMMON_STASH[os.fspath(checkpoint_dir)] = common_state_dict

    def save_sharded_objects(self, sharded_objects_state_dict: dict, checkpoint_dir: Any) -> None:
        raise CheckpointingException(
            "AnyshardCommonSaveStrategy stores no ShardedObjects: save them with "
            "AnyshardSaveStrategy, which does"
        )


class AnyshardCommonLoadStrategy(LoadCommonStrategy):
    """Megatron-Core common load strategy (``("anyshard", 1)``): the common state from the
    manifest, with no unpickling. A checkpoint saved with Megatron's ``common.pt`` (a plain
    ``dist_checkpointing.save`` with `AnyshardSaveStrategy`) is read by Megatron's own common
    strategy instead, as ``metadata.json`` names it."""

    def load_common(self, checkpoint_dir: str | Path) -> dict:
        path = os.fspath(checkpoint_dir)
        view = CheckpointView(path)
        if COMMON not in view.manifest.values:
            if storage.exists(storage.join(path, "common.pt")):
                return TorchCommonLoadStrategy().load_common(Path(path))
            raise CheckpointingException(f"{path}: the manifest holds no common state ({COMMON!r})")
        state = _decoded(view, COMMON)
        assert isinstance(state, dict)
        return state

    def load_sharded_objects(self, sharded_objects_state_dict: dict, checkpoint_dir: Any) -> None:
        raise CheckpointingException(
            "AnyshardCommonLoadStrategy loads no ShardedObjects: AnyshardLoadStrategy does"
        )

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass


def save(
    sharded_state_dict: dict,
    checkpoint_dir: str | os.PathLike,
    *,
    threads: int = 4,
    validate_access_integrity: bool = True,
    content_metadata: dict | None = None,
) -> None:
    """``dist_checkpointing.save`` of Megatron-Core with nothing pickled: the ShardedTensors,
    ShardedObjects and common state all in one anyshard checkpoint at ``checkpoint_dir``.

    Megatron-Core 0.16's save takes no common strategy, so for this call its registry's
    ``("torch", 1)`` common save entry is `AnyshardCommonSaveStrategy` (restored after, also on
    error; a concurrent save in another thread of this process would see it too), and rank 0
    rewrites ``metadata.json`` to name ``common_backend: "anyshard"`` once Megatron has written
    it. ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`` reads it back.
    """
    path = os.fspath(checkpoint_dir)
    with _common_save_strategy(AnyshardCommonSaveStrategy()):
        try:
            _serialization.save(
                sharded_state_dict,
                path,
                sharded_strategy=AnyshardSaveStrategy(threads=threads),
                validate_access_integrity=validate_access_integrity,
                content_metadata=content_metadata,
            )
        finally:
            _COMMON_STASH.pop(path, None)
    if _rank() == 0:
        config_path = storage.join(path, CONFIG_FNAME)
        config = json.loads(storage.read_bytes(config_path))
        config.update(common_backend=BACKEND, common_backend_version=VERSION)
        tmp = config_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(config, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, config_path)
    if dist.is_initialized():
        dist.barrier()


# ---- the registry --------------------------------------------------------------------------

_COMMON_STASH: dict[str, dict] = {}  # checkpoint dir -> the common state its save handed on
_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _common_save_strategy(strategy: SaveCommonStrategy) -> Iterator[None]:
    key = ("torch", 1)
    with _SWAP_LOCK:
        table = _base.default_strategies[StrategyAction.SAVE_COMMON.value]
        before = table.get(key)
        table[key] = strategy
        try:
            yield
        finally:
            if before is None:
                table.pop(key, None)
            else:
                table[key] = before


def _register() -> None:
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, AnyshardSaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, AnyshardLoadStrategy())
    register_default_strategy(
        StrategyAction.SAVE_COMMON, BACKEND, VERSION, AnyshardCommonSaveStrategy()
    )
    register_default_strategy(
        StrategyAction.LOAD_COMMON, BACKEND, VERSION, AnyshardCommonLoadStrategy()
    )


_register()


# ---- values: JSON, and the tensors inside them -----------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agree(error: AnyshardError | None, path: str) -> None:
    """Raise on every rank if any rank found a value it cannot store (its own error where it has
    one), so that no rank goes on into the save's collectives alone."""
    failed = error is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(failed)])
        dist.all_reduce(flag)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise AnyshardError(
            f"{path}: not saved: another rank holds a value anyshard cannot store (its error "
            "names it)"
        )


def _put_encoded(pyt: dict[str, Any], name: str, value: Any, what: str) -> None:
    """Store ``value`` as the JSON value ``name`` (a string of the tagged encoding) and its
    tensors as the tensors ``name#0``, ``name#1``..."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(value, name, tensors, what, ())
    try:
        pyt[name] = json.dumps(encoded, allow_nan=False, separators=(",", ":"))
    except ValueError as e:
        raise AnyshardError(f"{what}: {e}; anyshard stores finite numbers only") from None
    pyt.update(tensors)


def _encode(value: Any, name: str, tensors: dict, what: str, at: tuple) -> Any:
    """One node of a value as JSON that keeps what JSON alone would lose (int keys, tuples,
    tensors, dtypes, argparse namespaces): ``{"<kind>": ...}``."""
    if isinstance(value, torch.Tensor):
        key = f"{name}{_TENSOR_SEP}{len(tensors)}"
        tensors[key] = value.detach()
        return {"tensor": key}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise AnyshardError(
                    f"{what}: the key {k!r} at {_where(at)} is a {type(k).__name__}; anyshard "
                    "stores dicts keyed by strings or ints. Use one of those"
                )
            items.append([k, _encode(v, name, tensors, what, (*at, k))])
        return {"dict": items}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, name, tensors, what, (*at, i)) for i, v in enumerate(value)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, argparse.Namespace):
        return {"namespace": _encode(vars(value), name, tensors, what, at)}
    if value is None or (isinstance(value, (bool, int, float, str)) and is_json_value(value)):
        return {"value": value}
    raise AnyshardError(
        f"{what}: the value at {_where(at)} is a {type(value).__qualname__}, which anyshard does "
        "not store (it never pickles): tensors, numbers, strings, None, dtypes, argparse "
        "namespaces and dicts, lists and tuples of them are stored. Convert it to one of those, "
        "or save with dist_checkpointing.save(..., sharded_strategy=AnyshardSaveStrategy()), "
        "which leaves the common state to Megatron's common.pt"
    )


def _where(at: tuple) -> str:
    return "".join(f"[{k!r}]" for k in at) or "the top"


def _decoded(view: CheckpointView, name: str) -> Any:
    try:
        encoded = json.loads(view.get_value(name))
        return _decode(encoded, view)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise AnyshardError(
            f"{view.path}: the value {name!r} is not one anyshard's Megatron strategies stored "
            f"({type(e).__name__}: {e})"
        ) from None


def _decode(node: Any, view: CheckpointView) -> Any:
    ((kind, body),) = node.items()
    if kind == "value":
        return body
    if kind == "tensor":
        return view.get_tensor(body)
    if kind == "dict":
        return {k: _decode(v, view) for k, v in body}
    if kind == "list":
        return [_decode(v, view) for v in body]
    if kind == "tuple":
        return tuple(_decode(v, view) for v in body)
    if kind == "dtype":
        dtype = getattr(torch, body)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{body!r} is no torch dtype")
        return dtype
    if kind == "namespace":
        return argparse.Namespace(**_decode(body, view))
    raise ValueError(f"unknown kind {kind!r}")


def _object_keys(view: CheckpointView) -> list[str]:
    return [k for k in view.manifest.values if k != COMMON and "/shard_" in k]


def is_anyshard_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` holds an anyshard manifest (a save through these strategies)."""
    return storage.exists(storage.join(os.fspath(checkpoint_dir), MANIFEST_NAME))
