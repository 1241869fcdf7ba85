"""The cost model's nodes on real gloo ranks: four ranks counted as two nodes of two
(``ANYSHARD_DEVICES_PER_NODE=2``) read `Topology(2, 2)` from their process group, and the
calibration measures each collective across nodes as well as inside one.

Run: python -m pytest tests/dist/test_topology_calibration.py -q
"""

import os

TASKS = os.path.join(os.path.dirname(__file__), "_topology_tasks.py")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


def test_four_ranks_as_two_nodes_of_two_calibrate_rates_across_nodes(pool4):
    results = pool4.run(TASKS, "topology_and_crossing_rates", "2", timeout=60)
    for r in results:
        assert r["topology"] == (2, 2) and r["source"] == "ANYSHARD_DEVICES_PER_NODE=2"
        assert tuple(r["rates_topology"]) == (2, 2)
        # pairs one node apart (measured on stride-2 groups), and the world (2 per node)
        want = {f"{k}/{g}/{q}" for k in KINDS for g, q in ((2, 1), (4, 2))}
        assert set(r["crossing"]) == want
        assert all(alpha >= 0 and beta >= 0 for alpha, beta in r["crossing"].values())
    assert all(r["crossing"] == results[0]["crossing"] for r in results)  # rank 0's figures
