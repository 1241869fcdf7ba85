"""Stragglers: each rank's own work (its step less its waits in collectives, `waits`), the
kinds of straggler ``ANYSHARD_SLOW`` injects, and the scheduler's shares following a slow rank
and coming back when it recovers."""

import dataclasses
import os
import random
import re
import threading

import pytest
import torch

from anyshard.trainer_integration.gpt.config import (
    Config,
    ConfigError,
    ParallelConfig,
    loads_config,
)
from anyshard.trainer_integration.gpt.layout_chooser import straggler as straggler_module
from anyshard.trainer_integration.gpt.layout_chooser import waits
from anyshard.trainer_integration.gpt.layout_chooser.scheduler import Policy, Scheduler
from anyshard.trainer_integration.gpt.layout_chooser.straggler import (
    Straggler,
    pin_to_own_core,
    set_process_affinity,
)
from anyshard.trainer_integration.gpt.layout_chooser.waits import WaitClock, blocked_in
from anyshard.trainer_integration.planning.step_cost import Rates


def test_waits_are_booked_once_to_the_thread_that_waits_and_the_wrappers_go_when_it_leaves(
    monkeypatch,
):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    work_wait, wait_tensor = dist.Work.wait, funcol.wait_tensor
    ticks = iter([10.0, 12.5])  # a wrapped wait reads the clock as it starts and as it ends
    monkeypatch.setattr(waits, "_now", lambda: next(ticks))
    with WaitClock() as clock, WaitClock() as other:
        assert funcol.wait_tensor.__wrapped__ is wait_tensor
        assert dist.Work.wait.__wrapped__ is work_wait
        clock.begin()
        blocked_in(0.25)
        elsewhere = threading.Thread(target=blocked_in, args=(1.0,))
        elsewhere.start()
        elsewhere.join()
        assert clock.blocked_s == 0.25  # another thread's wait is not this one's
        # a wait inside a wait (wait_tensor waits its Work) counts once: 2.5 s, not twice
        outer = waits._timed(waits._timed(lambda: None))
        outer()
        assert clock.blocked_s == 2.75 and other.blocked_s == 2.75
        assert clock.own(3.0) == pytest.approx(0.25)
        clock.begin()
        assert clock.own(1.0) == 1.0
    assert dist.Work.wait is work_wait and funcol.wait_tensor is wait_tensor


def _job(s: Scheduler, steps: range, busy) -> None:
    for step in steps:
        s.decide(step)
        b, d = busy(step, s.shares)
        s.observe(max(b), b, d)


def _online(steps: int, **policy) -> Scheduler:
    p = ParallelConfig(dp_shard=2)
    cfg = dataclasses.replace(Config(), parallel=p)
    pol = Policy(trials=0, trial_steps=3, **policy)
    return Scheduler(cfg, p, Rates.nominal(), total_steps=steps, online=True, policy=pol)


def _moves(s: Scheduler, first: int = 0) -> list[dict]:
    return [d for d in s.decisions if d["event"] == "auto_rebalance" and d["step"] >= first]


@pytest.mark.parametrize("fixed", [0.0, 0.05])
def test_a_slow_rank_is_named_and_the_shares_come_back_to_even_when_it_recovers(fixed):
    # data rank 1 works 2x longer from step 50 to 150 (``fixed``: work no share changes, the
    # optimizer's, slowed too), each step within 4% noise; then both are alike again, and the
    # rank with the larger share is the busier one until the shares are even again
    rng = random.Random(3)
    s = _online(260)

    def busy(step, shares):
        n = shares or (24, 24)
        factor = 2.0 if 50 <= step < 150 else 1.0
        own = [fixed + 0.004 * n[0], factor * (fixed + 0.004 * n[1])]
        return [x * (1 + 0.04 * rng.random()) for x in own], [0, 1]

    _job(s, range(0, 150), busy)
    moves = _moves(s)
    assert moves and 50 < moves[0]["step"] <= 70 and "data rank 1 " in moves[0]["reason"], moves
    assert not any("back" in m["reason"] for m in moves), moves
    # the moves land near the balance: the busiest rank within 10% of the best split's
    best = min(max(busy(0, (k, 48 - k))[0][0], 2 * busy(0, (48 - k, k))[0][0]) for k in range(48))
    phase = s.shares
    assert phase is not None and phase[1] < phase[0], phase
    assert max(fixed + 0.004 * phase[0], 2 * (fixed + 0.004 * phase[1])) <= 1.1 * best
    _job(s, range(150, 260), busy)
    back = _moves(s, 150)
    assert back and "data rank 0 " in back[0]["reason"], back
    assert s.shares == (24, 24), s.decisions[-3:]


