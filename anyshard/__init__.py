"""anyshard: save training state as it is sharded; load it under any layout, reading only what is needed."""

from __future__ import annotations

__version__ = "0.1.0"

from anyshard import errors, ucl
from anyshard._async import SaveHandle
from anyshard._load import load
from anyshard._open import CheckpointView, TensorMetadata, TensorSlice
from anyshard._open import open_checkpoint as open
from anyshard._save import save
from anyshard.errors import AnyshardError

__all__ = [
    "AnyshardError",
    "CheckpointView",
    "SaveHandle",
    "TensorMetadata",
    "TensorSlice",
    "__version__",
    "errors",
    "load",
    "open",
    "save",
    "ucl",
]
