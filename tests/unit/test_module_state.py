"""State a process keeps between calls is safe to share between threads and cannot be mistaken
for another object's: the redistribution plans of recent calls, the indexes of the steps this
process saved (incremental saves), and the axis groups made over each process group.

Run: python -m pytest tests/unit/test_module_state.py -q
"""

from __future__ import annotations

import gc
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

import anyshard
from anyshard._lru import LRU
from anyshard.api import collectives, spec_state
from anyshard.api import redistribute as redistribute_module
from anyshard.format import incremental
from anyshard.format.incremental import Incremental


@pytest.fixture
def fine_thread_switching():
    """Switch threads as often as the interpreter can: races show within a second."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _run_threads(n: int, work) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(t: int) -> None:
        start.wait()
        try:
            work(t)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread did not finish"
    return errors


def test_an_lru_keeps_the_most_recently_used_entries():
    cache: LRU[int, str] = LRU(3)
    for k in range(5):
        cache.put(k, str(k))
        cache.get(0)  # used every time: kept
    assert [k for k in range(5) if k in cache] == [0, 3, 4]
    assert cache.get(1) is None and cache.get(4) == "4" and len(cache) == 3
    with pytest.raises(ValueError, match="at least one"):
        LRU(0)


def test_indexes_remembered_from_many_threads_stay_bounded_and_each_under_its_own_step(
    fine_thread_switching,
):
    """Saves on several threads remember the steps they committed at once: no entry is lost
    to another's eviction, at most `_REMEMBERED` are kept, each the one its step stored."""
    incremental._index_cache.clear()
    steps = 20_000

    def work(t: int) -> None:
        for i in range(steps):
            path = f"/root/run-{t}/step-{i:09d}"
            Incremental.remember(path, t, f"sha-{t}-{i}", [], {}, None, {}, {}, {})

    errors = _run_threads(8, work)
    assert not errors, errors[:3]
    kept = incremental._index_cache
    assert len(kept) == incremental._REMEMBERED
    # the newest step of each thread is among the most recently used, each under its own key
    for t in range(8):
        key = (f"/root/run-{t}/step-{steps - 1:09d}", t)
        got = kept.get(key)
        if got is not None:
            assert got[0] == f"sha-{t}-{steps - 1}"
    incremental._index_cache.clear()


def test_a_plan_evicted_by_another_thread_during_a_call_still_serves_that_call(monkeypatch):
    """A call that found its plan keeps it, even if calls on another thread push it out of
    the kept plans before this call uses it."""
    redistribute_module._PLANS.clear()
    src = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    anyshard.redistribute(src, {"w": torch.zeros(2, 3), "step": 0})  # its plan is now kept
    paused, resume = threading.Event(), threading.Event()
    victim: list[int] = []
    real = collectives.all_equal

    def all_equal(digest, group=None):
        # the victim has found its plan (it says so to the other ranks): hold it there
        if threading.get_ident() in victim and digest == b"\1" and not paused.is_set():
            paused.set()
            resume.wait(30)
        return real(digest, group)

    monkeypatch.setattr(collectives, "all_equal", all_equal)
    dst = {"w": torch.zeros(2, 3), "step": 0}
    errors: list[BaseException] = []

    def call() -> None:
        victim.append(threading.get_ident())
        try:
            anyshard.redistribute(src, dst)
        except BaseException as e:  # reported by the test
            errors.append(e)

    th = threading.Thread(target=call)
    th.start()
    assert paused.wait(30), "the call never reused its plan"
    for n in range(1, redistribute_module._PLANS_KEPT + 2):  # more plans than are kept
        other = {"v": torch.zeros(n)}
        anyshard.redistribute({"v": torch.arange(float(n))}, other)
        assert torch.equal(other["v"], torch.arange(float(n)))
    assert len(redistribute_module._PLANS) == redistribute_module._PLANS_KEPT
    resume.set()
    th.join(30)
    assert not errors, errors
    assert torch.equal(dst["w"], src["w"]) and dst["step"] == 7


