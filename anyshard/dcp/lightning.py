"""PyTorch Lightning checkpoints as anyshard checkpoints.

`AnyshardModelParallelStrategy` is Lightning's `ModelParallelStrategy` (FSDP2 x tensor
parallelism on one DeviceMesh) whose distributed checkpoints go through anyshard's DCP backends:

- a checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) is an anyshard checkpoint:
  every rank's shards of the model and optimizer states as they are, in its safetensors file
  with checksums, and the rest of Lightning's checkpoint (loops, callbacks, schedulers, epoch and
  step) as one JSON value in the same manifest, committed last. Lightning's own layout pickles
  that rest into ``meta.pt``; here nothing is pickled and nothing is unpickled at load;
- ``trainer.fit(..., ckpt_path=...)`` resumes from it under any ``data_parallel_size`` x
  ``tensor_parallel_size`` and world size, each rank reading only the bytes it holds, verified.
  A checkpoint Lightning wrote itself still loads through Lightning's own path.

Use it where ``ModelParallelStrategy`` would go::

    from lightning.pytorch import Trainer
    from anyshard.dcp.lightning import AnyshardModelParallelStrategy

    trainer = Trainer(strategy=AnyshardModelParallelStrategy(data_parallel_size=2,
                                                             tensor_parallel_size=2), ...)

docs/dcp.md has a complete example; this module needs ``lightning`` (2.4 or newer) installed.
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from anyshard.api.open import open_checkpoint
from anyshard.dcp import AnyshardReader, AnyshardWriter
from anyshard.errors import CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.manifest import MANIFEST_NAME

__all__ = ["AnyshardModelParallelStrategy", "decode_meta", "encode_meta"]

META_KEY = "lightning"  # the JSON value holding Lightning's checkpoint less the tensors' states
_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__")


class AnyshardModelParallelStrategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` with anyshard checkpoints: takes the same arguments,
    saves through `AnyshardWriter`, resumes through `AnyshardReader` under any layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is False:
            raise ValueError(
                "AnyshardModelParallelStrategy saves distributed checkpoints only; use "
                "ModelParallelStrategy(save_distributed_checkpoint=False) for one gathered file"
            )
        super().__init__(*args, **kwargs)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` (Lightning's dict) as an anyshard checkpoint at ``filepath``.
        Collective. Saving over an existing anyshard checkpoint (``last.ckpt``) writes the new
        one beside it and swaps the two once it has committed."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        state[META_KEY] = json.dumps(encode_meta(checkpoint), allow_nan=False)
        replacing = os.path.isfile(os.path.join(path, MANIFEST_NAME))
        target = path + ".incoming" if replacing else path
        if self.global_rank == 0:
            if os.path.isfile(path):  # a single-file checkpoint of this name
                os.remove(path)
            if replacing and os.path.exists(target):  # debris of an interrupted replacement
                shutil.rmtree(target)
        self.barrier("anyshard_save_checkpoint")
        dcp.save(state, storage_writer=AnyshardWriter(target))
        if replacing:
            if self.global_rank == 0:
                old = path + ".replaced"
                os.replace(path, old)
                os.replace(target, path)
                shutil.rmtree(old)
            self.barrier("anyshard_replace_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Load the model and optimizer states of an anyshard checkpoint into the current
        layout and return the rest of Lightning's checkpoint (loops, callbacks, step). A
        checkpoint Lightning wrote goes through Lightning's own loader."""
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        if not storage.exists(storage.join(path, MANIFEST_NAME)):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.model
        assert module is not None and self.lightning_module is not None
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
        dcp.load(state, storage_reader=AnyshardReader(path))
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(
                module,
                optimizer,
                optim_state_dict=state[f"optimizer_{i}"],
                options=StateDictOptions(cpu_offload=True),
            )
        with open_checkpoint(path) as view:
            text = view.get_value(META_KEY)
        if not isinstance(text, str):
            raise CorruptCheckpointError(
                f"{path}: the value {META_KEY!r} is not the JSON text of Lightning's checkpoint"
            )
        meta = decode_meta(json.loads(text))
        if dist.is_initialized():
            dist.barrier()
        return meta


def encode_meta(value: Any, where: str = "checkpoint") -> Any:
    """Lightning's checkpoint dict (less the model and optimizer states) as JSON-ready data,
    exactly: tensors as their dtype, shape and bytes; tuples, non-string keys and non-finite
    floats tagged. Anything else JSON cannot hold is a `TypeError` naming its key."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        return {"__tensor__": {"dtype": dtype, "shape": list(t.shape), "data": _b64(raw)}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_meta(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and set(value) & set(_TAGS)
        ):
            return {k: encode_meta(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__items__": [
                [encode_meta(k, f"{where} key"), encode_meta(v, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where} is a {type(value).__name__}, which an anyshard checkpoint does not store "
        "(no pickle): keep Lightning's checkpoint to tensors, numbers, strings, lists and dicts "
        "(on_save_checkpoint can convert it)"
    )


def decode_meta(value: Any) -> Any:
    """The inverse of `encode_meta`."""
    if isinstance(value, list):
        return [decode_meta(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__float__":
            return float(body)
        if tag == "__tuple__":
            return tuple(decode_meta(v) for v in body)
        if tag == "__items__":
            return {_hashable(decode_meta(k)): decode_meta(v) for k, v in body}
        if tag == "__tensor__":
            dtype = getattr(torch, body["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"Lightning metadata: unknown dtype {body['dtype']!r}")
            raw = bytearray(base64.b64decode(body["data"]))
            shape = [int(s) for s in body["shape"]]
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise CorruptCheckpointError(
                    f"Lightning metadata: a tensor of shape {shape} and {dtype} has {len(raw)} bytes"
                )
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    return {k: decode_meta(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
