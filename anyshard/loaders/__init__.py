"""Foreign checkpoint formats: readers that present them as the lazy view `anyshard.open`
gives, writers that stream any view into another format or layout, and `convert` / `diff`.

`anyshard.open` detects the format itself; import from here to name the types or write.
"""

from __future__ import annotations

from anyshard.api.open import Format, register_format
from anyshard.loaders import dcp, deepspeed, hf, megatron_dist, torchsave, zarr_store
from anyshard.loaders._shared import ExportReport, parse_dtype, parse_size, select_names
from anyshard.loaders.convert import DiffReport, TensorDiff, convert, diff
from anyshard.loaders.dcp import DCPCheckpointView
from anyshard.loaders.deepspeed import DeepSpeedUniversalView, DeepSpeedZeroView
from anyshard.loaders.export import write_anyshard, write_hf
from anyshard.loaders.export_dcp import write_dcp
from anyshard.loaders.hf import HFCheckpointView, HFTensorMetadata
from anyshard.loaders.megatron import MegatronCheckpointView, megatron_file_name
from anyshard.loaders.megatron_dist import MegatronDistView
from anyshard.loaders.torchsave import TorchSaveView
from anyshard.loaders.zarr_store import ZarrView, write_zarr

__all__ = [
    "DCPCheckpointView",
    "DeepSpeedUniversalView",
    "DeepSpeedZeroView",
    "DiffReport",
    "ExportReport",
    "HFCheckpointView",
    "HFTensorMetadata",
    "MegatronCheckpointView",
    "MegatronDistView",
    "TensorDiff",
    "TorchSaveView",
    "ZarrView",
    "convert",
    "diff",
    "megatron_file_name",
    "parse_dtype",
    "parse_size",
    "select_names",
    "write_anyshard",
    "write_dcp",
    "write_hf",
    "write_zarr",
]

# What `anyshard.open` tries, in order. Told by the path alone, before anyshard's manifest:
# a .safetensors file or index, a torch.save file. Then, where there is no manifest:
# DeepSpeed's and Megatron's markers first (``latest`` naming a step folder of DeepSpeed's
# files, ``metadata.json``), as such a directory may hold other files too; a root holding both
# kinds (converted in place) opens as its ZeRO files, the training state; Megatron's torch_dist
# is a DCP directory too, so it comes before DCP.
for _format in (
    Format("huggingface-file", hf.looks_like_file, hf.HFCheckpointView, by_name=True),
    Format("torch-save-file", torchsave.looks_like_file, torchsave.TorchSaveView, by_name=True),
    Format("deepspeed-zero", deepspeed.looks_like_deepspeed_zero, deepspeed.DeepSpeedZeroView),
    Format(
        "deepspeed-universal",
        deepspeed.looks_like_deepspeed_universal,
        deepspeed.DeepSpeedUniversalView,
    ),
    Format(
        "megatron-torch-dist",
        megatron_dist.looks_like_megatron_dist,
        megatron_dist.MegatronDistView,
    ),
    Format("huggingface", hf.looks_like_hf, hf.HFCheckpointView),
    Format("dcp", dcp.looks_like_dcp, dcp.DCPCheckpointView),
    Format("zarr", zarr_store.looks_like_zarr, zarr_store.ZarrView),
    Format("torch-save", torchsave.looks_like_torch_save, torchsave.TorchSaveView),
):
    register_format(_format)
del _format
