"""Goodput at scale: a discrete-event simulator of failures and recoveries (``anyshard plan``'s, in
`anyshard.trainer_integration.planning.plan_cli`).

A job of ``gpus`` GPUs trains in ``replicas`` replica groups of whole nodes; GPUs fail (each on
its own exponential or Weibull clock, the rate from a per-GPU MTBF), and the job recovers by its
mode:

- ``restart-sync``, ``restart-async``: the whole job restarts from its newest committed
  checkpoint in object storage (saved synchronously, or staged and written in the background);
- ``restart-local``: the same, from a local tier that every node writes (a failed node's shards
  fetched from a peer replica over the network), the object store written less often;
- ``ft-hsdp``: per-replica fault tolerance: only the failed group restarts and heals from a peer
  group's memory while the others train on, stalling once per fault;
- ``ft-elastic``: the failed group re-forms at once on its remaining nodes (a live relayout) and
  regrows when its node is back.

Every cost comes from a `Profile` measured on real runs and a `Cluster` whose parameters are
stated, turned into the seconds each event takes (`Costs`, in
`anyshard.trainer_integration.planning.recovery_costs`); `simulate` runs one mode, no processes:
100,000 GPUs over 30 days take well under a second per seed. Effective training time (ETT) is
the share of the wall time spent on training whose result is kept; goodput also counts a step
slowed by a missing group as slower: the steps kept x the fault-free step time over the wall
time (the measure of ``tools/bench_goodput.py``).

    >>> c = Costs(step_s=1.0, every_steps=10, save_write_s=0.5)
    >>> r = simulate("restart-sync", c, steps=100)  # no failures: only the 10 saves block
    >>> r.wall_s, round(r.goodput, 4)
    (105.0, 0.9524)
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from anyshard.trainer_integration.planning.recovery_costs import Cluster, Costs, Profile, costs

MODES = ("restart-sync", "restart-async", "restart-local", "ft-hsdp", "ft-elastic")


@dataclass
class Result:
    """One simulated run. ``wall_s``: its length; ``steps``: the steps kept; ``train_s``: wall
    time spent on steps kept (ETT's numerator); ``stalled_s``: over all failures, the time the job's
    healthy part made no progress it kept (detection, restart, restore, redone steps; for FT the
    healthy groups' stall)."""

    mode: str
    wall_s: float
    steps: float
    step_s: float
    train_s: float
    failures: int
    stalled_s: float
    lost_steps: float = 0.0

    @property
    def goodput(self) -> float:
        return self.steps * self.step_s / self.wall_s

    @property
    def ett(self) -> float:
        return self.train_s / self.wall_s

    @property
    def stall_per_failure_s(self) -> float:
        return self.stalled_s / self.failures if self.failures else 0.0


def failure_times(c: Costs, horizon_s: float, rng: np.random.Generator) -> tuple:
    """Every GPU's failures before ``horizon_s``: per GPU a renewal process of exponential or
    Weibull(``weibull_k``) times of mean ``mtbf_gpu_s`` (a failed GPU's slot starts a fresh
    clock), in equilibrium: a fleet of mixed ages, not all new, so that failures arrive at
    ``gpus / mtbf_gpu_s`` per second from the start. Returns (sorted times, the GPU of each)."""
    if not math.isfinite(c.mtbf_gpu_s):
        return np.empty(0), np.empty(0, dtype=np.int64)
    k = c.weibull_k
    scale = c.mtbf_gpu_s / math.gamma(1 + 1 / k)
    # the first failure: the residual life of a renewal process in equilibrium, a uniform share
    # of a length-biased lifetime (for Weibull: scale x Gamma(1 + 1/k)^(1/k))
    length = scale * rng.gamma(1 + 1 / k, size=c.gpus) ** (1 / k)
    clock = rng.random(c.gpus) * length
    alive = np.arange(c.gpus)[clock < horizon_s]
    times, gpus = [clock[alive].copy()], [alive]
    while alive.size:
        clock[alive] += scale * rng.weibull(k, alive.size)
        alive = alive[clock[alive] < horizon_s]
        times.append(clock[alive].copy())
        gpus.append(alive)
    t, g = np.concatenate(times), np.concatenate(gpus)
    order = np.argsort(t, kind="stable")
    return t[order], g[order]


class _Spares:
    """A pool of spare nodes: a failed node is swapped for a free one and, repaired, joins the
    pool; with none free, the job waits for the first repaired."""

    def __init__(self, c: Costs):
        self.c, self.free = c, [0.0] * c.spare_nodes

    def ready(self, t: float) -> float:
        """When a replacement for a node failed at ``t`` is in place."""
        if not self.free:
            return t + self.c.repair_s
        at = heapq.heappop(self.free)
        heapq.heappush(self.free, t + self.c.repair_s)
        return max(t, at) + self.c.swap_s


def _floor(x: float) -> int:
    """``floor`` that takes a value a rounding error short of an integer as that integer."""
    return math.floor(x + 1e-6)


@dataclass
class _Periodic:
    """Training from a committed checkpoint at step ``p0``, time ``t0``: ``every`` steps of
    ``step_s``, then a save blocking ``block_s`` that is durable ``write_s`` later. A save
    still writing when the next is due makes that one wait: [work][block], then [work][wait]
    [block] over and over."""

    p0: float
    t0: float
    step_s: float
    every: int
    block_s: float
    write_s: float

    @property
    def wait(self) -> float:
        return max(0.0, self.write_s - self.every * self.step_s)

    @property
    def period(self) -> float:
        return self.every * self.step_s + self.block_s + self.wait

    def _blocked(self, j: int) -> float:
        """When the ``j``-th save stops blocking (``t0`` for none)."""
        return self.t0 + j * self.period - (self.wait if j else 0.0)

    def steps_at(self, t: float) -> float:
        """Steps done by ``t`` (a step counts once finished)."""
        j = max(0, _floor((t - self.t0 + self.wait) / self.period))
        done = _floor(max(0.0, t - self._blocked(j)) / self.step_s)
        return self.p0 + j * self.every + min(self.every, done)

    def committed_at(self, t: float) -> float:
        """The newest step durable by ``t``."""
        j = _floor((t - self.t0 + self.wait - self.write_s) / self.period)
        return self.p0 + self.every * max(0, j)

    def time_of(self, step: float) -> float:
        """When ``step`` is done, its save (where it makes one) blocking no more."""
        k = step - self.p0
        saves = _floor(k / self.every)
        return self._blocked(saves) + (k - saves * self.every) * self.step_s


def _whole_job(mode: str, c: Costs, end: float, steps: float, faults, rng) -> Result:
    """The restart modes: every failure stops the job, which restarts from its newest durable
    checkpoint (a failure during a restart begins it again)."""
    every, block, write, restore = c.every_steps, c.async_block_s, c.save_write_s, c.restore_s
    if mode == "restart-sync":
        block, write = c.save_write_s, 0.0
    elif mode == "restart-local":
        every = c.local_every_steps or c.every_steps
        block, write, restore = c.local_block_s, c.local_write_s, c.local_restore_s
    times, _ = failure_times(c, end, rng) if faults is None else (None, None)
    spares = _Spares(c)
    run = _Periodic(0.0, c.startup_s, c.step_s, every, block, write)
    scheduled = sorted(faults or [])
    i = n = 0
    lost = stalled = train = 0.0
    while True:
        if faults is None:
            f = float(times[i]) if i < len(times) else math.inf
        elif i < len(scheduled):  # at step k: once done and its save durable (as injected)
            k = scheduled[i]
            f = run.time_of(k) + (write if (k - run.p0) % every == 0 else 0.0)
        else:
            f = math.inf
        finish = min(end, run.time_of(steps) if math.isfinite(steps) else math.inf)
        if f >= finish:
            done = steps if finish < end else min(steps, run.steps_at(finish))
            train += (done - run.p0) * c.step_s
            return Result(mode, finish, done, c.step_s, train, n, stalled, lost)
        i, n = i + 1, n + 1
        at, kept = run.steps_at(f), run.committed_at(f)
        train += (kept - run.p0) * c.step_s
        lost += at - kept
        t = max(f + c.detect_s, spares.ready(f)) + c.restart_s + restore
        while faults is None and i < len(times) and times[i] < t:  # the restart fails too
            t = max(t, max(times[i] + c.detect_s, spares.ready(times[i])) + c.restart_s + restore)
            i, n = i + 1, n + 1
        stalled += t - f + (at - kept) * c.step_s
        run = _Periodic(kept, t, c.step_s, every, block, write)


class _Replicated:
    """The FT modes: groups train on while a failed one recovers. With groups holding ``g`` of
    the job's GPUs (a share), a step takes ``step_s * (1 + absorb * (1 / g - 1))``: the others
    train the missing share. A fault stalls the groups training for ``stall_s``. ft-hsdp: the
    failed group relaunches once its node is replaced and heals from a peer; ft-elastic: a group
    of several nodes re-forms on the others at once (``shrink_s``) and regrows, healing, once
    every node is replaced. Saves (async, to the object store) block ``async_block_s`` every
    ``every_steps``, spread over the steps; with every group down the job restarts from the
    newest save durable ``save_write_s`` after its step."""

    def __init__(self, mode: str, c: Costs, end: float, steps: float, faults, rng):
        self.mode, self.c, self.end, self.steps, self.faults = mode, c, end, steps, faults
        self.nodes, G = c.gpus // c.gpus_per_node, c.groups
        self.size = [
            int(x) for x in np.bincount(np.arange(self.nodes) * G // self.nodes, minlength=G)
        ]
        self.weight = [x / self.nodes for x in self.size]
        self.capacity = [1.0] * G  # each group's share of its own full speed (0: down)
        self.missing = [0] * G  # its nodes awaiting a replacement
        self.gen = [0] * G  # its failures so far: an "up" of an older one is void
        self.last_fault = [0.0] * G
        self.up = 1.0  # the share of the job's GPUs training: sum of capacity x weight
        self.events: list = []  # (time, kind, group, generation, share)
        self.times, self.gpus = failure_times(c, end, rng) if faults is None else (None, None)
        self.scheduled = sorted(faults or [], key=lambda x: x[0])
        self.spares = _Spares(c)
        self.t, self.p, self.i, self.n = c.ft_startup_s, 0.0, 0, 0
        self.stalled = self.train = self.lost = 0.0
        # (steps, train_s, step time) where the speed changed
        self.trail: deque = deque(maxlen=4096)
        self.down_since = math.inf  # when every group went down

    def run(self) -> Result:
        c = self.c
        while True:
            up = self.up
            step = c.step_s * (1 + c.absorb * (1 / up - 1)) if up > 1e-12 else math.inf
            v = 1 / (step + c.async_block_s / c.every_steps)  # steps per second, saves included
            f = self._next_failure(v)
            e = self.events[0][0] if self.events else math.inf
            finite = v and math.isfinite(self.steps)
            done_at = self.t + (self.steps - self.p) / v if finite else math.inf
            nxt = min(f, e, done_at, self.end)
            self._train(nxt, step, v)
            if nxt in (done_at, self.end):
                break
            if nxt == e:
                self._on_event()
            else:
                self._on_failure(nxt, v)
        p = min(self.p, self.steps)
        return Result(self.mode, self.t, p, c.step_s, self.train, self.n, self.stalled, self.lost)

    def _elastic(self, g: int) -> bool:  # re-forms on its other nodes
        return self.mode == "ft-elastic" and self.size[g] > 1

    def _set_capacity(self, g: int, share: float) -> None:
        self.up += (share - self.capacity[g]) * self.weight[g]
        self.capacity[g] = share

    def _next_failure(self, v: float) -> float:
        if self.faults is None:
            return float(self.times[self.i]) if self.i < len(self.times) else math.inf
        if self.i < len(self.scheduled):  # a fault at step k: once step k is done
            return self.t + max(0.0, self.scheduled[self.i][0] - self.p) / v if v else math.inf
        return math.inf

    def _train(self, nxt: float, step: float, v: float) -> None:
        """Train at ``v`` steps per second until ``nxt``."""
        if v and nxt > self.t:
            if not self.trail or self.trail[-1][2] != step:
                self.trail.append((self.p, self.train, step))
            self.p += (nxt - self.t) * v
            self.train += (nxt - self.t) * v * step
        self.t = max(self.t, nxt)

    def _on_event(self) -> None:
        c = self.c
        at, kind, g, k, share = heapq.heappop(self.events)
        if kind == "node":  # a replacement node is in (at ``at``, maybe inside a stall)
            self.missing[g] -= 1
            if self.missing[g] == 0:
                start = max(at, self.last_fault[g] + c.group_detect_s)
                back = start + (0.0 if self._elastic(g) else c.group_restart_s) + c.heal_s
                heapq.heappush(self.events, (back, "up", g, self.gen[g], 1.0))
        elif k == self.gen[g]:  # the group trains again, at ``share`` of its speed
            if self.up <= 1e-12:  # the job was down: back from its checkpoint
                self.t += c.restore_s
                self.stalled += self.t - self.down_since
            self._set_capacity(g, max(self.capacity[g], share))

    def _on_failure(self, nxt: float, v: float) -> None:
        c, G = self.c, self.c.groups
        if self.faults is None:
            g = int(self.gpus[self.i]) // c.gpus_per_node * G // self.nodes
        else:
            self.p, g = float(self.scheduled[self.i][0]), int(self.scheduled[self.i][1]) % G
        self.i, self.n = self.i + 1, self.n + 1
        was_up = self.capacity[g] > 0
        self._set_capacity(g, 0.0)
        when = min(
            self.t, nxt
        )  # a failure during another's stall: its own time, not the stall's end
        self.last_fault[g] = when
        self.gen[g] += 1
        self.missing[g] += 1
        heapq.heappush(self.events, (self.spares.ready(when), "node", g, 0, 0.0))
        if self.up > 1e-12:  # the others train on, after their stall (a group already down: none)
            # from the failure's own time: one inside another's stall overlaps it
            stall = max(0.0, when + c.stall_s - self.t) if was_up else 0.0
            self.t += stall
            self.stalled += stall
        elif was_up:  # every group down: back to the newest durable save
            self._roll_back(v)
        if self._elastic(g) and self.missing[g] < self.size[g]:
            share = (self.size[g] - self.missing[g]) / self.size[g]
            up_at = self.last_fault[g] + c.shrink_s
            heapq.heappush(self.events, (up_at, "up", g, self.gen[g], share))

    def _roll_back(self, v: float) -> None:
        """Every group is down: the job goes back to its newest durable save, its steps since
        then lost, their training time stalled."""
        E = self.c.every_steps
        kept = E * _floor(max(0.0, self.p - v * self.c.save_write_s) / E)
        at = next((x for x in reversed(self.trail) if x[0] <= kept), (0.0, 0.0, self.c.step_s))
        redo = self.train - (at[1] + (kept - at[0]) * at[2])  # training time of the lost steps
        self.lost += self.p - kept
        self.stalled += redo
        self.train -= redo
        self.p, self.down_since = kept, self.t


def simulate(
    mode: str,
    c: Costs,
    *,
    days: float | None = None,
    steps: float = math.inf,
    faults: Sequence | None = None,
    seed: int = 0,
) -> Result:
    """One run of ``mode`` for ``days`` of wall time or until ``steps`` steps are kept. Failures
    are drawn from ``c`` (``seed``), or given, as the trainer injects them: ``faults`` lists
    steps (restart modes: the job fails once that step is done and a save of it durable) or
    (step, group) pairs (FT modes: the group fails once that step is done)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    end = math.inf if days is None else days * 86400.0
    if not math.isfinite(end) and not math.isfinite(steps):
        raise ValueError("simulate needs days or steps")
    if not math.isfinite(end) and faults is None and math.isfinite(c.mtbf_gpu_s):
        raise ValueError("random failures need days (a horizon to draw them over)")
    rng = np.random.default_rng(seed)
    if mode.startswith("restart"):
        return _whole_job(mode, c, end, steps, faults, rng)
    return _Replicated(mode, c, end, steps, faults, rng).run()


@dataclass
class Summary:
    """A mode's runs over seeds: means with a 95% interval (normal, over the seeds)."""

    mode: str
    every_steps: int
    ett: tuple[float, float]
    goodput: tuple[float, float]
    stall_s: tuple[float, float]
    failures: float


def _mean_ci(xs: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(xs, dtype=float)
    half = 1.96 * a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else math.nan
    return float(a.mean()), float(half)


def summarize(mode: str, c: Costs, days: float, seeds: int) -> Summary:
    """``mode`` over ``seeds`` seeds of ``days`` each."""
    runs = [simulate(mode, c, days=days, seed=s) for s in range(seeds)]
    return Summary(
        mode,
        c.every_steps,
        _mean_ci([r.ett for r in runs]),
        _mean_ci([r.goodput for r in runs]),
        _mean_ci([r.stall_per_failure_s for r in runs]),
        float(np.mean([r.failures for r in runs])),
    )


def young_daly_s(c: Costs, mode: str) -> float:
    """The Young/Daly optimal interval between saves, ``sqrt(2 x blocking x job MTBF)``
    (seconds of training), for ``mode``'s blocking per save."""
    block = {"restart-sync": c.save_write_s, "restart-local": c.local_block_s}.get(
        mode, c.async_block_s
    )
    job_mtbf = c.mtbf_gpu_s / c.gpus
    return math.sqrt(2 * max(block, 1e-9) * job_mtbf)


def best_interval(mode: str, c: Costs, days: float, seeds: int) -> Summary:
    """``mode`` at the checkpoint interval (in steps) of the best goodput among multiples of the
    Young/Daly optimum (1/4 to 4x), the local tier's for restart-local."""
    opt = young_daly_s(c, mode) / c.step_s
    best = None
    for x in sorted({max(1, round(opt * f)) for f in (0.25, 0.5, 1, 2, 4)}):
        key = "local_every_steps" if mode == "restart-local" else "every_steps"
        got = summarize(mode, dataclasses.replace(c, **{key: x}), days, seeds)
        got.every_steps = x
        if best is None or got.goodput[0] > best.goodput[0]:
            best = got
    assert best is not None
    return best


def plan(profile: Profile, cluster: Cluster, *, days: float = 30.0, seeds: int = 8) -> dict:
    """Every mode at its best checkpoint interval; the recommended mode (the best goodput) and
    the fewest spare nodes that keep it within 0.5 points of the default count's."""
    c = costs(profile, cluster)
    rows = {m: best_interval(m, c, days, seeds) for m in MODES}
    best = max(rows.values(), key=lambda r: r.goodput[0])
    key = "local_every_steps" if best.mode == "restart-local" else "every_steps"
    tuned = dataclasses.replace(c, **{key: best.every_steps})
    spare = c.spare_nodes
    for n in sorted({0, c.spare_nodes // 4, c.spare_nodes // 2, c.spare_nodes}):
        g = summarize(best.mode, dataclasses.replace(tuned, spare_nodes=n), days, seeds)
        if g.goodput[0] >= best.goodput[0] - 0.005:
            spare = n
            break
    return {"costs": c, "rows": rows, "best": best, "spares": spare,
            "young_daly_steps": young_daly_s(c, best.mode) / c.step_s}  # fmt: skip


def fmt_pct(x: tuple[float, float]) -> str:
    """A mean and its interval's half-width as percentages."""
    return f"{100 * x[0]:.1f}% +- {100 * x[1]:.1f}"
