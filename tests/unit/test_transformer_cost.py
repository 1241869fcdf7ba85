"""The transformer step-time and memory model (`transformer_cost.estimate`) and the layout search
over it (`layout_search`), term by term against arithmetic done by hand on round numbers: a
device of 100 TFLOP/s and 1 TB/s, nodes of 8 at 300 GB/s inside and 25 GB/s across, every
efficiency 1 and no fixed kernel or step costs.

Run: python -m pytest tests/unit/test_transformer_cost.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from anyshard.trainer_integration.planning.hardware import Hardware
from anyshard.trainer_integration.planning.layout_search import best_options, search
from anyshard.trainer_integration.planning.model_shape import ModelShape, parameter_count
from anyshard.trainer_integration.planning.topology import Span
from anyshard.trainer_integration.planning.transformer_cost import (
    Batch,
    Layout,
    Params,
    _Pricer,
    estimate,
    layout_problems,
)

GB = 1e9
PEAK, HBM = 100e12, 1e12
INTRA, INTER = 300 * GB, 25 * GB
LAT_IN, LAT_OUT = 1e-6, 1e-5

HW = Hardware(
    name="round",
    peak_flops=PEAK,
    memory_bytes=10_000 * GB,  # nothing is refused for memory unless a test says so
    hbm_bytes_per_s=HBM,
    devices_per_node=8,
    intra_node_bytes_per_s=INTRA,
    inter_node_bytes_per_s=INTER,
    intra_node_latency_s=LAT_IN,
    inter_node_latency_s=LAT_OUT,
)


def params(overlap: float = 0.0, **changes: float) -> Params:
    base = dict(
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        hbm_efficiency=1.0,
        network_efficiency=1.0,
        overlap=overlap,
        kernel_s=0.0,
        step_overhead_s=0.0,
    )
    return Params(**{**base, **changes})


# a GPT-style dense model: 8 layers, h = 1024, 8 heads of 128, MLP 4h with two matrices
L, H, HEADS, FFN, V = 8, 1024, 8, 4096, 32000
GPT = ModelShape(
    num_layers=L, hidden=H, num_heads=HEADS, num_kv_heads=HEADS, ffn=FFN, vocab=V, gated_mlp=False
)
LAYER_MATRICES = 4 * H * H + 2 * H * FFN  # q, k, v, o; up, down
LAYER_PARAMS = LAYER_MATRICES + 2 * H  # and two norms
EMBED = V * H
# a single pipeline stage of an untied model holds the embedding and the output layer both
TABLES = 2 * EMBED


def close(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-9, abs=1e-15)


def roofline(m: float, k: float, n: float, peak: float = PEAK, hbm: float = HBM) -> float:
    """An (m x k) @ (k x n) bf16 multiply: its FLOPs at peak plus its three matrices' bytes."""
    return 2 * m * k * n / peak + 2 * (m * k + k * n + m * n) / hbm


def step_sum(e) -> float:
    return sum(v for k, v in e.breakdown.items() if not k.endswith("_overlapped"))


def ring(kind_factor: float, size: int, per_node: int, nbytes: float) -> float:
    """A ring collective by hand: ``kind_factor`` 2 for an all-reduce, 1 for a gather or a
    scatter; bandwidth NVLink inside a node, else min(NVLink, per_node x NIC)."""
    nodes = size // per_node
    if nodes == 1:
        return kind_factor * (size - 1) * LAT_IN + kind_factor * (size - 1) / size * nbytes / INTRA
    levels = {2: 1, 4: 2, 8: 3, 16: 4, 32: 5}[nodes]
    lat = kind_factor * (per_node - 1) * LAT_IN + kind_factor * levels * LAT_OUT
    return lat + kind_factor * (size - 1) / size * nbytes / min(INTRA, per_node * INTER)


# -- the pricer -------------------------------------------------------------------------------


