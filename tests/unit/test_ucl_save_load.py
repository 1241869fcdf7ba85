"""Saving and loading plain local tensors with a spec: the primitives that act at the edges
(transpose, cast, alias, average), mixing spec and non-spec checkpoints, and clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from sealing import manifest_bytes

import anyshard
from anyshard import ucl
from anyshard.errors import CorruptCheckpointError, LayoutError, StateDictMismatchError

SPEC = """
mesh tp;
param n = 4, m = 6;
"lin.weight_t" -> "lin.weight" [m, n] : chunk(0, tp) | transpose(0, 1);
"lin.bias" -> "lin.bias" [m] : chunk(0, tp) | cast(float32);
"emb" -> "emb" [n, 3] : replicate(tp);
alias "head" -> "emb" [n, 3] : chunk(0, tp);
"""


def truth(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "lin.weight": torch.randn(6, 4, generator=g),
        "lin.bias": torch.randn(6, generator=g),
        "emb": torch.randn(4, 3, generator=g),
    }


def part(x, n, r):
    """Part r of torch.chunk(x, n) along dim 0, empty where torch.chunk has no part r."""
    size = -(-x.shape[0] // n)
    start = min(r * size, x.shape[0])
    return x[start : min(start + size, x.shape[0])]


def locals_for(t, tp, r):
    """Written independently of UCL: what a rank of a tp-way model holds."""
    return {
        "lin.weight_t": part(t["lin.weight"], tp, r).t().contiguous(),
        "lin.bias": part(t["lin.bias"], tp, r).to(torch.bfloat16),
        "emb": t["emb"].clone(),
        "head": part(t["emb"], tp, r).clone(),
    }


def test_transpose_cast_and_alias_round_trip_across_tp(tmp_path):
    t = truth()
    path = str(tmp_path / "c")
    ucl.save_local_states(
        path, {r: locals_for(t, 2, r) for r in range(2)}, spec=SPEC, layout={"tp": 2}
    )
    m = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert m["format_version"] == 4 and m["spec"]["layout"] == {"tp": 2, "n": 4, "m": 6}
    assert m["tensors"]["lin.bias"]["dtype"] == "F32"  # cast(): stored as float32
    assert "head" not in m["tensors"]  # an alias is not saved
    view = anyshard.open(path)
    assert torch.equal(view.get_tensor("lin.weight"), t["lin.weight"])
    assert torch.equal(view.get_tensor("lin.bias"), t["lin.bias"].to(torch.bfloat16).float())
    for r in range(3):
        want = locals_for({**t, "lin.bias": t["lin.bias"].to(torch.bfloat16).float()}, 3, r)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        anyshard.load(path, got, spec=SPEC, layout={"tp": 3}, coords={"tp": r})
        for k in want:
            assert torch.equal(got[k], want[k]), (r, k)


def test_a_plain_checkpoint_loads_into_spec_locals_and_back(tmp_path):
    t = truth(1)
    plain = str(tmp_path / "plain")
    anyshard.save(plain, dict(t))
    got = {k: torch.zeros_like(v) for k, v in locals_for(t, 2, 1).items()}
    anyshard.load(plain, got, spec=SPEC, layout={"tp": 2}, coords={"tp": 1}, cast=True)
    want = locals_for(t, 2, 1)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_average_in_one_process_saves_the_mean(tmp_path):
    spec = 'mesh dp;\n"s" -> "s" [3] : average(dp);\n'
    path = str(tmp_path / "a")
    states = {r: {"s": torch.full((3,), float(r))} for r in range(4)}
    ucl.save_local_states(path, states, spec=spec, layout={"dp": 4})
    assert torch.equal(anyshard.open(path).get_tensor("s"), torch.full((3,), 1.5))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "s")
    t = truth()
    ucl.save_local_states(
        path, {r: locals_for(t, 2, r) for r in range(2)}, spec=SPEC, layout={"tp": 2}
    )
    return path


def test_unmatched_local_name_is_named_with_a_suggested_rule(saved):
    state = locals_for(truth(), 2, 0)
    state["lin.weight_T"] = state.pop("lin.weight_t")
    with pytest.raises(StateDictMismatchError) as e:
        anyshard.load(saved, state, spec=SPEC, layout={"tp": 2}, coords={"tp": 0})
    msg = str(e.value)
    assert "lin.weight_T: no rule of the spec" in msg and "did you mean 'lin.weight_t'" in msg
    assert '"lin.weight_T" -> "lin.weight_T" [4, 3]' in msg
    assert "lacks: lin.weight_t" in msg


def test_local_shape_the_spec_does_not_give_is_an_error(saved):
    state = locals_for(truth(), 2, 0)
    state["emb"] = torch.zeros(4, 4)
    with pytest.raises(StateDictMismatchError, match=r"emb: local shape \[4, 4\].*gives \[4, 3\]"):
        anyshard.load(saved, state, spec=SPEC, layout={"tp": 2}, coords={"tp": 0})


def test_saving_with_a_wrong_layout_or_state_loses_nothing(tmp_path):
    path = str(tmp_path / "x")
    with pytest.raises(LayoutError, match="does not declare"):
        ucl.save_local_states(path, {0: {}}, spec=SPEC, layout={"tp": 1, "pp": 2})
    with pytest.raises(StateDictMismatchError, match="lacks"):
        ucl.save_local_states(path, {0: {"emb": torch.zeros(4, 3)}}, spec=SPEC, layout={"tp": 1})
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_a_manifest_whose_spec_does_not_compile_is_corrupt(saved):
    p = os.path.join(saved, "manifest.json")
    m = json.loads(open(p).read())
    m["spec"]["text"] = m["spec"]["text"].replace("chunk(0, tp)", "chunk(0, tq)", 1)
    open(p, "wb").write(manifest_bytes(m))
    with pytest.raises(CorruptCheckpointError, match="spec does not compile"):
        anyshard.open(saved)


def test_a_save_with_spec_in_a_single_process_needs_a_one_rank_layout(tmp_path):
    with pytest.raises(LayoutError, match="2 rank"):
        anyshard.save(str(tmp_path / "y"), locals_for(truth(), 2, 0), spec=SPEC, layout={"tp": 2})
    path = str(tmp_path / "z")
    anyshard.save(path, locals_for(truth(), 1, 0), spec=SPEC, layout={"tp": 1})
    assert torch.equal(anyshard.open(path).get_tensor("emb"), truth()["emb"])


@pytest.mark.parametrize(
    "spec,layout,states,why",
    [
        (  # replicate(dp) forgotten: every dp rank saves the same shard
            'mesh dp, tp;\n"w" -> "w" [4] : chunk(0, tp);\n',
            {"dp": 2, "tp": 2},
            {r: {"w": torch.zeros(2)} for r in range(4)},
            "w: the saved local tensors hold 8 of its 4 elements",
        ),
        (  # held only where on() says no rank saves it
            'mesh pp;\n"e" when rank(pp) == 1 -> "e" [2] : on(pp, 0);\n"f" -> "f" [1] : replicate(pp);\n',
            {"pp": 2},
            {0: {"f": torch.zeros(1)}, 1: {"e": torch.zeros(2), "f": torch.zeros(1)}},
            "e: the saved local tensors hold 0 of its 2 elements",
        ),
    ],
)
def test_a_spec_that_saves_an_element_twice_or_never_commits_nothing(
    tmp_path, spec, layout, states, why
):
    from anyshard.errors import SaveError

    path = str(tmp_path / "bad")
    with pytest.raises(SaveError, match="nothing was committed") as e:
        ucl.save_local_states(path, states, spec=spec, layout=layout)
    assert why in str(e.value)
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_loops_may_depend_on_earlier_loops_and_compile_takes_shipped_names():
    spec = ucl.parse(
        'mesh tp;\n"w.{i:int}.{j:int}" for i in range(2), j in range(i + 1) -> "w{i}{j}" [2];\n'
    )
    assert list(ucl.compile(spec, {}, {})) == ["w.0.0", "w.1.0", "w.1.1"]
    sizes = dict(tp=2, hidden=8, heads=2, ffn=4, vocab=5, layers=1)
    assert "lm_head.weight" in ucl.compile("hf_llama", sizes, {"tp": 1})


def test_a_save_of_json_values_only_commits(tmp_path):
    anyshard.save(str(tmp_path / "j"), {"step": 3, "cfg": {"lr": 0.1}})
    assert anyshard.open(str(tmp_path / "j")).get_value("cfg") == {"lr": 0.1}


@pytest.mark.parametrize(
    "text,message",
    [
        ("mesh pp;\nparam layers;\nlet first = rank(pp) * layers;\n", "only inside a rule"),
        ("mesh min;\n", "'min' is a function name"),
        ('mesh tp;\n"x" when tp == 1 -> "x" [1];\n"x" -> "x" [1];\n', "repeats the one at line 2"),
    ],
)
def test_static_mistakes_are_semantic_errors(text, message):
    with pytest.raises(ucl.UCLSemanticError, match=message):
        ucl.parse(text)


def test_params_and_lets_evaluate_in_order_and_empty_combinators_are_errors():
    spec = ucl.parse('mesh tp;\nlet a = 2;\nparam p = a;\n"x" -> "y" [p];\n')
    assert ucl.compile(spec, {}, {})["x"].shape == (2,)
    empty = ucl.parse('mesh tp;\n"a" -> bucket(for i in range(0) { "x" [2] });\n')
    with pytest.raises(ucl.UCLSemanticError, match="holds no logical tensor"):
        ucl.compile(empty, {}, {})
