"""Fit the cost model's parameters (`anyshard.trainer_integration.planning.transformer_cost.Params`)
to the two published tables it is calibrated on, and nothing else:

- Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (GPT, 1.7B to 1T, 32 to 3,072 A100-80GB);
- the Megatron-Core H100 table of NVIDIA/Megatron-LM's README (GPT, 1.7B to 462B, 48 to 6,144
  H100-SXM).

Both are copied with their settings in ``../shared/research/published_runs.md``; the rows are
below. A row's published step time is the source's own FLOP count of one iteration divided by
GPUs x its TFLOP/s per GPU: SC'21's Eq. 3 (which counts the recomputed forward pass), and for
Megatron-Core the model FLOPs (6 x parameters x tokens plus attention, as Megatron's
``num_floating_point_operations`` counts them, no recomputation). What a source states is
pinned; what it leaves out (micro-batch, virtual stages; for Megatron-Core also recomputation,
sequence parallelism and ZeRO-1) the model chooses: the fastest that fits.

    python tools/fit_cost_model.py            # fit, write cost_params.json, print the table
    python tools/fit_cost_model.py --check    # fit, compare with the committed file (exit 1)
    python tools/fit_cost_model.py --table    # the committed parameters' errors, no fit
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from anyshard.trainer_integration.planning.hardware import load_hardware
from anyshard.trainer_integration.planning.layout_search import (
    MICRO_BATCHES,
    VPPS,
    best_options,
    dim_candidates,
)
from anyshard.trainer_integration.planning.model_shape import (
    ModelShape,
    model_flops_per_token,
    sc21_flops_per_iteration,
)
from anyshard.trainer_integration.planning.transformer_cost import (
    PARAMS_FILE,
    Batch,
    Estimate,
    Layout,
    Params,
    estimate,
    load_params,
)

SC21 = "Narayanan et al., SC'21, Table 1"
MCORE = "NVIDIA/Megatron-LM README, Megatron-Core H100 table"

# (heads, hidden, layers, TP, PP, GPUs, global batch, TFLOP/s per GPU), as published
SC21_ROWS = (
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (32, 3072, 30, 2, 1, 64, 512, 138),
    (32, 4096, 36, 4, 1, 128, 512, 142),
    (48, 6144, 40, 8, 1, 256, 1024, 135),
    (64, 8192, 48, 8, 2, 512, 1536, 138),
    (80, 10240, 60, 8, 4, 1024, 1792, 140),
    (96, 12288, 80, 8, 8, 1536, 2304, 148),
    (128, 16384, 96, 8, 16, 1920, 2160, 155),
    (128, 20480, 105, 8, 35, 2520, 2520, 163),
    (160, 25600, 128, 8, 64, 3072, 3072, 163),
)
MCORE_ROWS = (
    (16, 2048, 24, 1, 1, 48, 192, 408.8),
    (32, 4096, 30, 2, 1, 96, 192, 465.9),
    (48, 6144, 32, 4, 1, 192, 192, 489.1),
    (56, 7168, 48, 8, 1, 384, 192, 459.6),
    (64, 8192, 84, 8, 2, 768, 384, 419.7),
    (80, 10240, 92, 8, 4, 1536, 768, 420.5),
    (96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    (128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    (144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)

# the search space of the fit: bounds that keep every number physical
# the search space of the fit: bounds that keep every number physical. Attention: fused
# kernels reach 50-75% of peak forward and backward (FlashAttention-2, Dao 2023, A100; -3,
# Shah et al. 2024, H100), so at least 0.3; streaming kernels reach 80-90% of memory
# bandwidth; NCCL's bus bandwidth 70-90% of a link's
BOUNDS = {
    "gemm_efficiency": (0.5, 0.9),
    "attention_efficiency": (0.3, 0.8),
    "hbm_efficiency": (0.5, 0.9),
    "network_efficiency": (0.5, 0.9),
    "overlap": (0.0, 1.0),
    "kernel_s": (2e-6, 2e-5),
    "step_overhead_s": (0.0, 0.2),
}
START = Params(
    gemm_efficiency=0.7,
    attention_efficiency=0.4,
    hbm_efficiency=0.7,
    network_efficiency=0.7,
    overlap=0.8,
    kernel_s=5e-6,
    step_overhead_s=0.02,
)
MEANING = {
    "gemm_efficiency": "share of the device's peak FLOP/s a compute-bound matrix multiply reaches",
    "attention_efficiency": "share of peak FLOP/s a fused (flash) attention kernel reaches",
    "hbm_efficiency": "share of memory bandwidth element-wise passes and thin multiplies reach",
    "network_efficiency": "share of a link's bandwidth a collective or send reaches",
    "overlap": "share of the communication the schedule can hide that is hidden",
    "kernel_s": "fixed seconds of one kernel (launch, tail)",
    "step_overhead_s": "fixed seconds of a step (data, loss and norm reductions, host work)",
}


@dataclass(frozen=True)
class Row:
    """One published run: its model, cluster, batch, what the source pins, and its step."""

    source: str
    name: str
    shape: ModelShape
    hardware: str
    batch: Batch
    gpus: int
    pins: dict[str, Any]
    flash_attention: bool
    published_step_s: float
    published_tflops: float


def rows() -> list[Row]:
    """Both tables as `Row`s, with the settings each source states pinned."""
    out = []
    for heads, h, layers, tp, pp, gpus, gb, tflops in SC21_ROWS:
        # GPT-3-style: plain MLP of 4h, one key-value head per head, tied embeddings (Megatron's
        # default then); full recomputation and the interleaved schedule (the paper's runs),
        # data parallelism without a sharded optimizer, no sequence parallelism and no fused
        # attention (both came after the paper)
        shape = ModelShape(num_layers=layers, hidden=h, num_heads=heads, num_kv_heads=heads,
                           ffn=4 * h, vocab=51200, gated_mlp=False, tied_embeddings=True)  # fmt: skip
        step = sc21_flops_per_iteration(shape, gb, 2048) / (gpus * tflops * 1e12)
        pins = dict(tp=tp, pp=pp, cp=1, dp_shard=1, dp_replicate=gpus // (tp * pp), zero=0,
                    recompute="full", sequence_parallel=False)  # fmt: skip
        if pp > 1:
            pins["interleaved"] = True
        out.append(Row(SC21, f"{_billions(shape)} GPT", shape, "a100-80gb", Batch(gb, 2048),
                       gpus, pins, False, step, tflops))  # fmt: skip
    for heads, h, layers, tp, pp, gpus, gb, tflops in MCORE_ROWS:
        # GPT: plain MLP of 4h, one key-value head per head, untied embeddings (the table's
        # parameter counts: 12 l h^2 + 2 V h); DP 48 over Megatron's data-parallel ranks
        shape = ModelShape(num_layers=layers, hidden=h, num_heads=heads, num_kv_heads=heads,
                           ffn=4 * h, vocab=131072, gated_mlp=False)  # fmt: skip
        step = model_flops_per_token(shape, 4096) * gb * 4096 / (gpus * tflops * 1e12)
        pins = dict(tp=tp, pp=pp, cp=1, dp_shard=1, dp_replicate=gpus // (tp * pp))
        out.append(Row(MCORE, f"{_billions(shape)} GPT", shape, "h100-sxm", Batch(gb, 4096),
                       gpus, pins, True, step, tflops))  # fmt: skip
    return out


def _billions(shape: ModelShape) -> str:
    from anyshard.trainer_integration.planning.model_shape import parameter_count

    return f"{parameter_count(shape) / 1e9:.1f}B"


def predict(row: Row, params: Params) -> Estimate:
    """The model's fastest layout of ``row`` with its pins: what ``layout_search.search``
    returns, from the candidates that fit (`candidates`: which fit does not depend on the
    parameters, so they are found once)."""
    hw = load_hardware(row.hardware)
    return min((estimate(row.shape, hw, row.batch, lay, params,
                         flash_attention=row.flash_attention) for lay in candidates(row)),
               key=lambda e: e.step_s)  # fmt: skip


_CANDIDATES: dict[tuple[str, int], list[Layout]] = {}


def candidates(row: Row) -> list[Layout]:
    """Every layout the search weighs for ``row``: per mesh dims, micro-batch and virtual
    stages, the least recomputation that fits (with the interleaved schedule stated: the
    virtual stages above 1)."""
    key = (row.source, row.gpus)
    if key not in _CANDIDATES:
        pins = dict(row.pins)
        interleaved = pins.pop("interleaved", False)
        hw = load_hardware(row.hardware)
        found = []
        for dims in dim_candidates(row.shape, hw, row.batch, row.gpus, pins):
            per_dp = row.batch.global_batch // (dims["dp_shard"] * dims["dp_replicate"])
            for mb in [b for b in MICRO_BATCHES if per_dp % b == 0]:
                for vpp in [v for v in VPPS if dims["pp"] > 1 or v == 1]:
                    if interleaved and vpp == 1:
                        continue
                    e = best_options(row.shape, hw, row.batch, dims,
                                     {**pins, "micro_batch": mb, "vpp": vpp}, START,
                                     flash_attention=row.flash_attention)  # fmt: skip
                    if e is not None:
                        found.append(e.layout)
        if not found:
            raise ValueError(f"{row.source}, {row.name} on {row.gpus} GPUs: no layout fits")
        _CANDIDATES[key] = found
    return _CANDIDATES[key]


def errors(params: Params, table: list[Row]) -> list[float]:
    """Each row's relative step-time error, predicted over published, less 1."""
    return [predict(r, params).step_s / r.published_step_s - 1 for r in table]


