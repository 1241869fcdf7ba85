"""trainer_integration: the Checkpointer plugin for training loops (the reference trainer lives in
its own subpackage, which the library never imports)."""

from anyshard.trainer_integration.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
