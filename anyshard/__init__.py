"""anyshard: save training state as it is sharded; load it under any layout, reading only what is needed."""

from __future__ import annotations

from anyshard import errors, ucl
from anyshard import loaders as _loaders  # noqa: F401  (registers the formats anyshard.open detects)
from anyshard._version import __version__
from anyshard.api.async_save import SaveHandle
from anyshard.api.load import load
from anyshard.api.open import open_checkpoint as open
from anyshard.api.redistribute import redistribute
from anyshard.api.save import save
from anyshard.api.views import CheckpointView, TensorMetadata, TensorSlice
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
    "redistribute",
    "save",
    "ucl",
]
