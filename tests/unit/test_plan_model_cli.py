"""``anyshard plan --model``: a job planned whole (anyshard.trainer_integration.planning
joint_plan and plan_cli): its layouts ranked, the fastest simulated in every recovery mode, the
layouts to reshard into when nodes are lost; and ``anyshard plan`` without --model unchanged."""

from __future__ import annotations

import doctest
import json

import pytest

from anyshard.trainer_integration.planning import joint_plan, plan_cli
from anyshard.trainer_integration.planning.failures import MODES
from anyshard.trainer_integration.planning.hardware import load_hardware
from anyshard.trainer_integration.planning.model_shape import model_shape_from_hf
from anyshard.trainer_integration.planning.transformer_cost import Batch, Layout, estimate

# a 1.7B GPT (SC'21 Table 1's first row)
GPT = {
    "hidden_size": 2304, "num_hidden_layers": 24, "num_attention_heads": 24,
    "intermediate_size": 9216, "vocab_size": 51200, "hidden_act": "gelu",
}  # fmt: skip
JOB = ["--hardware", "a100-80gb", "--gpus", "64", "--global-batch", "512", "--seq", "2048"]
FAST = ["--days", "2", "--seeds", "1"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT))
    return str(path)


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = plan_cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _plan(capsys, argv: list[str]) -> dict:
    rc, out, err = _run(capsys, [*argv, "--json"])
    assert rc == 0, err
    return json.loads(out)


def test_json_holds_layouts_plans_and_replan(config, capsys):
    out = _plan(capsys, ["--model", config, *JOB, *FAST, "--top", "4"])
    assert out["gpus"] == out["gpus_used"] == 64 and out["idle_gpus"] == 0
    assert isinstance(out["layouts_considered"], int) and out["layouts_considered"] >= 4
    assert len(out["layouts"]) == 4
    steps = [e["step_s"] for e in out["layouts"]]
    assert steps == sorted(steps)
    for e in out["layouts"]:
        assert set(e["layout"]) >= {"tp", "pp", "vpp", "cp", "ep", "dp_shard", "dp_replicate"}
        for key in ("step_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu"):
            assert isinstance(e[key], float) and e[key] > 0
        assert 0 < e["memory_gib_per_gpu"] < 80
        assert {"compute", "bubble"} <= set(e["breakdown"])
        assert e["dominant"] in e["breakdown"] and isinstance(e["name"], str)
    for p in out["plans"]:
        for key, kind in (("layout", dict), ("mode", str), ("every_steps", int),
                          ("goodput", float), ("ett", float), ("step_s", float),
                          ("effective_tokens_per_s", float), ("replicas", int)):  # fmt: skip
            assert isinstance(p[key], kind), key
    assert out["recommended"] == out["plans"][0]
    assert {"days": 2.0, "seeds": 1}.items() <= out["simulation"].items()


def test_plans_rank_every_layout_and_mode_by_effective_tokens(config, capsys):
    out = _plan(capsys, ["--model", config, *JOB, *FAST, "--top", "3"])
    plans = out["plans"]
    rates = [p["effective_tokens_per_s"] for p in plans]
    assert rates == sorted(rates, reverse=True)
    tokens = 512 * 2048
    for p in plans:
        assert p["effective_tokens_per_s"] == pytest.approx(p["goodput"] * tokens / p["step_s"])
        assert 0 < p["goodput"] <= 1
    names = {json.dumps(e["layout"], sort_keys=True) for e in out["layouts"]}
    planned = {json.dumps(p["layout"], sort_keys=True) for p in plans if not p["zero0_variant"]}
    assert planned == names
    for lay in {json.dumps(p["layout"], sort_keys=True) for p in plans}:
        modes = sorted(p["mode"] for p in plans if json.dumps(p["layout"], sort_keys=True) == lay)
        groups = {p["replicas"] for p in plans if json.dumps(p["layout"], sort_keys=True) == lay
                  and p["mode"].startswith("restart")}  # fmt: skip
        ft_groups = 1 if json.loads(lay)["zero"] else groups.pop()
        expected = [m for m in MODES if ft_groups > 1 or not m.startswith("ft")]
        assert modes == sorted(expected), lay


def test_zero1_layouts_have_no_ft_group_and_their_zero0_variant_many(config, capsys):
    argv = ["--model", config, *JOB, *FAST, "--layout", "tp=1,pp=1,cp=1,dp_replicate=64"]
    out = _plan(capsys, argv)
    assert [e["layout"]["zero"] for e in out["layouts"]] == [1]
    by = {(p["zero0_variant"], p["mode"]): p for p in out["plans"]}
    # one FT group has no peer to heal from: the ZeRO-1 layout is planned in restart modes only
    assert (False, "ft-hsdp") not in by and (False, "ft-elastic") not in by
    assert by[False, "restart-async"]["layout"]["zero"] == 1
    # 64 replicas of one GPU each: 8 share a node, so the simulator's groups are its 8 nodes
    assert by[True, "ft-hsdp"]["replicas"] == 8 and by[True, "ft-hsdp"]["layout"]["zero"] == 0
    assert by[True, "restart-sync"]["replicas"] == by[False, "restart-sync"]["replicas"] == 8


