"""`AnyshardTransport`: a replica group heals from another across torch.distributed worlds,
into another layout, bit-exact, with pickle made to raise in every process.

Run: python -m pytest tests/dist/test_ft_heal.py -q
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import socket

import pytest

pytest.importorskip("torchft")

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "src_layout,dst_layout",
    [("dp2", "dp2"), ("dp2", "tp2"), ("repl2", "dp2")],
)
def test_heal_across_groups_into_any_layout(tmp_path, src_layout, dst_layout):
    import sys

    sys.path.insert(0, HERE)
    from _ft_heal_tasks import group_main

    ctx = mp.get_context("spawn")
    src_port, dst_port = _free_port(), _free_port()
    procs = []
    for role, layout, port in (("source", src_layout, src_port), ("healer", dst_layout, dst_port)):
        for rank in range(2):
            out = str(tmp_path / role)
            args = (role, layout, rank, port, src_port, out)
            procs.append(ctx.Process(target=group_main, args=args))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    errors = sorted(tmp_path.glob("*.err"))
    assert not errors, errors[0].read_text()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    healed = [ast.literal_eval((tmp_path / f"healer.{r}.ok").read_text()) for r in range(2)]
    sent = [ast.literal_eval((tmp_path / f"source.{r}.ok").read_text()) for r in range(2)]
    assert all(h["checked"] == 6 for h in healed)
    # every byte the healers lack arrives once: what the sources sent is what they received
    assert sum(h["received"] for h in healed) == sum(s["sent"] for s in sent) > 0
