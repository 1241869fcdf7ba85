"""Goodput at scale: a discrete-event simulator of failures and recoveries, and ``anyshard plan``.

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

Every cost comes from a `Profile` measured by ``tools/`` benchmarks on real runs (rates per
rank, fixed costs of a restart, a heal, a stall) and from a `Cluster` whose parameters are
stated (bandwidths, MTBF, repair times), never from constants in this module. `costs` turns the
two into the seconds each event takes (`Costs`); `simulate` runs one mode, no processes: 100,000
GPUs over 30 days take well under a second per seed. Effective training time (ETT) is the share
of the wall time spent on training whose result is kept; goodput also counts a step slowed by a
missing group as slower: the steps kept x the fault-free step time over the wall time (the
measure of ``tools/bench_goodput.py``).

    >>> c = Costs(step_s=1.0, every_steps=10, save_write_s=0.5)
    >>> r = simulate("restart-sync", c, steps=100)  # no failures: only the 10 saves block
    >>> r.wall_s, round(r.goodput, 4)
    (105.0, 0.9524)
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

MODES = ("restart-sync", "restart-async", "restart-local", "ft-hsdp", "ft-elastic")
GiB = 1 << 30
PROFILE = os.path.join(os.path.dirname(__file__), "failure_profile.json")


@dataclass(frozen=True)
class Profile:
    """Costs measured on real runs (per rank: what the software takes on its hardware).

    Written by ``tools/goodput_profile.py`` from the JSON lines of ``tools/bench_goodput.py`` and
    ``tools/bench_storage.py``; ``source`` names the commands, commit, machine and date."""

    startup_s: float  # a fresh job's start-up and shutdown, outside its steps
    ft_startup_s: float  # the same for a job of FT-HSDP replica groups
    restart_s: float  # a whole-job restart: kill to model built (the agent's detection included)
    restore_fixed_s: float  # a restore's cost beyond its bytes (the manifest, planning)
    load_gib_s: float  # read rate per rank from the object store
    save_gib_s: float  # write rate per rank to the object store
    local_load_gib_s: float  # read rate per rank from the local tier (disk)
    local_save_gib_s: float  # write rate per rank to the local tier
    async_block_s_per_gib: float  # an async save's blocking (the staging copy) per GiB
    async_block_fixed_s: float  # its cost beyond the bytes (a save's planning)
    heal_s_per_gib: float  # a peer heal's transfer per GiB per rank
    heal_fixed_s: float  # a heal's quorum and handshake
    stall_s: float  # a healthy group's stall per fault, the FT heartbeat timeout included
    heartbeat_s: float  # the FT heartbeat timeout the stall was measured with
    group_restart_s: float  # FT: a failed group's relaunch: detection to model built
    absorb: float  # the share of a missing group's work that slows the others (1: own GPUs)
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | None = None) -> Profile:
        """The profile at ``path`` (default: the one measured on the project's own machine)."""
        path = path or PROFILE
        try:
            data = json.load(open(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"goodput profile {path}: {e}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data) - {"source"})
        if missing:
            raise ValueError(f"goodput profile {path}: missing {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.write("\n")


@dataclass(frozen=True)
class Cluster:
    """The job and its cluster, stated (docs/goodput.md gives each default's source). A cost
    left None is the profile's own, as measured (a bandwidth left None limits nothing)."""

    gpus: int = 100_000
    replicas: int = 12  # replica groups (whole nodes each): the unit FT-HSDP takes offline
    gpus_per_node: int = 8
    state_gib: float = 4.0  # checkpoint state per GPU
    step_s: float = 6.0  # a fault-free step: Llama 3 405B's 16M-token batch on 16k GPUs
    every_steps: int = 30  # checkpoint interval (object store)
    local_every_steps: int = 5  # restart-local: local-tier interval
    mtbf_gpu_h: float = 50680.0  # per GPU: Llama 3, 419 interruptions, 16,384 GPUs, 54 days
    weibull_k: float = 1.0  # failure clock shape (1: exponential)
    detect_s: float | None = 150.0  # a failure noticed: half a 5-minute health-check period
    launch_s: float | None = 300.0  # a whole-job relaunch: scheduling, process start, NCCL init
    ft_detect_s: float | None = 30.0  # FT: a lost group noticed (the heartbeat timeout)
    group_launch_s: float | None = 60.0  # FT: a replica group's relaunch
    spare_nodes: int | None = None  # None: enough for every node in repair, 99% of the time
    swap_s: float = 300.0  # a spare node swapped in
    repair_h: float = 24.0  # a failed node repaired and back in the pool
    storage_gib_s: float | None = 1862.6  # aggregate object store: 2 TB/s (Llama 3, Tectonic)
    network_gib_s: float | None = 46.6  # per GPU: 400 Gb/s
    tier: str = "object"  # where the restart modes save: "object" store or "local" disk
    # the share of a missing group's work that slows the others: 1 where each group has GPUs
    # of its own; None: the profile's, measured where groups share cores
    absorb: float | None = 1.0


@dataclass(frozen=True)
class Costs:
    """What each event of a job costs, in seconds (`costs` derives them; tests state them)."""

    step_s: float
    every_steps: int
    save_write_s: float = 0.0  # a save written to the object store (a sync save blocks for it)
    async_block_s: float = 0.0  # an async save's blocking (its staging copy)
    startup_s: float = 0.0
    ft_startup_s: float = 0.0  # the FT modes' start-up (replica groups and their quorum)
    detect_s: float = 0.0  # whole-job restarts: a failure noticed
    restart_s: float = 0.0  # whole-job restarts: relaunch to model built
    restore_s: float = 0.0  # whole-job restarts: the state loaded
    local_every_steps: int = 0  # restart-local: the local tier's interval
    local_block_s: float = 0.0  # restart-local: a save's blocking (every GPU stages its all)
    local_write_s: float = 0.0  # restart-local: a save written to the local tier
    local_restore_s: float = 0.0
    stall_s: float = 0.0  # FT: the training groups' stall per fault
    group_detect_s: float = 0.0  # FT: a lost group noticed
    group_restart_s: float = 0.0  # FT: a group's relaunch, once its node is in
    heal_s: float = 0.0  # FT: a group's heal from a peer
    shrink_s: float = 0.0  # elastic: the failed group re-formed on its remaining nodes
    absorb: float = 1.0  # the share of a missing group's work that slows the others
    groups: int = 1  # replica groups, of whole nodes, as even as the nodes allow
    gpus: int = 1
    gpus_per_node: int = 1
    mtbf_gpu_s: float = math.inf
    weibull_k: float = 1.0
    spare_nodes: int = 0
    swap_s: float = 0.0
    repair_s: float = 0.0


def spares(c: Cluster, quantile: float = 0.99) -> int:
    """The spare nodes that cover every node in repair at once with probability ``quantile``:
    the Poisson quantile of node failures over one repair time."""
    m = c.gpus / c.mtbf_gpu_h * c.repair_h  # nodes in repair on average (failures x repair)
    if m > 500:  # the normal approximation, where e^-m underflows
        return math.ceil(m + NormalDist().inv_cdf(quantile) * math.sqrt(m))
    k, pmf = 0, math.exp(-m)
    cdf = pmf
    while cdf < quantile:
        k += 1
        pmf *= m / k
        cdf += pmf
    return k


def costs(profile: Profile, cluster: Cluster) -> Costs:
    """Each event's seconds from measured per-rank rates and the cluster's stated bandwidths:
    a transfer takes the longer of the rank's own rate and its share of the shared bandwidth."""
    c, p, gib = cluster, profile, cluster.state_gib
    nodes = c.gpus // c.gpus_per_node
    if c.gpus % c.gpus_per_node or not 1 <= c.replicas <= nodes:
        raise ValueError(
            f"{c.gpus} GPUs in {c.replicas} replica group(s) of whole {c.gpus_per_node}-GPU "
            "nodes: take gpus a multiple of gpus_per_node, and 1 <= replicas <= nodes"
        )
    inf = math.inf
    if c.tier not in ("object", "local"):
        raise ValueError(f"tier {c.tier!r}: object or local")
    local = c.tier == "local"
    # the replica groups hold the same state, saved once: each GPU writes its group's share
    unique = gib / c.replicas
    store = (c.storage_gib_s or inf) / c.gpus  # each GPU's share when all of them write
    write = unique / (p.local_save_gib_s if local else min(p.save_gib_s, store))
    # read once, then sent to the other groups' GPUs holding the same shard
    read = unique / (p.local_load_gib_s if local else min(p.load_gib_s, store))
    peer = gib / min(1 / p.heal_s_per_gib, c.network_gib_s or inf)
    if c.replicas > 1:  # the other groups' shares of what this GPU holds
        read += peer * (c.replicas - 1) / c.replicas
    # a replacement node's local tier is empty: its shards from a peer group, or the store
    lost = peer if c.replicas > 1 else gib / min(p.load_gib_s, store)
    per_group = nodes / c.replicas
    ft_detect = p.heartbeat_s if c.ft_detect_s is None else c.ft_detect_s
    return Costs(
        step_s=c.step_s,
        every_steps=c.every_steps,
        save_write_s=write,
        async_block_s=p.async_block_fixed_s + unique * p.async_block_s_per_gib,
        local_block_s=p.async_block_fixed_s + gib * p.async_block_s_per_gib,
        startup_s=p.startup_s if c.launch_s is None else c.launch_s,
        ft_startup_s=p.ft_startup_s if c.launch_s is None else c.launch_s,
        # the profile's restart includes the launcher noticing its rank's death
        detect_s=0.0 if c.launch_s is None else (c.detect_s or 0.0),
        restart_s=p.restart_s if c.launch_s is None else c.launch_s,
        restore_s=p.restore_fixed_s + read,
        local_every_steps=c.local_every_steps,
        local_write_s=gib / p.local_save_gib_s,
        # the healthy nodes read their own copies, a replacement node fetches from a peer
        local_restore_s=p.restore_fixed_s + max(gib / p.local_load_gib_s, lost),
        stall_s=max(0.0, p.stall_s - p.heartbeat_s) + ft_detect,
        group_detect_s=ft_detect,
        group_restart_s=p.group_restart_s if c.group_launch_s is None else c.group_launch_s,
        heal_s=p.heal_fixed_s + peer,
        # the survivors take the lost node's shards from a peer group: more bytes each
        shrink_s=ft_detect + p.heal_fixed_s + peer * per_group / max(1.0, per_group - 1),
        absorb=p.absorb if c.absorb is None else c.absorb,
        groups=c.replicas,
        gpus=c.gpus,
        gpus_per_node=c.gpus_per_node,
        mtbf_gpu_s=c.mtbf_gpu_h * 3600,
        weibull_k=c.weibull_k,
        spare_nodes=spares(c) if c.spare_nodes is None else c.spare_nodes,
        swap_s=c.swap_s,
        repair_s=c.repair_h * 3600,
    )


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


def _replicated(mode: str, c: Costs, end: float, steps: float, faults, rng) -> Result:
    """The FT modes: groups train on while a failed one recovers. With groups holding ``g`` of
    the job's GPUs (a share), a step takes ``step_s * (1 + absorb * (1 / g - 1))``: the others
    train the missing share. A fault stalls the groups training for ``stall_s``. ft-hsdp: the
    failed group relaunches once its node is replaced and heals from a peer; ft-elastic: a group
    of several nodes re-forms on the others at once (``shrink_s``) and regrows, healing, once
    every node is replaced. Saves (async, to the object store) block ``async_block_s`` every
    ``every_steps``, spread over the steps; with every group down the job restarts from the
    newest save durable ``save_write_s`` after its step."""
    nodes, G, E = c.gpus // c.gpus_per_node, c.groups, c.every_steps
    size = [int(x) for x in np.bincount(np.arange(nodes) * G // nodes, minlength=G)]
    weight = [x / nodes for x in size]
    capacity = [1.0] * G  # each group's share of its own full speed (0: down)
    missing = [0] * G  # its nodes awaiting a replacement
    gen = [0] * G  # its failures so far: an "up" of an older one is void
    last_fault = [0.0] * G
    up = 1.0  # the share of the job's GPUs training: sum of capacity x weight
    events: list = []  # (time, kind, group, generation, share)
    times, gpus = failure_times(c, end, rng) if faults is None else (None, None)
    scheduled = sorted(faults or [], key=lambda x: x[0])
    spares = _Spares(c)
    t, p, i, n = c.ft_startup_s, 0.0, 0, 0
    stalled = train = lost = 0.0
    trail: deque = deque(maxlen=4096)  # (steps, train_s, step time) where the speed changed
    down_since = math.inf  # when every group went down

    def elastic(g: int) -> bool:  # re-forms on its other nodes
        return mode == "ft-elastic" and size[g] > 1

    def set_capacity(g: int, share: float) -> None:
        nonlocal up
        up += (share - capacity[g]) * weight[g]
        capacity[g] = share

    while True:
        step = c.step_s * (1 + c.absorb * (1 / up - 1)) if up > 1e-12 else math.inf
        v = 1 / (step + c.async_block_s / E)  # steps per second, saves included
        if faults is None:
            f = float(times[i]) if i < len(times) else math.inf
        elif i < len(scheduled):  # a fault at step k: once step k is done
            f = t + max(0.0, scheduled[i][0] - p) / v if v else math.inf
        else:
            f = math.inf
        e = events[0][0] if events else math.inf
        done_at = t + (steps - p) / v if v and math.isfinite(steps) else math.inf
        nxt = min(f, e, done_at, end)
        if v and nxt > t:
            if not trail or trail[-1][2] != step:
                trail.append((p, train, step))
            p += (nxt - t) * v
            train += (nxt - t) * v * step
        t = max(t, nxt)
        if nxt in (done_at, end):
            break
        if nxt == e:
            at, kind, g, k, share = heapq.heappop(events)
            if kind == "node":  # a replacement node is in (at ``at``, maybe inside a stall)
                missing[g] -= 1
                if missing[g] == 0:
                    start = max(at, last_fault[g] + c.group_detect_s)
                    back = start + (0.0 if elastic(g) else c.group_restart_s) + c.heal_s
                    heapq.heappush(events, (back, "up", g, gen[g], 1.0))
            elif k == gen[g]:  # the group trains again, at ``share`` of its speed
                if up <= 1e-12:  # the job was down: back from its checkpoint
                    t += c.restore_s
                    stalled += t - down_since
                set_capacity(g, max(capacity[g], share))
            continue
        # a failure
        if faults is None:
            g = int(gpus[i]) // c.gpus_per_node * G // nodes
        else:
            p, g = float(scheduled[i][0]), int(scheduled[i][1]) % G
        i, n = i + 1, n + 1
        was_up = capacity[g] > 0
        set_capacity(g, 0.0)
        when = min(t, nxt)  # a failure during another's stall: its own time, not the stall's end
        last_fault[g] = when
        gen[g] += 1
        missing[g] += 1
        heapq.heappush(events, (spares.ready(when), "node", g, 0, 0.0))
        if up > 1e-12:  # the others train on, after their stall (a group already down: none)
            # from the failure's own time: one inside another's stall overlaps it
            stall = max(0.0, when + c.stall_s - t) if was_up else 0.0
            t += stall
            stalled += stall
        elif was_up:  # every group down: back to the newest durable save
            kept = E * _floor(max(0.0, p - v * c.save_write_s) / E)
            at = next((x for x in reversed(trail) if x[0] <= kept), (0.0, 0.0, c.step_s))
            redo = train - (at[1] + (kept - at[0]) * at[2])  # training time of the lost steps
            lost += p - kept
            stalled += redo
            train -= redo
            p, down_since = kept, t
        if elastic(g) and missing[g] < size[g]:
            share = (size[g] - missing[g]) / size[g]
            heapq.heappush(events, (last_fault[g] + c.shrink_s, "up", g, gen[g], share))
    return Result(mode, t, min(p, steps), c.step_s, train, n, stalled, lost)


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
    run = _whole_job if mode.startswith("restart") else _replicated
    return run(mode, c, end, steps, faults, rng)


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def main(argv: list[str] | None = None) -> int:
    """``anyshard plan``: the recovery mode, checkpoint interval and spares for a job."""
    d = Cluster()
    p = argparse.ArgumentParser(
        prog="anyshard plan",
        description="Simulate a training job's failures and recoveries in every mode and\n"
        "recommend one: the recovery mode, checkpoint interval (against the Young/Daly\n"
        "optimum), tier and spare nodes, with each alternative's expected effective training\n"
        "time (ETT) and goodput. Costs per rank come from a profile measured by the project's\n"
        "benchmarks (--profile; default: the one measured on its own machine); the cluster's\n"
        "from the options, whose defaults and sources docs/goodput.md lists.",
        epilog="examples:\n  anyshard plan --gpus 100000\n"
        "  anyshard plan --gpus 16384 --state-gib 2 --mtbf-hours 30000 --spares 64\n"
        "  anyshard plan --gpus 100000 --profile my_profile.json --json",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--state-gib", type=float, default=d.state_gib, help="checkpoint GiB per GPU")
    p.add_argument("--mtbf-hours", type=float, default=d.mtbf_gpu_h, help="MTBF of one GPU (h)")
    p.add_argument("--profile", help="a profile JSON written by tools/goodput_profile.py")
    p.add_argument("--step-s", type=float, default=d.step_s, help="a fault-free step (s)")
    p.add_argument("--replicas", type=int, help="replica groups (default: 12, or 1 per node)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    help = "spare nodes (default: every node in repair covered 99%% of the time)"
    p.add_argument("--spares", type=int, help=help)
    p.add_argument("--repair-hours", type=float, default=d.repair_h, help="a node's repair")
    p.add_argument("--swap-s", type=float, default=d.swap_s, help="a spare node swapped in")
    p.add_argument("--weibull-k", type=float, default=d.weibull_k, help="failure clock shape")
    p.add_argument("--detect-s", type=float, default=d.detect_s, help="whole job: detection")
    p.add_argument("--launch-s", type=float, default=d.launch_s, help="whole job: relaunch")
    p.add_argument("--ft-detect-s", type=float, default=d.ft_detect_s, help="FT: detection")
    p.add_argument("--group-launch-s", type=float, default=d.group_launch_s, help="FT: relaunch")
    p.add_argument("--storage-gib-s", type=float, default=d.storage_gib_s, help="object store")
    p.add_argument("--network-gib-s", type=float, default=d.network_gib_s, help="per GPU")
    p.add_argument("--days", type=float, default=30.0, help="simulated wall time per seed")
    p.add_argument("--seeds", type=int, default=8, help="runs per mode and interval")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    nodes = max(1, a.gpus // a.gpus_per_node)
    try:
        profile = Profile.load(a.profile)
        cluster = Cluster(
            gpus=a.gpus, replicas=a.replicas or min(12, nodes), gpus_per_node=a.gpus_per_node,
            state_gib=a.state_gib, step_s=a.step_s, mtbf_gpu_h=a.mtbf_hours,
            weibull_k=a.weibull_k, detect_s=a.detect_s, launch_s=a.launch_s,
            ft_detect_s=a.ft_detect_s, group_launch_s=a.group_launch_s, spare_nodes=a.spares,
            swap_s=a.swap_s, repair_h=a.repair_hours, storage_gib_s=a.storage_gib_s,
            network_gib_s=a.network_gib_s,
        )  # fmt: skip
        out = plan(profile, cluster, days=a.days, seeds=a.seeds)
    except ValueError as e:
        print(f"anyshard plan: {e}", file=sys.stderr)
        return 2
    best, c = out["best"], out["costs"]
    if a.json:
        rows = {m: dataclasses.asdict(r) for m, r in out["rows"].items()}
        json.dump({"recommended": best.mode, "spare_nodes": out["spares"], "modes": rows,
                   "young_daly_steps": out["young_daly_steps"]}, sys.stdout, indent=1)  # fmt: skip
        print()
        return 0
    job_mtbf_min = c.mtbf_gpu_s / c.gpus / 60
    print(f"{a.gpus} GPUs in {c.groups} replica group(s), {a.state_gib:g} GiB per GPU, a failure "
          f"every {job_mtbf_min:.1f} min on average; {a.seeds} x {a.days:g} days per row")  # fmt: skip
    head = f"{'mode':<14} {'interval':>9} {'ETT':>16} {'goodput':>16} {'stall/failure':>14}"
    print(head)
    for m, r in out["rows"].items():
        stall = f"{r.stall_s[0]:.0f} s"
        print(
            f"{m:<14} {r.every_steps:>6} st {fmt_pct(r.ett):>16} {fmt_pct(r.goodput):>16} {stall:>14}"
        )
    where = "to every node's local disk" if best.mode == "restart-local" else "to the object store"
    print(f"recommended: {best.mode}, checkpoints {where} every {best.every_steps} steps "
          f"(Young/Daly: {out['young_daly_steps']:.0f}), {out['spares']} spare node(s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
