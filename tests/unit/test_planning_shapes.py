"""The model shapes and hardware the step-time model prices (anyshard.trainer_integration.planning
model_shape and hardware) against published figures: the parameter counts of real models from
their own config.json, and a row of SC'21 Table 1 computed by hand."""

from __future__ import annotations

import dataclasses
import doctest
import json

import pytest

from anyshard.trainer_integration.planning import hardware, model_shape
from anyshard.trainer_integration.planning.hardware import PRESETS, Hardware, load_hardware
from anyshard.trainer_integration.planning.model_shape import (
    ModelShape,
    model_flops_per_token,
    model_shape_from_hf,
    parameter_count,
    sc21_flops_per_iteration,
)

# The keys that matter of each model's published config.json (Hugging Face Hub).
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "vocab_size": 32000,
}  # fmt: skip
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "tie_word_embeddings": False, "vocab_size": 32000,
}  # fmt: skip


def test_module_examples():
    for module in (model_shape, hardware):
        assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_llama_2_7b_has_its_published_parameter_count():
    # per layer: q, k, v, o 4 x 4096^2 = 67,108,864; MLP 3 x 4096 x 11008 = 135,266,304;
    # two RMSNorms 8,192: 202,383,360, x 32 = 6,476,267,520. Embedding and head
    # 2 x 32000 x 4096 = 262,144,000; final norm 4,096.
    assert 32 * (67_108_864 + 135_266_304 + 8_192) + 262_144_000 + 4_096 == 6_738_415_616
    assert parameter_count(model_shape_from_hf(LLAMA_2_7B)) == 6_738_415_616


def test_llama_3_8b_counts_grouped_query_attention():
    # q, o 2 x 4096^2 = 33,554,432; k, v (8 heads of 128) 2 x 4096 x 1024 = 8,388,608;
    # MLP 3 x 4096 x 14336 = 176,160,768; norms 8,192: 218,112,000 per layer.
    # Embedding and head 2 x 128256 x 4096 = 1,050,673,152; final norm 4,096.
    assert 32 * 218_112_000 + 1_050_673_152 + 4_096 == 8_030_261_248
    shape = model_shape_from_hf(LLAMA_3_8B)
    assert (shape.q_dim, shape.kv_dim) == (4096, 1024)
    assert parameter_count(shape) == 8_030_261_248


def test_mixtral_counts_every_expert_and_the_router():
    # attention 41,943,040; 8 experts of 3 x 4096 x 14336 = 1,409,286,144; router 4096 x 8 =
    # 32,768; norms 8,192: 1,451,270,144 per layer. Embedding and head 262,144,000; final 4,096.
    assert 32 * 1_451_270_144 + 262_144_000 + 4_096 == 46_702_792_704
    shape = model_shape_from_hf(MIXTRAL_8X7B)
    assert (shape.num_experts, shape.top_k, shape.moe_ffn) == (8, 2, 14336)
    assert parameter_count(shape) == 46_702_792_704
    # a token uses 2 experts: 41,943,040 + 352,321,536 + 32,768 + 8,192 per layer (12.9B in all)
    assert parameter_count(shape, active=True) == 32 * 394_305_536 + 262_144_000 + 4_096


def test_tied_embeddings_count_the_matrix_once_but_the_head_matmul_still_costs():
    untied = model_shape_from_hf(LLAMA_3_8B)
    tied = dataclasses.replace(untied, tied_embeddings=True)
    assert parameter_count(untied) - parameter_count(tied) == 128256 * 4096
    assert model_flops_per_token(tied, 8192) == model_flops_per_token(untied, 8192)


def test_model_flops_are_six_per_multiplied_weight_plus_non_causal_attention():
    shape = model_shape_from_hf(LLAMA_3_8B)
    # weights a token multiplies: 32 layers x (41,943,040 + 176,160,768) + head 525,336,576
    weights = 32 * 218_103_808 + 525_336_576
    attention = 12 * 32 * 4096 * 8192  # PaLM's 12 L H Q T, full seq x seq
    assert model_flops_per_token(shape, 8192) == 6 * weights + attention == 57_912_852_480
    moe = model_shape_from_hf(MIXTRAL_8X7B)
    assert (
        model_flops_per_token(moe, 4096)
        == 6 * (32 * (41_943_040 + 2 * 176_160_768 + 32_768) + 32000 * 4096) + 12 * 32 * 4096 * 4096
    )


