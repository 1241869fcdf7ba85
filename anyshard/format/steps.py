"""Step directories under a checkpoint root: list them, find the newest commit, clear debris.

A root holds one directory per saved step, named ``step-{step:09d}`` (so names sort like steps);
any ``step-<digits>`` directory counts (``step-001000`` as the README names them, ``step-5``).
A step is committed when its ``manifest.json`` exists: the manifest is written last, so a step
without one is either a save still in progress or debris from an interrupted one. Nothing here can
tell those apart, so debris is only ever removed below the newest committed step: a save in
progress always writes a step newer than every commit. Every file operation goes through
`anyshard.format.storage`, so the root may be a local path or a URL.

Run the examples: ``python -m pytest --doctest-modules anyshard/format/steps.py``
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from anyshard.format import storage
from anyshard.format.manifest import MANIFEST_NAME

__all__ = [
    "StepInfo",
    "find_debris",
    "latest_committed",
    "list_steps",
    "remove_debris",
    "remove_step",
    "step_dir_name",
]

_STEP_RE = re.compile(r"^step-(\d+)$")
# The one subdirectory a checkpoint has (anyshard.api.save writes ``data/rank-NNNNN.safetensors``);
# object stores have no directory entries, so the layout, not a stat, says what to descend into.
_SUBDIRS = ("data",)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    """One step directory: its step number, path, whether it is committed, and its total bytes."""

    step: int
    path: str
    committed: bool
    bytes: int

    def __post_init__(self):
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.bytes < 0:
            raise ValueError(f"bytes must be >= 0, got {self.bytes}")


def step_dir_name(step: int) -> str:
    """The directory name of ``step``.

    >>> step_dir_name(42)
    'step-000000042'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:09d}"


def _listdir_or_empty(path: str) -> list[str]:
    try:
        return storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _size_or_zero(path: str) -> int:
    try:
        return storage.size(path)
    except FileNotFoundError:  # removed while listing (a concurrent gc or save)
        return 0


def _tree_bytes(path: str) -> int:
    total = 0
    for name in _listdir_or_empty(path):
        entry = storage.join(path, name)
        if name in _SUBDIRS:
            total += sum(_size_or_zero(storage.join(entry, f)) for f in _listdir_or_empty(entry))
            continue
        try:
            total += storage.size(entry)
        except FileNotFoundError:  # removed while listing (a concurrent gc or save)
            pass
    return total


def list_steps(root: str) -> list[StepInfo]:
    """Every ``step-*`` directory under ``root``, committed or not, sorted by step.

    A missing root has no steps. Other names under ``root`` are ignored.

    >>> import tempfile, torch, anyshard
    >>> root = tempfile.mkdtemp()
    >>> anyshard.save(root + "/step-000000002", {"w": torch.zeros(4)})
    >>> [(s.step, s.committed) for s in list_steps(root)]
    [(2, True)]
    """
    out = []
    for name in _listdir_or_empty(root):
        m = _STEP_RE.match(name)
        if not m:
            continue
        path = storage.join(root, name)
        committed = storage.exists(storage.join(path, MANIFEST_NAME))
        out.append(
            StepInfo(step=int(m.group(1)), path=path, committed=committed, bytes=_tree_bytes(path))
        )
    return sorted(out, key=lambda s: s.step)


def latest_committed(root: str) -> StepInfo | None:
    """The newest committed step under ``root``, or None when there is none.

    >>> import tempfile
    >>> latest_committed(tempfile.mkdtemp()) is None
    True
    """
    committed = [s for s in list_steps(root) if s.committed]
    return committed[-1] if committed else None


def find_debris(steps: list[StepInfo]) -> list[StepInfo]:
    """The uncommitted steps of ``steps`` that are older than its newest committed step."""
    newest = max((s.step for s in steps if s.committed), default=None)
    if newest is None:
        return []
    return [s for s in steps if not s.committed and s.step < newest]


def remove_step(path: str) -> None:
    """Remove one step directory and everything under it (a missing one is already removed).

    The manifest goes first, durably: a removal interrupted at any moment leaves at worst an
    uncommitted step (debris), never a committed one whose data files are gone.
    """
    manifest = storage.join(path, MANIFEST_NAME)
    try:
        if storage.exists(manifest):
            storage.remove_file(manifest)
        storage.remove_tree(path)
    except FileNotFoundError:
        pass


def remove_debris(root: str, *, dry_run: bool = False) -> list[str]:
    """Remove uncommitted steps older than the newest commit; return their paths, sorted by step.

    Uncommitted steps newer than the newest commit are left alone: one may be a save in
    progress. Names not of the form ``step-*`` are never touched. With ``dry_run``, only report.

    >>> import os, tempfile, torch, anyshard
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(root + "/step-000000001/data")
    >>> anyshard.save(root + "/step-000000002", {"w": torch.zeros(4)})
    >>> os.makedirs(root + "/step-000000003/data")
    >>> [os.path.basename(p) for p in remove_debris(root)]
    ['step-000000001']
    >>> [s.step for s in list_steps(root)]
    [2, 3]
    """
    removed = []
    for s in find_debris(list_steps(root)):
        if not dry_run:
            remove_step(s.path)
        removed.append(s.path)
    return removed
