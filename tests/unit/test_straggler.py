"""Stragglers: each rank's own work (its step less its waits in collectives, `waits`), the
kinds of straggler ``ANYSHARD_SLOW`` injects, and the scheduler's shares following a slow rank
and coming back when it recovers."""

import dataclasses
import os
import random
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


def _online(steps: int) -> Scheduler:
    p = ParallelConfig(dp_shard=2)
    cfg = dataclasses.replace(Config(), parallel=p)
    policy = Policy(trials=0, trial_steps=3)
    return Scheduler(cfg, p, Rates.nominal(), total_steps=steps, online=True, policy=policy)


@pytest.mark.parametrize("fixed", [0.0, 0.05])
def test_a_slow_rank_is_named_and_the_shares_come_back_when_it_recovers(fixed):
    # data rank 1 works 2x longer per sample from step 50 to 150 (``fixed``: work no share
    # changes, the optimizer's); then both are alike again, and the rank with the larger share
    # is the busier one until the shares are even again
    s = _online(260)

    def busy(step, shares):
        n = shares or (24, 24)
        factor = 2.0 if 50 <= step < 150 else 1.0
        return [fixed + 0.004 * n[0], factor * (fixed + 0.004 * n[1])], [0, 1]

    _job(s, range(0, 150), busy)
    moves = [d for d in s.decisions if d["event"] == "auto_rebalance"]
    assert moves and moves[0]["step"] >= 50 and "data rank 1 " in moves[0]["reason"], moves
    phase = s.shares
    assert phase is not None and phase[1] < phase[0] - 4, phase
    _job(s, range(150, 260), busy)
    back = [d for d in s.decisions if d["event"] == "auto_rebalance" and d["step"] >= 150]
    assert back and "data rank 0 " in back[0]["reason"], back
    final = s.shares or (24, 24)
    if fixed == 0.0:  # the ranks work alike per sample again: straight back to even
        assert final == (24, 24), s.decisions[-3:]
    else:  # a small share looks slower per sample: back within the imbalance the policy allows
        work = busy(300, final)[0]
        assert final[0] >= final[1] and max(work) <= 1.15 * sum(work) / 2, s.decisions[-3:]
        assert final[0] - final[1] < phase[0] - phase[1], (phase, final)


def test_ranks_alike_within_noise_keep_even_shares():
    rng = random.Random(1)
    s = _online(300)

    def busy(step, shares):
        n = shares or (24, 24)
        return [0.004 * k * (1 + 0.1 * rng.random()) for k in n], [0, 1]

    _job(s, range(300), busy)
    assert s.shares is None and not [d for d in s.decisions if "rebalance" in d["event"]]


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


def test_each_mode_slows_its_rank_its_own_way_only_in_its_steps(monkeypatch, one_thread):
    model = _tiny_model()
    slept = []
    monkeypatch.setattr(straggler_module.time, "sleep", slept.append)
    for mode in ("sleep", "compute", "data"):
        s, slept[:] = Straggler(2.0, 1, False, until=3, mode=mode), []
        for step in range(4):
            s.arm(model, step)
            s.data_phase()
            _step(model)
        on = [s.due(k) for k in range(4)]
        assert on == [False, True, True, False]
        n_blocks = model.cfg.n_layers
        if mode == "sleep":  # a forward and a backward of each block, in the 2 slow steps
            assert len(slept) == 4 * n_blocks and s.extra == 0.0
        elif mode == "compute":
            assert slept == [] and s.extra > 0.0
        else:  # one sleep per slow step, as long as the blocks' compute of the step before
            assert len(slept) == 2 and s.extra == 0.0 and all(x > 0 for x in slept)


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
