"""`anyshard.redistribute`: live resharding between layouts over gloo, bit-exact.

Run: python -m pytest tests/dist/test_redistribute.py -q
"""

import os

import pytest

TASKS = os.path.join(os.path.dirname(__file__), "_redistribute_tasks.py")


@pytest.mark.parametrize(
    "src,dst",
    [
        ("fsdp4", "fsdp2_tp2"),  # FSDP2 -> FSDP2 x TP
        ("fsdp2_tp2", "tp4"),
        ("ddp2_tp2", "fsdp4"),  # HSDP x TP -> FSDP2: replicas share the sending
        ("tp4", "ddp2_tp2"),  # uneven TP (10 and 13 rows over 4 ranks)
    ],
)
def test_layouts_bit_exact_with_adamw_state(pool4, src, dst):
    out = pool4.run(TASKS, "layouts_task", src, dst, 5, 256 << 20)
    assert min(o["tensors"] for o in out) > 10
    assert sum(o["sent"] for o in out) == sum(o["received"] for o in out) > 0


def test_small_inflight_budget_cuts_messages(pool4):
    out = pool4.run(TASKS, "layouts_task", "fsdp4", "tp4", 6, 256)
    # a round holds a message to and from each of the 3 peers: a sixth of the budget each
    assert max(o["largest"] for o in out) <= 256 // 6


def test_plan_is_identical_on_every_rank(pool4):
    digests = pool4.run(TASKS, "plan_digest_task", "fsdp2_tp2", "ddp2_tp2")
    assert len(set(digests)) == 1


def test_leaving_and_joining_ranks(pool4):
    checked = pool4.run(TASKS, "shrink_grow_task", 3)
    assert checked[0] == checked[1] > checked[2] == checked[3] > 10


def test_ranks_with_an_empty_source(pool4):
    sent = pool4.run(TASKS, "empty_src_task", 4)
    assert sent[0] > 0 and sent[1] > 0 and sent[2] == sent[3] == 0  # replicas share the sending


@pytest.mark.parametrize(
    "src,dst",
    [
        ({"tp": 2, "pp": 2}, {"tp": 4}),
        ({"tp": 2, "pp": 2}, {"pp": 2}),
        ({"pp": 2}, {"tp": 2, "pp": 2}),
    ],
)
def test_ucl_spec_layouts(pool4, src, dst):
    counts = pool4.run(TASKS, "spec_task", 9, src, dst)
    assert counts[0] > 5


def test_errors_name_the_tensor_on_every_rank(pool4):
    missing = pool4.run(TASKS, "error_task", "missing")
    assert all("model.up.bias" in m and "no rank's source state" in m for m in missing), missing
    shape = pool4.run(TASKS, "error_task", "shape")
    assert all("model.up.bias" in m for m in shape), shape


def test_large_moves_travel_in_place_over_several_rounds(pool4):
    pairs = pool4.run(TASKS, "large_moves_task", 1800 << 10)  # messages of <= 300 KiB
    assert min(pairs) == 6  # each rank sends to and receives from the 3 others


def test_repeated_calls_reuse_the_plan_on_every_rank_or_on_none(pool4):
    events = pool4.run(TASKS, "reuse_plan_task", 8)
    assert events == [["reused", "planned", "reused", "planned"]] * 4
