"""The layout scheduler on synthetic step times, and calibration from synthetic timings: the
switch policy's break-even and hysteresis, trials limited to what can pay, the drift re-plan,
and uneven data shares that keep the global batch."""

import dataclasses

import pytest

from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.candidates import layout_text
from anyshard.trainer_integration.gpt.layout_chooser.costmodel import rank_layouts
from anyshard.trainer_integration.gpt.layout_chooser.scheduler import Policy, Scheduler, shares_for
from anyshard.trainer_integration.planning.step_cost import Collective, Rates, rates_from_timings

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


def _timings(truth: Rates, groups=(2, 4)):
    """What calibrate would measure on a machine whose rates are ``truth``."""
    gemm = [(n, 2.0 * n**3 / truth.gemm_rate(2.0 * n**3)) for n in (32, 128, 384, 768)]
    stream = (1 << 24, (1 << 24) / truth.stream_bytes_per_s)
    coll = {
        f"{k}/{g}": [
            (b, truth.collective_s(Collective("x", k, g, b, 1))) for b in (1 << 10, 1 << 20)
        ]
        for k in KINDS
        for g in groups
    }
    return gemm, stream, truth.op_s, truth.dtensor_op_s, coll


def _machine(latency: float, s_per_byte: float, gemm_rate: float) -> Rates:
    coll = {f"{k}/{g}": (latency * g, s_per_byte) for k in KINDS for g in (2, 4)}
    gemm = ((2.0 * 32**3, gemm_rate / 8), (2.0 * 128**3, gemm_rate / 2), (2.0 * 768**3, gemm_rate))
    return Rates(gemm, 4e9, 4e-6, 6e-5, coll)


@pytest.mark.parametrize("name", ["fast network", "slow network"])
def test_calibration_from_synthetic_timings_recovers_their_ranking(name):
    truth = {
        "fast network": _machine(2e-5, 1e-10, 5e10),
        "slow network": _machine(2e-3, 5e-8, 5e10),
    }[name]
    cfg = Config()
    fitted = rates_from_timings(*_timings(truth))
    for key, (alpha, beta) in truth.collectives.items():
        assert fitted.collectives[key] == pytest.approx((alpha, beta), rel=1e-6)
    want = [r.layout for r in rank_layouts(cfg, 4, truth, memory_bytes=1 << 34).rows]
    got = [r.layout for r in rank_layouts(cfg, 4, fitted, memory_bytes=1 << 34).rows]
    assert got == want
    # the ranking follows the machine: the slow network puts the no-communication end first
    other = _machine(2e-3, 5e-8, 5e10) if name == "fast network" else _machine(2e-5, 1e-10, 5e10)
    assert [r.layout for r in rank_layouts(cfg, 4, other, memory_bytes=1 << 34).rows] != want


class _Job:
    """Drives a scheduler the way the training loop does, with step times from ``truth``."""

    def __init__(self, scheduler: Scheduler, truth, switch_s=0.5):
        self.s, self.truth, self.switch_s = scheduler, truth, switch_s
        self.layout = layout_text(scheduler.current)
        self.trace: list[tuple[str, str]] = []

    def run(self, first: int, last: int, busy=None) -> None:
        for step in range(first, last):
            d = self.s.decide(step)
            if d.action != "keep":
                self.trace.append((d.action, layout_text(d.parallel) if d.parallel else ""))
            if d.parallel is not None:
                self.layout = layout_text(d.parallel)
                self.s.switched(self.switch_s)
            t = self.truth(self.layout, step)
            shares = self.s.shares
            self.s.observe(t, *(busy(step, shares) if busy else (None, None)))


def _scheduler(steps, current=None, online=False, policy=None):
    current = current or ParallelConfig(tp=2)
    cfg = dataclasses.replace(Config(), parallel=current)
    return Scheduler(
        cfg,
        current,
        Rates.nominal(),
        total_steps=steps,
        online=online,
        policy=policy or Policy(trials=2, trial_steps=3),
    )


