"""The failure simulator (anyshard.trainer_integration.planning.failures) against hand-computed runs and
closed-form expectations: Daly's expected wall time for checkpoint/restart under exponential
failures, the renewal theorem for failure counts, and the steady state of a group that is down
for a fixed time after each failure."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math

import numpy as np
import pytest

from anyshard.trainer_integration.planning import failures as gp
from anyshard.trainer_integration.planning import plan_cli, recovery_costs

PROFILE = gp.Profile(
    startup_s=5.0, ft_startup_s=8.0, restart_s=2.0, restore_fixed_s=0.1, load_gib_s=0.7,
    save_gib_s=0.08, local_load_gib_s=1.5, local_save_gib_s=0.5, async_block_s_per_gib=0.07,
    async_block_fixed_s=0.01, heal_s_per_gib=0.7, heal_fixed_s=0.3, stall_s=1.5, heartbeat_s=1.0,
    group_restart_s=2.0, absorb=1.0,
)  # fmt: skip


def test_module_examples():
    for module in (gp, recovery_costs):
        assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_restart_modes_by_hand():
    """A fault once step 25 is done, a save every 10 steps of 1 s."""
    c = gp.Costs(step_s=1.0, every_steps=10, save_write_s=0.5, async_block_s=0.1, restart_s=5.0,
                 restore_s=2.0, local_every_steps=5, local_block_s=0.1, local_write_s=0.2,
                 local_restore_s=1.0)  # fmt: skip
    # sync: 25 steps + 2 saves (26 s); back at 20 after 7 s; 80 steps + 8 saves (84 s)
    r = gp.simulate("restart-sync", c, steps=100, faults=[25])
    assert (r.wall_s, r.lost_steps, r.stalled_s, r.failures) == (117.0, 5.0, 12.0, 1)
    # async: the save at 20 is durable 0.5 s after its 0.1 s blocking: 25.2 + 7 + 80.8
    r = gp.simulate("restart-async", c, steps=100, faults=[25])
    assert r.wall_s == pytest.approx(113.0) and r.lost_steps == 5.0
    # local tier every 5 steps: the fault at 25 waits for that step's save, then back at 25
    r = gp.simulate("restart-local", c, steps=100, faults=[25])
    assert r.wall_s == pytest.approx(25 + 5 * 0.1 + 0.2 + 6 + 75 + 15 * 0.1) and r.lost_steps == 0
    r = gp.simulate("restart-local", c, steps=100, faults=[24])  # back at 20
    assert r.wall_s == pytest.approx(24 + 4 * 0.1 + 6 + 80 + 16 * 0.1) and r.lost_steps == 4
    assert r.goodput == pytest.approx(100 / r.wall_s) and r.ett == pytest.approx(r.goodput)
    # a fault injected after a save waits for it (as the trainer's does): nothing lost
    r = gp.simulate("restart-sync", c, steps=100, faults=[30])
    assert r.lost_steps == 0.0 and r.wall_s == pytest.approx(100 + 10 * 0.5 + 7)
    r = gp.simulate("restart-async", c, steps=100, faults=[30])
    assert r.lost_steps == 0.0 and r.wall_s == pytest.approx(100 + 10 * 0.1 + 0.5 + 7)


def test_no_failures_costs_only_the_saves_and_the_start():
    c = gp.Costs(step_s=2.0, every_steps=4, async_block_s=0.25, startup_s=3.0, ft_startup_s=4.0,
                 groups=2, gpus=2)  # fmt: skip
    for mode, start in (("restart-async", 3.0), ("ft-hsdp", 4.0), ("ft-elastic", 4.0)):
        r = gp.simulate(mode, c, steps=40)
        assert r.wall_s == pytest.approx(start + 80 + 10 * 0.25), mode
        assert r.failures == 0 and r.steps == 40


def test_ft_modes_by_hand():
    """Two groups of two 2-GPU nodes; group 1 loses a node once step 10 is done; the node is
    back 50 s later (no spares). The others take the missing share (absorb 1): at a total of
    g of the job's GPUs a step takes 1/g s."""
    c = gp.Costs(step_s=1.0, every_steps=1000, groups=2, gpus=8, gpus_per_node=2, stall_s=0.5,
                 group_restart_s=3.0, heal_s=1.0, shrink_s=2.0, repair_s=50.0)  # fmt: skip
    # ft-hsdp: group 1 away from 10.5 (after the stall) until 10 + 50 + 3 + 1 = 64: half speed
    r = gp.simulate("ft-hsdp", c, steps=100, faults=[(10, 1)])
    assert r.wall_s == pytest.approx(10.5 + 53.5 + (100 - 10 - 53.5 / 2))
    assert (r.stalled_s, r.lost_steps) == (0.5, 0.0)
    # ft-elastic: stalled until 10.5, half speed until re-formed on its other node (10 + 2:
    # the shrink's time counts from the fault), then 3/4 of the GPUs until the node is back
    # and healed (10 + 50 + 1 = 61), then full speed
    r = gp.simulate("ft-elastic", c, steps=100, faults=[(10, 1)])
    done = 10 + 1.5 * 0.5 + (61 - 12) * 0.75
    assert r.wall_s == pytest.approx(61 + 100 - done)
    # the others absorb none of the missing share (shared cores): no slower
    r = gp.simulate("ft-hsdp", dataclasses.replace(c, absorb=0.0), steps=100, faults=[(10, 1)])
    assert r.wall_s == pytest.approx(100.5)


