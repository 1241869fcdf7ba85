"""The cluster a plan is priced on (`Hardware`): one device's peak and memory, and the links
between devices inside a node and across nodes. Named presets (`PRESETS`) carry the source of
every number; `load_hardware` returns a preset or reads a user's JSON file of the same fields.

    >>> h = load_hardware("h100-sxm")
    >>> h.peak_flops / 1e12, h.intra_node_bytes_per_s / 1e9, h.inter_node_bytes_per_s / 1e9
    (989.0, 450.0, 50.0)
    >>> sorted(PRESETS)
    ['a100-80gb', 'h100-sxm']
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "Hardware", "load_hardware"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """A cluster of identical nodes. Bandwidths are per device and one direction (what one
    device can send while it receives as much); latencies are a collective step's fixed cost on
    that link. ``oversubscription`` divides the inter-node bandwidth of traffic that leaves a
    pod (1: a full fat tree). ``sources`` names where each number comes from, by field."""

    name: str
    peak_flops: float  # BF16 dense tensor-core FLOP/s of one device
    memory_bytes: float  # one device's memory
    hbm_bytes_per_s: float  # one device's memory bandwidth
    devices_per_node: int
    intra_node_bytes_per_s: float  # per device, one direction (NVLink)
    inter_node_bytes_per_s: float  # per device, one direction (its share of the node's NICs)
    intra_node_latency_s: float
    inter_node_latency_s: float
    oversubscription: float = 1.0
    pod_nodes: int = 32  # nodes on one full-rate fabric; traffic between pods is oversubscribed
    sources: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name = {self.name!r} (expected a non-empty string)")
        for f in _NUMBERS:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problems.append(f"{f} = {value!r} (expected a number > 0)")
        dpn = self.devices_per_node
        if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
            problems.append(f"devices_per_node = {dpn!r} (expected an int >= 1)")
        pod = self.pod_nodes
        if isinstance(pod, bool) or not isinstance(pod, int) or pod < 1:
            problems.append(f"pod_nodes = {pod!r} (expected an int >= 1)")
        over = self.oversubscription
        if isinstance(over, bool) or not isinstance(over, int | float) or over < 1:
            problems.append(f"oversubscription = {over!r} (expected a number >= 1)")
        if not isinstance(self.sources, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            problems.append("sources is not a mapping of field names to strings")
        if problems:
            raise ValueError(f"hardware {self.name!r}: " + "; ".join(sorted(problems)))

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (what `from_json` and `load_hardware` read)."""
        return {**dataclasses.asdict(self), "sources": dict(self.sources)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "hardware") -> Hardware:
        """A `Hardware` from JSON values; unknown and missing fields are named all at once.

        >>> Hardware.from_json({"name": "x", "peak_flops": 1e12}, where="x.json")
        Traceback (most recent call last):
        ...
        ValueError: x.json: missing fields devices_per_node, hbm_bytes_per_s, inter_node_bytes_per_s, inter_node_latency_s, intra_node_bytes_per_s, intra_node_latency_s, memory_bytes
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a JSON object, found {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {"oversubscription", "pod_nodes", "sources"}
        problems = []
        if unknown := sorted(set(data) - names):
            problems.append(
                f"unknown fields {', '.join(unknown)} (known: {', '.join(sorted(names))})"
            )
        if missing := sorted(names - optional - set(data)):
            problems.append(f"missing fields {', '.join(missing)}")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


_NUMBERS = (
    "peak_flops",
    "memory_bytes",
    "hbm_bytes_per_s",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
)

_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com, A100 80GB SXM column)"
_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com, H100 SXM column)"
_NCCL_LATENCY = (
    "assumption: NCCL's own tuning model (src/graph/tuning.cc, hwLat, ring/Simple) prices one "
    "ring step at 3.4 us on NVLink and 9.6 us on the network; typical, not measured here"
)

_POD = (
    "NVIDIA DGX SuperPOD reference architecture: a scalable unit of 32 DGX nodes on one "
    "non-blocking leaf/spine fabric"
)

PRESETS: dict[str, Hardware] = {
    "a100-80gb": Hardware(
        name="a100-80gb",
        peak_flops=312e12,
        memory_bytes=80e9,
        hbm_bytes_per_s=2.039e12,
        devices_per_node=8,
        intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9,
        intra_node_latency_s=3.4e-6,
        inter_node_latency_s=9.6e-6,
        sources={
            "peak_flops": f"{_A100_SHEET}: BF16 tensor core 312 TFLOPS dense (624 sparse); "
            "SC'21 states the same peak",
            "memory_bytes": f"{_A100_SHEET}: 80 GB HBM2e",
            "hbm_bytes_per_s": f"{_A100_SHEET}: 2,039 GB/s",
            "devices_per_node": "NVIDIA DGX A100 user guide: 8 A100 on NVSwitch (SC'21's Selene)",
            "intra_node_bytes_per_s": f"{_A100_SHEET}: NVLink 600 GB/s, both directions "
            "together, so 300 GB/s each way",
            "inter_node_bytes_per_s": "DGX A100 / SC'21 Selene: 8 x 200 Gb/s HDR InfiniBand "
            "per node, one per GPU: 200 Gb/s = 25 GB/s each way",
            "intra_node_latency_s": _NCCL_LATENCY,
            "inter_node_latency_s": _NCCL_LATENCY,
            "oversubscription": "assumption: a full fat tree (Selene's is non-blocking)",
            "pod_nodes": _POD,
        },
    ),
    "h100-sxm": Hardware(
        name="h100-sxm",
        peak_flops=989e12,
        memory_bytes=80e9,
        hbm_bytes_per_s=3.35e12,
        devices_per_node=8,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        intra_node_latency_s=3.4e-6,
        inter_node_latency_s=9.6e-6,
        sources={
            "peak_flops": f"{_H100_SHEET}: BF16 tensor core 1,979 TFLOPS with sparsity, 989 dense",
            "memory_bytes": f"{_H100_SHEET}: 80 GB HBM3",
            "hbm_bytes_per_s": f"{_H100_SHEET}: 3.35 TB/s",
            "devices_per_node": "NVIDIA DGX H100 user guide: 8 H100 SXM on NVSwitch",
            "intra_node_bytes_per_s": f"{_H100_SHEET}: NVLink 900 GB/s, both directions "
            "together, so 450 GB/s each way",
            "inter_node_bytes_per_s": "DGX H100: 8 x 400 Gb/s ConnectX-7 (InfiniBand NDR or "
            "RoCE), one per GPU: 400 Gb/s = 50 GB/s each way",
            "intra_node_latency_s": _NCCL_LATENCY,
            "inter_node_latency_s": _NCCL_LATENCY,
            "oversubscription": "assumption: a full fat tree",
            "pod_nodes": _POD,
        },
    ),
}


def load_hardware(name_or_path: str) -> Hardware:
    """The preset of that name, or the `Hardware` in the JSON file at that path (the fields of
    `Hardware`; ``oversubscription``, ``pod_nodes`` and ``sources`` may be left out).

    >>> load_hardware("b200")
    Traceback (most recent call last):
    ...
    ValueError: hardware 'b200' is neither a preset (a100-80gb, h100-sxm) nor a readable JSON file: [Errno 2] No such file or directory: 'b200'
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    try:
        with open(name_or_path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        presets = ", ".join(sorted(PRESETS))
        raise ValueError(
            f"hardware {name_or_path!r} is neither a preset ({presets}) nor a readable "
            f"JSON file: {e}"
        ) from None
    return Hardware.from_json(data, where=name_or_path)