def test_a_switch_that_pays_is_made_once_and_never_undone():
    # nominal rates predict dp_shard=2 (whose optimizer steps half the state), then
    # dp_replicate=2, faster than tp=2: both are trialled
    fast = {"dp_shard=2": 0.10, "dp_replicate=2": 0.12}
    job = _Job(_scheduler(200), lambda name, step: fast.get(name, 0.20))
    job.run(0, 200)
    switches = [t for t in job.trace if t[0] in ("trial", "switch")]
    assert switches[0] == ("trial", "dp_shard=2")  # the trial is where the job stays
    assert job.layout == "dp_shard=2"
    assert len(switches) <= 3  # at most two trials and a switch back: no oscillation
    assert all(layout for _, layout in switches)


def test_no_switch_when_the_steps_left_cannot_pay_it():
    # the faster layout saves 5 ms a step; 30 steps left save 0.15 s, less than a 2 s switch
    job = _Job(_scheduler(30), lambda name, step: 0.100 if name == "tp=2" else 0.095, switch_s=2.0)
    job.s.switched(2.0)  # a switch measured at 2 s
    job.run(0, 30)
    assert job.trace == [] and job.layout == "tp=2"


def test_noise_within_the_margin_never_switches():
    # every layout measures the same within 2%: hysteresis keeps the running one
    import random

    rng = random.Random(0)
    job = _Job(_scheduler(300), lambda name, step: 0.1 * (1 + 0.02 * rng.random()))
    job.run(0, 300)
    assert [t for t in job.trace if t[0] == "switch"] == []


def test_a_trial_that_measures_slower_is_left_for_the_best_measured():
    # the model predicts others faster than tp=2 here; they all measure slower: back to tp=2
    s = _scheduler(300)
    job = _Job(s, lambda name, step: 0.10 if name == "tp=2" else 0.15)
    job.run(0, 300)
    assert job.layout == "tp=2"
    assert [a for a, _ in job.trace].count("trial") <= s.policy.trials


def test_online_a_drift_re_plans_and_a_slow_data_rank_gets_a_smaller_share():
    p = ParallelConfig(dp_shard=2)
    s = _scheduler(400, current=p, online=True, policy=Policy(trials=0, trial_steps=3))
    slow_from = 100

    def busy(step, shares):
        shares = shares or (24, 24)
        per = [0.004, 0.004 * (2.0 if step >= slow_from else 1.0)]  # rank 1 halves its speed
        b = [n * t for n, t in zip(shares, per, strict=True)]
        return b, [0, 1]

    job = _Job(s, lambda name, step: max(busy(step, s.shares)[0]))
    job.run(0, 400, busy=busy)
    rebalances = [d for d in s.decisions if d["event"] == "auto_rebalance"]
    assert rebalances, s.decisions
    assert rebalances[0]["step"] >= slow_from
    final = s.shares
    assert sum(final) == 48 and final[1] < final[0]
    assert abs(final[0] / final[1] - 2.0) < 0.3  # shares follow the measured speeds


def test_a_one_window_burst_on_a_data_rank_moves_no_share_and_two_windows_do():
    # a neighbour's burst makes data rank 1 look 2x slower for one window (5 steps) only: the
    # shares stay even; the same burst over two windows in a row (a straggler) moves them
    def run(burst):
        p = ParallelConfig(dp_shard=2)
        s = _scheduler(100, current=p, online=True, policy=Policy(trials=0, trial_steps=3))

        def busy(step, shares):
            n = shares or (24, 24)
            slow = 2.0 if burst[0] <= step < burst[1] else 1.0
            return [0.004 * n[0], 0.004 * n[1] * slow], [0, 1]

        job = _Job(s, lambda name, step: max(busy(step, s.shares)[0]))
        job.run(0, 100, busy=busy)
        return [d for d in s.decisions if d["event"] == "auto_rebalance"]

    settled = 4  # three measured steps after the warm one: the online windows start here
    window = Policy().window
    one = (settled + window, settled + 2 * window)
    assert run(one) == []
    moved = run((one[0], one[1] + window))
    assert moved and moved[0]["step"] == one[1] + window and moved[0]["shares"][1] < 24, moved


