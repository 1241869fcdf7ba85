"""Task functions for the cost model's topology on real ranks: the nodes read from the process
group, and the rates calibrated across them."""

from __future__ import annotations

import os


def topology_and_crossing_rates(per_node: str) -> dict:
    """This rank's `cluster.job_topology` with ``ANYSHARD_DEVICES_PER_NODE=per_node`` (the
    harness restores the environment), and a short calibration's rates across nodes."""
    from anyshard.trainer_integration.gpt.layout_chooser.cluster import job_topology
    from anyshard.trainer_integration.gpt.layout_chooser.costmodel import calibrate

    os.environ["ANYSHARD_DEVICES_PER_NODE"] = per_node
    topology, source = job_topology()
    rates = calibrate(
        gemm_sizes=(32, 64), message_bytes=(1 << 10, 1 << 16), budget_s=0.02, topology=None
    )
    return {
        "topology": (topology.devices_per_node, topology.nodes),
        "source": source,
        "rates_topology": rates.topology,
        "crossing": rates.crossing,
        "collectives": sorted(rates.collectives),
    }
