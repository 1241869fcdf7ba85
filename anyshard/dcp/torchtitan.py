"""torchtitan checkpoints as anyshard checkpoints.

torchtitan (0.3) checkpoints through DCP but offers no setting for a storage writer or reader:
its `CheckpointManager` passes DCP only a path. `AnyshardCheckpointManager` is that manager with
anyshard's DCP backends (`AnyshardWriter`, `AnyshardReader`) and a step finder that knows
anyshard's commit. torchtitan's override mechanism swaps it in for any model, with one flag::

    python -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --override.imports anyshard.dcp.torchtitan.anyshard_checkpoint

- every checkpoint (``checkpoint.interval``, the last step, ``async_mode="async"``) is an
  anyshard checkpoint: each rank's shards as they are, in its safetensors file with checksums,
  and the rest of torchtitan's state (train step, learning-rate schedulers, the data loader's
  position) in the manifest, which is written last: the commit. No ``.metadata`` is written;
- a restart with the same arguments resumes from the newest *committed* step
  (`find_load_step`): a ``step-N`` folder whose save was interrupted before its commit is
  skipped with a warning, as is a folder of another format; torchtitan's own finder sees no
  ``.metadata`` in an anyshard step and would start afresh;
- ``keep_latest_k`` keeps that many committed steps (`stale_steps`): a save in progress or a
  folder of another format never pushes the newest committed step out;
- the restart may use another layout (``--parallelism.data_parallel_shard_degree``,
  ``--parallelism.tensor_parallel_degree``, the world size): each rank reads only the bytes
  it holds, verified;
- a step that torchtitan's own DCP wrote (``.metadata``) still loads, through DCP's own reader,
  so a run checkpointed by stock torchtitan goes on with anyshard checkpoints. Hugging Face
  exports (``last_save_in_hf``) and imports (``initial_load_in_hf``) stay torchtitan's own.

In a config function (``--module my_configs --config my_run``), set the manager directly:
``config.checkpoint = AnyshardCheckpointManager.Config(enable=True, folder="checkpoint")``.

This module imports torchtitan only where torchtitan is installed, and builds the manager when
first asked for; `find_load_step` needs no torchtitan. docs/integrations/torchtitan.md has the
commands, what was tested and the limits.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.format.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = [
    "AnyshardCheckpointManager",  # noqa: F822 (built on first access: `__getattr__`)
    "StepFolder",
    "anyshard_checkpoint",
    "find_load_step",
    "scan_steps",
    "stale_steps",
]

OVERRIDE = "anyshard.dcp.torchtitan.anyshard_checkpoint"  # the --override.imports target
DCP_METADATA = ".metadata"  # what torchtitan's own DCP checkpoints commit last
HF_INDEX = "model.safetensors.index.json"  # torchtitan's Hugging Face exports
_STEP_RE = re.compile(r"^step-(\d+)$")
_MANAGER: Any = None  # AnyshardCheckpointManager, once defined


@dataclass(frozen=True, slots=True)
class StepFolder:
    """One ``step-N`` folder under a checkpoint folder, as `scan_steps` classifies it.

    ``kind`` is ``"anyshard"`` (its manifest is there: committed), ``"dcp"`` (torchtitan's own
    DCP checkpoint: ``.metadata`` is there), ``"hf"`` (a Hugging Face export with its index),
    ``"uncommitted"`` (anyshard data files or nothing yet, no manifest: a save in progress or
    interrupted) or ``"foreign"`` (files of another kind, such as DCP shards without their
    ``.metadata``). ``loadable`` is whether a restart may resume from it."""

    step: int
    path: str
    kind: str

    @property
    def loadable(self) -> bool:
        return self.kind in ("anyshard", "dcp", "hf")


def _kind(path: str) -> str:
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        return "anyshard"
    if storage.exists(storage.join(path, DCP_METADATA)):
        return "dcp"
    if storage.exists(storage.join(path, HF_INDEX)):
        return "hf"
    try:
        names = set(storage.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return "foreign"  # a file named like a step
    return "uncommitted" if names <= {"data"} else "foreign"


def scan_steps(folder: str) -> list[StepFolder]:
    """Every folder named ``step-N`` (torchtitan's naming, N without leading zeros) under
    ``folder``, classified, sorted by step. A missing folder has none; other names are ignored.

    >>> import tempfile, torch, anyshard
    >>> root = tempfile.mkdtemp()
    >>> anyshard.save(root + "/step-20", {"w": torch.zeros(2)})
    >>> import os; os.makedirs(root + "/step-30/data")
    >>> [(s.step, s.kind) for s in scan_steps(root)]
    [(20, 'anyshard'), (30, 'uncommitted')]
    """
    try:
        names = storage.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = _STEP_RE.match(name)
        if m is None or name != f"step-{int(m.group(1))}":
            continue  # torchtitan loads step N from "step-N" only
        path = storage.join(folder, name)
        out.append(StepFolder(step=int(m.group(1)), path=path, kind=_kind(path)))
    return sorted(out, key=lambda s: s.step)


def find_load_step(folder: str) -> int:
    """The newest step under ``folder`` that a restart resumes from, or -1 when there is none.

    A step is loadable when it is committed: an anyshard checkpoint with its manifest (written
    last), or a checkpoint torchtitan itself wrote (DCP's ``.metadata``, or a Hugging Face
    export's index). A newer ``step-N`` folder that is not (a save interrupted before its
    commit, or files of another format) is skipped with a warning naming it; where nothing is
    loadable but such folders exist, the fresh start is warned about too.

    >>> import tempfile, torch, anyshard
    >>> root = tempfile.mkdtemp()
    >>> find_load_step(root)
    -1
    >>> anyshard.save(root + "/step-20", {"w": torch.zeros(2)})
    >>> find_load_step(root)
    20
    """
    steps = scan_steps(folder)
    loadable = [s for s in steps if s.loadable]
    newest = loadable[-1].step if loadable else -1
    skipped = [s for s in steps if not s.loadable and s.step > newest]
    if skipped:
        why = {
            "uncommitted": "no manifest.json: a save in progress or interrupted before its commit",
            "foreign": f"neither an anyshard checkpoint ({MANIFEST_NAME}) nor a DCP one "
            f"({DCP_METADATA})",
        }
        lines = "; ".join(f"{s.path} ({why[s.kind]})" for s in skipped)
        then = (
            f"resuming from step {newest}, the newest committed one"
            if newest >= 0
            else "no committed step is there: training starts afresh"
        )
        warnings.warn(f"anyshard: skipping {lines}; {then}", stacklevel=2)
    return newest


def stale_steps(folder: str, keep: int) -> list[str]:
    """The step folders under ``folder`` that ``keep_latest_k=keep`` removes: all but the
    ``keep`` newest loadable steps, and the uncommitted folders older than the newest of those
    (debris of interrupted saves). A save in progress (newer than every commit) and folders of
    another format are never among them.

    >>> import tempfile, torch, anyshard, os
    >>> root = tempfile.mkdtemp()
    >>> for n in (2, 4, 6):
    ...     anyshard.save(f"{root}/step-{n}", {"w": torch.zeros(2)})
    >>> os.makedirs(root + "/step-5/data"); os.makedirs(root + "/step-8/data")
    >>> [os.path.basename(p) for p in stale_steps(root, 2)]
    ['step-2', 'step-5']
    """
    if keep <= 0:
        return []
    steps = scan_steps(folder)
    kept = [s for s in steps if s.loadable][-keep:]
    if not kept:
        return []
    oldest, newest = kept[0].step, kept[-1].step
    return [
        s.path
        for s in steps
        if (s.loadable and s.step < oldest) or (s.kind == "uncommitted" and s.step < newest)
    ]


def anyshard_checkpoint(config: Any) -> Any:
    """torchtitan override (``--override.imports anyshard.dcp.torchtitan.anyshard_checkpoint``):
    torchtitan's `CheckpointManager` config replaced by `AnyshardCheckpointManager`'s, with the
    same settings (every ``--checkpoint.*`` option keeps its meaning)."""
    manager = _manager_class()
    if isinstance(config, manager.Config):
        return config
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config import derive

    if type(config) is not CheckpointManager.Config:
        raise AnyshardError(
            f"{OVERRIDE} replaces torchtitan's CheckpointManager; this job's checkpoint "
            f"manager is {type(config).__qualname__} (TorchFT's?), which it does not extend. "
            "Remove the override, or subclass that manager as AnyshardCheckpointManager does"
        )
    return derive(config, manager.Config)


def __getattr__(name: str) -> Any:
    if name == "AnyshardCheckpointManager":
        return _manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _manager_class() -> Any:
    """`AnyshardCheckpointManager`, defined on first use (it subclasses torchtitan's)."""
    global _MANAGER
    if _MANAGER is not None:
        return _MANAGER
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    try:
        from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
        from torchtitan.tools.utils import GarbageCollection, device_module, device_type
    except ImportError as e:
        raise ImportError(
            f"anyshard.dcp.torchtitan.AnyshardCheckpointManager extends torchtitan's "
            f"CheckpointManager and needs torchtitan 0.3 installed ({e})"
        ) from e

    from anyshard.dcp import AnyshardReader, AnyshardWriter

    class AnyshardCheckpointManager(CheckpointManager):
        """torchtitan's `CheckpointManager` whose checkpoints are anyshard checkpoints: it
        takes the same settings, saves through `AnyshardWriter` (synchronously or with
        ``async_mode``), resumes through `AnyshardReader` under any layout, and finds the step
        to resume from by anyshard's commit (`find_load_step`)."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """`CheckpointManager.Config`: the same settings, anyshard checkpoints."""

        @torch.no_grad()
        def dcp_save(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            async_mode: AsyncMode,
            enable_garbage_collection: bool = False,
            to_hf: bool = False,
        ) -> Future | Any | None:
            """Save ``state_dict`` as an anyshard checkpoint at ``checkpoint_id`` (collective):
            at once, or in the background with ``async_mode`` (the returned future completes
            once the manifest is committed). A Hugging Face export stays torchtitan's."""
            if to_hf:
                return super().dcp_save(
                    state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
                )
            writer = AnyshardWriter(checkpoint_id)
            ret: Any = None
            if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
                pinned: dict[str, Any] = {}
                if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                    pinned = dict(
                        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                        async_stager=self.stager,
                    )
                ret = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                    process_group=self.pg,
                    **pinned,
                )
            else:
                dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return ret

        def dcp_load(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            from_hf: bool,
            from_quantized: bool,
        ) -> None:
            """Load the anyshard checkpoint at ``checkpoint_id`` into ``state_dict`` under the
            current layout (collective). A checkpoint torchtitan wrote (DCP or Hugging Face)
            loads through torchtitan's own path; a folder holding neither is an error."""
            if not from_hf and not storage.exists(storage.join(checkpoint_id, MANIFEST_NAME)):
                theirs = (storage.join(checkpoint_id, n) for n in (DCP_METADATA, HF_INDEX))
                if any(storage.exists(p) for p in theirs):  # torchtitan's own: its own path
                    return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
                raise AnyshardError(
                    f"{checkpoint_id} holds no committed checkpoint: no {MANIFEST_NAME} (an "
                    f"anyshard save interrupted before its commit?) and no DCP {DCP_METADATA}. "
                    "Load a committed step (--checkpoint.load_step=-1 finds the newest; "
                    "`anyshard ls` lists a folder's steps)"
                )
            if from_hf:
                return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            dcp.load(state_dict, storage_reader=AnyshardReader(checkpoint_id))
            if MODEL in self.states:  # the model's states are flattened into the state dict
                self.states[MODEL].load_state_dict(state_dict)

        def _find_load_step(self, folder: str = "") -> int:
            """The newest committed step (`find_load_step`), the same on every rank."""
            step = find_load_step(folder or self.folder)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                device = (
                    torch.device("cpu")
                    if device_type == "cpu"
                    else torch.device(device_type, device_module.current_device())
                )
                seen = torch.tensor([step, -step], dtype=torch.int64, device=device)
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)
                high, low = int(seen[0]), -int(seen[1])
                if high != low:
                    raise AnyshardError(
                        f"the ranks find different newest committed steps under "
                        f"{folder or self.folder} ({low} on some, {high} on others): every "
                        "rank must see the same checkpoint folder (a shared file system, or a "
                        "store that lists new files at once); pass --checkpoint.load_step"
                    )
            return step

        def _purge_stale_checkpoints(self) -> None:
            """``keep_latest_k``: queue the removal of `stale_steps` (rank 0). torchtitan's own
            counts every ``step-N`` folder, so a save in progress or a foreign folder could
            push the newest committed step out."""
            if self._should_purge():
                for path in stale_steps(self.folder, self.keep_latest_k):
                    self.purge_queue.put(path)

    AnyshardCheckpointManager.__module__ = __name__
    AnyshardCheckpointManager.__qualname__ = "AnyshardCheckpointManager"
    AnyshardCheckpointManager.Config.__qualname__ = "AnyshardCheckpointManager.Config"
    _MANAGER = AnyshardCheckpointManager
    return AnyshardCheckpointManager


def _register() -> None:
    """Register `anyshard_checkpoint` with torchtitan's override mechanism, where torchtitan
    is installed (``--override.imports`` imports this module, then looks it up)."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config.override import override

    try:
        override(
            target=CheckpointManager.Config,
            description="anyshard checkpoints (AnyshardWriter / AnyshardReader)",
        )(anyshard_checkpoint)
    except ValueError:  # registered already (this module was executed again)
        pass


if importlib.util.find_spec("torchtitan") is not None:
    _register()