def _to_unit(p: Params) -> list[float]:
    """Parameters mapped to [0, 1] within their bounds (kernel_s on a log scale)."""
    out = []
    for name, v in zip(Params.FIELDS, p.vector(), strict=True):
        lo, hi = BOUNDS[name]
        if name == "kernel_s":
            lo, hi, v = math.log(lo), math.log(hi), math.log(v)
        out.append(min(max((v - lo) / (hi - lo), 0.0), 1.0))
    return out


def _from_unit(u) -> Params:
    values = []
    for name, x in zip(Params.FIELDS, u, strict=True):
        lo, hi = BOUNDS[name]
        frac = min(max(float(x), 0.0), 1.0)
        if name == "kernel_s":
            values.append(math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo))))
        else:
            values.append(lo + frac * (hi - lo))
    return Params.of(values)


def fit(table: list[Row]) -> Params:
    """The parameters of least mean absolute step-time error over ``table`` (Nelder-Mead within
    the bounds from `START`, restarted where it moved: deterministic)."""
    from scipy.optimize import minimize

    def loss(u) -> float:
        return statistics.fmean(abs(e) for e in errors(_from_unit(u), table))

    x, best = _to_unit(START), math.inf
    for _ in range(4):  # restarts: a fresh simplex around the last optimum, until it settles
        res = minimize(loss, x, method="Nelder-Mead", bounds=[(0.0, 1.0)] * len(Params.FIELDS),
                       options={"maxfev": 1500, "xatol": 1e-4, "fatol": 1e-6})  # fmt: skip
        x, settled = res.x, best - res.fun < 1e-4
        best = min(best, res.fun)
        if settled:
            break
    return _rounded(_from_unit(x))


