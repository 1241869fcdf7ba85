"""The reference trainer resumes under another layout: the checkpoint saved under layout A is
loaded under layout B through the reshard engine, and the next 5 steps stay within the
floating-point noise floor (the largest difference between uninterrupted runs under A and under
B from the same start, and never less than 4 float32 ULPs of the loss: two valid reduction
orders differ by a few ULPs even where one pair of runs happens to agree) and within 1e-4
relative of the uninterrupted run under A.

Run: python -m pytest tests/dist/test_trainer_elastic.py -q
"""

import json
import math
import os

import pytest
import torch

TASKS = os.path.join(os.path.dirname(__file__), "_trainer_tasks.py")
# a wrong restore shows in the first steps after it: the data position and the step count at the
# first, the optimizer's moments from the second
SAVE_AT, AFTER = 2, 5
TOTAL = SAVE_AT + AFTER


def _args(root: str, steps: int, layout: list[str], extra: list[str], every: int = 1000) -> list:
    return [
        "--train.steps", str(steps),
        "--checkpoint.root", root,
        "--checkpoint.every_steps", str(every),
        "--checkpoint.keep_last", "1",
        "--run_dir", os.path.dirname(root),
        *layout, *extra,
    ]  # fmt: skip


_UNINTERRUPTED: dict[tuple[str, ...], list[float]] = {}


def _uninterrupted(pool4, run_dir, layout: list[str], extra: list[str]) -> list[float]:
    """The losses of an uninterrupted TOTAL-step run (no checkpoint) under ``layout``: a pure
    function of the layout and the model, run once per module and shared between the tests
    that compare against it."""
    key = (*layout, "|", *extra)
    if key not in _UNINTERRUPTED:
        args = _args(str(run_dir / "ckpt"), TOTAL, layout, extra)
        _UNINTERRUPTED[key] = pool4.run(TASKS, "train", args)[0]
    return _UNINTERRUPTED[key]


def _params(cases: list, ids: list[str]) -> list:
    """``cases`` with their ids. The uninterrupted runs they compare against are shared where
    two cases name the same layout (`_uninterrupted`): a case costs its own two runs and those
    of a layout no other case runs."""
    return [pytest.param(*c, id=i) for c, i in zip(cases, ids, strict=True)]


PAIRS = [
    (
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        ["--parallel.tp", "4"],
        ["--model.n_kv_heads", "4"],
    ),
    (["--parallel.pp", "2", "--parallel.dp_shard", "2"], ["--parallel.dp_shard", "4"], []),
    (["--parallel.dp_shard", "2", "--parallel.cp", "2"], ["--parallel.dp_shard", "4"], []),
    (
        ["--parallel.ep", "2", "--parallel.dp_shard", "2"],
        ["--parallel.dp_shard", "4"],
        ["--model.n_experts", "4"],
    ),
    (
        ["--parallel.ep", "2", "--parallel.tp", "2"],
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        ["--model.n_experts", "4"],
    ),
    (
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        ["--parallel.dp_shard", "4"],
        ["--model.tie_embeddings", "true"],
    ),
]


@pytest.mark.parametrize(
    "a,b,extra",
    _params(
        PAIRS,
        [
            "fsdp2xtp2-to-tp4",
            "pp2xdp2-to-dp4",
            "dp2xcp2-to-dp4",
            "moe-ep2-to-ep1",
            "moe-ep2xtp2-to-fsdp2xtp2",
            "tied-pp2xdp2-to-dp4",
        ],
    ),
)
def test_resume_under_another_layout_stays_within_the_noise_floor(pool4, tmp_path, a, b, extra):
    run_a = _uninterrupted(pool4, tmp_path / "a", a, extra)
    run_b = _uninterrupted(pool4, tmp_path / "b", b, extra)
    root = str(tmp_path / "r" / "ckpt")
    first = pool4.run(TASKS, "train", _args(root, SAVE_AT, a, extra, every=SAVE_AT))[0]
    assert first == run_a[:SAVE_AT]  # same layout, same start: bit-identical
    resumed = pool4.run(TASKS, "train", _args(root, TOTAL, b, extra))[0]
    assert len(resumed) == AFTER  # restored at SAVE_AT, no step repeated or skipped
    floor = max(abs(x - y) for x, y in zip(run_b[SAVE_AT:], run_a[SAVE_AT:], strict=True))
    for k, (got, want) in enumerate(zip(resumed, run_a[SAVE_AT:], strict=True)):
        ulps = 4 * float(torch.finfo(torch.float32).eps) * 2 ** math.floor(math.log2(abs(want)))
        assert abs(got - want) <= max(floor, ulps), (k, got, want, floor, ulps)
        assert abs(got - want) <= 1e-4 * abs(want), (k, got, want)
    assert run_a[-1] < run_a[0] - 0.5  # it trains


RELAYOUTS = [
    (
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        "tp=2,dp_shard=2",
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        [],
    ),
    (
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        "dp_shard=4",
        ["--parallel.dp_shard", "4"],
        ["--model.tie_embeddings", "true"],
    ),
    (
        ["--parallel.ep", "2", "--parallel.dp_shard", "2"],
        "dp_shard=2,tp=2",
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        ["--model.n_experts", "4"],
    ),
    (
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        "pp=2,dp_shard=2",
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        ["--model.tie_embeddings", "true"],
    ),
]


