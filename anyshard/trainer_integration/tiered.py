"""Tiered checkpoints: each step saved and committed on local disk first, then uploaded to the
root in the background (data files first, the manifest last: the commit on the object store);
a restore reads the newest step from local disk where every file it needs is there, else from
the root."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from anyshard.api import collectives as coll
from anyshard.errors import AnyshardError
from anyshard.format import steps, storage
from anyshard.format.manifest import MANIFEST_NAME, read_manifest


def upload(
    step: int,
    local: str,
    remote: str,
    group,
    *,
    committed: Callable[[], None],
    uploaded: Callable[[], None],
) -> None:
    """Background: every rank uploads its own data file, then rank 0 the manifest and runs
    ``committed`` (retention under the root); then one rank per node runs ``uploaded``
    (retention on its local disk)."""
    me = coll.rank(group)
    error = _clear_debris(remote, group)
    try:
        if error is not None:
            raise AnyshardError(error)
        mine = storage.join(local, "data", f"rank-{me:05d}.safetensors")
        if not storage.exists(storage.join(local, MANIFEST_NAME)) and me == 0:
            raise AnyshardError(f"{local}: the local save of step {step} did not commit")
        if storage.exists(mine):
            storage.makedirs(storage.join(remote, "data"))
            storage.upload(mine, storage.join(remote, "data", f"rank-{me:05d}.safetensors"))
    except Exception as e:
        error = f"rank {me}: {e}"
    errors = coll.gather_json(error, group)
    outcome: dict[str, Any] = {"ok": True}
    if me == 0:
        assert errors is not None  # rank 0 gathers every rank's
        try:
            _commit(step, local, remote, [e for e in errors if e])
            committed()
        except Exception as e:
            outcome = {"ok": False, "error": str(e)}
    outcome = coll.broadcast_json(outcome, group)
    if not outcome["ok"]:
        raise AnyshardError(outcome["error"])
    # one rank per node cleans its local disk (LOCAL_RANK 0 under torchrun); the barrier
    # makes wait() return everywhere only once that is done
    if int(os.environ.get("LOCAL_RANK", me)) == 0:
        uploaded()
    coll.broadcast_json(None, group)


def _clear_debris(remote: str, group) -> str | None:
    """Collective: rank 0 removes the debris of a crashed attempt at this step, before anyone
    writes; every rank learns of its failure."""
    error = None
    if coll.rank(group) == 0:
        try:
            if storage.exists(remote) and not storage.exists(storage.join(remote, MANIFEST_NAME)):
                steps.remove_step(remote)
        except Exception as e:
            error = f"rank 0: {e}"
    return coll.broadcast_json(error, group)


def _commit(step: int, local: str, remote: str, failed: list[str]) -> None:
    """Rank 0, once every rank's upload ended: the manifest to the root, unless one failed."""
    if failed:
        raise AnyshardError(
            f"upload of step {step} to {remote} failed; the step stays on local disk: {failed[0]}"
        )
    data = storage.read_bytes(storage.join(local, MANIFEST_NAME))
    storage.write_bytes_atomic(storage.join(remote, MANIFEST_NAME), data, exclusive=True)


def _local_complete(path: str) -> bool:
    """Whether this rank finds the step at ``path`` committed on its local disk with every
    data file."""
    try:
        manifest = read_manifest(path)
    except AnyshardError:
        return False
    return all(os.path.exists(os.path.join(path, f)) for f in manifest.files.values())


def choose_step(root: str, local_dir: str | None, process_group) -> tuple[int | None, bool]:
    """Collective: the step to restore, the newest that every rank can read, and whether this
    rank reads it from ``local_dir``."""
    remote = None
    local_steps: list[int] = []
    if coll.rank(process_group) == 0:
        latest = steps.latest_committed(root)
        remote = None if latest is None else latest.step
    if local_dir is not None and storage.exists(local_dir):
        local_steps = [s.step for s in steps.list_steps(local_dir) if s.committed]
    candidates = coll.broadcast_json(
        {"remote": remote, "local": sorted(local_steps, reverse=True)}, process_group
    )
    remote = candidates["remote"]
    ordered = [s for s in candidates["local"] if remote is None or s > remote]
    ordered += [remote] if remote is not None else []
    if local_dir is None:
        return remote, False
    mine = {s: _local_complete(storage.join(local_dir, steps.step_dir_name(s))) for s in ordered}
    # a step every rank can read: locally complete here, or committed in root
    ok = [s for s in ordered if mine[s] or s == remote]
    agreed = coll.gather_json(ok, process_group)
    choice = None
    if coll.rank(process_group) == 0:
        common = set.intersection(*(set(a) for a in agreed)) if agreed else set()
        choice = max(common) if common else None
    choice = coll.broadcast_json(choice, process_group)
    return choice, choice is not None and mine.get(choice, False)
