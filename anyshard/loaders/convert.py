"""``convert`` and ``diff`` between checkpoint formats, over lazy views in bounded memory.

Both open their inputs with `anyshard.open`, which detects the format. `convert` streams a view
into a writer (`write_hf`, `write_anyshard`); `diff` compares two views tensor by tensor in row
blocks, so neither holds more than a block of each tensor at a time.

Run: ``anyshard convert --help``, ``anyshard diff --help``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from anyshard.api.open import open_checkpoint
from anyshard.errors import AnyshardError
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.geometry.boxes import full_box
from anyshard.loaders._shared import ExportReport, Progress
from anyshard.loaders.export import write_anyshard, write_hf

__all__ = ["DiffReport", "TensorDiff", "convert", "diff", "format_of"]

TARGETS = ("anyshard", "hf", "dcp", "zarr")
_TARGET_NAMES = {"hf": "Hugging Face", "dcp": "PyTorch DCP", "zarr": "zarr"}
_DIFF_BLOCK = 32 << 20  # bytes of float64 per compared block


def format_of(view) -> str:
    """``"anyshard"`` or the view's own ``format`` (``"huggingface-safetensors"``)."""
    return getattr(view, "format", "anyshard")


def convert(
    src: str,
    dst: str,
    *,
    to: str | None = None,
    spec=None,
    layout: Mapping[str, int] | None = None,
    dtype: torch.dtype | str | None = None,
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    max_shard_size: int | str = "5GB",
    progress: Progress | None = None,
) -> ExportReport:
    """Convert the checkpoint at ``src`` (any format `anyshard.open` reads) into ``dst``.

    ``to`` is ``"hf"``, ``"anyshard"``, ``"dcp"`` (`write_dcp`: loadable by
    ``torch.distributed.checkpoint.load``) or ``"zarr"`` (`write_zarr`: a consolidated zarr v3
    store); by default an anyshard checkpoint becomes Hugging Face safetensors and anything
    else becomes anyshard. To anyshard, ``spec``
    and ``layout`` give the target layout (as `write_anyshard`); without them the result is a
    plain single-rank checkpoint. ``max_shard_size`` applies to ``"hf"`` only.

    >>> import torch, tempfile, anyshard
    >>> from anyshard.loaders import convert
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/ckpt", {"w": torch.ones(2, 2)})
    >>> convert(d + "/ckpt", d + "/hf").files
    ('model.safetensors',)
    >>> convert(d + "/hf", d + "/back", dtype="bf16").format
    'anyshard'
    """
    if to is not None and to not in TARGETS:
        raise AnyshardError(f"cannot convert to {to!r}; the targets are {', '.join(TARGETS)}")
    with open_checkpoint(src) as view:
        target = to or ("hf" if format_of(view) == "anyshard" else "anyshard")
        if target != "anyshard" and (spec is not None or layout):
            raise AnyshardError(
                f"a spec and layout describe an anyshard target; a {_TARGET_NAMES[target]} "
                "checkpoint has no layout (drop them, or convert to anyshard)"
            )
        if target == "dcp":
            from anyshard.loaders.export_dcp import write_dcp

            return write_dcp(view, dst, dtype=dtype, only=only, rename=rename, progress=progress)
        if target == "zarr":
            from anyshard.loaders.zarr_store import write_zarr

            return write_zarr(view, dst, dtype=dtype, only=only, rename=rename, progress=progress)
        if target == "hf":
            return write_hf(
                view,
                dst,
                max_shard_size=max_shard_size,
                dtype=dtype,
                only=only,
                rename=rename,
                progress=progress,
            )
        return write_anyshard(
            view,
            dst,
            spec=spec,
            layout=layout,
            dtype=dtype,
            only=only,
            rename=rename,
            progress=progress,
        )


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor present in both: shapes, dtypes, and the largest absolute difference
    (None when the shapes differ; ``inf`` where one side has a NaN or an infinity the other
    lacks)."""

    name: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    max_abs: float | None

    def equal(self, atol: float) -> bool:
        return self.max_abs is not None and self.max_abs <= atol


@dataclass(frozen=True, slots=True)
class DiffReport:
    """``only_a`` / ``only_b``: names in one checkpoint only; ``tensors``: those in both."""

    a: str
    b: str
    atol: float
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def differing(self) -> list[TensorDiff]:
        return [t for t in self.tensors if not t.equal(self.atol)]

    @property
    def equal(self) -> bool:
        return not self.only_a and not self.only_b and not self.differing


def diff(a: str, b: str, *, atol: float = 0.0) -> DiffReport:
    """Compare every tensor of checkpoints ``a`` and ``b`` (any formats): names in one only,
    shapes, dtypes, and the largest absolute difference of the values (compared as float64, or
    complex128; equal NaNs and equal infinities count as equal). Dtypes may differ: values
    are compared. ``equal`` holds when the names and shapes agree and every difference is at
    most ``atol``.

    >>> import torch, tempfile, anyshard
    >>> from anyshard.loaders import diff
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/a", {"w": torch.zeros(3)})
    >>> anyshard.save(d + "/b", {"w": torch.tensor([0.0, 0.5, 0.0])})
    >>> r = diff(d + "/a", d + "/b")
    >>> r.equal, r.tensors[0].max_abs, diff(d + "/a", d + "/b", atol=0.5).equal
    (False, 0.5, True)
    """
    with open_checkpoint(a) as va, open_checkpoint(b) as vb:
        names_a, names_b = va.keys(), vb.keys()
        in_b = set(names_b)
        report = DiffReport(
            a,
            b,
            float(atol),
            only_a=sorted(set(names_a) - in_b),
            only_b=sorted(in_b - set(names_a)),
        )
        for name in sorted(set(names_a) & in_b):
            sa, sb = va.get_slice(name), vb.get_slice(name)
            shape_a, shape_b = tuple(sa.get_shape()), tuple(sb.get_shape())
            dtype_a, dtype_b = ST_TO_DTYPE[sa.get_dtype()], ST_TO_DTYPE[sb.get_dtype()]
            m = _max_abs(va, vb, name, shape_a) if shape_a == shape_b else None
            report.tensors.append(TensorDiff(name, shape_a, shape_b, dtype_a, dtype_b, m))
    return report


def _max_abs(va, vb, name: str, shape: tuple[int, ...]) -> float:
    worst = 0.0
    row = math.prod(shape[1:]) * 16 if shape else 16
    step = max(1, _DIFF_BLOCK // max(row, 1))
    if not shape or shape[0] <= step:
        boxes = [full_box(shape)]
    else:
        rest = full_box(shape[1:])
        boxes = [((lo, min(lo + step, shape[0])),) + rest for lo in range(0, shape[0], step)]
    for box in boxes:
        worst = max(worst, _block_diff(va.read_region(name, box), vb.read_region(name, box)))
    return worst


def _wide(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return t.to(torch.complex128)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.to(torch.float32)  # float8 converts to float32, not straight to float64
    return t.to(torch.float64)


def _block_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    if x.dtype == y.dtype and torch.equal(x, y):
        return 0.0
    x, y = _wide(x), _wide(y)
    d = (x - y).abs()
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
    d = torch.nan_to_num(d, nan=math.inf)
    return float(d.max())
