"""Every rank fails together: an error one rank meets inside a collective load reaches every
rank as the same AnyshardError within seconds, not at the process group's time-out. The matrix:
damage only the last rank meets (a flipped data byte, a cut, a damaged header, a missing file)
x loads every rank makes (anyshard.load of DTensors, the same with read_once, a spec load of
plain local tensors, dcp.load through AnyshardReader, where DCP raises its CheckpointException,
holding the AnyshardError, on every rank) x 2 and 4 ranks.

Run: python -m pytest tests/dist/test_fail_together.py -q
"""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_fault_tasks.py")


@pytest.mark.parametrize("world", [2, 4])
def test_a_damaged_byte_one_rank_fetches_under_read_once_fails_every_rank(
    dist_pools, tmp_path, world
):
    pool = dist_pools.get(world)
    # 4 MiB: checksum blocks of 256 KiB, so only the rank fetching the last part reads the byte
    out = pool.run(TASKS, "damaged_read_once_task", str(tmp_path / "ckpt"), 1 << 20, timeout=120)
    causes = set()
    for rank, r in enumerate(out):
        assert r["raised"] is not None, f"rank {rank} did not raise"
        assert r["raised"]["type"] == "ChecksumError", (rank, r["raised"])
        assert r["seconds"] < 10, (rank, r["seconds"])
        causes.add(r["raised"]["text"].split(" failed on rank(s) ")[-1])
    assert len(causes) == 1, causes  # the same cause on every rank
    # the ranks that read the damaged block themselves: not all of them, so the others raised
    # what reached them from those
    failed = causes.pop().split(":")[0].split(", ")
    assert 0 < len(failed) < world, failed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "entry", ["load", "read_once", "spec", "spec_read_once", "dcp", "dcp_read_once"]
)
@pytest.mark.parametrize("kind", ["flip", "truncate", "header", "missing"])
def test_damage_one_rank_meets_fails_every_rank_with_the_same_cause(
    dist_pools, tmp_path, world, entry, kind
):
    pool = dist_pools.get(world)
    out = pool.run(TASKS, "fail_together_task", str(tmp_path), kind, entry, timeout=120)
    cause = {"flip": "ChecksumError", "header": "ChecksumError"}.get(kind, "CorruptCheckpointError")
    last = f"rank-{world - 1:05d}.safetensors"  # the damaged file, named on every rank
    for rank, r in enumerate(out):
        assert r["raised"] is not None, f"rank {rank} did not raise"
        assert r["seconds"] < 10, (rank, r["seconds"])
        assert last in r["raised"]["text"] and cause in r["raised"]["text"], (rank, r["raised"])
        if not entry.startswith("dcp"):  # the same AnyshardError class and cause on every rank
            assert r["raised"]["type"] == cause, (rank, r["raised"])
            assert r["raised"]["text"] == out[0]["raised"]["text"], (rank, r["raised"])
        else:  # DCP gathers every rank's read errors and raises them on every rank
            assert r["raised"]["type"] == "CheckpointException", (rank, r["raised"])
