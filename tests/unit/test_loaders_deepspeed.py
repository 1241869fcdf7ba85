"""DeepSpeed ZeRO-1/2/3 and universal checkpoints read as logical tensors.

Two sources of truth. tests/fixtures/deepspeed holds checkpoints real DeepSpeed wrote on CPU
(tests/fixtures/make_deepspeed.py: ZeRO-1 bf16, ZeRO-2 fp32, ZeRO-3 bf16, and ds_to_universal
run on the ZeRO-2 and ZeRO-3 ones), each with ``truth.safetensors``: the fp32 master parameters
and Adam moments taken from the live engine in the same run. Other checkpoints are written here
in DeepSpeed's file layout (stage_1_and_2.py / stage3.py ``state_dict``, ds_to_universal.py) from
plain-torch partitioning code, to cover what the small run does not: dp = 3, tensor
parallelism, parameter alignment, ZeRO-3 sub-groups, 0-d parameters.

Run: python -m pytest tests/unit/test_loaders_deepspeed.py -q
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file

import anyshard
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError, LayoutError
from anyshard.loaders import write_anyshard, write_hf
from anyshard.loaders.deepspeed import (
    DeepSpeedUniversalView,
    DeepSpeedZeroView,
    looks_like_deepspeed_universal,
    looks_like_deepspeed_zero,
)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
MOMENTS = ("exp_avg", "exp_avg_sq")


def truth_of(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "truth.safetensors"))


def assert_view_equals(view, truth: dict[str, torch.Tensor]) -> None:
    assert sorted(view.keys()) == sorted(truth)
    for name, want in truth.items():
        got = view.get_tensor(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        md = view.metadata(name)
        assert md.shape == tuple(want.shape) and md.dtype == want.dtype, name


# --- plain-torch partitioning, from DeepSpeed's documented layouts ----------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tp_shard(t: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    """torch.chunk's part ``rank`` (empty where torch.chunk gives fewer parts)."""
    if dim is None:
        return t
    per = cdiv(t.shape[dim], tp)
    lo = min(rank * per, t.shape[dim])
    return t.narrow(dim, lo, min(per, t.shape[dim] - lo))


def zero3_partition(params: list[torch.Tensor], dp: int, rank: int) -> torch.Tensor:
    """stage3.py: each parameter flattened, padded to a multiple of dp, split in dp pieces; a
    rank's pieces one after another."""
    pieces = []
    for t in params:
        flat = t.reshape(-1)
        per = cdiv(flat.numel(), dp)
        flat = torch.cat([flat, flat.new_zeros(per * dp - flat.numel())])
        pieces.append(flat[rank * per : (rank + 1) * per])
    return torch.cat(pieces) if pieces else torch.zeros(0)


def zero12_partition(
    params: list[torch.Tensor], dp: int, rank: int, align: int
) -> tuple[torch.Tensor, list[int], int]:
    """stage_1_and_2.py: a group's parameters in one buffer (each but the last padded so the
    next starts at a multiple of ``align``), padded to a multiple of 2 * dp, split in dp
    pieces. Returns the rank's piece as saved (the last rank's without the end padding), the
    per-parameter paddings, and the rank's group padding."""
    chunks, paddings, off = [], [], 0
    for i, t in enumerate(params):
        chunks.append(t.reshape(-1))
        off += t.numel()
        pad = 0 if i == len(params) - 1 else (-off) % align
        chunks.append(torch.zeros(pad))
        paddings.append(pad)
        off += pad
    total = cdiv(off, 2 * dp) * 2 * dp
    flat = torch.cat([*chunks, torch.zeros(total - off)])
    per = total // dp
    group_padding = total - off if rank == dp - 1 else 0
    return flat[rank * per : (rank + 1) * per - group_padding].clone(), paddings, group_padding


def adam_state(t_avg, t_sq):
    return {"step": torch.tensor(7.0), "exp_avg": t_avg, "exp_avg_sq": t_sq}