def test_the_first_move_goes_straight_to_the_balance_and_the_next_fits_the_fixed_work():
    # rank 1 2x slower from the start; 0.2 s of each step does not move with the share: the
    # first move assumes all work moves (its lines through the origin) and undershoots; the
    # second fits a line through the two shares measured and lands on the best split
    s = _online(100)

    def own(n):
        return [0.2 + 0.01 * n[0], 2 * (0.2 + 0.01 * n[1])]

    _job(s, range(100), lambda step, shares: (own(shares or (24, 24)), [0, 1]))
    moves = _moves(s)
    best = min(max(own((k, 48 - k))) for k in range(1, 48))
    assert len(moves) == 2, moves
    assert moves[0]["shares"] == [32, 16]  # the speeds at even shares, 2:1
    assert max(own(moves[1]["shares"])) == pytest.approx(best), moves


@pytest.mark.parametrize("seed", range(4))
def test_ranks_alike_within_noise_keep_even_shares(seed):
    # each step within 10%, and one step in ten twice as long on one rank (a save, a burst on
    # its core): nothing the measured noise cannot explain
    rng = random.Random(seed)
    s = _online(400)

    def busy(step, shares):
        n = shares or (24, 24)
        own = [0.004 * k * (1 + 0.1 * rng.random()) for k in n]
        if rng.random() < 0.1:
            own[rng.randrange(2)] *= 2
        return own, [0, 1]

    _job(s, range(400), busy)
    assert s.shares is None and _moves(s) == [], _moves(s)


def test_a_move_must_save_more_than_the_floor_and_the_noise_the_steps_show():
    # rank 1 works ``slow`` x longer per step, each rank's steps within ``noise``: the bound a
    # move must beat is the floor (10%) for clean steps, larger for noisy ones; an imbalance
    # that saves less than the floor is left
    def run(slow, noise):
        rng = random.Random(5)
        s = _online(60)

        def busy(step, shares):
            n = shares or (24, 24)
            own = [0.004 * n[0], slow * 0.004 * n[1]]
            return [x * (1 + noise * rng.random()) for x in own], [0, 1]

        _job(s, range(60), busy)
        moves = _moves(s)
        return [float(re.search(r"\(bound ([0-9.]+)%", m["reason"])[1]) for m in moves[:1]]

    assert run(1.5, 0.01) == [10.0]
    noisy = run(1.5, 1.0)
    assert noisy and noisy[0] > 12.0, noisy
    assert run(1.1, 0.01) == []


def test_a_move_goes_back_only_when_it_measured_worse_beyond_the_noise():
    # data rank 1 looks 2x slower at even shares (its own work holds time a share does not
    # change); under the move both ranks work alike, ``worse`` longer than the busiest did
    # before it, each step within ``noise``: clean steps 10% worse go back (and the same move
    # is not tried again); the same 10% within steps that vary by 60% (the machine's load, on
    # both ranks) stays, as does no change
    def run(worse, noise):
        rng = random.Random(7)
        s = _online(80)

        def busy(step, shares):
            n = shares or (24, 24)
            if n == (24, 24):
                return [x * (1 + 0.01 * rng.random()) for x in (0.24, 0.48)], [0, 1]
            return [0.48 * (1 + worse) * (1 + noise * (rng.random() - 0.5))] * 2, [0, 1]

        _job(s, range(80), busy)
        return _moves(s)

    back = run(0.1, 0.01)
    assert len(back) == 2 and "back" in back[1]["reason"] and back[1]["shares"] == [24, 24], back
    for worse, noise in [(0.1, 0.6), (0.0, 0.01)]:
        kept = run(worse, noise)
        assert len(kept) == 1 and kept[0]["shares"][1] < 24, (worse, noise, kept)


