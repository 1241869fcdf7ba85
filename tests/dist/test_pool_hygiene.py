"""The shared pool of gloo ranks leaves no process groups behind: each task's meshes are
destroyed when it returns, so a session of tests does not pile up polling threads in the
workers (a few hundred groups cost the 2-core machine a core)."""

import os

TASKS = os.path.abspath(__file__)


def build_meshes(n: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    for _ in range(n):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        assert mesh["b"].size() == 2
    return len(os.listdir("/proc/self/task"))


def threads_and_groups() -> tuple[int, int]:
    from anyshard._compat import process_groups

    return len(os.listdir("/proc/self/task")), len(process_groups())


def test_a_task_s_process_groups_are_released_when_it_returns(pool4):
    before = pool4.run(TASKS, "threads_and_groups")
    during = pool4.run(TASKS, "build_meshes", 6)
    after = pool4.run(TASKS, "threads_and_groups")
    for rank in range(4):
        threads0, groups0 = before[rank]
        # six meshes of two dims each held their groups' threads while the task ran
        assert during[rank] >= threads0 + 12, (rank, before, during)
        threads1, groups1 = after[rank]
        assert groups1 == groups0, (rank, before, after)
        assert threads1 <= threads0 + 1, (rank, before, after)
