"""What each event of a job's failures and recoveries costs, for the failure simulator
(`anyshard.trainer_integration.planning.failures`).

Every cost comes from a `Profile` measured by ``tools/`` benchmarks on real runs (rates per
rank, fixed costs of a restart, a heal, a stall) and from a `Cluster` whose parameters are
stated (bandwidths, MTBF, repair times), never from constants in this module. `costs` turns the
two into the seconds each event takes (`Costs`).

    >>> c = costs(Profile.load(), Cluster(gpus=1024, replicas=8, spare_nodes=4))
    >>> c.groups, c.spare_nodes, c.mtbf_gpu_s == 50680.0 * 3600
    (8, 4, True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

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
    """The job and its cluster, stated (docs/planning.md gives each default's source). A cost
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