def test_every_group_down_restarts_from_the_newest_durable_save():
    c = gp.Costs(step_s=1.0, every_steps=10, async_block_s=0.0, save_write_s=0.0, groups=1,
                 gpus=1, group_restart_s=4.0, heal_s=0.0, restore_s=2.0)  # fmt: skip
    r = gp.simulate("ft-hsdp", c, steps=50, faults=[(25, 0)])
    # back at step 20: the group relaunches (4 s), the job restores (2 s), 30 steps
    assert r.lost_steps == 5.0 and r.wall_s == pytest.approx(25 + 4 + 2 + 30)


def test_every_group_down_counts_the_lost_steps_at_their_own_pace():
    """Group 0 fails once step 10 is done and is away 100 s; group 1 trains alone, 2 s a step,
    and fails once step 25 is done (t = 40): back to the save at 20. Group 0 is back at 110, the
    job restores (2 s) and trains at half speed until group 1 is back (140), then full speed."""
    c = gp.Costs(step_s=1.0, every_steps=10, groups=2, gpus=2, group_restart_s=100.0,
                 restore_s=2.0)  # fmt: skip
    r = gp.simulate("ft-hsdp", c, steps=100, faults=[(10, 0), (25, 1)])
    assert r.wall_s == pytest.approx(112 + 28 + 66) and r.lost_steps == 5
    assert r.train_s == pytest.approx(10 + 10 * 2 + 28 + 66)  # the 5 lost steps took 10 s
    assert r.stalled_s == pytest.approx((112 - 40) + 10)  # down, then the lost steps


def test_a_save_still_writing_makes_the_next_one_wait():
    """1 s steps, a save every 2 blocking 0.1 s and written in 5 s: work, block; then work,
    wait for the previous write, block."""
    run = gp._Periodic(0.0, 0.0, 1.0, 2, 0.1, 5.0)
    durable = [2.1 + 5, 7.2 + 5, 12.3 + 5]
    assert [run.committed_at(t) for t in durable] == [2, 4, 6]
    assert [run.committed_at(t - 0.05) for t in durable] == [0, 2, 4]
    assert run.time_of(3) == pytest.approx(3.1) and run.time_of(4) == pytest.approx(7.2)
    assert run.steps_at(5.0) == 4 and run.steps_at(7.25) == 4 and run.steps_at(8.2) == 5


def test_steps_at_the_end_of_a_month_of_short_steps():
    run = gp._Periodic(0.0, 0.0, 0.1, 7, 0.013, 0.0)
    for k in range(25_000_000, 25_000_050):
        assert run.steps_at(run.time_of(k)) == k


