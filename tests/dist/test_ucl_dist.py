"""UCL specs across real processes: every rank saves its plain local tensors (Megatron-style
fused QKV with uneven GQA, fused gate/up, padded vocabulary, pipeline-local layer numbers); the
checkpoint loads under other layouts as spec locals and as DTensors, bit-exact.

Run: python -m pytest tests/dist/test_ucl_dist.py -q
"""

import os

import torch

import anyshard
from anyshard.reshard.verify import verify_checkpoint

TASKS = os.path.join(os.path.dirname(__file__), "_ucl_tasks.py")


def test_megatron_locals_saved_by_4_ranks_load_under_other_layouts(pool4, tmp_path):
    from _ucl_tasks import logical

    path = str(tmp_path / "meg")
    counts = pool4.run(TASKS, "save_megatron", path, 5, {"pp": 2, "tp": 2})
    assert len(counts) == 4
    assert verify_checkpoint(path).tensors == len(logical(5))
    with anyshard.open(path) as view:
        for name, t in logical(5).items():
            assert torch.equal(view.get_tensor(name), t), name
    # pp=2 x tp=2 -> tp=4 (uneven: 3 query groups over 4 ranks) and -> dp=2 x tp=2
    assert min(pool4.run(TASKS, "load_megatron", path, 5, {"tp": 4})) > 0
    assert min(pool4.run(TASKS, "load_megatron", path, 5, {"dp": 2, "tp": 2})) > 0
    assert pool4.run(TASKS, "load_as_dtensors", path, 5) == [len(logical(5))] * 4


def test_a_spec_load_reads_each_stored_region_once_per_job(pool4, tmp_path):
    """dp=2 x tp=2 locals: the two data-parallel replicas need the same regions. Read per rank,
    each is read twice; with read_once, once, and the loads stay bit-exact."""
    path = str(tmp_path / "meg")
    pool4.run(TASKS, "save_megatron", path, 5, {"pp": 2, "tp": 2})
    from anyshard.format.datafile import read_header

    stored = sum(  # the tensors' bytes in the data files
        e.stop - e.start
        for f in os.listdir(path + "/data")
        for e in read_header(os.path.join(path, "data", f)).shards.values()
    )
    each = pool4.run(TASKS, "load_megatron", path, 5, {"dp": 2, "tp": 2})
    once = pool4.run(TASKS, "load_megatron", path, 5, {"dp": 2, "tp": 2}, True)
    assert sum(each) >= 2 * stored, (each, stored)  # every byte, by both replicas
    assert sum(once) <= 1.02 * stored, (once, each, stored)
    assert all(n > 0 for n in once), once  # the reading is spread over the ranks


def test_average_over_replicas_saves_the_mean(pool4, tmp_path):
    path = str(tmp_path / "avg")
    pool4.run(TASKS, "save_averaged", path)
    # ranks (dp, tp): (0,0) [0,1] (0,1) [12,13] (1,0) [20,21] (1,1) [32,33]
    got = anyshard.open(path).get_tensor("stat")
    assert torch.equal(got, torch.tensor([10.0, 11.0, 22.0, 23.0]))