def test_a_layout_pinned_whole_predicts_that_layout(config, capsys):
    dims = "tp=2,pp=2,vpp=2,cp=1,ep=1,dp_shard=1,dp_replicate=16,zero=1"
    argv = ["--model", config, *JOB, *FAST, "--layout", dims, "--micro-batch", "2",
            "--recompute", "selective", "--sequence-parallel"]  # fmt: skip
    out = _plan(capsys, argv)
    assert len(out["layouts"]) == 1 and out["layouts_considered"] == 1
    lay = Layout(tp=2, pp=2, vpp=2, dp_replicate=16, zero=1, micro_batch=2,
                 recompute="selective", sequence_parallel=True)  # fmt: skip
    direct = estimate(model_shape_from_hf(GPT), load_hardware("a100-80gb"), Batch(512, 2048), lay)
    assert out["layouts"][0]["layout"] == lay.to_json()
    assert out["layouts"][0]["step_s"] == direct.step_s
    assert out["pins"]["recompute"] == "selective" and out["pins"]["sequence_parallel"] is True


def test_replan_reshards_for_each_count_of_nodes_lost(config, capsys):
    out = _plan(capsys, ["--model", config, *JOB, *FAST, "--top", "1"])
    rows = out["replan"]
    assert [r["nodes_lost"] for r in rows] == [1, 2, 4, 8]
    for r in rows[:3]:
        assert r["gpus_used"] + r["idle_gpus"] == r["gpus_healthy"] == 64 - 8 * r["nodes_lost"]
        assert Layout(**r["layout"]).gpus == r["gpus_used"]
        assert r["tokens_per_s"] == pytest.approx(512 * 2048 / r["step_s"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["gpus_used"])
        fastest = max(c["tokens_per_s"] for c in r["counts_compared"])
        assert r["tokens_per_s"] == fastest
    assert rows[3]["layout"] is None and "leave none" in rows[3]["error"]


def test_a_count_without_layouts_falls_back_and_reports_idle_gpus(config, capsys):
    argv = ["--model", config, "--hardware", "a100-80gb", "--gpus", "56", "--global-batch",
            "512", "--seq", "2048", "--layout", "pp=1", "--top", "1", *FAST]  # fmt: skip
    out = _plan(capsys, argv)
    assert out["gpus_used"] < 56 and out["idle_gpus"] == 56 - out["gpus_used"]
    assert Layout(**out["layouts"][0]["layout"]).gpus == out["gpus_used"]


def test_text_output_has_the_three_tables(config, capsys):
    rc, out, _ = _run(capsys, ["--model", config, *JOB, *FAST, "--top", "2"])
    assert rc == 0
    assert "MFU" in out and "dominant" in out and "recommended:" in out
    assert "nodes lost" in out and "tokens/s" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "{missing}", *JOB], "{missing}"),
        (["--model", "{bad_json}", *JOB], "{bad_json}"),
        (["--model", "{config}", *JOB, "--layout", "tp=2,dp=4"], "unknown dim 'dp'"),
        (["--model", "{config}", "--gpus", "64", "--global-batch", "512"], "--seq"),
        (["--model", "{config}", *JOB, "--step-s", "3"], "--step-s"),
        (["--model", "{config}", *JOB[:3], "60", *JOB[4:]], "whole number"),
        (["--model", "{config}", *JOB, "--hardware", "b200"], "b200"),
        (["--gpus", "64", "--seq", "2048"], "--model"),
        (["--model", "{config}", *JOB, "--layout", "tp=64"], "no layout of 64 GPUs"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(config, tmp_path, capsys, argv, needle):
    (tmp_path / "bad.json").write_text('{"hidden_size": 64}')
    names = {"config": config, "missing": str(tmp_path / "nope.json"),
             "bad_json": str(tmp_path / "bad.json")}  # fmt: skip
    argv = [a.format(**names) for a in argv]
    rc, _, err = _run(capsys, argv)
    assert rc == 2 and needle.format(**names) in err, err
    assert err.count("\n") == 1  # one line


def test_without_model_the_failure_plan_json_is_unchanged(capsys):
    out = _plan(capsys, ["--gpus", "1024", "--days", "2", "--seeds", "2"])
    assert set(out) == {"recommended", "spare_nodes", "modes", "young_daly_steps"}
    assert set(out["modes"]) == set(MODES)


def test_whole_node_groups():
    groups = joint_plan.whole_node_groups
    assert groups(Layout(tp=8, dp_replicate=16), devices_per_node=8) == 16
    assert groups(Layout(tp=4, pp=4, dp_replicate=8), devices_per_node=8) == 4
    assert groups(Layout(tp=2, pp=4, dp_replicate=2), devices_per_node=8) == 1
    assert groups(Layout(dp_shard=8), devices_per_node=8) == 1
    assert joint_plan.ft_replicas(Layout(tp=8, dp_replicate=16, zero=1), 8) == 1


def test_doctests():
    assert doctest.testmod(joint_plan).failed == 0


def test_a_pinned_layout_over_memory_is_predicted_with_a_warning(tmp_path, capsys):
    """A layout the user pins whole is predicted even where the model says it needs more
    memory than the GPU has (its leanest options, ``fits`` false, a warning); unpinned, the
    same job is refused, naming the GPUs."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**GPT, "hidden_size": 12288, "num_hidden_layers": 96,
                                "num_attention_heads": 96, "intermediate_size": 49152}))  # fmt: skip
    job = ["--model", str(path), "--hardware", "a100-80gb", "--gpus", "8",
           "--global-batch", "8", "--seq", "2048", *FAST]  # fmt: skip
    rc, out, err = _run(capsys, [*job, "--layout", "tp=8,pp=1,cp=1,dp_shard=1", "--json"])
    assert rc == 0, err
    (entry,) = json.loads(out)["layouts"]
    assert entry["fits"] is False and entry["memory_gib_per_gpu"] > 80
    assert entry["layout"]["recompute"] == "full" and entry["layout"]["micro_batch"] == 1
    assert "warning" in err and "predicted anyway" in err
    rc, _, err = _run(capsys, [*job, "--json"])
    assert rc == 2 and "no layout of 8 GPUs" in err
