"""Where a layout's groups sit on a cluster: which mesh dims live inside a node and which cross
nodes (`placement`), and what a collective over such a group costs on the links it crosses
(`collective_s`). Both sides of the cost model use it: ``anyshard plan`` with a `Hardware`
file's links, the live scheduler with the node shape it reads from its process groups.

Ranks are numbered node by node (``devices_per_node`` consecutive ranks share a node), and a
layout's mesh dims are laid out innermost first: the innermost dim's members are consecutive
ranks. A group of ``size`` members whose dim has ``stride`` (the product of the sizes inside
it) has ``per_node`` members on each node it touches.

    >>> spans = placement((("tp", 8), ("dp", 4)), devices_per_node=8)
    >>> spans["tp"], spans["dp"]
    (Span(size=8, per_node=8, extent=1), Span(size=4, per_node=1, extent=4))
    >>> placement((("tp", 2), ("dp", 8)), devices_per_node=8)["dp"].nodes
    2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Links", "Span", "Topology", "collective_s", "placement", "span_at"]

# bytes each member sends per byte of the whole message, times (size - 1) / size: a ring
RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


@dataclass(frozen=True, slots=True)
class Span:
    """A group of ``size`` members, ``per_node`` of them on each node it touches (the last
    node may hold fewer); ``extent``: the nodes from its first member's to its last's (0: as
    many as it touches), which decides whether it leaves a pod."""

    size: int
    per_node: int
    extent: int = 0

    @property
    def nodes(self) -> int:
        return max(1, -(-self.size // max(1, self.per_node)))


@dataclass(frozen=True, slots=True)
class Topology:
    """Nodes of ``devices_per_node`` ranks each (the live job reads it from its process groups:
    the local world size and the number of hosts)."""

    devices_per_node: int
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes


def span_at(size: int, stride: int, devices_per_node: int) -> Span:
    """The `Span` of a group of ``size`` members ``stride`` ranks apart (the first at the
    start of a node)."""
    if size <= 1:
        return Span(1, 1, 1)
    per_node = min(size, max(1, devices_per_node // stride))
    extent = -(-(stride * (size - 1) + 1) // devices_per_node)
    return Span(size, per_node, extent)


def placement(dims: Sequence[tuple[str, int]], devices_per_node: int) -> dict[str, Span]:
    """The `Span` of every mesh dim, ``dims`` given innermost first as (name, size)."""
    spans: dict[str, Span] = {}
    stride = 1
    for name, size in dims:
        spans[name] = span_at(size, stride, devices_per_node)
        stride *= size
    return spans


@dataclass(frozen=True, slots=True)
class Links:
    """The links a collective runs on, per device and one direction: bandwidth (bytes/s) and a
    step's latency (s), inside a node and across nodes. ``pod_nodes`` nodes share a full-rate
    fabric; traffic between pods gets ``1 / oversubscription`` of the inter-node bandwidth."""

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float
    inter_latency_s: float
    pod_nodes: int = 1 << 30
    oversubscription: float = 1.0


def collective_s(kind: str, span: Span, nbytes: float, links: Links) -> float:
    """Seconds of one collective over ``span`` on a message of ``nbytes`` (the whole gathered
    or reduced tensor; for ``send``, the bytes sent).

    Inside a node: a ring on the intra-node links. Across nodes: the ring's bytes are bound by
    the slower of the intra-node links and the inter-node links of the ``per_node`` members a
    node has in the group (each member's share of the node's NICs carries one of the rings that
    NCCL runs in parallel); the latency is a ring step per member inside the node and a tree
    across the nodes (``2 log2(nodes)`` steps for an all-reduce). An all-to-all sends the share
    bound for other nodes over each member's own NIC.

    >>> links = Links(300e9, 25e9, 0.0, 0.0)
    >>> inside = collective_s("all_reduce", Span(8, 8), 8e9, links)
    >>> across = collective_s("all_reduce", Span(8, 1), 8e9, links)
    >>> round(inside, 4), round(across, 4)  # 2 x 7/8 x 8 GB at 300 GB/s, then at 25 GB/s
    (0.0467, 0.56)
    """
    size = span.size
    if size <= 1 or nbytes <= 0:
        return 0.0
    nodes = span.nodes
    inter = links.inter_bytes_per_s
    if max(nodes, span.extent) > links.pod_nodes:
        inter /= links.oversubscription
    if kind == "send":
        if nodes > 1:
            return links.inter_latency_s + nbytes / inter
        return links.intra_latency_s + nbytes / links.intra_bytes_per_s
    factor = RING_FACTOR[kind]
    moved = factor * nbytes * (size - 1) / size
    if kind == "all_to_all":
        away = nbytes * (size - span.per_node) / size  # to members on other nodes
        near = nbytes * (span.per_node - 1) / size
        lat = (span.per_node - 1) * links.intra_latency_s + (nodes - 1) * links.inter_latency_s
        return lat + max(near / links.intra_bytes_per_s, away / inter)
    if nodes == 1:
        return factor * (size - 1) * links.intra_latency_s + moved / links.intra_bytes_per_s
    bw = min(links.intra_bytes_per_s, span.per_node * inter)
    lat = factor * (span.per_node - 1) * links.intra_latency_s
    lat += factor * math.ceil(math.log2(nodes)) * links.inter_latency_s
    return lat + moved / bw