def test_pricer_scales_peak_memory_and_links_by_the_efficiencies():
    pr = _Pricer(HW, params(gemm_efficiency=0.5, hbm_efficiency=0.25, network_efficiency=0.5))
    # 1024 x 1024 x 1024: 2 GFLOP at 50 TFLOP/s, 6 MiB at 250 GB/s
    assert pr.gemm(1024, 1024, 1024) == close(2 * 1024**3 / 50e12 + 2 * 3 * 1024**2 / 250e9)
    assert pr.stream(1e9, 10) == close(1e9 / 250e9)
    assert pr.links.intra_bytes_per_s == 150 * GB and pr.links.inter_bytes_per_s == 12.5 * GB
    assert pr.links.intra_latency_s == LAT_IN and pr.links.inter_latency_s == LAT_OUT
    # a send across nodes at half the NIC
    assert pr.coll("send", Span(2, 1), 1e9) == close(LAT_OUT + 1e9 / (12.5 * GB))
    # kernel_s per kernel, times the count
    pr = _Pricer(HW, params(kernel_s=1e-5))
    assert pr.gemm(1, 1, 1, count=3) == close(3 * (2 / PEAK + 6 / HBM + 1e-5))
    assert pr.stream(0, 4) == close(4e-5)


# -- compute ----------------------------------------------------------------------------------


def _forward_multiplies(tokens: int, tp: int, peak: float = PEAK, hbm: float = HBM) -> float:
    return (
        roofline(tokens, H, 3 * H / tp, peak, hbm)  # q, k, v
        + roofline(tokens, H / tp, H, peak, hbm)  # o
        + roofline(tokens, H, FFN / tp, peak, hbm)  # up
        + roofline(tokens, FFN / tp, H, peak, hbm)  # down
    )


def test_compute_of_a_step_on_one_gpu_by_hand():
    mb, seq, gb = 2, 1024, 16
    e = estimate(GPT, HW, Batch(gb, seq), Layout(micro_batch=mb), params())
    tokens, m = mb * seq, gb // mb
    assert e.microbatches == m == 8
    multiplies = _forward_multiplies(tokens, 1)
    # their FLOPs are 2 x tokens x the layer's matrices
    flops = 2 * tokens * LAYER_MATRICES
    bytes_ = 2 * (
        (tokens * H + H * 3 * H + tokens * 3 * H)
        + (tokens * H + H * H + tokens * H)
        + (tokens * H + H * FFN + tokens * FFN)
        + (tokens * FFN + FFN * H + tokens * H)
    )
    assert multiplies == close(flops / PEAK + bytes_ / HBM)
    # norms, adds, dropout on h-wide rows (16 passes) and the activation on 3 ffn-wide passes
    elementwise = 2 * (16 * tokens * H + 3 * tokens * FFN) / HBM
    attention = 2 * tokens * seq * H / PEAK  # causal: half of 4 x tokens x seq x head_dim x heads
    head = 3 * roofline(tokens, H, V) + 24 * tokens * V / HBM
    per_mb = L * (3 * (multiplies + elementwise) + 3.5 * attention) + head
    assert e.breakdown["compute"] == close(m * per_mb)
    assert e.breakdown["recompute"] == 0.0
    # Adam over every weight (the embedding and the output layer too): 30 bytes a parameter
    assert e.breakdown["optimizer"] == close(30 * (L * LAYER_PARAMS + TABLES) / HBM)
    assert e.breakdown["bubble"] == 0.0 and e.breakdown["overhead"] == 0.0
    assert e.step_s == close(m * per_mb + e.breakdown["optimizer"])
    assert step_sum(e) == close(e.step_s)
    assert e.tokens_per_s_per_gpu == close(gb * seq / e.step_s)