def test_a_failure_during_another_s_stall_recovers_from_its_own_time(monkeypatch):
    """Three groups; group 0 fails at 10 s (the others stall until 15 s), group 2 at 12 s,
    inside that stall: its stall runs from 12 s to 17 s, overlapping the first; group 0 is back
    at 13 s and group 2 at 15 s, 3 s after its own failure."""
    failures = (np.array([10.0, 12.0]), np.array([0, 2]))
    monkeypatch.setattr(gp, "failure_times", lambda c, end, rng: failures)
    c = gp.Costs(step_s=1.0, every_steps=10**6, groups=3, gpus=3, stall_s=5.0,
                 group_restart_s=3.0, mtbf_gpu_s=1e9)  # fmt: skip
    r = gp.simulate("ft-hsdp", c, days=30 / 86400)
    # 10 steps; stalled from 10 to 17; then all three train again: 13 more steps
    assert r.steps == pytest.approx(10 + 13) and r.stalled_s == pytest.approx(7.0)


def test_spare_pool():
    s = gp._Spares(gp.Costs(step_s=1, every_steps=1, spare_nodes=1, swap_s=5.0, repair_s=100.0))
    assert s.ready(0.0) == 5.0  # the one spare
    assert s.ready(1.0) == 105.0  # the first failed node, once repaired
    s = gp._Spares(gp.Costs(step_s=1, every_steps=1, repair_s=7.0))
    assert s.ready(3.0) == 10.0  # no spares: the node's own repair


@pytest.mark.parametrize("gpus", [1000, 100_000])
def test_default_spares_cover_the_nodes_in_repair_99_percent_of_the_time(gpus):
    cl = gp.Cluster(gpus=gpus)
    in_repair = np.random.default_rng(0).poisson(gpus / cl.mtbf_gpu_h * cl.repair_h, 400_000)
    n = recovery_costs.spares(cl)
    assert (in_repair <= n).mean() >= 0.99 > (in_repair <= n - 1).mean()


@pytest.mark.parametrize("k", [1.0, 0.7, 1.5])
def test_failure_counts_follow_the_mtbf(k):
    """Renewal theorem: over a horizon long against the MTBF, failures per GPU ~ horizon/MTBF."""
    c = gp.Costs(step_s=1, every_steps=1, gpus=2000, mtbf_gpu_s=1000.0, weibull_k=k)
    times, gpus = gp.failure_times(c, 50_000.0, np.random.default_rng(0))
    assert len(times) == pytest.approx(2000 * 50, rel=0.03)
    assert np.all(np.diff(times) >= 0) and times.max() < 50_000.0
    assert np.bincount(gpus, minlength=2000).min() > 10  # every GPU fails, none stuck


@pytest.mark.parametrize("k", [0.7, 1.5])
def test_a_fleet_in_equilibrium_fails_at_its_mean_rate_from_the_start(k):
    """Over a tenth of the MTBF a fleet of mixed ages has N/10 failures; a fleet all new would
    have about twice as many (k 0.7: infant failures) or a tenth (k 1.5: wear-out)."""
    c = gp.Costs(step_s=1, every_steps=1, gpus=100_000, mtbf_gpu_s=1000.0, weibull_k=k)
    times, _ = gp.failure_times(c, 100.0, np.random.default_rng(1))
    assert len(times) == pytest.approx(10_000, rel=0.03)
    # what this test tells apart: the first failures of a fleet all new
    fresh = 1000.0 / math.gamma(1 + 1 / k) * np.random.default_rng(1).weibull(k, 100_000) < 100
    assert abs(int(fresh.sum()) - 10_000) > 3000


def test_restart_matches_daly_under_exponential_failures():
    """Checkpoint/restart with failures during the restart too: a segment of tau work and a
    sync save delta takes M e^(R/M) (e^((tau+delta)/M) - 1) on average (Daly 2006)."""
    M, tau, delta, R = 3600.0, 600.0, 30.0, 120.0
    c = gp.Costs(step_s=60.0, every_steps=10, save_write_s=delta, restart_s=R - 20.0,
                 detect_s=20.0, gpus=100, mtbf_gpu_s=100 * M)  # fmt: skip
    expected = tau / (M * math.exp(R / M) * (math.exp((tau + delta) / M) - 1))
    etts = [gp.simulate("restart-sync", c, days=120, seed=s).ett for s in range(4)]
    assert np.mean(etts) == pytest.approx(expected, abs=0.01)


