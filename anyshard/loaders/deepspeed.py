"""DeepSpeed checkpoints as logical views: ZeRO-1/2/3 partitions and universal checkpoints.

ZeRO (``engine.save_checkpoint``)::

    ROOT/latest                                               # names the step: global_step3
    ROOT/global_step3/mp_rank_00_model_states.pt              # ZeRO-1/2: one per tp rank
    ROOT/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt   # ZeRO-3: one per (dp, tp) rank
    ROOT/global_step3/[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt

Each optimizer file holds one data-parallel rank's partition of the fp32 master parameters and
of Adam's ``exp_avg`` / ``exp_avg_sq``. ZeRO-1/2 flattens each parameter group into one buffer
padded to a multiple of 2 x dp and gives each rank a contiguous piece (``deepspeed_zero``
spec); ZeRO-3 pads and splits every parameter on its own and concatenates a rank's pieces
(``deepspeed_zero3`` spec). The model-states files record every parameter's shape
(``param_shapes``), so without ``layout`` the view writes the UCL spec of the files from them;
with ``layout`` (and a spec, by default the shipped one for the stage) it reads Megatron-style
tensor-parallel checkpoints too, whose TP split the files do not record.

Universal (``ds_to_universal.py``)::

    ROOT/latest_universal                                     # names the step directory
    ROOT/global_step3_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt

Each file is one whole logical tensor: a dict with ``param`` (ZeRO-1/2 sources, TP merged) or,
from ZeRO-3, a flat tensor shaped by the ``param_shapes`` of the model-states file next to it.

Every file is read with ``torch.load(weights_only=True)``. DeepSpeed's optimizer files also
hold four small objects that this allowlists, under their DeepSpeed names, as inert stand-ins
defined here (plain attribute holders and an ``IntEnum``; none runs code when unpickled):
``LossScaler`` / ``DynamicLossScaler`` (the loss scale), ``ZeroStageEnum`` and
``fragment_address`` (a parameter's start and size in the flat buffer).
"""

from __future__ import annotations

import enum
import io
import re
import threading
from collections.abc import Callable
from typing import Any

import torch

from anyshard.api.views import BaseView, StoredShard
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError, LayoutError
from anyshard.format import storage
from anyshard.geometry.boxes import Box, box_shape, full_box
from anyshard.loaders._shared import checked_region, not_there, rank_grid
from anyshard.loaders.dcp import DCPTensorMetadata
from anyshard.loaders.megatron import MegatronCheckpointView, _Tensor

__all__ = [
    "DeepSpeedUniversalView",
    "DeepSpeedZeroView",
    "looks_like_deepspeed_universal",
    "looks_like_deepspeed_zero",
]

_ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt$")
_Z3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
_STATES = (("fp32", ""), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq"))


# --- reading DeepSpeed's files without running code -----------------------------------------


class _LossScaler:
    """Stands in for DeepSpeed's loss scalers: their attributes only."""


class _ZeroStage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _FragmentAddress:
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""


_STAND_INS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
# torch's allowlist is process-wide state; one DeepSpeed load changes it at a time
_ALLOWLIST_LOCK = threading.Lock()


def _load(path: str, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of one DeepSpeed file, the stand-ins allowed; a local
    file is memory-mapped when ``mmap`` (only the bytes used are read)."""
    try:
        if mmap and not storage.is_url(path):
            local = path[len("file://") :] if path.startswith("file://") else path
            src: Any = local
        else:
            src, mmap = io.BytesIO(storage.read_bytes(path)), False
        with _ALLOWLIST_LOCK, torch.serialization.safe_globals(_STAND_INS):
            return torch.load(src, weights_only=True, mmap=mmap, map_location="cpu")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    except Exception as e:
        raise CorruptCheckpointError(
            f"{path}: not loadable with torch.load(weights_only=True) ({type(e).__name__}: {e})"
        ) from None


def _step_dir(path: str, tracker: str) -> str:
    """``path``, or the step directory its ``tracker`` file (``latest``) names."""
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory")
    file = storage.join(path, tracker)
    if not storage.exists(file):
        return path
    step = storage.read_bytes(file).decode(errors="replace").strip()
    if not step or "/" in step or "\\" in step or step in (".", ".."):
        raise CorruptCheckpointError(f"{file}: {step!r} is not a step directory name")
    out = storage.join(path, step)
    if not storage.exists(out):
        raise CorruptCheckpointError(f"{file}: names {step!r}, which is missing from {path}")
    return out


def _param_shapes(model_states: Any, file: str) -> list[dict[str, tuple[int, ...]]]:
    """The ``param_shapes`` of a model-states file: one ``{name: shape}`` per group."""
    groups = model_states.get("param_shapes") if isinstance(model_states, dict) else None
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(f"{file}: no 'param_shapes' (a list of name -> shape dicts)")
    try:
        return [{str(k): tuple(int(n) for n in v) for k, v in g.items()} for g in groups]
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{file}: malformed 'param_shapes' ({e})") from None


def looks_like_deepspeed_zero(path: str) -> bool:
    """Whether ``path`` (or the step its ``latest`` file names) holds ZeRO optimizer files."""
    try:
        step = _step_dir(path, "latest")
        return any(_ZERO_FILE.match(n) for n in storage.listdir(step))
    except CorruptCheckpointError:  # ``latest`` names no step directory
        return False
    except OSError as e:
        return not_there(path, "a DeepSpeed ZeRO checkpoint", e)


def looks_like_deepspeed_universal(path: str) -> bool:
    """Whether ``path`` (or the step its ``latest_universal`` file names) is a DeepSpeed
    universal checkpoint: a ``zero/`` directory of per-parameter folders."""
    try:
        zero = storage.join(_step_dir(path, "latest_universal"), "zero")
        if storage.exists(storage.join(zero, "optimizer_state.pt")):
            return True
        dirs = [n for n in storage.listdir(zero) if not n.endswith(".pt")][:3]
        return any(storage.exists(storage.join(zero, d, "fp32.pt")) for d in dirs)
    except CorruptCheckpointError:  # ``latest_universal`` names no step directory
        return False
    except OSError as e:
        return not_there(path, "a DeepSpeed universal checkpoint", e)


# --- UCL specs written from param_shapes -----------------------------------------------------


def _quoted(name: str, file: str) -> str:
    if any(c in name for c in '"{}\n\\'):
        raise CorruptCheckpointError(f"{file}: parameter name {name!r} cannot be named in UCL")
    return f'"{name}"'


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _zero12_spec(groups: list[dict[str, tuple]], aligns: list[int], file: str) -> str:
    """ZeRO-1/2 with dp only: per group, the parameters in one buffer, split over dp."""
    rules = ["mesh dp;"]
    for g, (params, align) in enumerate(zip(groups, aligns, strict=True)):
        for local, suffix in (
            ("fp32_flat_groups", ""),
            ("exp_avg", ".exp_avg"),
            ("exp_avg_sq", ".exp_avg_sq"),
        ):
            parts = ",\n    ".join(
                f"{_quoted(n + suffix, file)} {_shape(s)}" for n, s in params.items()
            )
            rules.append(
                f'"{local}.{g}" -> bucket(align={align}, multiple=2 * dp,\n    {parts})\n'
                "  | chunk(0, dp);"
            )
    return "\n".join(rules) + "\n"


def _zero3_spec(groups: list[dict[str, tuple]], file: str) -> str:
    """ZeRO-3 with dp only: every parameter padded and split over dp on its own."""
    params = {n: s for g in groups for n, s in g.items()}
    rules = ["mesh dp;"]
    for local, suffix in (
        ("fp32_flat", ""),
        ("exp_avg", ".exp_avg"),
        ("exp_avg_sq", ".exp_avg_sq"),
    ):
        parts = ",\n    ".join(
            f"{_quoted(n + suffix, file)} {_shape(s)} : flatten() | pad(0, multiple=dp) | chunk(0, dp)"
            for n, s in params.items()
        )
        rules.append(f'"{local}" -> bucket(\n    {parts});')
    return "\n".join(rules) + "\n"


def _alignment(paddings: Any, shapes: dict[str, tuple], file: str) -> int:
    """The start alignment (elements) that gives DeepSpeed's recorded per-parameter paddings."""
    sizes = [_numel(s) for s in shapes.values()]
    if paddings is None or not any(paddings):
        return 1
    for align in (2, 4, 8, 16):
        want, off = [], 0
        for i, n in enumerate(sizes):
            off += n
            pad = 0 if i == len(sizes) - 1 else (-off) % align
            want.append(pad)
            off += pad
        if list(paddings) == want:
            return align
    raise CorruptCheckpointError(
        f"{file}: parameter alignment paddings {list(paddings)} match no start alignment of 2, "
        "4, 8 or 16 elements"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- ZeRO-1/2/3 -------------------------------------------------------------------------------


class DeepSpeedZeroView(MegatronCheckpointView):
    """A logical view of a DeepSpeed ZeRO-1/2/3 checkpoint (same methods as `CheckpointView`):
    the fp32 master parameters ``P`` and Adam's ``P.exp_avg`` / ``P.exp_avg_sq``.

    ``path`` is the checkpoint root (its ``latest`` file names the step) or a ``global_step*``
    directory; dp and tp come from the file names. Without ``layout``, the parameter names,
    groups and shapes come from the model-states files (``param_shapes``), which DeepSpeed
    writes with every checkpoint; this needs tp = 1, since the files do not say how tensor
    parallelism split each parameter. With ``layout`` (the spec's params), ``spec`` (default
    ``deepspeed_zero`` for ZeRO-1/2, ``deepspeed_zero3`` for ZeRO-3) maps the local buffers to
    logical tensors, under tensor parallelism too. ``zero_stage`` is 1, 2 or 3.
    """

    format = "deepspeed-zero"

    def __init__(self, path: str, *, layout: dict[str, int] | None = None, spec: Any = None):
        self.path = _step_dir(path, "latest")
        names, dp, tp = rank_grid(self.path, _ZERO_FILE, "ZeRO optimizer files", ("dp", "tp"))
        entries = storage.listdir(self.path)
        z3_models = sorted(n for n in entries if _Z3_MODEL_FILE.match(n))
        models = z3_models or sorted(n for n in entries if _MODEL_FILE.match(n))
        first = storage.join(self.path, names[(0, 0)])
        data = _load(first, mmap=True)
        osd = self._optimizer_state(data, first)
        self.zero_stage = 3 if "fp32_flat_groups" in osd else int(osd.get("zero_stage", 2))
        self._check_partition_count(osd, names, dp, tp)
        if layout is None and spec is None:
            spec = self._spec_from_files(models, osd, tp, first)
            full = {"dp": dp}
        else:
            if spec is None:
                spec = "deepspeed_zero3" if self.zero_stage == 3 else "deepspeed_zero"
            full = {k: v for k, v in (layout or {}).items() if k not in ("tp", "dp", "pp")}
            full.update(dp=dp, tp=tp)
        self._setup(spec, full, lambda c: names[(c["dp"], c.get("tp", 0))])
        self._loaded = (0, self._locals(data, first))  # rank 0 is dp 0, tp 0

    def _check_partition_count(self, osd: dict, names: dict, dp: int, tp: int) -> None:
        """The files of the last dp ranks are missing when the partition count says so."""
        count = osd.get("partition_count")
        count = count[0] if isinstance(count, (list, tuple)) and count else count
        if not isinstance(count, int) or count <= dp:
            return
        prefix = "bf16_" if names[(0, 0)].startswith("bf16_") else ""
        missing = [
            f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"
            for t in range(tp)
            for d in range(dp, count)
        ]
        raise CorruptCheckpointError(
            f"{self.path}: found {dp * tp} of the {count * tp} ZeRO optimizer files "
            f"(partition_count {count}); missing: {', '.join(missing)}"
        )

    def _spec_from_files(self, models: list[str], osd: dict, tp: int, optim_file: str) -> str:
        if tp > 1:
            raise LayoutError(
                f"{self.path}: tp={tp}, and DeepSpeed's files do not say how tensor parallelism "
                "split each parameter; pass spec= (e.g. 'deepspeed_zero') and layout="
            )
        if not models:
            raise CorruptCheckpointError(
                f"{self.path}: no *_model_states.pt file, whose param_shapes name the parameters; "
                "pass spec= and layout= to read the optimizer files alone"
            )
        file = storage.join(self.path, models[0])
        states = _load(file, mmap=True)
        groups = _param_shapes(states, file)
        dims = states.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("pp_degree", 1)) > 1:
            raise LayoutError(
                f"{file}: pipeline parallel (pp={dims['pp_degree']}); pass spec= and layout="
            )
        if self.zero_stage == 3:
            return _zero3_spec(groups, file)
        paddings = osd.get("param_alignment_paddings") or [None] * len(groups)
        if len(paddings) != len(groups) or len(osd["single_partition_of_fp32_groups"]) != len(
            groups
        ):
            raise CorruptCheckpointError(
                f"{optim_file}: {len(osd['single_partition_of_fp32_groups'])} parameter groups, "
                f"{file} gives {len(groups)}"
            )
        aligns = [_alignment(p, g, optim_file) for p, g in zip(paddings, groups, strict=True)]
        return _zero12_spec(groups, aligns, file)

    @staticmethod
    def _optimizer_state(data: Any, file: str) -> dict:
        osd = data.get("optimizer_state_dict") if isinstance(data, dict) else None
        if not isinstance(osd, dict) or not (
            "fp32_flat_groups" in osd or "single_partition_of_fp32_groups" in osd
        ):
            raise CorruptCheckpointError(
                f"{file}: not a ZeRO optimizer state file (no optimizer_state_dict with "
                "single_partition_of_fp32_groups or fp32_flat_groups)"
            )
        return osd

    def _state(self, rank: int) -> dict:
        with self._lock:
            if self._loaded is not None and self._loaded[0] == rank:
                return self._loaded[1]
        file = storage.join(self.path, *self._files[rank].split("/"))
        local = self._locals(_load(file, mmap=True), file)
        with self._lock:
            self._loaded = (rank, local)
        return local

    def _locals(self, data: Any, file: str) -> dict:
        osd = self._optimizer_state(data, file)
        try:
            if "fp32_flat_groups" in osd:
                return self._zero3_locals(osd)
            return self._zero12_locals(osd)
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{file}: malformed ZeRO optimizer state ({type(e).__name__}: {e})"
            ) from None

    @staticmethod
    def _zero3_locals(osd: dict) -> dict:
        flats = list(osd["fp32_flat_groups"])
        states = osd["optimizer_state_dict"]["state"]
        cat = lambda ts: ts[0] if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
        local = {"fp32_flat": cat(flats)}
        for key in ("exp_avg", "exp_avg_sq"):
            local[key] = cat([states[g][key] for g in range(len(flats))])
        return local

    @staticmethod
    def _zero12_locals(osd: dict) -> dict:
        base = osd["base_optimizer_state"]
        states = base["state"] if isinstance(base, dict) else base  # elastic: a list per group
        paddings = osd.get("group_paddings") or [0] * len(osd["single_partition_of_fp32_groups"])
        local = {}
        for g, flat in enumerate(osd["single_partition_of_fp32_groups"]):
            # DeepSpeed drops the padding at the end of the last rank's partition
            lean, full = flat.numel(), flat.numel() + int(paddings[g])
            pad = lambda t, lean=lean, full=full: (  # noqa: E731
                torch.cat([t.reshape(-1), t.new_zeros(full - lean)])
                if t.numel() == lean < full
                else t
            )
            local[f"fp32_flat_groups.{g}"] = pad(flat)
            local[f"exp_avg.{g}"] = pad(states[g]["exp_avg"])
            local[f"exp_avg_sq.{g}"] = pad(states[g]["exp_avg_sq"])
        return local


# --- universal --------------------------------------------------------------------------------


class DeepSpeedUniversalView(BaseView):
    """A DeepSpeed universal checkpoint (``ds_to_universal.py``'s output) as a lazy view, with
    `CheckpointView`'s methods: each ``zero/<P>/`` folder gives ``P`` (``fp32.pt``) and, when
    present, ``P.exp_avg`` and ``P.exp_avg_sq``, the names `DeepSpeedZeroView` uses.

    ``path`` is the root (its ``latest_universal`` names the step directory) or the step
    directory. A local file is memory-mapped, so a region read touches only its bytes; a
    URL's file is read whole. The last tensor read stays open for the next region of it.
    """

    format = "deepspeed-universal"

    def __init__(self, path: str):
        self.path = _step_dir(path, "latest_universal")
        zero = storage.join(self.path, "zero")
        if not storage.exists(zero):
            raise CheckpointNotFoundError(
                f"{self.path}: no DeepSpeed universal checkpoint (no zero/ directory)"
            )
        self._files: dict[str, str] = {}
        for entry in storage.listdir(zero):
            if entry.endswith(".pt"):  # optimizer_state.pt: param groups, no tensors of ours
                continue
            present = set(storage.listdir(storage.join(zero, entry)))
            for state, suffix in _STATES:
                if f"{state}.pt" in present:
                    self._files[entry + suffix] = f"zero/{entry}/{state}.pt"
        if not self._files:
            raise CorruptCheckpointError(f"{zero}: no parameter folder with an fp32.pt")
        self._lock = threading.Lock()
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._param_shapes: dict[str, tuple[int, ...]] | None = None
        self._last: tuple[str, torch.Tensor] | None = None

    def close(self) -> None:
        self._last = None

    def keys(self) -> list[str]:
        return sorted(self._files)

    def value_keys(self) -> list[str]:
        return []

    def get_value(self, name: str) -> Any:
        raise KeyError(f"{self.path}: no JSON value named {name!r}")

    @property
    def values(self) -> dict[str, Any]:
        return {}

    def _model_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes from the model-states file ``ds_to_universal`` copies next to ``zero/``."""
        if self._param_shapes is None:
            names = sorted(
                n
                for n in storage.listdir(self.path)
                if _Z3_MODEL_FILE.match(n) or _MODEL_FILE.match(n)
            )
            shapes: dict[str, tuple[int, ...]] = {}
            if names:
                file = storage.join(self.path, names[0])
                for g in _param_shapes(_load(file, mmap=True), file):
                    shapes.update(g)
            self._param_shapes = shapes
        return self._param_shapes

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        with self._lock:
            if self._last is not None and self._last[0] == name:
                return self._last[1]
        file = storage.join(self.path, *self._files[name].split("/"))
        data = _load(file, mmap=True)
        t = data.get("param") if isinstance(data, dict) else data
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(
                f"{file}: neither a tensor nor a dict with a 'param' tensor"
            )
        if not isinstance(data, dict):  # from ZeRO-3: flat, shaped by param_shapes
            param = name.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")
            shape = self._model_param_shapes().get(param)
            if shape is not None and tuple(t.shape) != shape:
                if t.numel() != _numel(shape):
                    raise CorruptCheckpointError(
                        f"{file}: {t.numel()} elements, the model states give {param!r} the shape "
                        f"{list(shape)}"
                    )
                t = t.reshape(shape)
        with self._lock:
            self._last = (name, t)
            self._shapes[name] = (tuple(t.shape), t.dtype)
        return t

    def _shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self._shapes:
            self._tensor(name)
        return self._shapes[name]

    def _entry(self, name: str) -> _Tensor:
        return _Tensor(*self._shape_dtype(name), ())

    def metadata(self, name: str) -> DCPTensorMetadata:
        shape, dtype = self._shape_dtype(name)
        shard = StoredShard(-1, self._files[name], {}, (full_box(shape),))
        return DCPTensorMetadata(name, shape, dtype, (shard,))

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._tensor(name)
        box = checked_region(name, box, tuple(t.shape))
        src = t[tuple(slice(lo, hi) for lo, hi in box)]
        if out is None:
            return src.clone()
        out.copy_(src.reshape(box_shape(box)))
        return out
