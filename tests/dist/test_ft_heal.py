"""`AnyshardTransport`: a replica group heals from another across torch.distributed worlds,
into another layout, bit-exact, with pickle made to raise in every process.

Run: python -m pytest tests/dist/test_ft_heal.py -q
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("torchft")

TASKS = os.path.join(os.path.dirname(__file__), "_ft_heal_tasks.py")


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Four processes in no process group, shared by the cases: two for each replica group, each
    group its own torch.distributed world per case."""
    from harness import DistPool

    pool = DistPool(4, str(tmp_path_factory.mktemp("ft-heal")), init=False)
    yield pool
    pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "src_layout,dst_layout",
    [("dp2", "dp2"), ("dp2", "tp2"), ("repl2", "dp2")],
)
def test_heal_across_groups_into_any_layout(processes, tmp_path, src_layout, dst_layout):
    src_port, dst_port = _free_port(), _free_port()
    args = [
        (role, layout, rank, port, src_port, str(tmp_path / role))
        for role, layout, port in (
            ("source", src_layout, src_port),
            ("healer", dst_layout, dst_port),
        )
        for rank in range(2)
    ]
    out = processes.run_ranks(TASKS, "group_main", args, timeout=120)
    sent, healed = out[:2], out[2:]
    assert all(h["checked"] == 6 for h in healed)
    # every byte the healers lack arrives once: what the sources sent is what they received
    assert sum(h["received"] for h in healed) == sum(s["sent"] for s in sent) > 0