def test_shares_keep_the_global_batch_and_one_sample_each():
    assert shares_for([1.0, 100.0], [4, 4], 8) == [7, 1]
    assert sum(shares_for([0.3, 0.2, 0.9, 0.1], [3, 3, 3, 3], 12)) == 12
    with pytest.raises(ValueError, match="no sample for each"):
        shares_for([1.0] * 3, [1, 0, 1], 2)


def test_a_straggler_in_a_pipeline_moves_the_job_where_shares_can_move():
    # pp=2 measures fastest until rank 1 slows 3x; a data-parallel layout whose shares follow
    # the speeds is then faster: the job re-plans, trials it rebalanced, and stays there
    base = {"pp=2": 0.10, "dp_shard=2": 0.11, "dp_replicate=2": 0.11}
    slow_from = 80

    def busy(step, shares):
        factor = 3.0 if step >= slow_from else 1.0
        b = base.get(job.layout, 0.2)
        if job.layout.startswith("dp_"):
            n = shares or (24, 24)
            return [n[0] * b / 24, n[1] * b / 24 * factor], [0, 1]
        return [b, b * factor], [0, 0]

    s = _scheduler(400, current=ParallelConfig(pp=2), online=True)
    job = _Job(s, lambda name, step: max(busy(step, s.shares)[0]))
    job.run(0, slow_from, busy=busy)
    assert job.layout == "pp=2"  # the trials measured slower: back to pp
    job.run(slow_from, 400, busy=busy)
    assert job.layout.startswith("dp_"), s.decisions[-3:]
    assert s.shares is not None and s.shares[1] < s.shares[0]
    replans = [d for d in s.decisions if "re-plan" in d["reason"]]
    assert replans and "skew" in replans[0]["reason"]


def test_a_memory_budget_that_rules_out_replication_keeps_the_scheduler_off_it():
    # on a network 4x slower per byte than the nominal one, the model's favourite from tp=2 is
    # dp_replicate=2 (its one all-reduce against FSDP's gathers, over a smaller optimizer step);
    # a budget between its count and the sharded layouts' leaves it out of every trial and switch
    from anyshard.trainer_integration.gpt.layout_chooser.memory import memory_per_rank

    nominal = Rates.nominal()
    rates = dataclasses.replace(
        nominal, collectives={k: (a, 4 * b) for k, (a, b) in nominal.collectives.items()}
    )

    cfg = dataclasses.replace(Config(), parallel=ParallelConfig(tp=2))
    need = {
        layout_text(p): memory_per_rank(cfg, p)
        for p in (ParallelConfig(dp_replicate=2), ParallelConfig(dp_shard=2))
    }
    assert need["dp_shard=2"] < need["dp_replicate=2"]
    budget = (need["dp_shard=2"] + need["dp_replicate=2"]) // 2
    s = Scheduler(
        cfg, cfg.parallel, rates, total_steps=200,
        policy=Policy(trials=4, trial_steps=3), memory_bytes=budget,
    )  # fmt: skip
    job = _Job(s, lambda name, step: 0.05 if name == "dp_replicate=2" else 0.2)
    job.run(0, 200)
    ran = {layout for _, layout in job.trace} | {job.layout}
    assert "dp_replicate=2" not in ran and "dp_shard=2" in ran, job.trace
    unbounded = Scheduler(
        cfg, cfg.parallel, rates, total_steps=200,
        policy=Policy(trials=4, trial_steps=3), memory_bytes=1 << 40,
    )  # fmt: skip
    job = _Job(unbounded, lambda name, step: 0.05 if name == "dp_replicate=2" else 0.2)
    job.run(0, 200)
    assert job.layout == "dp_replicate=2"  # the budget, not the model, kept it out above


def test_the_memory_budget_setting_parses_and_refuses_nonsense():
    from anyshard.trainer_integration.gpt.config import ConfigError, load_config

    cfg = load_config(None, ["--parallel.auto_memory_gib", "1.5"], environ={})
    assert cfg.parallel.auto_memory_gib == 1.5
    assert load_config(None, [], environ={}).parallel.auto_memory_gib is None
    with pytest.raises(ConfigError, match=r"parallel.auto_memory_gib must be in \(0, inf\)"):
        load_config(None, ["--parallel.auto_memory_gib", "0"], environ={})


