"""A read-once load plans once: the manifest read and the state dict checked against it one time
per rank, whichever route it then takes (a replica split, or by stored shards).

Run: python -m pytest tests/dist/test_load_planning.py -q
"""

import os

TASKS = os.path.join(os.path.dirname(__file__), "_load_planning_tasks.py")


def test_a_read_once_load_plans_once_on_every_rank_whichever_route_it_takes(pool2, tmp_path):
    counts = pool2.run(TASKS, "planned_loads_task", str(tmp_path / "ckpt"), "_plan")
    assert counts == [{"replica split": 1, "stored shards": 1}] * 2
