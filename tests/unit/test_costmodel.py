"""The layout cost model: counts that grow never predict a faster step; the memory filter
rejects what does not fit; the table ranks every valid layout."""

import dataclasses

from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.costmodel import Rates, predict, rank_layouts, workload


def test_more_bytes_moved_never_predicts_a_faster_step():
    cfg = Config()
    rates = Rates.nominal()
    table = rank_layouts(cfg, 4, rates, memory_bytes=1 << 34)
    assert len(table.rows) == 13  # every valid layout of 4 ranks
    bigger = dataclasses.replace(cfg.train, seq_len=cfg.train.seq_len * 2)
    cfg2 = dataclasses.replace(cfg, train=bigger)
    for row in table.rows:
        a, b = workload(cfg, row.parallel), workload(cfg2, row.parallel)
        assert sum(c.bytes * c.count for c in b.collectives) >= sum(
            c.bytes * c.count for c in a.collectives
        )
        assert predict(cfg2, row.parallel, rates).step_s > row.step_s, row.layout


def test_the_memory_filter_rejects_what_does_not_fit():
    cfg = Config()
    rates = Rates.nominal()
    full = rank_layouts(cfg, 4, rates, memory_bytes=1 << 34)
    budget = sorted(r.memory_bytes for r in full.rows)[len(full.rows) // 2]
    tight = rank_layouts(cfg, 4, rates, memory_bytes=budget)
    assert 0 < len(tight.rows) < len(full.rows)
    assert all(r.memory_bytes <= budget for r in tight.rows)
    assert any("exceeds" in why for _, why in tight.rejected)
