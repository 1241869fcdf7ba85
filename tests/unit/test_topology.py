"""Placement of mesh dims on nodes and the price of a collective over the links a group crosses
(`anyshard.trainer_integration.planning.topology`), each against arithmetic done by hand.

Run: python -m pytest tests/unit/test_topology.py -q
"""

from __future__ import annotations

import math

import pytest

from anyshard.trainer_integration.planning.topology import (
    Links,
    Span,
    Topology,
    collective_s,
    placement,
    span_at,
)

GB = 1e9
INTRA, INTER = 300 * GB, 25 * GB  # per device, one direction
LAT_IN, LAT_OUT = 1e-6, 1e-5
LINKS = Links(INTRA, INTER, LAT_IN, LAT_OUT)
NO_LATENCY = Links(INTRA, INTER, 0.0, 0.0)
N = 8 * GB  # message bytes


def close(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-12, abs=0.0)


# -- placement --------------------------------------------------------------------------------


def test_tp_of_8_fills_a_node_of_8_and_dp_above_it_has_one_member_per_node():
    spans = placement((("tp", 8), ("dp", 4)), devices_per_node=8)
    assert spans["tp"] == Span(size=8, per_node=8, extent=1)  # ranks 0-7: node 0
    assert spans["tp"].nodes == 1
    # stride 8: ranks 0, 8, 16, 24 on nodes 0 to 3
    assert spans["dp"] == Span(size=4, per_node=1, extent=4)
    assert spans["dp"].nodes == 4


def test_a_dim_of_stride_4_on_nodes_of_8_has_2_members_per_node():
    # ranks 0, 4 | 8, 12: two per node, two nodes (0 and 1)
    assert span_at(4, 4, 8) == Span(4, 2, 2)
    assert span_at(4, 4, 8).nodes == 2
    spans = placement((("tp", 4), ("dp", 4)), devices_per_node=8)
    assert spans["tp"] == Span(4, 4, 1) and spans["tp"].nodes == 1  # ranks 0-3
    assert spans["dp"] == Span(4, 2, 2) and spans["dp"].nodes == 2


def test_strides_accumulate_innermost_first():
    spans = placement((("tp", 2), ("cp", 2), ("dp", 2), ("pp", 4)), devices_per_node=8)
    assert spans["tp"] == Span(2, 2, 1)  # stride 1: ranks 0 and 1
    assert spans["cp"] == Span(2, 2, 1)  # stride 2: ranks 0 and 2
    assert spans["dp"] == Span(2, 2, 1)  # stride 4: ranks 0 and 4 share node 0
    assert spans["pp"] == Span(4, 1, 4)  # stride 8: ranks 0, 8, 16, 24, one stage per node
    assert spans["pp"].nodes == 4


def test_a_consecutive_group_larger_than_a_node_fills_its_nodes():
    assert span_at(16, 1, 8) == Span(16, 8, 2)  # ranks 0-15: nodes 0 and 1
    assert span_at(16, 1, 8).nodes == 2
    # stride beyond a node: one member per node; ranks 0 and 16 touch nodes 0 and 2, and the
    # group reaches from node 0 to node 2 (3 nodes) past node 1, which holds none of it
    assert span_at(2, 16, 8) == Span(2, 1, 3)
    assert span_at(2, 16, 8).nodes == 2


def test_a_group_of_one_is_one_member_on_one_node():
    assert span_at(1, 1, 8) == Span(1, 1, 1)
    assert span_at(1, 64, 8) == Span(1, 1, 1)
    assert span_at(1, 64, 8).nodes == 1


def test_topology_world():
    assert Topology(8, 4).world == 32
    assert Topology(4).world == 4


def test_a_group_that_does_not_fill_its_last_node_still_reaches_it():
    span = span_at(12, 1, 8)
    assert span.nodes == 2
    # a ring over the two nodes: bound by the inter-node links, not by NVLink
    assert collective_s("all_reduce", span, N, NO_LATENCY) > 2 * 11 / 12 * N / INTRA


# -- collectives ------------------------------------------------------------------------------


def test_nothing_to_do_for_a_group_of_one_or_an_empty_message():
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        assert collective_s(kind, Span(1, 1), N, LINKS) == 0.0
        assert collective_s(kind, Span(8, 8), 0, LINKS) == 0.0


def test_ring_all_reduce_inside_a_node():
    # 8 GPUs on one node at 300 GB/s: each sends 2 x 7/8 of the message; 2 x 7 ring steps
    expected = 2 * 7 * LAT_IN + 2 * (7 / 8) * N / INTRA
    assert collective_s("all_reduce", Span(8, 8), N, LINKS) == close(expected)
    # the docstring's figure, without latencies: 2 x 7/8 x 8 GB / 300 GB/s = 46.7 ms
    assert collective_s("all_reduce", Span(8, 8), N, NO_LATENCY) == close(0.04666666666666667)


def test_all_reduce_of_8_members_one_per_node_runs_at_the_inter_node_rate():
    # bandwidth: min(300 GB/s, 1 x 25 GB/s); latency: no intra-node steps, a tree over 8 nodes
    # of 2 x log2(8) = 6 inter-node steps
    expected = 2 * 3 * LAT_OUT + 2 * (7 / 8) * N / INTER
    assert collective_s("all_reduce", Span(8, 1), N, LINKS) == close(expected)
    assert collective_s("all_reduce", Span(8, 1), N, NO_LATENCY) == close(0.56)


