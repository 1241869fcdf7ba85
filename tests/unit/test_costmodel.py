"""The layout cost model: counts that grow never predict a faster step; the memory filter
rejects what does not fit; the table ranks every valid layout."""

import dataclasses

from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.layout_chooser.costmodel import (
    block_model_s,
    calibrate,
    predict,
    rank_layouts,
    workload,
)
from anyshard.trainer_integration.planning.step_cost import Rates


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


def test_the_block_scale_multiplies_compute_and_dispatch_not_communication():
    cfg = Config()
    rates = Rates.nominal()
    slower = dataclasses.replace(rates, block_scale=1.5)
    for row in rank_layouts(cfg, 4, rates, memory_bytes=1 << 34).rows:
        a, b = predict(cfg, row.parallel, rates), predict(cfg, row.parallel, slower)
        assert abs(b.compute_s - 1.5 * a.compute_s) < 1e-12, row.layout
        assert abs(b.dispatch_s - 1.5 * a.dispatch_s) < 1e-12, row.layout
        assert b.comm_s == a.comm_s, row.layout


def test_calibration_times_one_block_against_its_counted_time():
    import time

    import torch

    from anyshard.trainer_integration.gpt.model import ParallelContext, TransformerBlock

    tiny = Config()
    tiny = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, dim=64, ffn_dim=128))
    # the calibration the other worker's tests disturbed least, of three
    rates = [calibrate(gemm_sizes=(32, 128), budget_s=0.05, cfg=tiny) for _ in range(3)]
    rates = min(rates, key=lambda r: r.block_scale * block_model_s(tiny, 1, r))
    counted = block_model_s(tiny, 1, rates)
    # the block timed here, independently: forward and backward on the whole batch
    block = TransformerBlock(tiny.model, ParallelContext())
    x = torch.randn(tiny.train.global_batch, tiny.train.seq_len, 64, requires_grad=True)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        block(x).sum().backward()
        times.append(time.perf_counter() - t0)
    measured = min(times)  # the run the other worker's tests disturbed least
    # the same work timed twice on a shared machine (the suite's two workers): within 3x
    assert 1 / 3 < rates.block_scale * counted / measured < 3, (
        rates.block_scale,
        counted,
        measured,
    )


def test_the_wait_for_peers_is_added_to_every_collective_of_its_group_size():
    from anyshard.trainer_integration.planning.step_cost import Collective, rates_from_timings

    timings = {f"{k}/{g}": [(1 << 10, 1e-4 * g), (1 << 20, 1e-3 * g)]
               for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
               for g in (2, 4)}  # fmt: skip
    args = ([(32, 1e-5), (128, 1e-4)], (1e6, 1e-4), 1e-6, 1e-5, timings)
    idle, busy = rates_from_timings(*args), rates_from_timings(*args, peer_wait={"2": 0.003})
    for kind in ("all_gather", "all_reduce", "send"):
        c2, c4 = Collective("x", kind, 2, 1 << 16, 1), Collective("x", kind, 4, 1 << 16, 1)
        assert abs(busy.collective_s(c2) - idle.collective_s(c2) - 0.003) < 1e-12, kind
        assert busy.collective_s(c4) == idle.collective_s(c4), kind
    assert Rates.from_json(busy.to_json()) == busy
    cfg = Config()
    for row in rank_layouts(cfg, 4, idle, memory_bytes=1 << 34).rows:
        pairs = sum(c.count for c in workload(cfg, row.parallel).collectives if c.group == 2)
        extra = predict(cfg, row.parallel, busy).comm_s - predict(cfg, row.parallel, idle).comm_s
        assert abs(extra - 0.003 * pairs) < 1e-9, row.layout


def test_busy_timing_counts_only_the_calls_that_ended_while_every_rank_was_busy():
    import time

    from anyshard.trainer_integration.gpt.layout_chooser.measure import time_busy

    durations = iter([0.0, 0.01, 0.01, 0.01, 0.3])  # a warm call, three short, one long

    def fn() -> None:
        time.sleep(next(durations))

    # the long call ends after the budget: the others may have stopped by then
    assert 0.009 < time_busy(fn, 0.035) < 0.02


def test_the_docstring_examples_of_the_cost_model_and_the_scheduler_run():
    import doctest

    from anyshard.trainer_integration.gpt.layout_chooser import costmodel, memory, shares, valid
    from anyshard.trainer_integration.gpt.layout_chooser import scheduler as autolayout
    from anyshard.trainer_integration.planning import step_cost

    for module in (costmodel, autolayout, memory, valid, step_cost, shares):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, (module.__name__, result)
