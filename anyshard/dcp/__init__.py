"""PyTorch DCP integration: storage backends through which ``torch.distributed.checkpoint`` saves
and loads anyshard checkpoints (`AnyshardWriter`, `AnyshardReader`), and the trainer integrations
built on them, each imported on its own since each needs its trainer: a Lightning strategy
(`anyshard.dcp.lightning`), torchtitan's checkpoint manager with them (`anyshard.dcp.torchtitan`,
docs/integrations/torchtitan.md), Megatron-Core ``dist_checkpointing`` strategies
(`anyshard.dcp.megatron`, docs/integrations/megatron.md), and a context that routes Hugging Face
Accelerate's FSDP ``save_state`` / ``load_state`` through them (`anyshard.dcp.accelerate`,
docs/integrations/accelerate.md).

Trainers that checkpoint through DCP (torchtitan, torchtune, Lightning's FSDP strategies,
Accelerate) take their storage as a `StorageWriter` / `StorageReader`; these two are anyshard's
(`anyshard.dcp.writer` and `anyshard.dcp.reader`):

>>> import torch, tempfile, torch.distributed.checkpoint as dcp
>>> from anyshard.dcp import AnyshardReader, AnyshardWriter
>>> d = tempfile.mkdtemp() + "/step-1"
>>> state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
>>> dcp.save(state, storage_writer=AnyshardWriter(d), no_dist=True)  # doctest: +ELLIPSIS
Metadata(...)
>>> back = {"w": torch.zeros(2, 3), "step": 0}
>>> dcp.load(back, storage_reader=AnyshardReader(d), no_dist=True)
>>> back["w"][1], back["step"]
(tensor([3., 4., 5.]), 1)
"""

from anyshard.dcp.reader import AnyshardReader
from anyshard.dcp.writer import AnyshardWriter

__all__ = ["AnyshardReader", "AnyshardWriter"]
