"""PyTorch DCP integration: storage backends through which ``torch.distributed.checkpoint`` saves
and loads anyshard checkpoints (`AnyshardWriter`, `AnyshardReader`), and a Lightning strategy that
checkpoints through them (`anyshard.dcp.lightning`, imported on its own: it needs Lightning)."""

from anyshard.dcp.backend import AnyshardReader, AnyshardWriter

__all__ = ["AnyshardReader", "AnyshardWriter"]
