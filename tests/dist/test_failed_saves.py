"""Saves that meet a storage fault clean up after themselves: a disk that fills up (a real,
size-limited tmpfs where this machine lets the test mount one, else ENOSPC injected at the
storage layer), EIO and EACCES, on one rank or every rank, sync and async. Every rank raises an
AnyshardError that names the path and the cause, nothing is committed, no file of the failed
step is left, the previous step still loads and the next save succeeds with no manual step.

Run: python -m pytest tests/dist/test_failed_saves.py -q
"""

from __future__ import annotations

import os
import subprocess

import pytest

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_fault_tasks.py")


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 2 MiB tmpfs, or None where mounting one is not allowed."""
    where = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _check(out, step_dir: str, cause: str, world: int) -> None:
    for rank, r in enumerate(out):
        assert r["raised"] is not None, f"rank {rank} did not raise"
        assert r["raised"]["type"] in ("StorageError", "SaveError"), (rank, r["raised"])
        assert step_dir in r["raised"]["text"], (rank, r["raised"])
        assert cause in r["raised"]["text"], (rank, r["raised"])
        # nothing committed and nothing left: the failed step's directory is gone
        assert r["left"] is None, (rank, r["left"])
        assert r["step1_loads"] and r["step3_saved"], (rank, r)
    assert len(out) == world


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_fails_every_rank_leaves_nothing_and_the_next_save_succeeds(
    pool2, small_disk, tmp_path, mode
):
    if small_disk is not None:  # the disk itself: 2 ranks x 1.5 MiB into 2 MiB
        root = os.path.join(small_disk, mode)
        out = pool2.run(TASKS, "failed_save_task", root, None, [], mode, 1.5)
    else:  # no mount allowed here: ENOSPC from the storage layer on both ranks
        root = str(tmp_path / mode)
        out = pool2.run(TASKS, "failed_save_task", root, "enospc", [0, 1], mode, 1.5)
    _check(out, os.path.join(root, "step-2"), "No space left on device", 2)
    assert sorted(os.listdir(root)) == ["step-1", "step-3"]


@pytest.mark.parametrize(
    "kind, ranks, mode",
    [
        ("eio", [1], "sync"),
        ("eio", [0], "async"),
        ("eacces", [0, 1], "sync"),
        ("eacces", [1], "async"),
        ("enospc", [1], "sync"),
    ],
)
def test_an_injected_storage_fault_fails_every_rank_and_leaves_nothing(
    pool2, tmp_path, kind, ranks, mode
):
    root = str(tmp_path / "ckpt")
    out = pool2.run(TASKS, "failed_save_task", root, kind, ranks, mode, 0.25)
    cause = os.strerror({"eio": 5, "eacces": 13, "enospc": 28}[kind])
    _check(out, os.path.join(root, "step-2"), cause, 2)
    assert sorted(os.listdir(root)) == ["step-1", "step-3"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_skipping_checkpointer_trains_on_through_failed_saves_and_raises_at_the_limit(
    pool2, tmp_path, mode
):
    # EIO on rank 1 at steps 2 and 3: both skipped on every rank, step 4 commits again
    out = pool2.run(TASKS, "skipping_checkpointer_task", str(tmp_path / "a"), mode, [2, 3], 1)
    for r in out:
        assert r["raised"] is None, r
        assert r["failures"] == [2, 3], r
        assert r["committed"] == [1, 4, 5, 6] and r["debris"] == [], r
        assert r["newest_loads"] and r["warned"] == 2, r
        if mode == "sync":  # an async save's failure is known only at the next save
            assert [r["returned"][s] for s in range(1, 7)] == [1, 0, 0, 1, 1, 1], r
    # three failures in a row (steps 2, 3, 4) raise on every rank, at the same call
    out = pool2.run(TASKS, "skipping_checkpointer_task", str(tmp_path / "b"), mode, [2, 3, 4], 0)
    at = {"sync": 4, "async": 5}[mode]  # async: step 4's failure surfaces at step 5's save
    for r in out:
        assert r["raised"] is not None and r["raised"]["step"] == at, r
        assert (
            "3 checkpoint saves" in r["raised"]["text"] and "failed in a row" in r["raised"]["text"]
        )
        assert r["failures"] == [2, 3, 4] and r["committed"][0] == 1 and r["debris"] == [], r


def test_a_save_to_a_committed_path_is_refused_on_every_rank_and_touches_nothing(pool2, tmp_path):
    out = pool2.run(TASKS, "save_over_committed_task", str(tmp_path / "step-1"))
    for r in out:
        assert (
            r["raised"] is not None
            and "already holds a committed checkpoint" in r["raised"]["text"]
        )
        assert r["intact"], r  # no rank wrote into it, nothing of it was removed


def test_a_seeded_fault_soak_loses_nothing_and_every_next_save_succeeds(pool2, tmp_path):
    """``ANYSHARD_FAULT_ROUNDS`` rounds (default 4; tools/crash_soak.py --faults runs more) of
    seeded faults (``ANYSHARD_FAULT_SEED``): every faulted save fails on every rank within 10 s
    and leaves no file; the save after the fault clears succeeds; every commit loads bit-exact."""
    rounds = int(os.environ.get("ANYSHARD_FAULT_ROUNDS", "4"))
    seed = int(os.environ.get("ANYSHARD_FAULT_SEED", "7"))
    out = pool2.run(
        TASKS, "fault_soak_task", str(tmp_path / "soak"), seed, rounds, timeout=60 + 30 * rounds
    )
    for rank, r in enumerate(out):
        assert r["faults"] == r["failed"] == r["retried"] == rounds, (rank, r)
        assert r["slow"] == r["left"] == r["lost"] == r["wrong"] == 0, (rank, r)
    print(
        f"fault-soak: seed {seed}: {rounds} faults x {len(out)} ranks, "
        f"{sum(r['failed'] for r in out)} saves failed together, {out[0]['left']} files left, "
        f"{out[0]['retried']} saves succeeded after the fault cleared, {out[0]['lost']} commits "
        f"lost, {out[0]['slow']} hangs, {out[0]['wrong']} wrong loads"
    )