def test_sc21_eq3_matches_table_1_row_1_by_hand():
    """1.7B: 24 layers, hidden 2304, vocabulary 51,200, seq 2048, batch 512, 32 GPUs at 137
    TFLOP/s: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    gpt = ModelShape(num_layers=24, hidden=2304, num_heads=24, num_kv_heads=24, ffn=9216,
                     vocab=51200, gated_mlp=False)  # fmt: skip
    # 96 x 512 x 2048 x 24 = 2,415,919,104; x 2304^2 (5,308,416) = 12,824,703,626,379,264.
    # s/6h = 2048/13824 = 4/27; V/16lh = 51200/884736 = 25/432; 1 + 4/27 + 25/432 = 521/432.
    # 12,824,703,626,379,264 / 432 = 29,686,813,950,878.1...; x 521: 15,466,830,067,924,992
    by_hand = 15_466_830_067_924_992
    assert 12_824_703_626_379_264 * 521 == by_hand * 432
    assert sc21_flops_per_iteration(gpt, batch=512, seq=2048) == by_hand
    # the step time the published throughput implies: 15.4668e15 / (32 x 137e12) = 3.528 s
    step_s = sc21_flops_per_iteration(gpt, batch=512, seq=2048) / (32 * 137e12)
    assert step_s == pytest.approx(3.5280, abs=1e-4)
    # without recomputation the forward pass is done three times, not four; the logit layer's
    # 6 B s h V (742,170,348,748,800) stays
    without = sc21_flops_per_iteration(gpt, batch=512, seq=2048, recompute=False)
    assert without == (by_hand - 742_170_348_748_800) * 3 // 4 + 742_170_348_748_800


def test_hf_config_errors_name_the_key():
    with pytest.raises(ValueError, match="lacks intermediate_size, vocab_size"):
        model_shape_from_hf({k: v for k, v in LLAMA_2_7B.items()
                             if k not in ("vocab_size", "intermediate_size")})  # fmt: skip
    with pytest.raises(ValueError, match="lacks vocab_size"):
        model_shape_from_hf({**LLAMA_2_7B, "vocab_size": None})
    with pytest.raises(ValueError, match="num_key_value_heads = 'eight'"):
        model_shape_from_hf({**LLAMA_3_8B, "num_key_value_heads": "eight"})
    with pytest.raises(ValueError, match="hidden_act = 'tanh'"):
        model_shape_from_hf({**LLAMA_3_8B, "hidden_act": "tanh"})
    with pytest.raises(ValueError, match="num_heads 32 is not a multiple of num_kv_heads 6"):
        model_shape_from_hf({**LLAMA_3_8B, "num_key_value_heads": 6})
    with pytest.raises(ValueError, match="top_k 0 is not within 1..num_experts"):
        model_shape_from_hf({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"})


def test_gelu_means_the_plain_two_matrix_mlp_and_deepseek_keys_are_read():
    gpt = model_shape_from_hf({**LLAMA_2_7B, "hidden_act": "gelu_new"})
    assert not gpt.gated_mlp
    assert parameter_count(model_shape_from_hf(LLAMA_2_7B)) - parameter_count(gpt) == (
        32 * 4096 * 11008
    )
    moe = model_shape_from_hf({**LLAMA_3_8B, "n_routed_experts": 64, "n_shared_experts": 2,
                               "num_experts_per_tok": 6, "moe_intermediate_size": 1408})  # fmt: skip
    assert (moe.num_experts, moe.num_shared_experts, moe.top_k, moe.moe_ffn) == (64, 2, 6, 1408)


def test_presets_load_with_a_source_for_every_number():
    a100 = load_hardware("a100-80gb")
    assert (a100.peak_flops, a100.memory_bytes, a100.devices_per_node) == (312e12, 80e9, 8)
    assert (a100.intra_node_bytes_per_s, a100.inter_node_bytes_per_s) == (300e9, 25e9)
    h100 = load_hardware("h100-sxm")
    assert (h100.peak_flops, h100.intra_node_bytes_per_s, h100.inter_node_bytes_per_s) == (
        989e12, 450e9, 50e9,
    )  # fmt: skip
    numbers = {f.name for f in dataclasses.fields(Hardware)} - {"name", "sources"}
    for preset in PRESETS.values():
        assert set(preset.sources) == numbers, preset.name


def test_a_user_file_round_trips(tmp_path):
    mine = dataclasses.replace(PRESETS["h100-sxm"], name="my-h100", oversubscription=2.0)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(mine.to_json()))
    assert load_hardware(str(path)) == mine
    bare = {k: v for k, v in mine.to_json().items() if k not in ("sources", "oversubscription")}
    path.write_text(json.dumps(bare))
    assert load_hardware(str(path)).oversubscription == 1.0


def test_bad_hardware_files_name_what_is_wrong(tmp_path):
    path = tmp_path / "hw.json"
    good = PRESETS["a100-80gb"].to_json()
    bad = {**{k: v for k, v in good.items() if k != "peak_flops"}, "peak_tflops": 312}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown fields peak_tflops .*missing fields peak_flops"):
        load_hardware(str(path))
    path.write_text(json.dumps({**good, "devices_per_node": 0, "inter_node_bytes_per_s": -1}))
    with pytest.raises(ValueError, match="devices_per_node = 0.*inter_node_bytes_per_s = -1"):
        load_hardware(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"neither a preset \(a100-80gb, h100-sxm\)"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="a100-80gb, h100-sxm"):
        load_hardware("a100")
