"""Every hop checked: bytes damaged between ranks (one bit flipped in each tensor a rank sends,
at the transport) are a `ChecksumError` on every rank, naming the tensor and the sender, for a
read-once load, `anyshard.redistribute` (Shard(0) -> Shard(1)) and a peer heal; undamaged, the
same calls are bit-exact.

Run: python -m pytest tests/dist/test_transit_checksums.py -q
"""

from __future__ import annotations

import os
import socket

import pytest

TASKS = os.path.join(os.path.dirname(__file__), "_transit_tasks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hops(pool2, tmp_path_factory):
    """The outcomes of the three hops on both ranks, from one spawned job."""
    path = str(tmp_path_factory.mktemp("transit"))
    return pool2.run(TASKS, "every_hop_task", path, _free_port(), timeout=180)


def _assert_names(outcomes: list[dict], tensors: set[str], sender: int) -> None:
    for rank, o in enumerate(outcomes):
        assert o["type"] == "ChecksumError", (rank, o)
        assert o["tensor"] in tensors and o["sender"] == sender, (rank, o)
        assert o["tensor"] in o["text"] and f"sent by rank {sender}" in o["text"], o["text"]
    assert len({o["text"] for o in outcomes}) == 1  # the same error on every rank


def test_redistribute_damaged_in_transit_raises_on_every_rank(hops):
    got = [h["redistribute"] for h in hops]
    assert all(g["exact"] for g in got)
    _assert_names([g["damaged"] for g in got], {"w", "big"}, sender=1)
    assert got[0]["damaged"]["receiver"] == 0
    # with the checks off the same damage reaches the destination unnoticed
    assert all(g["unchecked_differs"] for g in got)


def test_read_once_forwarding_damaged_in_transit_raises_on_every_rank(hops):
    got = [h["read_once"] for h in hops]
    assert all(g["exact"] for g in got)
    # DCP's reader: the reading rank forwards what it read
    forwarded = [g["forwarded"] for g in got]
    _assert_names(forwarded, {"a", "b"}, sender=1)
    assert all(o["text"].startswith("load of ") for o in forwarded), forwarded
    # anyshard.load: the replicas read parts and redistribute them
    _assert_names([g["split"] for g in got], {"a", "b"}, sender=1)


def test_heal_damaged_in_transit_raises_on_both_groups(hops):
    got = [h["heal"] for h in hops]
    assert all(g["exact"] for g in got)
    _assert_names([g["damaged"] for g in got], {"user.default.w", "user.default.m"}, sender=0)
    assert got[1]["damaged"]["receiver"] == 1