def test_a_group_down_a_fixed_time_matches_its_steady_state():
    """Each group fails at rate l and is down D after its last failure: down a share
    1 - e^(-l D) of the time; with the others absorbing its share, goodput e^(-l D)."""
    c = gp.Costs(step_s=10.0, every_steps=10**9, groups=10, gpus=80, gpus_per_node=8,
                 group_restart_s=300.0, heal_s=60.0, mtbf_gpu_s=8 * 3600.0)  # fmt: skip
    rate = 8 / c.mtbf_gpu_s
    expected = math.exp(-rate * 360.0)
    got = [gp.simulate("ft-hsdp", c, days=60, seed=s).goodput for s in range(3)]
    assert expected == pytest.approx(0.905, abs=0.001)  # a tenth of the time down
    assert np.mean(got) == pytest.approx(expected, abs=0.005)


def test_costs_from_a_profile_and_a_cluster():
    cl = gp.Cluster(gpus=1024, replicas=4, state_gib=2.0, storage_gib_s=64.0, network_gib_s=1.0)
    c = gp.costs(PROFILE, cl)
    # each GPU writes its quarter (4 groups hold the same state) at the store's share, not 0.08
    assert c.save_write_s == pytest.approx(2.0 / 4 / (64 / 1024))
    # read once; the other 3 groups' quarters come over the network
    assert c.restore_s == pytest.approx(0.1 + 8.0 + 2.0 * 3 / 4)
    assert c.heal_s == pytest.approx(0.3 + 2.0 / 1.0)  # the network, not 1/0.7 GiB/s
    assert c.stall_s == pytest.approx(0.5 + cl.ft_detect_s)
    assert c.groups == 4 and c.spare_nodes == recovery_costs.spares(cl)
    assert c.absorb == 1.0  # groups of GPUs of their own
    here = dataclasses.replace(cl, launch_s=None, ft_detect_s=None, group_launch_s=None,
                               storage_gib_s=None, tier="local", absorb=None)  # fmt: skip
    c = gp.costs(dataclasses.replace(PROFILE, absorb=0.25), here)
    assert c.absorb == 0.25  # as measured where the groups share cores
    assert (c.restart_s, c.detect_s, c.startup_s, c.stall_s) == (2.0, 0.0, 5.0, 1.5)
    assert c.save_write_s == pytest.approx(2.0 / 4 / 0.5)
    local = gp.costs(PROFILE, dataclasses.replace(cl, tier="local"))
    assert local.save_write_s == pytest.approx(2.0 / 4 / 0.5)  # local disks: no shared store
    with pytest.raises(ValueError, match="replica group"):
        gp.costs(PROFILE, dataclasses.replace(cl, gpus=1001))


def test_simulate_refuses_what_it_cannot_run():
    c = gp.Costs(step_s=1.0, every_steps=1, mtbf_gpu_s=100.0)
    with pytest.raises(ValueError, match="unknown mode"):
        gp.simulate("restart", c, days=1)
    with pytest.raises(ValueError, match="need days"):
        gp.simulate("ft-hsdp", c, steps=10)


def test_profile_file(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(str(path))
    assert gp.Profile.load(str(path)) == PROFILE
    data = json.loads(path.read_text())
    del data["stall_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing stall_s"):
        gp.Profile.load(str(path))


def test_the_shipped_profile_loads_and_names_its_runs():
    p = gp.Profile.load()
    assert p.heal_s_per_gib > 0 and p.load_gib_s > 0 and p.restart_s > 0
    assert p.source["command"].startswith("python tools/goodput_profile.py")
    assert set(p.source["workload"]) == {"restart", "ft"}


def test_plan_recommends_the_best_goodput(tmp_path, capsys):
    path = tmp_path / "p.json"
    PROFILE.save(str(path))
    argv = ["--gpus", "4096", "--profile", str(path), "--days", "5", "--seeds", "2", "--json"]
    assert plan_cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    best = max(out["modes"].values(), key=lambda r: r["goodput"][0])
    assert out["recommended"] == best["mode"] and set(out["modes"]) == set(gp.MODES)
    assert plan_cli.main(argv[:-1]) == 0
    text = capsys.readouterr().out
    assert f"recommended: {best['mode']}" in text and "Young/Daly" in text
    assert plan_cli.main(["--gpus", "1001", "--profile", str(path)]) == 2
    assert "gpus_per_node" in capsys.readouterr().err
