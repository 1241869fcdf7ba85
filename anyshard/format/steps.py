"""Step directories under a checkpoint root: list them, find the newest commit, clear debris.

A root holds one directory per saved step, named ``step-{step:09d}`` (so names sort like steps);
any ``step-<digits>`` directory counts (``step-001000`` as the README names them, ``step-5``).
A step is committed when its ``manifest.json`` exists: the manifest is written last, so a step
without one is either a save still in progress or debris from an interrupted one. Nothing here can
tell those apart, so debris is only ever removed below the newest committed step: a save in
progress always writes a step newer than every commit. Every file operation goes through
`anyshard.format.storage`, so the root may be a local path or a URL.

An incremental step references data files of earlier steps. Removing a step removes its manifest
first, then only the data files that no committed step references (the references are read
from the manifests, never kept anywhere else); a step directory left holding referenced files
is removed by the retention or gc that finds them unreferenced. An interrupted removal therefore
leaves every committed step loadable.

Run the examples: ``python -m pytest --doctest-modules anyshard/format/steps.py``
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

from anyshard.errors import AnyshardError
from anyshard.format import storage, strict_json
from anyshard.format.manifest import MANIFEST_NAME, check_ref_file, read_manifest

__all__ = [
    "StepInfo",
    "find_debris",
    "latest_committed",
    "list_steps",
    "referenced_files",
    "remove_orphans",
    "remove_unnamed",
    "remove_debris",
    "remove_step",
    "remove_steps",
    "step_dir_name",
]

_STEP_RE = re.compile(r"^step-(\d+)$")
# The one subdirectory a checkpoint has (anyshard.api.save writes ``data/rank-NNNNN.safetensors``);
# object stores have no directory entries, so the layout, not a stat, says what to descend into.
_SUBDIRS = ("data",)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    """One step directory: its step number, path, whether it is committed, its total bytes,
    and (when listed with ``refs``) the bytes of shards it references in other steps' files
    and whether, uncommitted, it still holds files that committed steps reference."""

    step: int
    path: str
    committed: bool
    bytes: int
    shared: int = 0
    referenced: bool = False

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


def list_steps(root: str, *, refs: bool = False) -> list[StepInfo]:
    """Every ``step-*`` directory under ``root``, committed or not, sorted by step.

    A missing root has no steps. Other names under ``root`` are ignored. With ``refs``, each
    committed step's manifest is read for the bytes it references in other steps
    (`StepInfo.shared`), and uncommitted steps holding referenced files are marked.

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
        size = _tree_bytes(path)
        if storage.is_url(path) and not size:
            continue  # an object store's directory is its objects: one without bytes is gone
            # (a filer-backed store such as SeaweedFS lists its folder markers for a while)
        committed = storage.exists(storage.join(path, MANIFEST_NAME))
        out.append(StepInfo(step=int(m.group(1)), path=path, committed=committed, bytes=size))
    out.sort(key=lambda s: s.step)
    if not refs:
        return out
    referenced = referenced_files(root, out) or set()
    listed = []
    for s in out:
        shared = 0
        if s.committed:
            try:
                manifest = read_manifest(s.path)
                shared = sum(
                    r.stop - r.start for per in manifest.refs.values() for r in per.values()
                )
            except AnyshardError:
                pass
        held = not s.committed and any(
            storage.normalize(storage.join(s.path, "data", f)) in referenced
            for f in _listdir_or_empty(storage.join(s.path, "data"))
        )
        listed.append(
            StepInfo(
                step=s.step,
                path=s.path,
                committed=s.committed,
                bytes=s.bytes,
                shared=shared,
                referenced=held,
            )
        )
    return listed


def referenced_files(root: str, listed: list[StepInfo] | None = None) -> set[str] | None:
    """Every data file that a committed step under ``root`` references in another step, or
    None when a committed manifest cannot be read (what it references is then unknown, and
    nothing may be removed on the strength of this answer)."""
    out: set[str] = set()
    for s in listed if listed is not None else list_steps(root):
        if not s.committed:
            continue
        try:
            files = _ref_files(s.path)
        except FileNotFoundError:
            continue  # removed while listing
        if files is None:
            return None
        out.update(
            storage.normalize(storage.join(storage.parent(s.path), *f.split("/")[1:]))
            for f in files
        )
    return out


def _ref_files(path: str) -> set[str] | None:
    """The files the manifest of the step at ``path`` references (``../STEP/data/FILE``), read
    without checking the rest of the manifest (what a deletion needs), or None when the
    manifest cannot be read as one."""
    try:
        j = strict_json.loads(storage.read_bytes(storage.join(path, MANIFEST_NAME)))
        return {
            check_ref_file(ref["file"], path)
            for per in j.get("refs", {}).values()
            for ref in per.values()
        }
    except FileNotFoundError:
        raise
    except (AnyshardError, ValueError, KeyError, TypeError, AttributeError):
        return None


def latest_committed(root: str) -> StepInfo | None:
    """The newest committed step under ``root``, or None when there is none.

    >>> import tempfile
    >>> latest_committed(tempfile.mkdtemp()) is None
    True
    """
    committed = [s for s in list_steps(root) if s.committed]
    return committed[-1] if committed else None


