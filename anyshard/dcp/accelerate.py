"""Hugging Face Accelerate checkpoints as anyshard checkpoints.

Under FSDP with ``SHARDED_STATE_DICT``, ``Accelerator.save_state`` and ``load_state`` hand the
model and optimizer states to ``torch.distributed.checkpoint`` with a storage writer and reader
they construct themselves (``dist_cp.FileSystemWriter(dir)``, ``dist_cp.FileSystemReader(dir)``,
in ``accelerate.utils.fsdp_utils``). Inside `anyshard_checkpoints`, those two constructions made
by Accelerate on this thread make `AnyshardWriter` and `AnyshardReader` instead:

- ``save_state(dir)`` writes ``dir/pytorch_model_fsdp_0`` and ``dir/optimizer_0`` as anyshard
  checkpoints: every rank's shards as they are, in its safetensors file with checksums, one JSON
  manifest committed last, nothing pickled. ``anyshard verify``, ``anyshard.open`` and
  ``anyshard convert`` read them;
- ``load_state(dir)`` reads them (or a checkpoint Accelerate wrote through DCP itself) into the
  current layout, whatever the world size, each rank reading only the bytes it holds, verified.

Everything else ``save_state`` writes (RNG states, schedulers, samplers, the step, custom
objects) stays Accelerate's own files in the same directory.

Use it around the calls::

    from anyshard.dcp.accelerate import anyshard_checkpoints

    with anyshard_checkpoints(accelerator):
        accelerator.save_state("ckpt/step-100")

docs/integrations/accelerate.md has a complete example. This module does not import Accelerate
(the library imports without it); it reads the Accelerator it is given (1.15 is tested).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import Any

from anyshard.dcp.reader import AnyshardReader
from anyshard.dcp.writer import AnyshardWriter
from anyshard.errors import AnyshardError

__all__ = ["NotRoutedError", "NothingRoutedWarning", "anyshard_checkpoints"]

# the two names Accelerate's FSDP checkpointing looks up on torch.distributed.checkpoint
_NAMES = {"FileSystemWriter": AnyshardWriter, "FileSystemReader": AnyshardReader}
_ROUTED_CALLERS = "accelerate."  # modules whose constructions are routed to anyshard

_lock = threading.Lock()
_users = 0  # contexts open in any thread; the names are patched while there is one
_originals: dict[str, type] = {}  # the names' values before they were patched
_installed: dict[str, type] = {}  # what was put in their place
_local = threading.local()  # .depth, .marks (open contexts), .routed (constructions routed)


class NotRoutedError(AnyshardError, ValueError):
    """`anyshard_checkpoints` was entered for an Accelerator whose ``save_state`` and
    ``load_state`` do not go through ``torch.distributed.checkpoint`` (no FSDP, or FSDP with
    a full or local state dict), where routing them would change nothing."""


def anyshard_checkpoints(accelerator: Any) -> contextlib.AbstractContextManager[None]:
    """A context in which ``accelerator.save_state`` / ``load_state`` (Accelerate's FSDP
    checkpointing, ``SHARDED_STATE_DICT``) save and load the model and optimizer states as
    anyshard checkpoints, through `AnyshardWriter` and `AnyshardReader`.

    Only the DCP storage writers and readers that Accelerate's own code constructs, on the
    thread that entered the context, are anyshard's; any other construction of
    ``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader`` (another thread, or
    your own code inside the block) gets DCP's. Contexts nest and may be open in several threads
    at once; when the last one closes, normally or by an exception, both names are what they
    were before the first opened. The context may be kept and entered again (at every save).

    Raises `NotRoutedError` on entry where Accelerate would not checkpoint through DCP (the
    message says what to set). A block that ends without an exception and with nothing routed
    (no ``save_state`` / ``load_state`` in it, or an Accelerate that constructs its storage
    elsewhere) warns, `NothingRoutedWarning`, rather than let a checkpoint silently be DCP's.
    """
    return _Route(accelerator)


class NothingRoutedWarning(UserWarning):
    """An `anyshard_checkpoints` block ended with no DCP writer or reader routed to anyshard."""


class _Route:
    """The context `anyshard_checkpoints` returns; reusable, and re-entrant in any thread."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def __enter__(self) -> None:
        _check_applies(self._accelerator)
        _acquire()
        _local.depth = getattr(_local, "depth", 0) + 1
        # this thread's count of routed constructions at entry, one mark per open context
        _local.marks = [*getattr(_local, "marks", []), getattr(_local, "routed", 0)]

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        before = _local.marks.pop()
        _local.depth -= 1
        _release()
        if kind is None and getattr(_local, "routed", 0) == before:  # no warning over an error
            warnings.warn(
                "anyshard_checkpoints: nothing in this block was saved or loaded through anyshard "
                "(no DCP writer or reader constructed by Accelerate on this thread). Call "
                "accelerator.save_state / load_state inside the block, on the thread that "
                "entered it; an Accelerate other than 1.15 may construct its storage elsewhere",
                NothingRoutedWarning,
                stacklevel=2,
            )


