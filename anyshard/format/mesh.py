"""A device mesh as a checkpoint records it: named dims with sizes, and the global rank at each
coordinate (`MeshEntry`). Manifests list the meshes their tensors are stored over; layouts of
live tensors are described by the same record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping as MappingType
from dataclasses import dataclass
from typing import Any

import numpy as np

from anyshard.format.strict_json import FieldError, field_dict, field_int, field_list, field_name

__all__ = ["MeshEntry"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshEntry:
    """A device mesh: named dims with sizes, and the global rank at each coordinate.

    Ranks are ``offset + sum(coord * stride)`` when ``strides`` is given (every mesh cut from a
    row-major world is), else listed in ``ranks`` in row-major order of the coordinates.
    """

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    offset: int = 0
    strides: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes) or len(set(self.dims)) != len(self.dims):
            raise ValueError(f"mesh dims {self.dims} and sizes {self.sizes} do not match")
        if (self.strides is None) == (self.ranks is None):
            raise ValueError("a mesh needs exactly one of strides or ranks")
        if self.ranks is not None and len(self.ranks) != math.prod(self.sizes):
            raise ValueError(f"mesh of sizes {self.sizes} lists {len(self.ranks)} ranks")
        if self.strides is not None and len(self.strides) != len(self.sizes):
            raise ValueError(f"mesh of sizes {self.sizes} has strides {self.strides}")

    @classmethod
    def from_rank_grid(
        cls, dims: tuple[str, ...], sizes: tuple[int, ...], ranks: list[int]
    ) -> MeshEntry:
        """Describe a mesh from its ranks in row-major order, compactly when they are affine."""
        strides = []
        for d in range(len(sizes)):
            step = math.prod(sizes[d + 1 :])
            strides.append(ranks[step] - ranks[0] if sizes[d] > 1 else 0)
        entry = cls(dims=dims, sizes=sizes, offset=ranks[0], strides=tuple(strides))
        if all(entry.rank_at_index(i) == r for i, r in enumerate(ranks)):
            return entry
        return cls(dims=dims, sizes=sizes, ranks=tuple(ranks))

    @classmethod
    def row_major(cls, sizes: MappingType[str, int]) -> MeshEntry:
        """Ranks in row-major order of the dims of ``sizes`` (the last varies fastest), as a
        UCL spec's mesh numbers them."""
        strides = []
        step = 1
        for n in reversed(list(sizes.values())):
            strides.append(step if n > 1 else 0)
            step *= n
        return cls(
            dims=tuple(sizes),
            sizes=tuple(sizes.values()),
            offset=0,
            strides=tuple(reversed(strides)),
        )

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.dims, self.sizes, strict=True))

    def rank_at_index(self, flat: int) -> int:
        coords = []
        for n in reversed(self.sizes):
            coords.append(flat % n)
            flat //= n
        return self.rank(dict(zip(self.dims, reversed(coords), strict=True)))

    def rank(self, coords: MappingType[str, int]) -> int:
        """Global rank at ``coords``; dims missing from ``coords`` take coordinate 0."""
        c = [coords.get(d, 0) for d in self.dims]
        if self.strides is not None:
            return self.offset + sum(i * s for i, s in zip(c, self.strides, strict=True))
        flat = 0
        for i, n in zip(c, self.sizes, strict=True):
            flat = flat * n + i
        return self.ranks[flat]

    def rank_grid(self) -> np.ndarray:
        """The global rank at every coordinate, as an array of shape ``sizes``."""
        if self.ranks is not None:
            return np.array(self.ranks, dtype=np.int64).reshape(self.sizes)
        grid = np.full((), self.offset, dtype=np.int64)
        for d, (n, s) in enumerate(zip(self.sizes, self.strides, strict=True)):
            shape = [1] * len(self.sizes)
            shape[d] = n
            grid = grid + (np.arange(n, dtype=np.int64) * s).reshape(shape)
        return np.broadcast_to(grid, self.sizes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dims": list(self.dims), "sizes": list(self.sizes)}
        if self.strides is not None:
            out["offset"], out["strides"] = self.offset, list(self.strides)
        else:
            out["ranks"] = list(self.ranks)
        return out

    @classmethod
    def from_json(cls, j: MappingType[str, Any]) -> MeshEntry:
        """From its JSON, every field checked (`FieldError`)."""
        j = field_dict(j, "a mesh")
        dims = tuple(field_name(d, "a mesh dim") for d in field_list(j["dims"], "mesh dims"))
        sizes = tuple(field_int(n, "a mesh size", 1) for n in field_list(j["sizes"], "mesh sizes"))
        strides = ranks = None
        if "strides" in j:
            strides = tuple(
                field_int(x, "a mesh stride", lo=-(2**62))
                for x in field_list(j["strides"], "mesh strides")
            )
        if "ranks" in j:
            ranks = tuple(field_int(r, "a mesh rank") for r in field_list(j["ranks"], "mesh ranks"))
        offset = field_int(j.get("offset", 0), "the mesh offset")
        try:
            return cls(dims=dims, sizes=sizes, offset=offset, strides=strides, ranks=ranks)
        except ValueError as e:
            raise FieldError(str(e)) from None

    def rank_range(self) -> tuple[int, int]:
        """The lowest and highest global rank of the mesh."""
        if self.ranks is not None:
            return min(self.ranks), max(self.ranks)
        lo = hi = self.offset
        for n, s in zip(self.sizes, self.strides, strict=True):
            lo, hi = lo + (n - 1) * min(s, 0), hi + (n - 1) * max(s, 0)
        return lo, hi