@pytest.mark.parametrize("waits", [False, True])
def test_rebalancing_settles_near_the_best_split_despite_fixed_costs_and_waits(waits):
    # each step also has work no share changes (the optimizer), and a rank's busy time holds its
    # wait for the others in the gradient exchange (``waits``): a small share then looks slow
    # per sample; the shares must not keep draining the straggler until the fast rank paces
    # the job (a rebalance that measures slower goes back)
    p = ParallelConfig(dp_shard=2)
    s = _scheduler(400, current=p, online=True, policy=Policy(trials=0, trial_steps=3))
    fixed, per = 0.2, 0.01  # a 0.44 s step at 24 samples a rank, over half of it per sample

    def compute(n):
        return [fixed + per * n[0], 2.0 * (fixed + per * n[1])]  # rank 1: 2x slower

    def busy(step, shares):
        c = compute(shares or (24, 24))
        w = 0.3 if waits else 0.0  # the part of its wait for the slowest a rank's time holds
        return [x + w * (max(c) - x) for x in c], [0, 1]

    def step_time(n):
        return max(compute(n))

    job = _Job(s, lambda name, step: step_time(s.shares or (24, 24)))
    job.run(0, 400, busy=busy)
    final = s.shares or (24, 24)
    best = min(step_time((k, 48 - k)) for k in range(1, 48))
    assert sum(final) == 48 and step_time(final) <= step_time((24, 24)), (final, s.decisions)
    assert final[1] < 24 and step_time(final) <= 1.10 * best, (final, best)


def test_a_rebalance_that_measures_slower_goes_back_and_stays_back():
    # rank 1 looks twice as slow per sample (its busy time holds waits), but both ranks compute
    # alike: moving samples to rank 0 makes the step slower, so the shares go back to even and
    # the scheduler stops moving them (until a re-plan)
    p = ParallelConfig(dp_shard=2)
    s = _scheduler(200, current=p, online=True, policy=Policy(trials=0, trial_steps=3))

    def compute(n):
        return [0.2 + 0.01 * n[0], 0.2 + 0.01 * n[1]]

    def busy(step, shares):
        c = compute(shares or (24, 24))
        return [c[0], 2 * max(c)], [0, 1]

    job = _Job(s, lambda name, step: max(compute(s.shares or (24, 24))))
    job.run(0, 200, busy=busy)
    moves = [d for d in s.decisions if d["event"] == "auto_rebalance"]
    assert len(moves) == 2 and "back" in moves[1]["reason"], moves
    assert tuple(s.shares) == (24, 24)


def test_a_rebalance_that_shortens_the_busiest_compute_stays_whatever_the_wall_time():
    # rank 1 is busier per sample; under its smaller share the busiest rank computes less,
    # while the step's wall time measures 1% slower (the machine's other load): the move is
    # judged by the compute, and stays
    p = ParallelConfig(dp_shard=2)
    s = _scheduler(200, current=p, online=True, policy=Policy(trials=0, trial_steps=3))

    def busy(step, shares):
        n = shares or (24, 24)
        return [0.01 * n[0], 0.02 * n[1]], [0, 1]

    job = _Job(s, lambda name, step: 0.44 if s.shares in (None, (24, 24)) else 0.4444)
    job.run(0, 200, busy=busy)
    moves = [d for d in s.decisions if d["event"] == "auto_rebalance"]
    assert moves and not any("back" in d["reason"] for d in moves), moves
    assert s.shares[1] < s.shares[0]


def test_ranks_sharing_cores_give_a_pipelines_idle_time_to_its_busy_stages():
    # contention 2 (every rank multiplying takes twice one rank alone): a pipeline stage that
    # waits leaves its core to the others, so its compute runs with fewer ranks busy at once;
    # layouts without a pipeline are busy throughout and predicted as before
    import dataclasses as dc

    from anyshard.trainer_integration.gpt.layout_chooser.costmodel import predict

    cfg, own = Config(), Rates.nominal()
    shared = dc.replace(own, contention=2.0)
    for p in (ParallelConfig(dp_shard=4), ParallelConfig(tp=2, dp_shard=2)):
        assert predict(cfg, p, shared).step_s == predict(cfg, p, own).step_s
    pp = ParallelConfig(pp=2, dp_shard=2, microbatches=2)  # bubble (2 - 1) / 2
    a, b = predict(cfg, pp, own), predict(cfg, pp, shared)
    # busy 1 / 1.5 of the time: 1.33 ranks' worth of the 2 sharing a core, not 2
    assert b.compute_s == pytest.approx(a.compute_s * (2 / 1.5) / 2)
    assert b.comm_s == a.comm_s


