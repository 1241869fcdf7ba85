"""The cost model's fitted parameters are what tools/fit_cost_model.py fits from the two
published tables, and they predict those tables within the target.

    python -m pytest tests/unit/test_fit_cost_model.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import fit_cost_model as fit  # noqa: E402

from anyshard.trainer_integration.planning.transformer_cost import (  # noqa: E402
    PARAMS_FILE,
    Params,
    load_params,
)


def test_refit_from_the_two_tables_gives_the_committed_file() -> None:
    committed = load_params()
    refit = fit.fit(fit.rows())
    assert fit.same_params(refit, committed), (refit, committed)
    # and the comparison can fail: one parameter 1% off is another fit
    moved = dataclasses.replace(committed, overlap=committed.overlap * 1.01)
    assert not fit.same_params(refit, moved)


def test_the_file_holds_at_most_eight_parameters_each_with_its_fit_script() -> None:
    with open(PARAMS_FILE) as f:
        data = json.load(f)
    assert set(data["params"]) == set(Params.FIELDS)
    assert len(Params.FIELDS) <= 8
    for name, entry in data["params"].items():
        assert entry["fit_by"] == "tools/fit_cost_model.py", name
        lo, hi = entry["bounds"]
        assert lo <= entry["value"] <= hi, name
    assert os.path.exists(os.path.join(ROOT, data["fit_by"]))


def test_the_calibration_rows_are_predicted_within_ten_percent_on_average() -> None:
    table = fit.rows()
    assert len(table) == 19  # SC'21 Table 1: 10 rows; the Megatron-Core H100 table: 9
    errs = fit.errors(load_params(), table)
    assert statistics.fmean(abs(e) for e in errs) <= 0.10
    for source in (fit.SC21, fit.MCORE):
        mine = [abs(e) for e, r in zip(errs, table, strict=True) if r.source == source]
        assert statistics.fmean(mine) <= 0.10, source


def test_published_steps_follow_each_sources_flop_count() -> None:
    """SC'21's 1T row: Eq. 3 over 3,072 GPUs at 163 TFLOP/s; Megatron-Core's 462B row: model
    FLOPs over 6,144 GPUs at 459.9 TFLOP/s."""
    table = {(r.source, r.gpus): r for r in fit.rows()}
    one_t = table[(fit.SC21, 3072)]
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200  # noqa: E741
    eq3 = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert one_t.published_step_s == pytest.approx(eq3 / (3072 * 163e12), rel=1e-9)
    big = table[(fit.MCORE, 6144)]
    l, h, s, v = 112, 18432, 4096, 131072  # noqa: E741
    per_token = 6 * (l * 12 * h * h + v * h) + 12 * l * h * s
    assert big.published_step_s == pytest.approx(per_token * 3072 * s / (6144 * 459.9e12), rel=1e-9)