def _check_applies(accelerator: Any) -> None:
    """Raise `NotRoutedError` unless ``accelerator`` checkpoints its models through DCP."""
    kind = getattr(accelerator, "distributed_type", None)
    if _name(kind) != "FSDP":  # accelerate.utils.DistributedType.FSDP
        raise NotRoutedError(
            f"anyshard_checkpoints: this Accelerator's distributed_type is {_name(kind)}, not "
            "FSDP; save_state then writes model.safetensors and optimizer.bin itself, not through "
            "torch.distributed.checkpoint, and there is nothing to route. Prepare the model "
            "under FSDP (Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin("
            "fsdp_version=2, state_dict_type='SHARDED_STATE_DICT'))), or save without "
            "anyshard_checkpoints"
        )
    plugin = accelerator.state.fsdp_plugin
    state_dict_type = _name(getattr(plugin, "state_dict_type", None))
    if state_dict_type != "SHARDED_STATE_DICT":
        raise NotRoutedError(
            f"anyshard_checkpoints: the FSDP plugin's state_dict_type is {state_dict_type}; "
            "Accelerate saves that with torch.save, not through torch.distributed.checkpoint. "
            "Set FullyShardedDataParallelPlugin(state_dict_type='SHARDED_STATE_DICT') (or "
            "FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT) to checkpoint through anyshard"
        )


def _name(value: Any) -> str:
    """An enum member's name (Accelerate's and torch's enums), else the value as text."""
    return str(getattr(value, "name", value))


def _routing() -> bool:
    """Whether a construction happening now goes to anyshard: a context is open in this thread
    and the caller (two frames up: past ``__new__``) is Accelerate's code."""
    if not getattr(_local, "depth", 0):
        return False
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return isinstance(caller, str) and caller.startswith(_ROUTED_CALLERS)


def _router(original: type, target: type) -> type:
    """What stands in for DCP's class ``original`` while a context is open: constructed while
    `_routing`, a ``target``; constructed otherwise, an ``original`` itself (DCP's object as it
    would be, picklable for a process-based async save). DCP's objects pass ``isinstance``
    checks against it (a virtual subclass), and a class derived from it meanwhile is built as
    usual."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is not routed:  # a subclass someone derived while the name was patched
            if original.__new__ is object.__new__:
                return object.__new__(cls)
            return original.__new__(cls, *args, **kwargs)
        if _routing():
            _local.routed = getattr(_local, "routed", 0) + 1
            return target(*args, **kwargs)
        return original(*args, **kwargs)  # not a cls instance: cls.__init__ does not run

    def __subclasshook__(cls: type, sub: type) -> Any:
        return True if issubclass(sub, original) else NotImplemented

    namespace = {"__new__": __new__, "__subclasshook__": classmethod(__subclasshook__)}
    routed = type(original.__name__, (original,), namespace)
    routed.__qualname__ = original.__qualname__
    routed.__module__ = original.__module__
    routed.__doc__ = original.__doc__
    return routed


def _acquire() -> None:
    global _users
    import torch.distributed.checkpoint as dist_cp

    with _lock:
        if _users == 0:
            for name, target in _NAMES.items():
                original = getattr(dist_cp, name)
                _originals[name] = original
                _installed[name] = _router(original, target)
                setattr(dist_cp, name, _installed[name])
        _users += 1


def _release() -> None:
    global _users
    import torch.distributed.checkpoint as dist_cp

    with _lock:
        _users -= 1
        if _users:
            return
        for name, original in _originals.items():
            # a name someone else patched meanwhile stays theirs (ours under it routes nothing)
            if getattr(dist_cp, name, None) is _installed.get(name):
                setattr(dist_cp, name, original)
        _originals.clear()
        _installed.clear()