def test_a_straggler_sleeps_inside_each_blocks_forward_and_backward(monkeypatch):
    # ANYSHARD_SLOW's emulation of a slow device: each transformer block sleeps (factor - 1) x
    # its compute as its forward and its backward end (between its collectives, where a slow
    # device's compute is), from slow_from on; each forward's compute is also timed here by
    # hooks of the test's own, which run just inside the straggler's
    import time

    import torch

    from anyshard.trainer_integration.gpt.config import load_config
    from anyshard.trainer_integration.gpt.layout_chooser import straggler
    from anyshard.trainer_integration.gpt.model import GPT, TransformerBlock

    sleeps: list[float] = []
    monkeypatch.setattr(straggler.time, "sleep", sleeps.append)
    cfg = load_config(None, ["--model.dim", "64", "--model.ffn_dim", "256"], environ={})
    model, x = GPT(cfg.model), torch.randint(0, 256, (4, 64))
    s = straggler.Straggler(3.0, from_step=5, cuda=False)
    s.arm(model, 4)  # before slow_from: no sleep
    model(x).sum().backward()
    assert sleeps == [] and s.slept == 0.0
    forward: list[float] = []
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            block.register_forward_pre_hook(lambda m, a: setattr(m, "t0", time.thread_time()))
            block.register_forward_hook(
                lambda m, a, o: forward.append(time.thread_time() - m.t0), prepend=True
            )
    n, total = cfg.model.n_layers, 0.0
    for step in (5, 6):  # arming the same model again adds no hooks
        sleeps.clear()
        forward.clear()
        s.arm(model, step)
        model(x).sum().backward()
        assert len(sleeps) == 2 * n and all(p > 0 for p in sleeps), sleeps  # forward, backward
        for slept, compute in zip(sleeps[:n], forward, strict=True):
            assert slept == pytest.approx(2 * compute, abs=2e-4)
        total += sum(sleeps)
    assert s.slept == pytest.approx(total)  # what the compute time the step reports adds


def test_no_trial_or_switch_where_both_layouts_state_would_not_fit_at_once():
    import os

    from anyshard.trainer_integration.gpt import config as config_module
    from anyshard.trainer_integration.gpt.layout_chooser.costmodel import predict
    from anyshard.trainer_integration.gpt.layout_chooser.memory import (
        memory_per_rank,
        switch_memory,
    )

    heavy = os.path.join(os.path.dirname(config_module.TINY_CONFIG), "state_heavy.toml")
    cfg = config_module.load_config(heavy, ["--parallel.pp", "2"], environ={})
    start, rates = ParallelConfig(pp=2), Rates.nominal()
    layouts = [start, *(ParallelConfig(**{k: 2}) for k in ("tp", "dp_shard", "cp"))]
    steady = max(memory_per_rank(cfg, p) for p in layouts)
    moving = min(switch_memory(cfg, start, p) for p in layouts[1:])
    assert steady < moving  # a budget between them fits these layouts, but no switch
    by_name = {layout_text(p): predict(cfg, p, rates).step_s for p in layouts}
    for budget, switches in ((steady, False), (moving * 4, True)):
        s = Scheduler(
            cfg, start, rates, total_steps=200,
            policy=Policy(trials=2, trial_steps=3), memory_bytes=budget,
        )  # fmt: skip
        job = _Job(s, lambda name, step: by_name.get(name, 10.0))  # steps as predicted
        job.run(0, 200)
        assert set(by_name) <= {r.layout for r in s.table.rows}, budget  # each fits alone
        assert bool(job.trace) is switches, (budget, job.trace)
        assert job.layout == ("tp=2" if switches else "pp=2"), job.trace
        reasons = [d["reason"] for d in s.decisions]
        assert any("over the budget" in r for r in reasons) is not switches, reasons
