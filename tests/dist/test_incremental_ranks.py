"""Incremental checkpoints across ranks: a step saved on top of another under FSDP2 x TP
references every shard that did not change, and loads bit-exact under other layouts (torch's own
full tensors are the truth), also once its base has been deleted by retention; and a load into
a replicated layout fetches each stored byte once per job, forwarding it between replicas.

Run: python -m pytest tests/dist/test_incremental_ranks.py -q
"""

from __future__ import annotations

import os

import pytest

import anyshard
from anyshard.format.steps import remove_step
from anyshard.reshard.verify import verify_checkpoint

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_incremental_tasks.py")
LAYOUTS = os.path.join(HERE, "_layouts.py")


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    root = tmp_path_factory.mktemp("incremental")
    base, ckpt, truth = str(root / "step-1"), str(root / "step-2"), str(root / "truth")
    out = pool4.run(TASKS, "incremental_save_task", "fsdp2_tp2", base, ckpt, truth, 5)
    return base, ckpt, truth, out


def test_unchanged_shards_are_referenced_on_every_rank(saved):
    _, ckpt, _, out = saved
    # the model's weights other than up.weight are unchanged, the optimizer states all changed;
    # each rank references the shards it would have written (replicated ones by one holder)
    referenced = {k for r in out for k in r["referenced"]}
    model = {"model.emb.weight", "model.norm.weight", "model.up.bias", "model.down.weight"}
    assert referenced == model, referenced
    assert sum(len(r["referenced"]) for r in out) >= 2 * len(model)  # dim-0 shards on 2 ranks
    assert verify_checkpoint(ckpt).shards > 0


@pytest.mark.parametrize("layout", ["tp4", "fsdp4"])
def test_an_incremental_step_loads_bit_exact_under_another_layout(pool4, saved, layout):
    _, ckpt, truth, _ = saved
    checked = pool4.run(LAYOUTS, "load_check_task", layout, ckpt, truth, 6)
    assert all(n > 10 for n in checked), checked


def test_it_stays_loadable_once_retention_deleted_its_base(pool4, saved):
    base, ckpt, truth, _ = saved
    remove_step(base)
    assert not os.path.exists(os.path.join(base, "manifest.json"))
    with pytest.raises(anyshard.AnyshardError):
        anyshard.open(base)
    checked = pool4.run(LAYOUTS, "load_check_task", "ddp2_tp2", ckpt, truth, 7)
    assert all(n > 10 for n in checked), checked
    assert verify_checkpoint(ckpt).shards > 0


def test_a_replicated_target_fetches_each_stored_byte_once_and_forwards_it(pool4, saved):
    """ddp2 x tp2: every tensor is replicated over dp_replicate. Without forwarding each replica
    fetches the same bytes; with it the replicas fetch halves and exchange them, bit-exact."""
    _, ckpt, truth, _ = saved
    plain = pool4.run(TASKS, "read_once_load_task", "ddp2_tp2", ckpt, truth, 8, False)
    once = pool4.run(TASKS, "read_once_load_task", "ddp2_tp2", ckpt, truth, 8, True)
    assert all(r["forwarded"] > 0 for r in once), once
    direct, forwarded = sum(r["read"] for r in plain), sum(r["read"] for r in once)
    # two replicas: each fetches about half of what it needs (these shards are small: a read
    # of part of one widens to its one checksum block, hence not exactly half)
    assert forwarded < 0.6 * direct, (forwarded, direct)
