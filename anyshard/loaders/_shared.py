"""What the foreign-format readers and the writers share: region and file-name checks, rank
grids of per-rank files, and the vocabulary of every writer (the source's items, name
selection, sizes, dtypes, progress and reports)."""

from __future__ import annotations

import math
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from anyshard.errors import AnyshardError, CorruptCheckpointError, StorageError
from anyshard.format import storage
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.geometry.boxes import Box

__all__ = [
    "ExportItem",
    "ExportReport",
    "Progress",
    "check_file_name",
    "checked_region",
    "export_items",
    "is_absent",
    "not_there",
    "parse_dtype",
    "parse_size",
    "rank_grid",
    "select_names",
    "split_path",
]

# --- readers ------------------------------------------------------------------------------------


def is_absent(e: BaseException) -> bool:
    """Whether ``e`` says only that a file or directory is not there (missing, or a file where
    a directory was expected, or the reverse), itself or as the cause of a `StorageError`."""
    for _ in range(8):
        if not isinstance(e, StorageError) or e.__cause__ is None:
            break
        e = e.__cause__
    return isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError))


def not_there(path: str, what: str, e: OSError) -> bool:
    """A format detector's answer when looking into ``path`` raised ``e``: False (``path``
    does not hold ``what``) where ``e`` says a file is not there; any other error (access
    denied, an I/O error) is no answer, and raises a `StorageError` naming ``path``."""
    if is_absent(e):
        return False
    raise StorageError(
        f"{path}: could not tell whether it holds {what}: {e}; check that the path is "
        "readable (permissions, credentials) and the storage healthy"
    ) from e


def checked_region(name: str, box, shape: tuple[int, ...]) -> Box:
    """``box`` as ints; an IndexError naming the tensor when it is not inside ``shape``."""
    box = tuple((int(lo), int(hi)) for lo, hi in box)
    if len(box) != len(shape) or any(
        not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True)
    ):
        raise IndexError(f"{name}: region {list(box)} is outside its shape {list(shape)}")
    return box


def check_file_name(name: object, where: str) -> str:
    """A file an index names: a plain relative POSIX path, never outside the checkpoint."""
    if not (isinstance(name, str) and _inside(name)):
        raise CorruptCheckpointError(
            f"{where}: names the file {name!r}, which is not a relative path inside the "
            "checkpoint; the index is corrupt or hostile"
        )
    return name


def _inside(name: str) -> bool:
    return (
        name != ""
        and "://" not in name
        and not name.startswith("/")
        and "\\" not in name
        and not any(ord(ch) < 32 or ord(ch) == 127 for ch in name)
        and all(p not in ("", ".", "..") for p in name.split("/"))
    )


def split_path(path: str) -> tuple[str, str]:
    if storage.is_url(path):
        return posixpath.dirname(path), posixpath.basename(path)
    return os.path.dirname(path), os.path.basename(path)


def rank_grid(path: str, pattern: re.Pattern, what: str, dims: tuple[str, str]):
    """The entries of ``path`` whose names match ``pattern`` (two integer groups, the second
    optional), by (a, b); and the grid's two sizes, checked complete."""
    found = {}
    for entry in storage.listdir(path):
        m = pattern.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m:
            found[(int(m.group(1)), int(m.group(2) or 0))] = m.group(0)
    if not found:
        raise CorruptCheckpointError(f"{path}: no {what}")
    a = 1 + max(i for i, _ in found)
    b = 1 + max(j for _, j in found)
    if len(found) != a * b:
        raise CorruptCheckpointError(
            f"{path}: found {len(found)} of the {a * b} {what} of {dims[0]}={a}, {dims[1]}={b}"
        )
    return found, a, b


# --- writers ------------------------------------------------------------------------------------

# (tensors done, tensors in all, bytes done, bytes in all): called after each tensor.
Progress = Callable[[int, int, int, int], None]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What a writer wrote: ``files`` relative to ``path``; ``num_tensors`` of the source's
    tensors in ``num_bytes`` bytes as stored (progress counts stored tensors: under a spec, a
    rank's local tensors)."""

    path: str
    format: str  # "huggingface-safetensors" or "anyshard"
    files: tuple[str, ...]
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class ExportItem:
    target: str  # name written
    source: str  # name in the view
    shape: tuple[int, ...]
    src_dtype: torch.dtype
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (10^9), ``2GiB`` (2^30), ``500MB``, ``123`` (as transformers reads
    ``max_shard_size``).

    >>> parse_size("5GB"), parse_size("1KiB"), parse_size(100)
    (5000000000, 1024, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if m is None:
            raise AnyshardError(
                f"{size!r} is not a size; write e.g. 5GB, 500MB or 2GiB (or a number of bytes)"
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    if value <= 0:
        raise AnyshardError(f"a shard size must be positive, got {size!r}")
    return value


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``bf16``, ``fp16``, ``fp32`` (or their torch names, or a `torch.dtype`)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise AnyshardError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32")
    return _DTYPES[key]


def select_names(
    names: Iterable[str],
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
) -> dict[str, str]:
    """Written name -> source name: the names ``only`` finds (``re.search``), each rewritten by
    every ``(pattern, replacement)`` of ``rename`` in turn (``re.sub``).

    >>> select_names(["a.w", "b.w", "c.b"], only=r"\\.w$", rename=[(r"^a\\.", "x.")])
    {'x.w': 'a.w', 'b.w': 'b.w'}
    """
    pattern = _regex(only) if only is not None else None
    rules = list(rename.items()) if isinstance(rename, Mapping) else list(rename or ())
    subs = [(_regex(a), b) for a, b in rules]
    out: dict[str, str] = {}
    clashes: list[str] = []
    for src in names:
        if pattern is not None and not pattern.search(src):
            continue
        dst = src
        for rx, repl in subs:
            try:
                dst = rx.sub(repl, dst)
            except re.error as e:
                raise AnyshardError(f"rename {rx.pattern!r} -> {repl!r}: {e}") from None
        if dst in out:
            clashes.append(f"{out[dst]!r} and {src!r} both become {dst!r}")
        out[dst] = src
    if clashes:
        raise AnyshardError(
            "the renames give two tensors one name: " + "; ".join(sorted(clashes)[:10])
        )
    return out


def _regex(p: str | re.Pattern) -> re.Pattern:
    if isinstance(p, re.Pattern):
        return p
    try:
        return re.compile(p)
    except re.error as e:
        raise AnyshardError(f"{p!r} is not a regular expression ({e})") from None


def export_items(view, only, rename, dtype) -> list[ExportItem]:
    cast = parse_dtype(dtype)
    items = []
    for target, source in select_names(view.keys(), only, rename).items():
        s = view.get_slice(source)
        src_dtype = ST_TO_DTYPE[s.get_dtype()]
        out = cast if cast is not None and src_dtype.is_floating_point else src_dtype
        items.append(ExportItem(target, source, tuple(s.get_shape()), src_dtype, out))
    return items
