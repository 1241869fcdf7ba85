"""What a `Checkpointer` keeps and what it removes: the retention policy over committed steps,
debris of unfinished saves, the files of an earlier attempt at the step being saved, and the
local copies of a tiered checkpoint once uploaded.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/retention.py``
"""

from __future__ import annotations

import os
import warnings

from anyshard.api import collectives as coll
from anyshard.errors import AnyshardError
from anyshard.format import steps, storage
from anyshard.format.manifest import MANIFEST_NAME


def steps_to_delete(
    committed: list[int], *, keep_last: int | None, keep_every: int | None
) -> list[int]:
    """The committed steps a retention policy deletes: all but the newest ``keep_last`` and the
    multiples of ``keep_every``. ``keep_last=None`` keeps everything.

    >>> steps_to_delete([0, 2, 4, 6, 8], keep_last=2, keep_every=4)
    [2]
    """
    if keep_last is None:
        return []
    newest = set(sorted(committed)[-keep_last:])
    return sorted(
        s
        for s in committed
        if s not in newest and not (keep_every is not None and s % keep_every == 0)
    )


def apply_retention(
    root: str,
    *,
    keep_last: int | None,
    keep_every: int | None,
    stale_after_s: float | None,
    in_flight: str | None,
) -> None:
    """Remove the committed steps under ``root`` that the policy lets go, and the debris (never
    ``in_flight``, the save under way)."""
    # Housekeeping after a commit: a failure here must not fail the save that succeeded (and
    # raising on rank 0 alone would leave the other ranks in a different place), so warn.
    try:
        listed = steps.list_steps(root)
        committed = [s.step for s in listed if s.committed]
        doomed = set(steps_to_delete(committed, keep_last=keep_last, keep_every=keep_every))
        debris = steps.find_debris(listed, stale_after_s=stale_after_s)
        steps.remove_steps(
            [s.path for s in listed if s.step in doomed]
            + [s.path for s in debris if s.path != in_flight]  # never the one in flight
        )
    except (AnyshardError, OSError) as e:
        warnings.warn(
            f"anyshard: retention under {root} failed ({e}); old steps remain, "
            f"`anyshard gc {root}` removes debris",
            stacklevel=4,  # the Checkpointer's call, past its method that runs this
        )


def apply_local_retention(local_dir: str, uploaded: int, keep_local: int) -> None:
    """Local step directories older than the newest ``keep_local`` uploaded ones go."""
    try:
        names = storage.listdir(local_dir) if storage.exists(local_dir) else []
        found = sorted(
            int(n.rsplit("-", 1)[1])
            for n in (os.path.basename(x.rstrip("/")) for x in names)
            if n.startswith("step-") and n.rsplit("-", 1)[1].isdigit()
        )
        keep = {s for s in found if s <= uploaded}
        keep = set(sorted(keep)[-keep_local:]) | {s for s in found if s > uploaded}
        for s in found:
            if s not in keep:
                steps.remove_step(storage.join(local_dir, steps.step_dir_name(s)))
    except OSError as e:
        warnings.warn(f"anyshard: local retention under {local_dir} failed ({e})", stacklevel=2)


def clear_stale(path: str, group) -> AnyshardError | None:
    """Collective over ``group``: rank 0 clears the files an earlier attempt at the step ``path``
    left, and every rank learns whether it could (the error to raise, or None)."""
    # A crashed earlier attempt at this same step may have left files (perhaps from another
    # world size); this run owns the step now, so rank 0 clears them before anyone writes.
    # A committed step is left for anyshard.save to refuse.
    problem = None
    if coll.rank(group) == 0:
        try:
            problem = _clear_stale_here(path)
        except (AnyshardError, OSError) as e:
            problem = f"{path}: could not clear the files of an earlier attempt ({e})"
    problem = coll.broadcast_json(problem, group)  # nobody writes before the clear
    return AnyshardError(problem) if problem else None


def _clear_stale_here(path: str) -> str | None:
    """Rank 0's part of `clear_stale`: why the step directory cannot be reused, or None."""
    if storage.exists(path) and not storage.exists(storage.join(path, MANIFEST_NAME)):
        if steps.remove_steps([path]):
            return (
                f"{path}: holds data files that committed steps of {storage.parent(path)} "
                "reference (it was an incremental base, since deleted); saving this step "
                "again would overwrite them. Save under another step number"
            )
    return None
