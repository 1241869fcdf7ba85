"""Megatron-LM legacy checkpoints (written here in Megatron's documented file layout from the
independent reference of its tensor layout) read as logical tensors through the megatron_gpt
spec, converted to Hugging Face and to an anyshard checkpoint under another layout."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

import anyshard
from anyshard.errors import CorruptCheckpointError
from anyshard.loaders import MegatronCheckpointView, megatron_file_name, write_anyshard, write_hf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucl_ref.reference import FAMILIES, all_coords  # noqa: E402

CFG = dict(hidden=12, heads=6, kv_heads=3, ffn=10, vocab=7, layers=4, vocab_divisor=4)
ORDER = ("pp", "dp", "tp")


def logical(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(s, generator=g) for k, s in sorted(FAMILIES["megatron_gpt"][0](CFG).items())
    }


def write_megatron(root, truth, tp, pp, iteration=100):
    sizes = {"pp": pp, "dp": 1, "tp": tp}
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    for c in all_coords(sizes, ORDER):
        local = FAMILIES["megatron_gpt"][1](truth, CFG, sizes, c)
        path = os.path.join(it_dir, megatron_file_name(c["tp"], c["pp"], pp))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": local, "iteration": iteration, "checkpoint_version": 3.0}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


@pytest.mark.parametrize("tp,pp", [(2, 2), (3, 1), (1, 4)])
def test_megatron_files_read_as_logical_tensors(tmp_path, tp, pp):
    truth = logical()
    write_megatron(str(tmp_path), truth, tp, pp)
    view = MegatronCheckpointView(str(tmp_path), layout=CFG)
    assert sorted(view.keys()) == sorted(truth)
    for name, t in truth.items():
        assert torch.equal(view.get_tensor(name), t), name
    q = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(view.get_slice(q)[2:9, 4], truth[q][2:9, 4])
    assert view.iteration == 100


def test_megatron_to_hf_and_to_anyshard_under_another_layout(tmp_path):
    truth = logical(1)
    root = str(tmp_path / "meg")
    write_megatron(root, truth, tp=2, pp=2)
    view = MegatronCheckpointView(root, layout=CFG)
    write_hf(view, str(tmp_path / "hf"))
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(hf) == sorted(truth) and all(torch.equal(hf[k], truth[k]) for k in truth)

    dst = str(tmp_path / "tp4")
    write_anyshard(view, dst, spec="megatron_gpt", layout={**CFG, "tp": 4})
    sizes = {"pp": 1, "dp": 1, "tp": 4}
    for c in all_coords(sizes, ORDER):
        want = FAMILIES["megatron_gpt"][1](truth, CFG, sizes, c)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        anyshard.load(dst, got, spec="megatron_gpt", layout={**CFG, "tp": 4}, coords=c)
        assert all(torch.equal(got[k], want[k]) for k in want), c


def test_a_megatron_file_with_a_wrong_shape_is_named(tmp_path):
    truth = logical(2)
    write_megatron(str(tmp_path), truth, tp=2, pp=1)
    path = tmp_path / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt"
    data = torch.load(path, weights_only=True)
    data["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(3, 3)
    torch.save(data, path)
    view = MegatronCheckpointView(str(tmp_path), layout=CFG)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01.*linear_fc2.*\[3, 3\]"):
        view.get_tensor("model.layers.0.mlp.down_proj.weight")


DS_CFG = dict(hidden=4, ffn=6, vocab=5, layers=2)


def test_deepspeed_zero_files_read_as_parameters_and_adam_moments(tmp_path):
    from anyshard.loaders import DeepSpeedZeroView

    shapes, local = FAMILIES["deepspeed_zero"]
    g = torch.Generator().manual_seed(5)
    truth = {k: torch.randn(s, generator=g) for k, s in sorted(shapes(DS_CFG).items())}
    sizes = {"pp": 1, "dp": 3, "tp": 2}
    step_dir = tmp_path / "global_step40"
    step_dir.mkdir()
    for c in all_coords(sizes, ORDER):
        loc = local(truth, DS_CFG, sizes, c)
        osd = {
            "single_partition_of_fp32_groups": [loc["fp32_flat_groups.0"]],
            "base_optimizer_state": {
                "state": {
                    0: {"exp_avg": loc["exp_avg.0"], "exp_avg_sq": loc["exp_avg_sq.0"], "step": 40}
                },
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}],
            },
            "zero_stage": 2,
            "partition_count": 3,
        }
        name = f"zero_pp_rank_{c['dp']}_mp_rank_{c['tp']:02d}_optim_states.pt"
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.16.0"}, step_dir / name)
    (tmp_path / "latest").write_text("global_step40")
    view = DeepSpeedZeroView(str(tmp_path), layout=DS_CFG)
    assert view.layout["dp"] == 3 and view.layout["tp"] == 2
    assert sorted(view.keys()) == sorted(truth)
    for name, t in truth.items():
        assert torch.equal(view.get_tensor(name), t), name