def find_debris(steps: list[StepInfo], *, stale_after_s: float | None = None) -> list[StepInfo]:
    """The uncommitted steps of ``steps`` that are older than its newest committed step; with
    ``stale_after_s``, also those newer (or with no commit at all) in which nothing was written
    for that many seconds: no save in progress leaves its files untouched that long."""
    newest = max((s.step for s in steps if s.committed), default=None)
    out = [s for s in steps if not s.committed and newest is not None and s.step < newest]
    if stale_after_s is not None:
        now = time.time()
        out += [
            s
            for s in steps
            if not s.committed
            and (newest is None or s.step > newest)
            and now - last_modified(s.path) >= stale_after_s
        ]
    return sorted(out, key=lambda s: s.step)


def last_modified(path: str) -> float:
    """When anything under the step directory ``path`` was last written (seconds since the
    epoch; 0 when nothing is there)."""
    newest = 0.0
    if not storage.is_url(path):
        for d, _, names in os.walk(path):
            for n in [*names, "."]:
                try:
                    newest = max(newest, os.stat(os.path.join(d, n)).st_mtime)
                except FileNotFoundError:  # removed while listing
                    pass
        return newest
    for name in _listdir_or_empty(path):
        entry = storage.join(path, name)
        files = (
            [storage.join(entry, f) for f in _listdir_or_empty(entry)]
            if name in _SUBDIRS
            else [entry]
        )
        for f in files:
            try:
                newest = max(newest, storage.modified(f))
            except FileNotFoundError:
                pass
    return newest


def remove_step(path: str) -> None:
    """Remove one step directory and everything under it that no committed step of its root
    references (a missing one is already removed); see `remove_steps`."""
    remove_steps([path])


def remove_steps(paths: list[str]) -> list[str]:
    """Remove step directories of one root.

    Each manifest goes first, durably: a removal interrupted at any moment leaves at worst an
    uncommitted step (debris), never a committed one whose data files are gone. Then each data
    file goes unless a committed step of the root references it; a directory that keeps such
    files stays (uncommitted) until a later removal finds them unreferenced. Returns the
    directories kept so.
    """
    kept: list[str] = []
    if not paths:
        return kept
    for path in paths:
        manifest = storage.join(path, MANIFEST_NAME)
        try:
            if storage.exists(manifest):
                storage.remove_file(manifest)
        except FileNotFoundError:
            pass
    root = storage.parent(paths[0])
    keep = referenced_files(root)
    for path in paths:
        data = storage.join(path, "data")
        names = _listdir_or_empty(data)
        held = (
            names
            if keep is None
            else [n for n in names if storage.normalize(storage.join(data, n)) in keep]
        )
        if held:
            kept.append(path)
        try:
            if not held:
                storage.remove_tree(path)
                continue
            for name in names:
                if name not in held:
                    storage.remove_file(storage.join(data, name))
        except FileNotFoundError:
            pass
    return kept


def remove_debris(
    root: str,
    *,
    dry_run: bool = False,
    report_kept: bool = False,
    stale_after_s: float | None = None,
):
    """Remove uncommitted steps older than the newest commit; return their paths, sorted by step
    (with ``report_kept``, also those of them kept for files committed steps reference).

    Uncommitted steps newer than the newest commit are left alone (one may be a save in
    progress) unless ``stale_after_s`` is given: then those in which nothing was written for
    that many seconds go too (a killed save's). Names not of the form ``step-*`` are never
    touched. With ``dry_run``, only report.

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
    removed = [s.path for s in find_debris(list_steps(root), stale_after_s=stale_after_s)]
    kept = remove_steps(removed) if not dry_run else []
    return (removed, kept) if report_kept else removed


def remove_orphans(root: str, *, stale_after_s: float, dry_run: bool = False) -> list[str]:
    """Remove the data files in committed steps of ``root`` that their own manifest does not
    name and no committed step references, written more than ``stale_after_s`` seconds ago: the
    old files of a checkpoint replaced in place (`AnyshardWriter` with ``overwrite``) by a
    process killed between its commit and its cleanup, or what a failed replacement wrote. A
    file written since may belong to a replacement in progress, and stays. Returns their paths.
    """
    listed = list_steps(root)
    keep = referenced_files(root, listed)
    if keep is None:
        return []  # a committed manifest cannot be read: what it references is unknown
    out = []
    now = time.time()
    for s in listed:
        if not s.committed:
            continue
        try:
            named = set(read_manifest(s.path).files.values())
        except (AnyshardError, FileNotFoundError):
            continue
        for path in _unnamed_files(s.path, named, keep):
            try:
                if now - storage.modified(path) < stale_after_s:
                    continue
                if not dry_run:
                    storage.remove_file(path)
            except FileNotFoundError:
                continue
            out.append(path)
    return out


def remove_unnamed(path: str, named: set[str]) -> None:
    """Remove the data files of the checkpoint at ``path`` that its manifest's ``files``
    (``named``) do not list and no committed step beside it references: after a checkpoint was
    replaced in place, the old one's and a failed replacement's. Best effort: the commit is
    done, and what stays is only unreferenced bytes (`remove_orphans` finds them later)."""
    keep = referenced_files(storage.parent(path))
    if keep is None:
        return  # a committed manifest beside it cannot be read: what it references is unknown
    for file in _unnamed_files(path, named, keep):
        with contextlib.suppress(OSError):
            storage.remove_file(file)


def _unnamed_files(path: str, named: set[str], keep: set[str]) -> list[str]:
    """The files in the data directory of the step at ``path`` that neither ``named`` (its
    manifest's ``files``, relative) lists nor ``keep`` (normalized paths) holds."""
    data = storage.join(path, "data")
    return [
        f
        for name in _listdir_or_empty(data)
        if f"data/{name}" not in named
        and storage.normalize(f := storage.join(data, name)) not in keep
    ]