def test_doubling_tp_halves_the_multiplies_flops():
    # memory bandwidth out of the way: the multiplies are their FLOPs alone
    fast = dataclasses.replace(HW, hbm_bytes_per_s=1e30)
    batch = Batch(16, 1024)
    tokens = 1024
    got = {}
    for tp in (1, 2, 4):
        e = estimate(GPT, fast, batch, Layout(tp=tp), params())
        head = 3 * 2 * tokens * H * (V / tp) / PEAK
        attention = 2 * tokens * 1024 * (H / tp) / PEAK
        got[tp] = e.breakdown["compute"] / e.microbatches
        assert got[tp] == close(
            L * (3 * 2 * tokens * LAYER_MATRICES / tp / PEAK + 3.5 * attention) + head
        )
    assert got[2] == close(got[1] / 2)
    assert got[4] == close(got[1] / 4)
    # with the bytes term the multiplies take their FLOPs plus the roofline's bytes
    assert _forward_multiplies(tokens, 2) > 2 * tokens * LAYER_MATRICES / 2 / PEAK


def test_full_recomputation_adds_one_forward_pass():
    e = estimate(GPT, HW, Batch(8, 1024), Layout(recompute="full"), params())
    tokens = 1024
    forward = (
        _forward_multiplies(tokens, 1)
        + 2 * (16 * tokens * H + 3 * tokens * FFN) / HBM
        + 2 * tokens * 1024 * H / PEAK
    )
    assert e.breakdown["recompute"] == close(e.microbatches * L * forward)
    assert step_sum(e) == close(e.step_s)


# -- the pipeline -----------------------------------------------------------------------------


def test_1f1b_bubble_is_pp_minus_1_micro_batch_times_and_halves_with_two_virtual_stages():
    batch = Batch(16, 1024)
    act = 2 * 1024 * H  # one micro-batch's activations, bf16
    send = LAT_IN + act / INTRA  # stages 1 rank apart: inside a node
    got = {}
    for vpp in (1, 2):
        e = estimate(GPT, HW, batch, Layout(pp=4, vpp=vpp), params(overlap=0.0))
        m = e.microbatches
        assert m == 16
        # a forward and a backward send per virtual stage and micro-batch
        assert e.breakdown["pp"] == close(m * 2 * vpp * send)
        t_mb = (e.breakdown["compute"] + e.breakdown["recompute"] + e.breakdown["pp"]) / m
        assert e.breakdown["bubble"] == close((4 - 1) / vpp * t_mb)
        assert e.step_s == close(
            m * t_mb + e.breakdown["bubble"] + e.breakdown["optimizer"] + e.breakdown["overhead"]
        )
        assert step_sum(e) == close(e.step_s)
        got[vpp] = e
    # 8 layers on 4 stages: 2 per stage either way, so the same compute per micro-batch
    compute_mb = got[1].breakdown["compute"] / 16
    assert got[2].breakdown["compute"] == close(got[1].breakdown["compute"])
    assert got[1].breakdown["bubble"] == close(3 * (compute_mb + 2 * send))
    assert got[2].breakdown["bubble"] == close(1.5 * (compute_mb + 4 * send))


def test_the_busiest_stage_has_the_layers_rounded_up():
    one = estimate(GPT, HW, Batch(8, 1024), Layout(), params())
    three = estimate(GPT, HW, Batch(8, 1024), Layout(pp=3), params())
    four = estimate(GPT, HW, Batch(8, 1024), Layout(pp=4), params())
    head = 3 * roofline(1024, H, V) + 24 * 1024 * V / HBM
    layer = (one.breakdown["compute"] / 8 - head) / L
    assert three.breakdown["compute"] / 8 == close(3 * layer + head)  # ceil(8 / 3)
    assert four.breakdown["compute"] / 8 == close(2 * layer + head)


def test_pipeline_sends_across_nodes_use_the_nic():
    # tp=8 fills a node, so the next stage is on the next node
    e = estimate(GPT, HW, Batch(8, 1024), Layout(tp=8, pp=2), params())
    act = 2 * 1024 * H / 8
    assert e.breakdown["pp"] == close(8 * 2 * (LAT_OUT + act / INTER))
    # tp=4: stages 0 and 1 (ranks 0 and 4) share node 0, stages 2 and 3 (ranks 8 and 12) node
    # 1; the hop from stage 1 to 2 crosses nodes, and the slowest hop sets the pace
    e = estimate(GPT, HW, Batch(8, 1024), Layout(tp=4, pp=4), params())
    act = 2 * 1024 * H / 4
    assert e.breakdown["pp"] == close(8 * 2 * (LAT_OUT + act / INTER))


