"""A 4-process save to s3:// (moto's server on loopback) and a reshard load from it, bit-exact.

Run: python -m pytest tests/dist/test_s3_reshard.py -q
"""

import os

import pytest

import torch
from _s3_tasks import full_tensors

import anyshard
from anyshard.reshard.verify import verify_checkpoint

TASKS = os.path.join(os.path.dirname(__file__), "_s3_tasks.py")


def test_a_dp2_tp2_save_to_s3_loads_bit_exact_under_tp4(pool4, s3_server, s3):
    url = f"{s3}/run/step-000000003"
    env = s3_server.env()  # the workers started before the server: they get its address here
    assert sorted(pool4.run(TASKS, "save_task", env, url, 11)) == [0, 1, 2, 3]
    assert pool4.run(TASKS, "load_check_task", env, url, 11) == [5] * 4

    report = verify_checkpoint(url)  # this process finds the server through its environment
    assert report.tensors == 5 and report.files == 4
    with anyshard.open(url) as view:
        for name, t in full_tensors(11).items():
            got = view.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        assert view.get_value("step") == 3


def test_tiered_checkpointer_uploads_and_a_replacement_node_restores_from_s3(
    pool4, s3_server, s3, tmp_path
):
    import shutil

    from anyshard.format import steps

    root, local = f"{s3}/tiered", str(tmp_path / "local")
    env = s3_server.env()
    listed = pool4.run(TASKS, "tiered_save_task", env, root, local)
    assert listed == [["step-000000004"]] * 4  # keep_local=1
    assert [s.step for s in steps.list_steps(root) if s.committed] == [4]  # keep_last=1
    shutil.rmtree(local)
    assert pool4.run(TASKS, "tiered_restore_task", env, root, local) == [[4, True]] * 4


def test_four_ranks_save_and_load_through_random_faults(pool4, moto_server, s3_proxy):
    """A fifth of S3 requests fail (503, 500, dropped, stalled) while 4 ranks save and reshard-
    load: every round is bit-exact or fails with a clean error, and every commit verifies."""
    env = {
        **moto_server.env(),
        "AWS_ENDPOINT_URL": s3_proxy.endpoint,
        "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries off: anyshard's are tested
        "ANYSHARD_STORAGE_DEADLINE": "20",
        "ANYSHARD_STORAGE_ATTEMPT_TIMEOUT": "0.5",
    }
    s3_proxy.stall_seconds = 1.0
    s3_proxy.random_faults(0.2, seed=7)
    outcomes = []
    for k in range(2):
        url = f"{s3_proxy.bucket}/faulty/step-{k}"
        outcomes.append(pool4.run(TASKS, "faulty_round_task", env, url, 20 + k))
    total = len(s3_proxy.requests())
    assert s3_proxy.injected >= 0.1 * total, (s3_proxy.injected, total)
    s3_proxy.rate = 0.0
    for k, per_rank in enumerate(outcomes):
        url = f"{s3_proxy.bucket}/faulty/step-{k}"
        try:
            report = verify_checkpoint(url)
        except anyshard.errors.CheckpointNotFoundError:
            assert all(o.startswith("save failed") for o in per_rank), per_rank
        else:
            assert report.tensors == 5
            assert all(o == "ok" or o.startswith("load failed") for o in per_rank), per_rank
    assert any(o == "ok" for per_rank in outcomes for o in per_rank), outcomes


@pytest.mark.parametrize("plain", [False, True], ids=["dtensor", "plain-tensor"])
def test_a_replicated_load_from_s3_fetches_each_byte_once_per_job(pool4, s3_server, s3, plain):
    """Four ranks each need the whole tensor (a replicated DTensor, or a plain tensor every
    rank passes whole): by default (an object store) each fetches a quarter and forwards it;
    with read_once=False each fetches all of it."""
    url, env = f"{s3}/replicated/step-1", s3_server.env()
    direct = pool4.run(TASKS, "replicated_load_task", env, url, False, plain)
    once = pool4.run(TASKS, "replicated_load_task", env, url, None, plain)
    nbytes = 1024 * 256 * 4 + 3 * 4
    assert sum(direct) >= 4 * nbytes, direct
    assert sum(once) <= 1.05 * nbytes, once  # each stored byte fetched once per job
    assert all(0 < n <= 0.3 * nbytes for n in once), once  # spread evenly over the ranks


def test_a_column_split_load_from_s3_fetches_each_row_once_per_job(pool4, s3_server, s3):
    """w split by columns over tp=2 (and replicated over dp=2): read per rank, each rank reads
    the whole rows of its columns (the job: 4x the stored bytes); read once (the default on an
    object store), the rows read from the same stored shards go to one rank, which reads them
    once and sends the others their columns."""
    url, env = f"{s3}/columns/step-1", s3_server.env()
    direct = pool4.run(TASKS, "column_split_load_task", env, url, False)
    once = pool4.run(TASKS, "column_split_load_task", env, url, None)
    stored = (512 * 2048 + 2048) * 4
    assert sum(r["bytes"] for r in direct) >= 3.9 * stored, direct
    assert stored <= sum(r["bytes"] for r in once) <= 1.02 * stored, once
    assert sum(r["bytes"] > 0 for r in once) >= 2 and any(r["forwarded"] for r in once), once