def test_plans_made_on_many_threads_stay_bounded_and_correct(fine_thread_switching):
    redistribute_module._PLANS.clear()

    def work(t: int) -> None:
        for i in range(300):
            n = 1 + (i * 7 + t) % 13  # more shapes than plans kept: evictions all the time
            dst = {"w": torch.zeros(n)}
            anyshard.redistribute({"w": torch.arange(float(n))}, dst)
            assert torch.equal(dst["w"], torch.arange(float(n)))

    errors = _run_threads(4, work)
    assert not errors, errors[:3]
    assert len(redistribute_module._PLANS) == redistribute_module._PLANS_KEPT


class _Group:
    """Stands in for a process group object (its identity is all that `axis_group` keys on)."""


def test_axis_groups_of_a_collected_group_are_never_handed_to_a_new_one_at_its_address(
    monkeypatch,
):
    made: list[tuple[int, tuple[int, ...]]] = []

    def new_group(ranks):
        made.append((len(made), tuple(ranks)))
        return made[-1]

    monkeypatch.setattr(collectives, "active", lambda group=None: True)
    monkeypatch.setattr(collectives, "alive", lambda group: True)
    monkeypatch.setattr(spec_state.dist, "new_group", new_group)
    monkeypatch.setattr(spec_state.dist, "get_global_rank", lambda group, r: r)
    lay = SimpleNamespace(sizes={"dp": 2, "tp": 2})
    kept_before = len(spec_state._GROUPS)
    old = _Group()
    first = spec_state.axis_group(lay, "tp", {"dp": 1, "tp": 0}, old)
    assert first[1] == (2, 3) and len(made) == 2  # one group per dp coordinate
    assert spec_state.axis_group(lay, "tp", {"dp": 1, "tp": 1}, old) is first  # kept
    # many groups dropped, then many made: some of the new ones sit at addresses of old ones
    olds = [_Group() for _ in range(300)]
    before = {id(g): spec_state.axis_group(lay, "tp", {"dp": 1, "tp": 0}, g) for g in olds}
    assert len(spec_state._GROUPS) == kept_before + 301
    del olds, old
    gc.collect()
    # a collected group leaves nothing behind that an object at its address could find
    assert len(spec_state._GROUPS) == kept_before
    news = [_Group() for _ in range(600)]
    # where the interpreter does reuse an address (it usually does, not always), check it
    reused = [g for g in news if id(g) in before]
    for g in reused:
        got = spec_state.axis_group(lay, "tp", {"dp": 1, "tp": 0}, g)
        assert got is not before[id(g)] and got[1] == (2, 3)  # made anew, not a stale hit
    # the default group is kept apart from every group object
    count = len(made)
    default = spec_state.axis_group(lay, "tp", {"dp": 0, "tp": 0}, None)
    assert default[1] == (0, 1) and len(made) == count + 2
    assert spec_state.axis_group(lay, "tp", {"dp": 0, "tp": 1}, None) is default
    spec_state._DEFAULT_GROUPS.clear()


def test_axis_groups_go_with_their_process_group(monkeypatch):
    monkeypatch.setattr(collectives, "active", lambda group=None: True)
    monkeypatch.setattr(collectives, "alive", lambda group: True)
    monkeypatch.setattr(spec_state.dist, "new_group", lambda ranks: tuple(ranks))
    monkeypatch.setattr(spec_state.dist, "get_global_rank", lambda group, r: r)
    lay = SimpleNamespace(sizes={"dp": 2, "tp": 2})
    group = _Group()
    spec_state.axis_group(lay, "dp", {"dp": 0, "tp": 1}, group)
    assert group in spec_state._GROUPS
    before = len(spec_state._GROUPS)
    del group
    gc.collect()
    assert len(spec_state._GROUPS) == before - 1