def test_all_reduce_of_16_with_8_per_node_uses_the_nodes_nics_together():
    # two nodes; each member's NIC carries one of 8 parallel rings: min(300, 8 x 25) = 200 GB/s
    bw = min(INTRA, 8 * INTER)
    assert bw == 200 * GB
    expected = 2 * 7 * LAT_IN + 2 * 1 * LAT_OUT + 2 * (15 / 16) * N / bw
    assert collective_s("all_reduce", Span(16, 8), N, LINKS) == close(expected)
    # with faster NICs (8 x 50 = 400 GB/s) NVLink is the bound
    fast = Links(INTRA, 50 * GB, 0.0, 0.0)
    assert collective_s("all_reduce", Span(16, 8), N, fast) == close(2 * (15 / 16) * N / INTRA)


def test_tree_latency_rounds_the_node_count_up_to_a_power_of_two():
    latency_only = Links(1e30, 1e30, LAT_IN, LAT_OUT)
    # 3 nodes, one member each: ceil(log2 3) = 2 levels, twice for an all-reduce
    assert collective_s("all_reduce", Span(3, 1), 1.0, latency_only) == close(
        2 * 2 * LAT_OUT + 2 * (2 / 3) / 1e30
    )


@pytest.mark.parametrize("span", [Span(8, 8), Span(8, 1), Span(16, 8), Span(32, 4)])
def test_all_gather_and_reduce_scatter_move_half_the_bytes_of_an_all_reduce(span):
    ar = collective_s("all_reduce", span, N, NO_LATENCY)
    assert collective_s("all_gather", span, N, NO_LATENCY) == close(ar / 2)
    assert collective_s("reduce_scatter", span, N, NO_LATENCY) == close(ar / 2)


def test_all_gather_inside_a_node_by_hand():
    expected = 7 * LAT_IN + (7 / 8) * N / INTRA
    assert collective_s("all_gather", Span(8, 8), N, LINKS) == close(expected)


def test_reduce_scatter_across_nodes_by_hand():
    # 32 members, 4 per node, 8 nodes: min(300, 4 x 25) = 100 GB/s; 3 intra steps, 3 levels
    expected = 3 * LAT_IN + 3 * LAT_OUT + (31 / 32) * N / (100 * GB)
    assert collective_s("reduce_scatter", Span(32, 4), N, LINKS) == close(expected)


def test_all_to_all_inside_a_node():
    # each member keeps 1/8, sends 7/8 of the message over NVLink; a step per peer
    expected = 7 * LAT_IN + (7 / 8) * N / INTRA
    assert collective_s("all_to_all", Span(8, 8), N, LINKS) == close(expected)


def test_all_to_all_across_nodes_sends_the_remote_share_over_each_members_nic():
    # 16 members, 8 per node: 8/16 of the message leaves the node over the member's own NIC
    # (25 GB/s), 7/16 stays on NVLink; the slower of the two, plus 7 + 1 latency steps
    away, near = N * 8 / 16, N * 7 / 16
    expected = 7 * LAT_IN + 1 * LAT_OUT + max(near / INTRA, away / INTER)
    assert away / INTER > near / INTRA
    assert collective_s("all_to_all", Span(16, 8), N, LINKS) == close(expected)
    # one member per node: all but its own 1/8 crosses nodes
    expected = 7 * LAT_OUT + (7 / 8) * N / INTER
    assert collective_s("all_to_all", Span(8, 1), N, LINKS) == close(expected)


def test_a_send_inside_a_node_and_across_nodes():
    assert collective_s("send", Span(2, 2), N, LINKS) == close(LAT_IN + N / INTRA)
    assert collective_s("send", Span(2, 1), N, LINKS) == close(LAT_OUT + N / INTER)


def test_oversubscription_applies_only_to_groups_beyond_a_pod():
    pods = Links(INTRA, INTER, 0.0, 0.0, pod_nodes=4, oversubscription=2.0)
    # 4 nodes: inside one pod, full rate
    assert collective_s("all_reduce", Span(4, 1), N, pods) == close(2 * (3 / 4) * N / INTER)
    # 8 nodes: beyond the pod, half the inter-node rate
    assert collective_s("all_reduce", Span(8, 1), N, pods) == close(2 * (7 / 8) * N / (INTER / 2))
    # 16 members on 2 nodes: min(300, 8 x 25) inside a pod
    assert collective_s("all_reduce", Span(16, 8), N, pods) == close(2 * (15 / 16) * N / (200 * GB))
    # 64 members on 8 nodes: min(300, 8 x 12.5) = 100 GB/s
    assert collective_s("all_reduce", Span(64, 8), N, pods) == close(2 * (63 / 64) * N / (100 * GB))
    # inside a node nothing changes
    assert collective_s("all_reduce", Span(8, 8), N, pods) == close(2 * (7 / 8) * N / INTRA)
    # a send between two nodes stays in the pod; all-to-all over 8 nodes pays it
    assert collective_s("send", Span(2, 1), N, pods) == close(N / INTER)
    assert collective_s("all_to_all", Span(8, 1), N, pods) == close((7 / 8) * N / (INTER / 2))


def test_pod_nodes_default_never_oversubscribes():
    over = Links(INTRA, INTER, 0.0, 0.0, oversubscription=4.0)  # pod_nodes default: 2**30
    assert collective_s("all_reduce", Span(1024, 1), N, over) == close(
        2 * (1023 / 1024) * N / INTER
    )


def test_unknown_collective_kind_is_refused():
    with pytest.raises(KeyError):
        collective_s("broadcast", Span(8, 8), N, LINKS)


def test_latency_counts_of_a_ring_inside_a_node_scale_with_the_group():
    latency_only = Links(1e30, 1e30, LAT_IN, LAT_OUT)
    for size in (2, 4, 8):
        t = collective_s("all_reduce", Span(size, size), 1.0, latency_only)
        assert t == pytest.approx(2 * (size - 1) * LAT_IN, rel=1e-9)
        assert math.isfinite(t)