# -- exposed and overlapped communication -----------------------------------------------------


def _fsdp_per_mb(shard: int) -> float:
    weights = L * LAYER_PARAMS + TABLES  # one stage: every layer, the embedding and the head
    gathers = 2 * ring(1, shard, shard, 2 * weights)  # bf16 weights, forward and backward
    return gathers + ring(1, shard, shard, 4 * weights)  # fp32 gradients reduce-scattered


def test_fsdp_gathers_hide_behind_compute_with_overlap_and_are_exposed_without():
    batch, lay = Batch(64, 1024), Layout(dp_shard=8)
    per_mb = _fsdp_per_mb(8)
    hidden = estimate(GPT, HW, batch, lay, params(overlap=1.0))
    exposed = estimate(GPT, HW, batch, lay, params(overlap=0.0))
    m = hidden.microbatches
    assert m == 8
    assert per_mb < hidden.breakdown["compute"] / m  # the premise: less than the compute
    assert hidden.breakdown["dp_shard"] == pytest.approx(0.0, abs=1e-12)
    assert hidden.breakdown["dp_shard_overlapped"] == close(m * per_mb)
    assert exposed.breakdown["dp_shard"] == close(m * per_mb)
    assert exposed.breakdown["dp_shard_overlapped"] == pytest.approx(0.0, abs=1e-12)
    assert exposed.step_s == close(hidden.step_s + m * per_mb)
    half = estimate(GPT, HW, batch, lay, params(overlap=0.5))
    assert half.breakdown["dp_shard"] == close(m * per_mb / 2)
    for e in (hidden, exposed, half):
        assert step_sum(e) == close(e.step_s)
        assert "dp_replicate" not in e.breakdown


def test_overlap_never_hides_more_than_the_compute_beside_it():
    quick = dataclasses.replace(HW, peak_flops=1e18, hbm_bytes_per_s=1e16)
    e = estimate(GPT, quick, Batch(64, 1024), Layout(dp_shard=8), params(overlap=1.0))
    m, per_mb = e.microbatches, _fsdp_per_mb(8)
    busy = e.breakdown["compute"] / m
    assert per_mb > busy
    assert e.breakdown["dp_shard"] == close(m * (per_mb - busy))
    assert e.breakdown["dp_shard_overlapped"] == close(m * busy)
    assert step_sum(e) == close(e.step_s)


def test_pipeline_sends_hide_with_overlap():
    hidden = estimate(GPT, HW, Batch(16, 1024), Layout(pp=4), params(overlap=1.0))
    send = LAT_IN + 2 * 1024 * H / INTRA
    assert hidden.breakdown["pp"] == pytest.approx(0.0, abs=1e-12)
    assert hidden.breakdown["pp_overlapped"] == close(16 * 2 * send)


def test_tensor_parallel_all_reduces_are_exposed_unless_sequence_parallel():
    batch = Batch(16, 1024)
    plain = estimate(GPT, HW, batch, Layout(tp=2), params(overlap=1.0))
    sp = estimate(GPT, HW, batch, Layout(tp=2, sequence_parallel=True), params(overlap=1.0))
    assert plain.breakdown["tp"] > 0 and plain.breakdown["tp_overlapped"] == 0.0
    assert sp.breakdown["tp"] == pytest.approx(0.0, abs=1e-12)
    assert sp.breakdown["tp_overlapped"] == close(plain.breakdown["tp"])
    # a whole number of all-reduces of a micro-batch's activations (bf16) over 2 ranks
    one = ring(2, 2, 2, 2 * 1024 * H)
    count = plain.breakdown["tp"] / (plain.microbatches * L * one)
    assert count == pytest.approx(round(count), rel=1e-9)