def test_the_docstring_examples_of_the_balance_and_the_waits_run():
    import doctest

    from anyshard.trainer_integration.gpt.layout_chooser import balance

    for module in (balance, waits):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, (module.__name__, result)


def test_the_slow_setting_takes_an_end_and_a_mode_and_refuses_nonsense():
    def fault(slow: str):
        return loads_config("", ["--parallel.dp_shard", "2"], environ={"ANYSHARD_SLOW": slow}).fault

    f = fault("1:2:15:40:neighbour")
    assert (f.slow_rank, f.slow_factor, f.slow_from, f.slow_until, f.slow_mode) == (
        1, 2.0, 15, 40, "neighbour"
    )  # fmt: skip
    f = fault("1:3")
    assert (f.slow_from, f.slow_until, f.slow_mode) == (0, None, "sleep")  # as before
    assert fault("0:2:compute").slow_mode == "compute"
    with pytest.raises(ConfigError, match="slow_until .20. must come after fault.slow_from .30."):
        fault("1:2:30:20")
    with pytest.raises(ConfigError, match="expected rank:factor.*mode one of sleep, compute"):
        fault("1:2:fast")
    if hasattr(os, "sched_setaffinity"):
        with pytest.raises(ConfigError, match="processes sharing the slow rank's core"):
            fault("1:2.5:neighbour")


def _tiny_model():
    from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
    from anyshard.trainer_integration.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(load_config(TINY_CONFIG, [], environ={}).model)


def _step(model) -> None:
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(x).float().sum().backward()


@pytest.fixture
def one_thread():
    """One intra-op thread, as each rank of a job has (torchrun's OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_each_mode_slows_its_rank_whole_own_work_its_own_way_only_in_its_steps(
    monkeypatch, one_thread
):
    # factor 3: each slow step adds twice the rank's own work, its blocks' (as they run) and
    # the rest's (the step before's work outside the blocks: embedding, loss, optimizer)
    model = _tiny_model()
    slept: list[float] = []
    monkeypatch.setattr(straggler_module.time, "sleep", slept.append)
    n_blocks = model.cfg.n_layers
    for mode in ("sleep", "compute", "data"):
        s, slept[:] = Straggler(3.0, 1, False, until=3, mode=mode), []
        added = []
        for step in range(4):
            s.arm(model, step)
            before, rest, whole = len(slept), s.last_rest_s, s.last_blocks_s + s.last_rest_s
            extra = s.extra
            s.data_phase()
            _step(model)
            if s.due(step):
                added.append((slept[before:], s.extra - extra, rest, whole, s.blocks_s))
        assert [s.due(k) for k in range(4)] == [False, True, True, False]
        assert len(added) == 2
        for pauses, computed, rest, whole, blocks in added:
            assert rest > 0.0
            if mode == "sleep":  # the rest after loading, then each block's forward and backward
                assert len(pauses) == 1 + 2 * n_blocks and computed == 0.0
                assert sum(pauses) == pytest.approx(2 * (rest + blocks))
            elif mode == "compute":
                assert pauses == [] and computed == pytest.approx(2 * (rest + blocks))
            else:  # one sleep as the batch is loaded, twice the step before's own work
                assert pauses == [pytest.approx(2 * whole)] and computed == 0.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no os.sched_setaffinity here")
def test_a_neighbour_shares_the_slow_rank_core_only_during_its_steps():
    mine = os.sched_getaffinity(0)
    try:
        core = pin_to_own_core(1)
        assert core == sorted(mine)[1 % len(mine)] and os.sched_getaffinity(0) == {core}
        s = Straggler(3, 2, False, until=4, mode="neighbour")
        model = torch.nn.Linear(2, 2)
        s.arm(model, 1)
        assert s.neighbours == []
        s.arm(model, 2)
        busy = list(s.neighbours)
        assert len(busy) == 2 and all(p.poll() is None for p in busy)
        assert all(os.sched_getaffinity(p.pid) == {core} for p in busy)
        s.arm(model, 3)
        assert s.neighbours == busy  # still running
        s.arm(model, 4)
        assert s.neighbours == [] and all(p.poll() is not None for p in busy)
    finally:
        set_process_affinity(mine)
