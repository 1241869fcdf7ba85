"""The job's nodes, read from its process groups, and where each of a layout's groups sits on
them: the `topology.Topology` the live cost model prices collectives on (`costmodel`), and the
spans of the trainer's mesh dims (`dim_spans`), laid out innermost first as
`parallel.setup_mesh` lays them out (tp, cp, ep, dp_shard, dp_replicate, pp).

``ANYSHARD_DEVICES_PER_NODE=N`` makes the ranks count as nodes of ``N`` consecutive ranks
whatever their hosts (several nodes emulated on one machine).

    >>> from anyshard.trainer_integration.gpt.config import MESH_ORDER, ParallelConfig
    >>> spans = dim_spans(ParallelConfig(tp=2, dp_shard=2), devices_per_node=2)
    >>> spans["tp"].nodes, spans["fsdp"].nodes
    (1, 2)
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence

from anyshard.trainer_integration.gpt.config import MESH_ORDER, ParallelConfig
from anyshard.trainer_integration.planning.topology import Span, Topology, placement, span_at

HOST_BYTES = 255  # the longest host name (HOST_NAME_MAX on Linux)

__all__ = [
    "DEVICES_PER_NODE_ENV",
    "INNERMOST_FIRST",
    "dim_spans",
    "job_topology",
    "topology_of_hosts",
]

DEVICES_PER_NODE_ENV = "ANYSHARD_DEVICES_PER_NODE"

# the trainer's mesh dims, innermost (consecutive ranks) first: tp, cp, ep, dp_shard,
# dp_replicate, pp (`parallel.setup_mesh` builds its mesh slowest first, in `MESH_ORDER`)
INNERMOST_FIRST = tuple(reversed(MESH_ORDER))


def dim_spans(p: ParallelConfig, devices_per_node: int) -> dict[str, Span]:
    """The `Span` of every group the trainer's collectives run over under layout ``p``: each
    mesh dim's; ``fsdp``, the flattened (dp_shard, ep, cp) FSDP shards over (stride tp);
    ``world``, every rank; and ``pp``, the pair of neighbouring stages a pipeline send joins."""
    spans = placement([(d, getattr(p, d)) for d in INNERMOST_FIRST], devices_per_node)
    spans["fsdp"] = span_at(p.dp_shard * p.ep * p.cp, p.tp, devices_per_node)
    spans["world"] = span_at(p.world_size, 1, devices_per_node)
    spans["pp"] = span_at(2 if p.pp > 1 else 1, p.world_size // p.pp, devices_per_node)
    return spans


def topology_of_hosts(
    hosts: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[Topology, str]:
    """The `Topology` of ranks on ``hosts`` (each rank's host name, in rank order) and how it
    was found: ``ANYSHARD_DEVICES_PER_NODE`` where set, else one node per host. Raises
    ValueError where hosts hold unequal numbers of ranks, a host's ranks are not consecutive
    (ranks are numbered node by node) or ``LOCAL_WORLD_SIZE`` disagrees with its count."""
    env = os.environ if environ is None else environ
    world = len(hosts)
    forced = env.get(DEVICES_PER_NODE_ENV, "").strip()
    if forced:
        n = int(forced) if forced.isdigit() else 0
        if n < 1 or world % n:
            raise ValueError(
                f"{DEVICES_PER_NODE_ENV}={forced!r}: want a positive number of ranks per node "
                f"that divides the world of {world} ranks"
            )
        return Topology(n, world // n), f"{DEVICES_PER_NODE_ENV}={n}"
    counts = Counter(hosts)
    if len(set(counts.values())) > 1:
        held = ", ".join(f"{h}: {c}" for h, c in sorted(counts.items()))
        raise ValueError(f"hosts hold unequal numbers of ranks ({held}); the cost model wants "
                         f"nodes of equal size (or set {DEVICES_PER_NODE_ENV})")  # fmt: skip
    per_node = counts[hosts[0]]
    for i in range(0, world, per_node):
        if len(set(hosts[i : i + per_node])) != 1:
            raise ValueError(
                f"ranks {i}-{i + per_node - 1} are on several hosts: ranks must be numbered "
                f"host by host (as torchrun numbers them), or set {DEVICES_PER_NODE_ENV}"
            )
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    if local and local != str(per_node):
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local} but each host holds {per_node} of the {world} ranks"
        )
    return Topology(per_node, len(counts)), "from the process group"


def job_topology() -> tuple[Topology, str]:
    """The job's `Topology` and how it was found, from the default process group: every rank's
    host name gathered (collective: call on every rank), as `topology_of_hosts` reads them.
    Without a process group: one node of one rank."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return Topology(1, 1), "one rank, no process group"
    # host names as fixed-width UTF-8 in a tensor (no pickled objects on the wire)
    name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    hosts = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in everyone]
    return topology_of_hosts(hosts)