@pytest.mark.parametrize(
    "a,switch,b,extra",
    _params(
        RELAYOUTS,
        [
            "pp2xdp2-to-tp2xdp2",
            "tied-pp2xdp2-to-dp4",
            "moe-ep2xdp2-to-fsdp2xtp2",
            "tied-fsdp2xtp2-to-pp2xdp2",
        ],
    ),
)
def test_relayout_in_a_running_job_stays_within_the_noise_floor(
    pool4, tmp_path, a, switch, b, extra
):
    """The job switches layout at step SAVE_AT over the network (no checkpoint written or read):
    the same criterion as a restart under another layout."""
    run_a = _uninterrupted(pool4, tmp_path / "a", a, extra)
    run_b = _uninterrupted(pool4, tmp_path / "b", b, extra)
    root = tmp_path / "r" / "ckpt"
    args = _args(str(root), TOTAL, a, [*extra, "--parallel.relayout_at", f"{SAVE_AT}:{switch}"])
    switched = pool4.run(TASKS, "train", args)[0]
    assert not root.exists() or not any(root.iterdir())  # no checkpoint on the way
    assert switched[:SAVE_AT] == run_a[:SAVE_AT]
    assert len(switched) == TOTAL
    floor = max(abs(x - y) for x, y in zip(run_b[SAVE_AT:], run_a[SAVE_AT:], strict=True))
    for k, (got, want) in enumerate(zip(switched[SAVE_AT:], run_a[SAVE_AT:], strict=True)):
        ulps = 4 * float(torch.finfo(torch.float32).eps) * 2 ** math.floor(math.log2(abs(want)))
        assert abs(got - want) <= max(floor, ulps), (k, got, want, floor, ulps)
        assert abs(got - want) <= 1e-4 * abs(want), (k, got, want)
    events = [json.loads(x) for x in open(tmp_path / "r" / "events.jsonl")]
    moved = [e for e in events if e.get("event") == "relayout"]
    assert len(moved) == 1 and moved[0]["step"] == SAVE_AT and moved[0]["received_bytes"] > 0


@pytest.mark.parametrize(
    "layout",
    _params(
        [
            (["--parallel.dp_shard", "2", "--parallel.tp", "2"],),
            (["--parallel.pp", "2", "--parallel.dp_shard", "2"],),
        ],
        ["fsdp2xtp2", "pp2xdp2"],
    ),
)
def test_async_saves_staged_during_the_step_hold_the_state_a_sync_save_holds(
    pool4, tmp_path, layout
):
    """Async saves whose staging copy runs during forward and backward (`Checkpointer.guard`)
    save every step exactly what sync saves save, and training is the same, although every
    copy starts late (0.3 s, longer than a step): the optimizer steps wait for them."""
    import anyshard

    steps = 5
    runs = {}
    for mode, extra in [
        ("sync", []),
        ("overlapped", ["--checkpoint.async_", "true", "--checkpoint.stage_in_background", "true"]),
    ]:
        root = str(tmp_path / mode / "ckpt")
        args = _args(root, steps, layout, extra, every=1)
        args[args.index("--checkpoint.keep_last") + 1] = str(steps)
        task = "train_with_slow_staging" if extra else "train"
        runs[mode] = (root, pool4.run(TASKS, task, args, *([0.3] if extra else []))[0])
    (sync_root, sync_losses), (root, losses) = runs["sync"], runs["overlapped"]
    assert losses == sync_losses
    for step in range(1, steps + 1):
        name = f"step-{step:09d}"
        with (
            anyshard.open(os.path.join(sync_root, name)) as a,
            anyshard.open(os.path.join(root, name)) as b,
        ):
            assert a.keys() == b.keys() and a.values == b.values, step
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (step, k)
    events = [json.loads(x) for x in open(tmp_path / "overlapped" / "events.jsonl")]
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["saves"] == steps and end["ckpt_blocked_s"] >= 0


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--model.tie_embeddings", "true"],
    ],
    ids=["fsdp2xtp2", "pp2xdp2", "tied-fsdp2xtp2"],
)
def test_remembered_state_dicts_equal_dcps_taken_anew(pool4, layout):
    """The trainer remembers DCP's state dict between saves; with the learning rate changing
    every step, after the optimizer's state tensors are replaced, another hyperparameter set
    and a submodule added, what it returns is what
    DCP returns when asked again, on every rank; its own state dict filled in place loads
    without a copy."""
    assert pool4.run(TASKS, "cached_state_dicts", layout, 3) == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.pp", "2", "--parallel.dp_shard", "2"],
        ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--model.tie_embeddings", "true"],
    ],
    ids=["pp2xdp2", "tied-fsdp2xtp2"],
)
def test_a_primed_state_trains_exactly_as_a_fresh_one(pool4, layout):
    """The trainer takes its state dict before the first step (AdamW's state made by DCP's step
    of lr 0, its step counts reset): training then gives bit-identical parameters, optimizer
    states and losses to an optimizer left alone, and needs no new walk over the model."""
    losses = pool4.run(TASKS, "primed_state_trains_as_fresh", layout, 3)
    assert all(len(x) == 3 and x == losses[0] for x in losses)


def test_a_second_mesh_hierarchy_in_the_same_processes_saves_under_its_own_root(pool4, tmp_path):
    """torch's DTensor op cache keys by the meshes' values: after tp=2 x cp=2, the tied
    pp=2 x tp=2 run's new tensors got the first hierarchy's equal tp slices, with its root, and
    the save failed its shard count check. The trainer empties the cache; the save succeeds
    and holds both stages' tensors."""
    names = pool4.run(TASKS, "save_after_another_hierarchy", str(tmp_path / "ckpt"))
    assert all(n == names[0] for n in names)
    assert "train.model.tok_embeddings.weight" in names[0]
    assert "train.model.layers.3.attention.wq.weight" in names[0]
