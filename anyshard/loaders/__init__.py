"""Foreign checkpoint formats: readers that present them as the lazy view `anyshard.open`
gives, writers that stream any view into another format or layout, and `convert` / `diff`.

`anyshard.open` detects the format itself; import from here to name the types or write.
"""

from __future__ import annotations

from anyshard.loaders.convert import DiffReport, TensorDiff, convert, diff
from anyshard.loaders.dcp import DCPCheckpointView
from anyshard.loaders.deepspeed import DeepSpeedUniversalView, DeepSpeedZeroView
from anyshard.loaders.export import (
    ExportReport,
    parse_dtype,
    parse_size,
    select_names,
    write_anyshard,
    write_hf,
)
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