def test_tensor_parallel_does_four_all_reduces_per_layer_without_recomputation():
    e = estimate(GPT, HW, Batch(16, 1024), Layout(tp=2), params(overlap=0.0))
    one = ring(2, 2, 2, 2 * 1024 * H)
    assert e.breakdown["tp"] == close(e.microbatches * 4 * L * one)


def test_data_parallel_all_reduce_across_nodes_once_per_step():
    # tp=8 fills a node; the two replicas are on two nodes: a ring over one NIC each, on the
    # gradients of the layers and of both tables (each rank's eighth)
    weights = L * (LAYER_MATRICES / 8 + 2 * H) + TABLES / 8
    ar = 2 * 1 * LAT_OUT + 2 * (1 / 2) * 4 * weights / INTER
    batch = Batch(64, 1024)
    exposed = estimate(GPT, HW, batch, Layout(tp=8, dp_replicate=2, micro_batch=8), params())
    assert exposed.breakdown["dp_replicate"] == close(ar)
    assert exposed.breakdown["dp_replicate_overlapped"] == 0.0
    assert step_sum(exposed) == close(exposed.step_s)
    # with overlap it hides behind the last backward (which takes longer: its FLOPs alone are
    # 4 x tokens x the stage's matrices)
    assert 4 * 8192 * L * LAYER_MATRICES / 8 / PEAK > ar
    hidden = estimate(GPT, HW, batch, Layout(tp=8, dp_replicate=2, micro_batch=8), params(1.0))
    assert hidden.breakdown["dp_replicate"] == pytest.approx(0.0, abs=1e-12)
    assert hidden.breakdown["dp_replicate_overlapped"] == close(ar)
    # ZeRO-1: fp32 gradients reduce-scattered, bf16 weights gathered
    zero = estimate(GPT, HW, batch, Layout(tp=8, dp_replicate=2, zero=1, micro_batch=8), params())
    rs = LAT_OUT + (1 / 2) * 4 * weights / INTER
    ag = LAT_OUT + (1 / 2) * 2 * weights / INTER
    assert zero.breakdown["dp_replicate"] == close(rs + ag)
    assert step_sum(zero) == close(zero.step_s)


def test_data_parallel_reduction_includes_the_embedding_gradients():
    # one stage: the embedding and the output layer, untied, are both reduced
    weights = L * (LAYER_MATRICES / 8 + 2 * H) + 2 * EMBED / 8
    ar = 2 * LAT_OUT + 4 * weights / INTER
    e = estimate(GPT, HW, Batch(64, 1024), Layout(tp=8, dp_replicate=2), params())
    assert e.breakdown["dp_replicate"] == close(ar)
    # two stages of 4 layers: the busiest holds one of the two tables; tp=8 fills a node, so
    # the two replicas (ranks 0 and 8) are one per node on two nodes, as above
    weights = 4 * (LAYER_MATRICES / 8 + 2 * H) + EMBED / 8
    ar = 2 * LAT_OUT + 4 * weights / INTER
    e = estimate(GPT, HW, Batch(64, 1024), Layout(tp=8, pp=2, dp_replicate=2), params())
    assert e.breakdown["dp_replicate"] == close(ar)


def test_replicas_in_different_pods_pay_the_oversubscription():
    lay = Layout(tp=8, dp_shard=32, dp_replicate=2)  # 512 GPUs, 64 nodes: a replica per pod
    batch = Batch(64, 1024)
    full = estimate(GPT, dataclasses.replace(HW, pod_nodes=32), batch, lay, params())
    over = dataclasses.replace(HW, pod_nodes=32, oversubscription=4.0)
    slow = estimate(GPT, over, batch, lay, params())
    assert slow.breakdown["dp_replicate"] > 2 * full.breakdown["dp_replicate"]


# -- memory -----------------------------------------------------------------------------------


