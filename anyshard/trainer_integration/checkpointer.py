"""The trainer plugin: save every N steps under one root, keep a retention policy, restore the newest.

Each save goes to ``ROOT/step-{step:09d}`` through `anyshard.save`, whose manifest written last is
the commit; a restore reads only committed steps, so a crash at any moment leaves at worst debris,
never a checkpoint that looks committed but is not. Old steps are deleted only once a newer one
has committed, and only by rank 0.

This version is synchronous: `Checkpointer.save` returns once the step is committed and
retention has run. There is no async save and no tiered ``local_dir`` mode yet.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/checkpointer.py``
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import anyshard
from anyshard import _collectives as coll
from anyshard.errors import AnyshardError
from anyshard.format import steps, storage
from anyshard.format.manifest import MANIFEST_NAME

__all__ = ["Checkpointer"]


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _check_app_state(app_state: Mapping[str, Any]) -> None:
    bad = sorted(
        f"{name!r} ({type(obj).__name__})"
        for name, obj in app_state.items()
        if not (_is_stateful(obj) or isinstance(obj, dict))
    )
    if bad:
        raise TypeError(
            f"app_state values must have state_dict()/load_state_dict() or be dicts; "
            f"got {', '.join(bad)}; wrap them in a class with those two methods"
        )


def _state_dicts(app_state: Mapping[str, Any]) -> dict[str, Any]:
    _check_app_state(app_state)
    return {name: obj.state_dict() if _is_stateful(obj) else obj for name, obj in app_state.items()}


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _steps_to_delete(
    committed: list[int], *, keep_last: int | None, keep_every: int | None
) -> list[int]:
    """The committed steps a retention policy deletes: all but the newest ``keep_last`` and the
    multiples of ``keep_every``. ``keep_last=None`` keeps everything.

    >>> _steps_to_delete([0, 2, 4, 6, 8], keep_last=2, keep_every=4)
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


class Checkpointer:
    """Save training state every ``every_steps`` steps under ``root`` and restore the newest.

    ``root`` is a local path or an fsspec URL. ``keep_last`` keeps the newest N committed steps
    (None: keep all), ``keep_every`` additionally keeps every step divisible by it. With
    ``async_``, `save` returns once the shards are staged in host memory and the files are
    written in the background; at most one save is in flight, and the next `save` (or `wait`)
    waits for it, raises its error, and applies retention. No tiered ``local_dir`` yet.

    >>> import tempfile, torch
    >>> root = tempfile.mkdtemp()
    >>> ckpt = Checkpointer(root, every_steps=2, keep_last=1)
    >>> state = {"model": {"w": torch.zeros(3)}}
    >>> for step in range(1, 5):
    ...     state["model"]["w"] += 1
    ...     _ = ckpt.save(step, state)
    >>> fresh = {"model": {"w": torch.zeros(3)}}
    >>> ckpt.restore_latest(fresh), fresh["model"]["w"]
    (4, tensor([4., 4., 4.]))
    """

    def __init__(
        self,
        root: str,
        *,
        every_steps: int = 1,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_: bool = False,
        process_group=None,
    ):
        if every_steps is None:
            raise ValueError("every_steps must be a positive int, got None")
        for name, value in (
            ("every_steps", every_steps),
            ("keep_last", keep_last),
            ("keep_every", keep_every),
        ):
            _positive(name, value)
        self.root = root
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.process_group = process_group
        self.async_ = async_
        self._pending = None  # the SaveHandle of the async save in flight

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved."""
        return storage.join(self.root, steps.step_dir_name(step))

    def save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save ``app_state`` as ``step`` if ``step`` is a multiple of ``every_steps``.

        Collective over the process group, like `anyshard.save`. Returns whether it saved. After
        the commit, rank 0 applies retention and removes debris older than this step.
        """
        if step % self.every_steps:
            return False
        self.wait()
        state = _state_dicts(app_state)
        path = self.step_path(step)
        self._clear_stale(path)
        if self.async_:
            self._pending = anyshard.save(
                path, state, process_group=self.process_group, async_=True
            )
            return True
        anyshard.save(path, state, process_group=self.process_group)
        if coll.rank(self.process_group) == 0:
            self._apply_retention()
        return True

    def wait(self) -> None:
        """Wait for the async save in flight (if any): raise its error, or apply retention."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.result()
        if coll.rank(self.process_group) == 0:
            self._apply_retention()

    def _clear_stale(self, path: str) -> None:
        # A crashed earlier attempt at this same step may have left files (perhaps from another
        # world size); this run owns the step now, so rank 0 clears them before anyone writes.
        # A committed step is left for anyshard.save to refuse.
        if coll.rank(self.process_group) == 0:
            if storage.exists(path) and not storage.exists(storage.join(path, MANIFEST_NAME)):
                steps.remove_step(path)
        coll.broadcast_json(None, self.process_group)  # a barrier: nobody writes before the clear

    def _apply_retention(self) -> None:
        # Housekeeping after a commit: a failure here must not fail the save that succeeded (and
        # raising on rank 0 alone would leave the other ranks in a different place), so warn.
        try:
            listed = steps.list_steps(self.root)
            committed = [s.step for s in listed if s.committed]
            doomed = set(
                _steps_to_delete(committed, keep_last=self.keep_last, keep_every=self.keep_every)
            )
            for s in listed:
                if s.step in doomed:
                    steps.remove_step(s.path)
            for s in steps.find_debris(listed):
                steps.remove_step(s.path)
        except (AnyshardError, OSError) as e:
            warnings.warn(
                f"anyshard: retention under {self.root} failed ({e}); old steps remain, "
                f"`anyshard gc {self.root}` removes debris",
                stacklevel=3,
            )

    def latest_step(self) -> int | None:
        """The newest committed step, the same on every rank (rank 0 lists and broadcasts)."""
        found = None
        if coll.rank(self.process_group) == 0:
            latest = steps.latest_committed(self.root)
            found = None if latest is None else latest.step
        return coll.broadcast_json(found, self.process_group)

    def restore_latest(self, app_state: Mapping[str, Any]) -> int | None:
        """Load the newest committed step into ``app_state``; return that step, or None if none.

        The template is each entry's current ``state_dict()``: tensors are filled in place under
        their current layout, then each Stateful gets ``load_state_dict``; plain dicts are
        updated in place. Uncommitted steps are never read.
        """
        _check_app_state(app_state)
        self.wait()
        step = self.latest_step()
        if step is None:
            return None
        state = _state_dicts(app_state)
        anyshard.load(self.step_path(step), state, process_group=self.process_group)
        for name, obj in app_state.items():
            if _is_stateful(obj):
                obj.load_state_dict(state[name])
        return step