def _rounded(p: Params) -> Params:
    """Four significant figures: what the file holds, and what a re-fit is compared at."""
    return Params.of([float(f"{v:.4g}") for v in p.vector()])


def same_params(a: Params, b: Params) -> bool:
    """Whether two fits agree (to 0.2%: the file holds four significant figures)."""
    return all(
        math.isclose(x, y, rel_tol=2e-3) for x, y in zip(a.vector(), b.vector(), strict=True)
    )


def document(params: Params, table: list[Row]) -> dict[str, Any]:
    """The parameter file's contents: each value with its meaning, bounds and fit script, and
    the calibration's errors."""
    errs = errors(params, table)
    by_source = {
        src: statistics.fmean(abs(e) for e, r in zip(errs, table, strict=True) if r.source == src)
        for src in (SC21, MCORE)
    }
    return {
        "fit_by": "tools/fit_cost_model.py",
        "calibrated_on": [SC21, MCORE],
        "objective": "mean absolute relative error of the step time over both tables' rows",
        "params": {
            name: {
                "value": value,
                "meaning": MEANING[name],
                "bounds": list(BOUNDS[name]),
                "fit_by": "tools/fit_cost_model.py",
            }  # fmt: skip
            for name, value in zip(Params.FIELDS, params.vector(), strict=True)
        },
        "calibration_mae": statistics.fmean(abs(e) for e in errs),
        "calibration_mae_by_source": by_source,
    }


def print_table(params: Params, table: list[Row]) -> None:
    print(f"{'source':<8} {'model':<10} {'GPUs':>5} {'published s':>11} {'predicted s':>11} "
          f"{'error':>7}  layout chosen")  # fmt: skip
    errs = []
    for r in table:
        e = predict(r, params)
        err = e.step_s / r.published_step_s - 1
        errs.append(err)
        src = "SC'21" if r.source == SC21 else "MCore"
        print(f"{src:<8} {r.name:<10} {r.gpus:>5} {r.published_step_s:>11.2f} {e.step_s:>11.2f} "
              f"{err:>+7.1%}  {e.layout.name()}")  # fmt: skip
    print(f"mean absolute error {statistics.fmean(abs(x) for x in errs):.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--check", action="store_true", help="compare a re-fit with the file")
    ap.add_argument("--table", action="store_true", help="the file's errors, no fit")
    ap.add_argument("--out", default=PARAMS_FILE, help="the parameter file")
    a = ap.parse_args(argv)
    table = rows()
    if a.table:
        print_table(load_params(a.out), table)
        return 0
    params = fit(table)
    if a.check:
        same = same_params(params, load_params(a.out))
        print(("same as" if same else "differs from") + f" {a.out}: {params}")
        return 0 if same else 1
    with open(a.out, "w") as f:
        json.dump(document(params, table), f, indent=1)
        f.write("\n")
    load_params.cache_clear()
    print_table(params, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