def _activations(tokens: int, layers: int, in_flight: float, tp: int = 1) -> float:
    # Korthikanti et al. 2022, Eq. 2 with flash attention: 10 h replicated, 24 h / tp sharded
    return tokens * (10 * H + 24 * H / tp) * layers * in_flight


def test_plain_data_parallel_holds_18_bytes_a_parameter():
    batch = Batch(8, 1024)
    e = estimate(GPT, HW, batch, Layout(dp_replicate=4, micro_batch=2), params())
    p = L * LAYER_PARAMS + TABLES
    tokens = 2 * 1024
    assert e.memory_bytes == close(18 * p + _activations(tokens, L, 1) + 6 * tokens * V)
    assert e.state_bytes == close(12 * p)


def test_zero_1_shards_the_fp32_master_weights_and_adam_over_the_replicas():
    batch = Batch(8, 1024)
    e = estimate(GPT, HW, batch, Layout(dp_replicate=4, zero=1, micro_batch=2), params())
    p = L * LAYER_PARAMS + TABLES
    tokens = 2 * 1024
    state = (2 + 4) * p + 12 * p / 4
    assert e.memory_bytes == close(state + _activations(tokens, L, 1) + 6 * tokens * V)
    assert e.state_bytes == close(12 * p)  # the replica is whole


def test_fsdp_shards_everything_and_gathers_two_layers():
    batch = Batch(8, 1024)
    e = estimate(GPT, HW, batch, Layout(dp_shard=4, micro_batch=2), params())
    p = L * LAYER_PARAMS + TABLES
    tokens = 2 * 1024
    state = 16 * p / 4 + 2 * (2 + 4) * LAYER_PARAMS
    assert e.memory_bytes == close(state + _activations(tokens, L, 1) + 6 * tokens * V)
    assert e.state_bytes == close(12 * p / 4)


def test_memory_ordering_of_the_three_data_parallel_ways():
    batch = Batch(8, 1024)
    plain, zero, fsdp = (
        estimate(GPT, HW, batch, lay, params())
        for lay in (Layout(dp_replicate=4), Layout(dp_replicate=4, zero=1), Layout(dp_shard=4))
    )
    assert plain.memory_bytes > zero.memory_bytes > fsdp.memory_bytes


def test_full_recomputation_holds_each_layers_input_per_tp_rank_with_sequence_parallelism():
    batch = Batch(8, 1024)
    tokens = 1024
    state = 18 * (L * (LAYER_MATRICES / 2 + 2 * H) + TABLES / 2)  # each tp rank's half
    logits = 6 * tokens * V / 2
    full_sp = estimate(
        GPT, HW, batch, Layout(tp=2, recompute="full", sequence_parallel=True), params()
    )
    held = 2 * H / 2 * tokens * L  # bf16 inputs, each tp rank its half of the sequence
    one_layer = tokens * 34 * H / 2  # the layer being recomputed, all of it sharded
    assert full_sp.memory_bytes == close(state + held + one_layer + logits)
    full = estimate(GPT, HW, batch, Layout(tp=2, recompute="full"), params())
    held = 2 * H * tokens * L  # without sequence parallelism every rank holds all of it
    one_layer = tokens * (10 * H + 24 * H / 2)
    assert full.memory_bytes == close(state + held + one_layer + logits)


def test_unfused_attention_keeps_the_scores():
    batch = Batch(8, 1024)
    flash = estimate(GPT, HW, batch, Layout(), params())
    unfused = estimate(GPT, HW, batch, Layout(), params(), flash_attention=False)
    # 5 x heads x seq bytes a token a layer (scores, softmax, dropout mask and output)
    assert unfused.memory_bytes - flash.memory_bytes == close(1024 * 5 * HEADS * 1024 * L)


@pytest.mark.parametrize(
    ("gb", "vpp", "in_flight"),
    [(16, 1, 4), (2, 1, 2), (16, 2, 4 * (1 + 3 / (4 * 2)))],
)
def test_the_first_stage_holds_its_in_flight_micro_batches(gb, vpp, in_flight):
    e = estimate(GPT, HW, Batch(gb, 1024), Layout(pp=4, vpp=vpp), params())
    tokens = 1024
    state = 18 * (2 * LAYER_PARAMS + EMBED)  # 2 layers a stage and the embedding or the head
    act = _activations(tokens, 2, in_flight)
    assert e.memory_bytes == close(state + act + 6 * tokens * V)


