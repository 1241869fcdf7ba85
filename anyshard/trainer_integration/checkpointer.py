"""The trainer plugin: save every N steps under one root, keep a retention policy, restore the newest.

Each save goes to ``ROOT/step-{step:09d}`` through `anyshard.save`, whose manifest written last is
the commit; a restore reads only committed steps, so a crash at any moment leaves at worst debris,
never a checkpoint that looks committed but is not. Old steps are deleted only once a newer one
has committed, and only by rank 0.

Retention runs in the background after each commit. With ``local_dir`` (tiered mode) each step
is first saved to local disk and committed there, then uploaded to ``root`` in the background
(data files first, the manifest last: the commit on the object store); a restore reads the newest
step from local disk where every file it needs is there, else from ``root``.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/checkpointer.py``
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch

from anyshard.api import async_save
from anyshard.api import collectives as coll
from anyshard.api.load import load
from anyshard.api.save import save, save_deferred
from anyshard.errors import AnyshardError
from anyshard.format import steps, storage
from anyshard.trainer_integration.app_state import check_restorable, state_dicts, write_back
from anyshard.trainer_integration.retention import (
    apply_local_retention,
    apply_retention,
    clear_stale,
)
from anyshard.trainer_integration.tiered import choose_step, upload

__all__ = ["Checkpointer"]


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


class Checkpointer:
    """Save training state every ``every_steps`` steps under ``root`` and restore the newest.

    ``root`` is a local path or an fsspec URL. ``keep_last`` keeps the newest N committed steps
    (None: keep all), ``keep_every`` additionally keeps every step divisible by it; retention runs
    in the background after a newer step has committed. With ``async_``, `save` returns once the
    shards are staged in host memory and the files are written in the background; at most one
    save is in flight, and the next `save` (or `wait`) waits for it and raises its error. With
    `guard` (``ckpt.guard(optimizer)``), an async `save` returns at once and the staging copy
    runs while forward and backward proceed; ``optimizer.step()`` waits only if the copy of the
    tensors it would modify is not done yet.

    Retention also removes debris: uncommitted steps older than the newest commit, and those
    newer in which nothing was written for ``stale_after_s`` seconds (a killed save's; None:
    never).

    With ``local_dir`` (a local directory, one per node), steps are saved there first and
    uploaded to ``root`` in the background; the newest ``keep_local`` steps stay on local disk.
    With ``incremental``, every save hashes its shards (SHA-256) and references, rather than
    writes again, each shard that the previous step of this root holds unchanged (see
    `anyshard.save`'s ``base``); ``frozen`` names stored tensors (as ``anyshard.open(step)``
    lists them, e.g. ``"model.tok_emb.weight"``) known not to change, which skip the hashing.
    Retention never deletes a file that a kept step references.

    With ``on_error="skip"``, a save that fails (a full disk, a storage error after its
    retries; sync or async) does not stop training: every rank learns of it together, the
    failure is warned about and kept in `failures` (step, error), the failed step's files are
    already removed (see `anyshard.save`), debris is cleared (as after a commit), and the next
    interval tries again; only
    ``max_failures`` failed saves in a row raise (the last one's error). ``"raise"`` (the
    default) raises the first. Skipping adds two small collectives to each save.

    `restore_latest` picks the newest step that every rank can read, from local disk where all
    the files it needs are there (a restart on the same nodes), else from ``root`` (a replacement
    node, or a lost local disk).

    The app state passed to `save` and `restore_latest` maps names to objects with
    ``state_dict()`` and ``load_state_dict()`` (models, optimizers, schedulers), to dicts of
    tensors and JSON values, or to plain JSON values (``{"step": 5}``, ``{"lrs": [0.1, 0.2]}``:
    ints, floats, strings, bools, None, and lists and dicts of them), which are saved as JSON
    values. A plain value cannot be loaded in place: `restore_latest` writes the stored value
    into the app state's entry (a list is refilled in place), so read it from the dict after
    the restore, not from a name bound to it before.

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
        local_dir: str | None = None,
        keep_local: int = 1,
        process_group=None,
        incremental: bool = False,
        frozen: Collection[str] | None = None,
        on_error: str = "raise",
        max_failures: int = 3,
        stale_after_s: float | None = 3600.0,
    ):
        self.root = root
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.process_group = process_group
        self.async_ = async_
        self.local_dir = local_dir
        self.keep_local = keep_local
        self.incremental = incremental
        self.on_error = on_error
        self.max_failures = max_failures
        self.stale_after_s = stale_after_s
        self._check_options(frozen)
        self.frozen = frozenset(frozen or ())
        self._base: str | None = None  # the newest committed step of this root we know of
        self._issued: str | None = None  # the save in flight, a base once it has committed
        self._pending: list = []  # SaveHandles of the background work in flight
        self._hooks: list = []  # optimizer pre-step hooks of `guard`
        self.blocked_s = 0.0  # seconds `save` and `wait_staged` have held up their caller
        # failed saves skipped under on_error="skip": {"step", "error", "time"}, oldest first
        self.failures: list[dict[str, Any]] = []
        self._failed_in_a_row = 0
        self._in_flight: int | None = None  # the step of the async save not yet waited for

    def _check_options(self, frozen: Collection[str] | None) -> None:
        """The options given to `__init__`, checked before anything uses them."""
        if self.every_steps is None:
            raise ValueError("every_steps must be a positive int, got None")
        for name in ("every_steps", "keep_last", "keep_every", "keep_local"):
            _positive(name, getattr(self, name))
        local_dir = self.local_dir
        if local_dir is not None and storage.is_url(local_dir):
            raise ValueError(f"local_dir must be a local directory, not the URL {local_dir!r}")
        if self.incremental and local_dir is not None:
            raise ValueError(
                "incremental=True is not supported with local_dir (tiered saves upload each "
                "step's own files); use one of them"
            )
        if frozen and not self.incremental:
            raise ValueError("frozen names only apply with incremental=True")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        _positive("max_failures", self.max_failures)
        stale_after_s = self.stale_after_s
        if stale_after_s is not None and not stale_after_s >= 0:
            raise ValueError(f"stale_after_s must be None or >= 0 seconds, got {stale_after_s}")

    def guard(self, *optimizers) -> None:
        """Let async saves return at once and stage their copies while the training loop runs
        forward and backward: each optimizer's ``step()`` first waits, if it must, until the
        save in flight has copied the tensors it would modify (`wait_staged`). Replaces the
        optimizers guarded before (after a relayout, guard the new one). Without ``async_``,
        saves block as always, and the hooks cost nothing.

        Only optimizer steps are guarded: a model whose forward pass updates saved buffers
        (batch-norm running statistics) must call `wait_staged` before that forward.

        With ``async_``, collective over the process group: it starts the save thread and its
        gloo group, which the first save would otherwise do while the training loop waits."""
        if self.async_:
            async_save.start(self.process_group)
        for h in self._hooks:
            h.remove()
        self._hooks = [
            opt.register_step_pre_hook(lambda *_: self.wait_staged()) for opt in optimizers
        ]

    def wait_staged(self) -> None:
        """Wait until the save in flight has copied every tensor it saves into its staging
        buffers (at once when none is in flight): the one call a training loop that does not
        use `guard` makes before it modifies saved tensors (``optimizer.step()``)."""
        start = time.perf_counter()
        for handle in self._pending:
            wait = getattr(handle, "wait_staged", None)
            if wait is not None:
                wait()
        self.blocked_s += time.perf_counter() - start

    def prepare(self, app_state: Mapping[str, Any]) -> async_save.SaveHandle:
        """Allocate and touch the staging buffers of an async save of ``app_state`` on the save
        thread, while training goes on, so that the first save does not pay for them (it waits
        for the reservation only if that has not finished). Takes each entry's ``state_dict()``
        (which, for an optimizer that has not stepped yet, makes torch initialise its state:
        call this after the first step or a restore) and copies its containers; the rest runs
        on the save thread. Returns the reservation's handle (`wait` waits for it too)."""
        from anyshard.api.state import copy_containers, flatten_state

        state = copy_containers(state_dicts(app_state))

        def reserve() -> int:
            local = {}
            for fqn, leaf in flatten_state(state).items():
                v = leaf.value
                if isinstance(v, torch.Tensor):
                    local[fqn] = v.to_local() if hasattr(v, "to_local") else v
            return async_save.reserve(local)

        # on the save thread, while training goes on; the first save waits for it if it must
        handle = async_save.submit(reserve)
        self._pending.append(handle)
        return handle

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved in ``root``."""
        return storage.join(self.root, steps.step_dir_name(step))

    def local_path(self, step: int) -> str | None:
        """Where ``step`` is (or would be) saved on local disk; None without ``local_dir``."""
        if self.local_dir is None:
            return None
        return self._local_step(step)

    def _local_step(self, step: int) -> str:
        """`local_path` in tiered mode (``local_dir`` set), where every caller of it runs."""
        assert self.local_dir is not None
        return storage.join(self.local_dir, steps.step_dir_name(step))

    def save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save ``app_state`` as ``step`` if ``step`` is a multiple of ``every_steps``.

        Collective over the process group, like `anyshard.save`. Returns whether it saved.
        """
        if step % self.every_steps:
            return False
        start = time.perf_counter()
        try:
            if self.on_error == "raise":
                self._save(step, app_state)
                return True
            before, prev, this = self._in_flight, None, None
            try:  # the async save before this one (its failure surfaces here)
                self._wait()
            except Exception as e:
                prev = e
            # agreed first: at the limit, every rank raises before this step's save starts
            self._settle(before, prev, None, None)
            try:  # after a failure, this step is the next attempt
                self._save(step, app_state)
            except Exception as e:
                this = e
            return self._settle(None, None, step, this)
        finally:
            self.blocked_s += time.perf_counter() - start

    def _settle(
        self, before: int | None, prev: BaseException | None, step: int | None,
        this: BaseException | None,
    ) -> bool:  # fmt: skip
        """``on_error="skip"`` (collective): agree over every rank whether the background save
        of step ``before`` (``prev``) and this call's save of ``step`` (``this``) failed; record
        and warn, or raise after ``max_failures`` in a row. Whether ``step``'s save was issued
        without an error."""
        mine = [None if e is None else f"{type(e).__name__}: {e}" for e in (prev, this)]
        everyone = coll.all_gather_json(mine, self.process_group)
        background = self.async_ or self.local_dir is not None  # alike on every rank
        issued = True
        for i, at, cause in ((0, before, prev), (1, step, this)):
            if at is None:
                continue
            failed = next((m[i] for m in everyone if m[i] is not None), None)
            if failed is None:
                if i == 0 or not background:  # committed
                    self._failed_in_a_row = 0
                continue
            if i == 1:  # this call's save was not issued (the one before: already waited for)
                issued, self._issued = False, None
            self._failed_in_a_row += 1
            self.failures.append({"step": at, "error": failed, "time": time.time()})
            if coll.rank(self.process_group) == 0:  # room for the next attempt: debris of
                self._apply_retention()  # killed saves (stale) and of older attempts goes
            if self._failed_in_a_row >= self.max_failures:
                raise AnyshardError(
                    f"{self._failed_in_a_row} checkpoint saves under {self.root} failed in a "
                    f"row (on_error='skip', max_failures={self.max_failures}); the last, of "
                    f"step {at}: {failed}"
                ) from cause
            warnings.warn(
                f"anyshard: the checkpoint save of step {at} under {self.root} failed "
                f"({failed}); its files are removed and training goes on, the next save tries "
                f"again ({self._failed_in_a_row} of at most {self.max_failures} failures in a "
                "row)",
                stacklevel=4,
            )
        self._in_flight = step if background and issued and step is not None else None
        return issued

    def _save(self, step: int, app_state: Mapping[str, Any]) -> None:
        self._wait()
        state: dict[str, Any] = {}
        error = None
        try:  # rank-local: a rank that fails here must not leave the others in a collective
            state = state_dicts(app_state)
        except Exception as e:
            error = e
        if self.async_ and self._hooks and self.local_dir is None:
            if error is not None:  # no collective follows on this thread: nobody waits
                raise error
        else:
            coll.raise_together(error, self.process_group, f"checkpoint save of step {step}")
        path = self.step_path(step)
        if self.local_dir is not None:  # the root is cleared and written in the background
            self._save_tiered(step, state)
            return
        inc: dict[str, Any] = {}
        if self.incremental:
            inc = {"base": self._base, "frozen": self.frozen, "content_hash": True}
            if self._base is None:
                inc["frozen"] = None
        self._issued = path
        if self.async_ and self._hooks:  # nothing here waits for the other ranks
            before = functools.partial(clear_stale, path)  # on the save thread, its group
            self._pending.append(
                save_deferred(path, state, process_group=self.process_group, before=before, **inc)
            )
        elif self.async_:
            self._clear_stale(path)
            self._pending.append(
                save(path, state, process_group=self.process_group, async_=True, **inc)
            )
        else:
            self._clear_stale(path)
            try:
                save(path, state, process_group=self.process_group, **inc)
            except BaseException:
                self._issued = None
                raise
            self._base, self._issued = path, None
        if coll.rank(self.process_group) == 0:
            self._pending.append(async_save.submit(self._apply_retention))

    def _save_tiered(self, step: int, state: dict[str, Any]) -> None:
        local, remote = self._local_step(step), self.step_path(step)
        self._clear_stale(local)
        group = async_save.background_group(self.process_group)  # collective: on this thread
        handle = save(
            local,
            state,
            process_group=self.process_group,
            async_=self.async_,
            defer_staging=self.async_ and bool(self._hooks),
        )
        if handle is not None:
            self._pending.append(handle)
        assert self.local_dir is not None  # tiered mode
        uploaded = functools.partial(apply_local_retention, self.local_dir, step, self.keep_local)
        self._pending.append(
            async_save.submit(
                lambda: upload(
                    step, local, remote, group, committed=self._apply_retention, uploaded=uploaded
                )
            )
        )

    def wait(self, *, collective: bool = True) -> None:
        """Wait for the background work in flight (save, upload, retention); raise its error
        (under ``on_error="skip"``, collective: as `save` does, count it and raise only the
        ``max_failures``-th failure in a row; ``collective=False``: this rank alone, raising any
        error, e.g. before a rank exits on its own)."""
        if self.on_error == "raise" or not collective:
            self._wait()
            return
        before, prev = self._in_flight, None
        try:
            self._wait()
        except Exception as e:
            prev = e
        self._settle(before, prev, None, None)

    def _wait(self) -> None:
        """Wait for every handle in flight (none is left running), then raise the first error."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for handle in pending:
            try:
                handle.result()
            except BaseException as e:
                first = first or e
        if first is not None:
            self._issued = None
            raise first
        if self._issued is not None:
            self._base, self._issued = self._issued, None

    def _clear_stale(self, path: str) -> None:
        """Collective: rank 0 clears what an earlier attempt at this step left before anyone
        writes (`clear_stale`); every rank raises if it could not."""
        error = clear_stale(path, self.process_group)
        if error is not None:
            raise error

    def _apply_retention(self) -> None:
        apply_retention(
            self.root,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            stale_after_s=self.stale_after_s,
            in_flight=self._issued,
        )

    def latest_step(self) -> int | None:
        """The newest committed step in ``root``, the same on every rank (rank 0 lists and
        broadcasts)."""
        found = None
        if coll.rank(self.process_group) == 0:
            latest = steps.latest_committed(self.root)
            found = None if latest is None else latest.step
        return coll.broadcast_json(found, self.process_group)

    def restore_latest(self, app_state: Mapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest committed step into ``app_state``; return that step, or None if none.

        The template is each entry's current ``state_dict()``: tensors are filled in place under
        their current layout, then each Stateful gets ``load_state_dict``; plain dicts and lists
        are updated in place. Any other JSON value (an int, a string, a tuple) cannot change in
        place: ``app_state[name]`` is set to the stored value (``app_state`` must be a mutable
        mapping then). Uncommitted steps are never read. ``strict=False`` lets a rank load a part
        of the checkpoint (a pipeline stage holds only its layers).

        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> _ = Checkpointer(root).save(3, {"step": 3, "config": {"lr": 0.1, "name": "x"}})
        >>> app = {"step": 0, "config": {}}
        >>> Checkpointer(root).restore_latest(app), app
        (3, {'step': 3, 'config': {'lr': 0.1, 'name': 'x'}})
        """
        check_restorable(app_state)
        self.wait()
        step, local = choose_step(self.root, self.local_dir, self.process_group)
        if step is None:
            return None
        state = state_dicts(app_state)
        path = self._local_step(step) if local else self.step_path(step)
        self.restored_from = path
        load(path, state, process_group=self.process_group, strict=strict)
        if not local:
            self._base = path  # the next incremental save references what it holds
        write_back(app_state, state)
        return step
