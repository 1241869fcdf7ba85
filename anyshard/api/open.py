"""``anyshard.open``: detect a checkpoint's format and open the view that reads it.

The formats other than anyshard's own are registered by the layer above (`anyshard.loaders`)
with `register_format`: this module knows how to choose among them, not what they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anyshard.api.views import CheckpointView
from anyshard.errors import CheckpointNotFoundError

__all__ = ["Format", "open_checkpoint", "register_format"]


@dataclass(frozen=True, slots=True)
class Format:
    """A checkpoint format `open_checkpoint` can detect: ``detect(path)`` says whether ``path``
    holds it, ``view(path)`` opens it. ``by_name`` formats are told by the path alone (a file's
    suffix, no request needed) and are tried before anyshard's own manifest; the others after
    it, in the order of registration."""

    name: str
    detect: Callable[[str], bool]
    view: Callable[[str], Any]
    by_name: bool = False


_FORMATS: list[Format] = []


def register_format(fmt: Format) -> None:
    """Add ``fmt`` to the formats `open_checkpoint` tries (once per name)."""
    if all(f.name != fmt.name for f in _FORMATS):
        _FORMATS.append(fmt)


def open_checkpoint(path: str, *, threads: int = 8, verify: bool = True):
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

    An anyshard checkpoint's reads are verified: every byte returned lies in a checksum block
    that was read whole and checked (a `ChecksumError` otherwise). ``verify=False`` reads only
    the needed bytes, unchecked.

    The foreign formats are registered by `anyshard.loaders` (`register_format`), in the order
    in which they are tried.
    """
    for fmt in _FORMATS:
        if fmt.by_name and fmt.detect(path):
            return fmt.view(path)
    try:
        return CheckpointView(path, threads=threads, verify=verify)
    except CheckpointNotFoundError:
        for fmt in _FORMATS:
            if not fmt.by_name and fmt.detect(path):
                return fmt.view(path)
        raise