def test_a_single_stage_of_an_untied_model_holds_the_embedding_and_the_head():
    assert not GPT.tied_embeddings
    e = estimate(GPT, HW, Batch(8, 1024), Layout(), params())
    assert e.state_bytes == pytest.approx(12 * parameter_count(GPT), rel=1e-4)


def test_a_tied_model_on_one_stage_checkpoints_every_parameter():
    tied = dataclasses.replace(GPT, tied_embeddings=True)
    e = estimate(tied, HW, Batch(8, 1024), Layout(), params())
    # parameter_count adds the final norm (h weights), which the estimate leaves out
    assert e.state_bytes == pytest.approx(12 * parameter_count(tied), rel=1e-4)


# -- search -----------------------------------------------------------------------------------


def test_search_sorts_by_step_time_and_returns_only_layouts_that_fit():
    batch = Batch(64, 1024)
    found = search(GPT, HW, batch, 8, {}, params(0.5))
    assert len(found) > 5
    steps = [e.step_s for e in found]
    assert steps == sorted(steps)
    for e in found:
        assert e.fits
        assert e.layout.gpus == 8
        assert not layout_problems(GPT, batch, e.layout, 8)
    assert len(search(GPT, HW, batch, 8, {}, params(0.5), top=3)) == 3


def test_search_never_changes_a_pinned_value():
    batch = Batch(64, 1024)
    found = search(GPT, HW, batch, 8, {"tp": 2, "micro_batch": 4}, params())
    assert found
    for e in found:
        assert e.layout.tp == 2 and e.layout.micro_batch == 4
    found = search(GPT, HW, batch, 8, {"pp": 2, "sequence_parallel": False}, params())
    assert found and all(e.layout.pp == 2 and not e.layout.sequence_parallel for e in found)


def test_a_model_too_big_for_the_gpus_is_refused_naming_them():
    big = ModelShape(
        num_layers=32, hidden=8192, num_heads=64, num_kv_heads=64, ffn=4 * 8192, vocab=32000
    )
    small = dataclasses.replace(HW, memory_bytes=20 * GB)
    with pytest.raises(ValueError, match=r"no layout of 8 GPUs .* 20 GB per GPU"):
        search(big, small, Batch(64, 1024), 8, {}, params())


def test_best_options_picks_the_least_recomputation_that_fits():
    batch = Batch(64, 1024)
    dims = dict(tp=1, cp=1, pp=1, ep=1, dp_shard=1, dp_replicate=8)
    lay = Layout(**dims, zero=1, micro_batch=8)
    none = estimate(GPT, HW, batch, lay, params())
    full = estimate(GPT, HW, batch, dataclasses.replace(lay, recompute="full"), params())
    # a budget between the two: no recomputation does not fit, full recomputation does
    tight = dataclasses.replace(
        HW, memory_bytes=4 * GB + (none.memory_bytes + full.memory_bytes) / 2
    )
    best = best_options(GPT, tight, batch, dims, {"micro_batch": 8}, params())
    assert best is not None and best.fits
    assert best.layout.recompute != "none"
    assert best.layout.zero == 1  # ZeRO-1 on by default where weights are replicated
    roomy = best_options(GPT, HW, batch, dims, {"micro_batch": 8}, params())
    assert roomy is not None and roomy.layout.recompute == "none"
    # tp > 1: sequence parallelism on unless pinned off
    tp2 = dict(dims, tp=2, dp_replicate=4)
    assert best_options(GPT, HW, batch, tp2, {}, params()).layout.sequence_parallel
    off = best_options(GPT, HW, batch, tp2, {"sequence_parallel": False}, params())
    assert not off.layout.sequence_parallel