def random_truth(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        out[name] = torch.randn(shape, generator=g)
        for m in MOMENTS:
            out[f"{name}.{m}"] = torch.randn(shape, generator=g)
    return out


def write_zero3(root, truth, groups, *, dp, tp=1, tp_dims=None, step="global_step7"):
    """A ZeRO-3 checkpoint as stage3.py and engine.save_checkpoint lay it out."""
    tp_dims = tp_dims or {}
    step_dir = pathlib.Path(root) / step
    step_dir.mkdir(parents=True)
    (pathlib.Path(root) / "latest").write_text(step)
    for t in range(tp):
        local = {
            k: tp_shard(
                v, tp_dims.get(k.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")), tp, t
            )
            for k, v in truth.items()
        }
        shapes = [{n: torch.Size(local[n].shape) for n in g} for g in groups]
        for d in range(dp):
            flats = [zero3_partition([local[n] for n in g], dp, d) for g in groups]
            state = {
                i: adam_state(
                    *(zero3_partition([local[f"{n}.{m}"] for n in g], dp, d) for m in MOMENTS)
                )
                for i, g in enumerate(groups)
            }
            osd = {
                "zero_stage": 3,
                "loss_scaler": {"cur_scale": 1.0},
                "partition_count": dp,
                "optimizer_state_dict": {
                    "state": state,
                    "param_groups": [{"lr": 0.1}] * len(groups),
                },
                "fp32_flat_groups": flats,
            }
            name = f"zero_pp_rank_{d}_mp_rank_{t:02d}"
            torch.save(
                {"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                step_dir / f"{name}_optim_states.pt",
            )
            model = {"module": {}, "param_shapes": shapes, "dp_world_size": dp, "mp_world_size": tp}
            torch.save(model, step_dir / f"{name}_model_states.pt")
    return step_dir


def write_zero12(root, truth, groups, *, dp, align=1, elastic=False, step="global_step9"):
    """A ZeRO-1/2 checkpoint (dp only) as stage_1_and_2.py and engine.save_checkpoint lay it out."""
    step_dir = pathlib.Path(root) / step
    step_dir.mkdir(parents=True)
    (pathlib.Path(root) / "latest").write_text(step)
    shapes = [{n: torch.Size(truth[n].shape) for n in g} for g in groups]
    torch.save(
        {"module": {n: truth[n].bfloat16() for g in groups for n in g}, "param_shapes": shapes},
        step_dir / "mp_rank_00_model_states.pt",
    )
    for d in range(dp):
        flats, states, paddings, group_paddings = [], [], [], []
        for g in groups:
            flat, pads, gpad = zero12_partition([truth[n] for n in g], dp, d, align)
            moments = [
                zero12_partition([truth[f"{n}.{m}"] for n in g], dp, d, align)[0] for m in MOMENTS
            ]
            if not elastic:  # the base optimizer's own state keeps the end padding
                moments = [torch.cat([x, torch.zeros(gpad)]) for x in moments]
            flats.append(flat)
            states.append(adam_state(*moments))
            paddings.append(pads)
            group_paddings.append(gpad)
        base = states if elastic else {"state": dict(enumerate(states)), "param_groups": []}
        osd = {
            "zero_stage": 2,
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": flats,
            "group_paddings": group_paddings,
            "param_alignment_paddings": paddings,
            "partition_count": [dp] * len(groups),
        }
        name = f"bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": osd}, step_dir / name)
    return step_dir


# --- real DeepSpeed's checkpoints ---------------------------------------------------------------


@pytest.mark.parametrize("name,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_real_zero_checkpoints_read_bit_exact_against_the_engines_own_state(name, stage):
    truth = truth_of(name)
    with DeepSpeedZeroView(str(FIXTURES / name)) as view:
        assert view.zero_stage == stage and view.layout == {"dp": 2}
        assert_view_equals(view, truth)
        w = "fc1.weight.exp_avg_sq"
        assert torch.equal(view.get_slice(w)[3:7, 2:5], truth[w][3:7, 2:5])
        assert torch.equal(view.get_slice("fc2.bias")[1], truth["fc2.bias"][1])
    assert looks_like_deepspeed_zero(str(FIXTURES / name))
    assert looks_like_deepspeed_zero(str(FIXTURES / name / "global_step3"))
    assert not looks_like_deepspeed_universal(str(FIXTURES / name))


@pytest.mark.parametrize("name", ["universal", "universal_zero3"])
def test_real_universal_checkpoints_read_bit_exact_against_the_engines_own_state(name):
    truth = truth_of(name)
    for path in (FIXTURES / name, FIXTURES / name / "global_step3_universal"):
        with DeepSpeedUniversalView(str(path)) as view:
            assert_view_equals(view, truth)
            w = "embed.weight.exp_avg"
            assert torch.equal(view.get_slice(w)[4:9, 1:4], truth[w][4:9, 1:4])
            out = torch.full((2, 6), -1.0)
            assert view.read_region("fc1.weight", ((8, 10), (0, 6)), out=out) is out
            assert torch.equal(out, truth["fc1.weight"][8:10])
    assert looks_like_deepspeed_universal(str(FIXTURES / name))
    assert not looks_like_deepspeed_zero(str(FIXTURES / name))


def test_the_deepspeed_views_are_exported_and_detected_by_open():
    from anyshard.loaders import DeepSpeedUniversalView as universal
    from anyshard.loaders import DeepSpeedZeroView as exported

    assert exported is DeepSpeedZeroView and universal is DeepSpeedUniversalView
    with anyshard.open(str(FIXTURES / "zero3")) as view:
        assert isinstance(view, DeepSpeedZeroView)
    with anyshard.open(str(FIXTURES / "universal")) as view:
        assert isinstance(view, DeepSpeedUniversalView)


def test_real_zero3_and_universal_to_hf_and_to_anyshard_under_another_zero_layout(tmp_path):
    truth = truth_of("zero3")
    zero3 = DeepSpeedZeroView(str(FIXTURES / "zero3"))
    universal = DeepSpeedUniversalView(str(FIXTURES / "universal_zero3"))
    for i, view in enumerate((zero3, universal)):
        write_hf(view, str(tmp_path / f"hf{i}"))
        hf = load_file(str(tmp_path / f"hf{i}" / "model.safetensors"))
        assert sorted(hf) == sorted(truth) and all(torch.equal(hf[k], truth[k]) for k in truth)

        # ZeRO-3 written under dp = 3 (the run had 2): each rank's buffers as stage3.py has them
        dst = str(tmp_path / f"dp3_{i}")
        write_anyshard(view, dst, spec=zero3.spec, layout={"dp": 3})
        names = param_order(
            FIXTURES / "zero3" / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        )
        for d in range(3):
            got = {k: torch.zeros(n) for k, n in zero3_sizes(truth, names, 3, d).items()}
            anyshard.load(dst, got, spec=zero3.spec, layout={"dp": 3}, coords={"dp": d})
            assert torch.equal(got["fp32_flat"], zero3_partition([truth[n] for n in names], 3, d))
            for m in MOMENTS:
                want = zero3_partition([truth[f"{n}.{m}"] for n in names], 3, d)
                assert torch.equal(got[m], want), (d, m)
        with anyshard.open(dst) as ckpt:
            assert all(torch.equal(ckpt.get_tensor(k), truth[k]) for k in truth)


def param_order(model_states) -> list[str]:
    """The parameters in DeepSpeed's order: its param_shapes, group after group."""
    groups = torch.load(model_states, weights_only=True)["param_shapes"]
    return [n for g in groups for n in g]


def zero3_sizes(truth, names, dp, rank):
    n = zero3_partition([truth[k] for k in names], dp, rank).numel()
    return {"fp32_flat": n, "exp_avg": n, "exp_avg_sq": n}


# --- checkpoints written here in DeepSpeed's layout ---------------------------------------------


def test_zero3_with_sub_groups_uneven_sizes_and_a_0d_parameter_needs_no_layout(tmp_path):
    shapes = {"w": (5, 3), "b": (4,), "scale": (), "v": (7, 2), "tiny": (1,)}
    truth = random_truth(shapes, 1)
    write_zero3(tmp_path, truth, [["w", "b", "scale"], ["v", "tiny"]], dp=3)
    view = DeepSpeedZeroView(str(tmp_path))
    assert view.zero_stage == 3 and view.layout == {"dp": 3}
    assert_view_equals(view, truth)
    assert torch.equal(view.get_slice("v.exp_avg")[2:6, 1], truth["v.exp_avg"][2:6, 1])


@pytest.mark.parametrize("dp,tp", [(2, 2), (3, 1), (1, 3)])
def test_zero3_under_tensor_parallelism_reads_through_the_shipped_spec(tmp_path, dp, tp):
    cfg = dict(hidden=4, ffn=6, vocab=5, layers=2)
    h, f, v = cfg["hidden"], cfg["ffn"], cfg["vocab"]
    shapes, tp_dims = {"embed.weight": (v, h)}, {"embed.weight": 0}
    for i in range(cfg["layers"]):
        shapes |= {f"layers.{i}.attn.weight": (h, h), f"layers.{i}.attn.bias": (h,)}
        shapes |= {f"layers.{i}.mlp.weight": (h, f), f"layers.{i}.norm.weight": (h,)}
        tp_dims |= {
            f"layers.{i}.attn.weight": 0,
            f"layers.{i}.attn.bias": 0,
            f"layers.{i}.mlp.weight": 1,
        }
    shapes["final_norm.weight"] = (h,)
    truth = random_truth(shapes, 2)
    write_zero3(tmp_path, truth, [list(shapes)], dp=dp, tp=tp, tp_dims=tp_dims)
    view = DeepSpeedZeroView(str(tmp_path), layout=cfg)
    assert view.layout == {**cfg, "dp": dp, "tp": tp}
    assert_view_equals(view, truth)
    if tp > 1:
        with pytest.raises(LayoutError, match="tp=.*spec="):
            DeepSpeedZeroView(str(tmp_path))


@pytest.mark.parametrize("align,elastic", [(1, False), (8, False), (4, True)])
def test_zero12_alignment_paddings_and_lean_last_partitions_need_no_layout(
    tmp_path, align, elastic
):
    shapes = {"a": (3, 3), "b": (5,), "c": (2, 7), "d": (1,), "e": (6,)}
    truth = random_truth(shapes, 3)
    write_zero12(tmp_path, truth, [["a", "b", "c"], ["d", "e"]], dp=3, align=align, elastic=elastic)
    view = DeepSpeedZeroView(str(tmp_path))
    assert view.zero_stage == 2 and view.layout == {"dp": 3}
    assert_view_equals(view, truth)


def test_universal_dicts_and_flat_zero3_tensors_shaped_by_the_model_states(tmp_path):
    truth = random_truth({"embed": (6, 4), "norm": (4,), "w": (3, 5)}, 4)
    step = tmp_path / "global_step5_universal"
    for name in ("embed", "norm", "w"):
        d = step / "zero" / name
        d.mkdir(parents=True)
        for state, suffix in (("fp32", ""), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq")):
            t = truth[name + suffix]
            if name == "w":  # ds_to_universal's ZeRO-3 path saves the merged flat tensor as is
                torch.save(t.reshape(-1).clone(), d / f"{state}.pt")
            else:
                extra = {"vocab_tensor": True} if name == "embed" else {}
                torch.save({"param": t, "cat_dim": 0, **extra}, d / f"{state}.pt")
        torch.save(torch.tensor(5.0), d / "step.pt")
    torch.save({"param_groups": [{"lr": 0.1}]}, step / "zero" / "optimizer_state.pt")
    shapes = [{"embed": torch.Size([6, 4]), "w": torch.Size([3, 5])}, {"norm": torch.Size([4])}]
    torch.save({"param_shapes": shapes}, step / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (tmp_path / "latest_universal").write_text(step.name)
    with anyshard.loaders.deepspeed.DeepSpeedUniversalView(str(tmp_path)) as view:
        assert view.path.endswith("global_step5_universal")
        assert_view_equals(view, truth)
        assert torch.equal(view.get_slice("w.exp_avg")[1:, 2:4], truth["w.exp_avg"][1:, 2:4])
        assert view.value_keys() == [] and view.values == {}


def test_universal_flat_tensor_that_the_model_states_do_not_fit_is_named(tmp_path):
    d = tmp_path / "zero" / "w"
    d.mkdir(parents=True)
    torch.save(torch.zeros(14), d / "fp32.pt")
    torch.save(
        {"param_shapes": [{"w": torch.Size([3, 5])}]}, tmp_path / "mp_rank_00_model_states.pt"
    )
    view = DeepSpeedUniversalView(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match=r"zero/w/fp32\.pt.*14 elements.*\[3, 5\]"):
        view.get_tensor("w")


# --- errors name the file -----------------------------------------------------------------------


def copy_fixture(name, tmp_path) -> pathlib.Path:
    import shutil

    return pathlib.Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def test_a_missing_zero_file_is_named_with_what_is_expected(tmp_path):
    root = copy_fixture("zero2", tmp_path)
    step = root / "global_step3"
    last = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    kept = last.read_bytes()
    last.unlink()  # the grid of file names looks whole; rank 0's partition_count says 2
    with pytest.raises(
        CorruptCheckpointError, match=r"found 1 of the 2 .*missing: zero_pp_rank_1_"
    ):
        DeepSpeedZeroView(str(root))
    last.write_bytes(kept)
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"global_step3: found 1 of the 2 ZeRO"):
        DeepSpeedZeroView(str(root))


def test_a_truncated_zero_file_is_named(tmp_path):
    root = copy_fixture("zero3", tmp_path)
    bad = root / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:1000])
    view = DeepSpeedZeroView(str(root))  # rank 0's file and the model states are intact
    with pytest.raises(
        CorruptCheckpointError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt"
    ):
        view.get_tensor("embed.weight")


def test_a_zero_file_of_the_wrong_shape_is_named(tmp_path):
    root = copy_fixture("zero2", tmp_path)
    path = root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # read with the view's allowlisted load, written back without DeepSpeed's objects
    osd = anyshard.loaders.deepspeed._load(str(path))["optimizer_state_dict"]
    osd["single_partition_of_fp32_groups"][0] = torch.zeros(5)
    for k in ("loss_scaler", "zero_stage", "param_slice_mappings"):
        osd.pop(k)
    torch.save({"optimizer_state_dict": osd}, path)
    data = DeepSpeedZeroView(str(root))
    with pytest.raises(
        CorruptCheckpointError, match=r"zero_pp_rank_1_mp_rank_00.*fp32_flat_groups\.0.*\[5\]"
    ):
        data.get_tensor("fc2.weight")


def test_a_missing_universal_file_or_directory_is_named(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        DeepSpeedUniversalView(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointNotFoundError, match=r"no zero/ directory"):
        DeepSpeedUniversalView(str(tmp_path))
    root = copy_fixture("universal", tmp_path)
    (root / "latest_universal").write_text("global_step9_universal")
    with pytest.raises(
        CorruptCheckpointError, match=r"latest_universal.*global_step9_universal.*missing"
    ):
        DeepSpeedUniversalView(str(root))
    (root / "latest_universal").write_text("global_step3_universal")
    bad = root / "global_step3_universal" / "zero" / "fc1.bias" / "exp_avg.pt"
    bad.write_bytes(b"not a torch file")
    view = DeepSpeedUniversalView(str(root))
    with pytest.raises(CorruptCheckpointError, match=r"zero/fc1\.bias/exp_avg\.pt"):
        view.get_tensor("fc1.bias.exp_avg")


def test_a_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    marker.write_text("still here")

    class Payload:
        def __reduce__(self):
            return (os.remove, (str(marker),))

    step = tmp_path / "global_step1"
    step.mkdir()
    for d in range(2):
        torch.save(
            {"optimizer_state_dict": Payload()},
            step / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt",
        )
    with pytest.raises(
        CorruptCheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt.*weights_only"
    ):
        DeepSpeedZeroView(str(step))
    assert marker.read_text() == "still here"
