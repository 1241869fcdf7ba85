"""Each parallelism of the reference trainer, alone and composed, gives the single-process
run's losses (within 1e-5 relative) from the same initial weights and batches.

Run: python -m pytest tests/dist/test_gpt_parallel.py -q
"""

import json
import os
import subprocess
import sys

import pytest

TASKS = os.path.join(os.path.dirname(__file__), "_gpt_tasks.py")
STEPS = 3
COMMON = ["--train.lr", "0.02", "--train.warmup_steps", "1"]
MOE = ["--model.n_experts", "4"]
TIED = ["--model.tie_embeddings", "true"]


def single_process(runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """The losses of each run of ``runs`` (name: overrides), trained one after the other in one
    new process that has no process group."""
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        "from _gpt_tasks import losses; "
        f"print(json.dumps({{k: losses(v, {STEPS}) for k, v in {runs!r}.items()}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference():
    return single_process({"dense": COMMON, "moe": COMMON + MOE, "tied": COMMON + TIED})


def close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "layout,model",
    [
        (["--parallel.dp_shard", "2"], "dense"),
        (["--parallel.dp_replicate", "2"], "dense"),
        (["--parallel.tp", "2"], "dense"),
        (["--parallel.pp", "2"], "dense"),
        (["--parallel.cp", "2"], "dense"),
        (["--parallel.ep", "2"] + MOE, "moe"),
        (["--parallel.tp", "2"] + MOE, "moe"),
        (["--parallel.pp", "2"] + TIED, "tied"),
        (["--parallel.tp", "2"] + TIED, "tied"),
    ],
    ids=["fsdp", "ddp", "tp", "pp-1f1b", "cp", "ep", "moe-tp", "tied-pp", "tied-tp"],
)
def test_each_parallelism_alone_matches_one_process(pool2, reference, layout, model):
    got = pool2.run(TASKS, "losses", COMMON + layout, STEPS)
    assert all(g == got[0] for g in got)  # every rank reports the same global loss
    assert close(got[0], reference[model]), (got[0], reference[model])


@pytest.mark.parametrize(
    "layout,model",
    [
        (["--parallel.dp_shard", "2", "--parallel.tp", "2"], "dense"),
        (["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], "dense"),
        (["--parallel.pp", "2", "--parallel.dp_shard", "2"], "dense"),
        (["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "GPipe"], "dense"),
        (["--parallel.dp_shard", "2", "--parallel.cp", "2"], "dense"),
        (["--parallel.ep", "2", "--parallel.dp_shard", "2"] + MOE, "moe"),
        (["--parallel.ep", "2", "--parallel.tp", "2"] + MOE, "moe"),
        (["--parallel.dp_shard", "2", "--parallel.tp", "2"] + MOE, "moe"),
        (["--parallel.pp", "2", "--parallel.dp_shard", "2"] + TIED, "tied"),
        (
            ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "GPipe"] + TIED,
            "tied",
        ),
        (["--parallel.dp_shard", "2", "--parallel.tp", "2"] + TIED, "tied"),
        (["--parallel.pp", "2", "--parallel.cp", "2"], "dense"),
        (["--parallel.tp", "2", "--parallel.cp", "2"], "dense"),
        (["--parallel.pp", "2", "--parallel.ep", "2"] + MOE, "moe"),
        (["--parallel.cp", "2", "--parallel.ep", "2"] + MOE, "moe"),
    ],
    ids=[
        "fsdp-tp",
        "hsdp",
        "pp-fsdp",
        "pp-tp-gpipe",
        "fsdp-cp",
        "ep-fsdp",
        "ep-tp",
        "moe-fsdp-tp",
        "tied-pp-fsdp",
        "tied-pp-tp",
        "tied-fsdp-tp",
        "pp-cp",
        "tp-cp",
        "pp-ep",
        "cp-ep",
    ],
)
def test_composed_parallelisms_match_one_process(pool4, reference, layout, model):
    got = pool4.run(TASKS, "losses", COMMON + layout, STEPS)
    assert close(got[0], reference[model]), (got[0], reference[model])
