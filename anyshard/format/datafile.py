"""Data files: plain safetensors files, one per writing rank, with per-shard crc32c checksums.

The file is written straight from tensor memory (no serialised copy of the tensors is built):
an 8-byte little-endian header size, the JSON header padded with spaces to a multiple of 8,
then each shard's bytes back to back. The header's ``__metadata__["anyshard"]`` is a JSON
string holding the format version and the crc32c of every shard.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import torch

from anyshard.errors import CorruptCheckpointError, FormatVersionError
from anyshard.format import storage, strict_json
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.manifest import Manifest
from anyshard.format.pool import io_pool

__all__ = [
    "DATAFILE_VERSION",
    "DataFileHeader",
    "ShardEntry",
    "data_path",
    "read_headers",
    "read_header",
    "tensor_bytes",
    "write_datafile",
]

DATAFILE_VERSION = 1
_FIRST_READ = 64 * 1024
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """Where one stored shard's bytes lie in a data file (absolute byte offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class DataFileHeader:
    path: str
    shards: dict[str, ShardEntry]
    file_size: int | None = None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    # as_strided, not reshape: a contiguous tensor may still carry odd strides on size-1 dims
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    if flat.dtype is not torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _checksum(mv: memoryview) -> int:
    return crc32c.crc32c(mv)


def write_datafile(
    path: str, shards: Sequence[tuple[str, torch.Tensor]], *, threads: int = 4
) -> int:
    """Write ``shards`` (contiguous CPU tensors) into a new safetensors file; returns its size."""
    views = [tensor_bytes(t) for _, t in shards]
    pool = io_pool(threads)
    crcs = list(pool.map(_checksum, views))
    header: dict[str, object] = {}
    offset = 0
    for (name, t), mv in zip(shards, views, strict=True):
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + mv.nbytes],
        }
        offset += mv.nbytes
    meta = {
        "format_version": DATAFILE_VERSION,
        "crc32c": {name: c for (name, _), c in zip(shards, crcs, strict=True)},
    }
    header["__metadata__"] = {"format": "pt", "anyshard": json.dumps(meta, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with storage.open_writer(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for mv in views:
            if mv.nbytes:
                f.write(mv)
    return 8 + len(raw) + offset


def read_header(path: str) -> DataFileHeader:
    """Parse a data file's header; raises `CorruptCheckpointError` naming the file on any defect."""
    try:
        with storage.FileReader(path) as r:
            prefix = r.read_prefix(_FIRST_READ)  # most headers fit: one read (one GET) per file
            if len(prefix) < 8:
                raise EOFError(f"expected 8 bytes at offset 0, the file has {len(prefix)}")
            (n,) = struct.unpack("<Q", prefix[:8])
            if n > _MAX_HEADER:
                raise CorruptCheckpointError(
                    f"{path}: header size {n} is not plausible (at most {_MAX_HEADER}); the file is "
                    "corrupt or not a safetensors file"
                )
            if 8 + n <= len(prefix):
                raw = prefix[8 : 8 + n]
            else:
                raw = bytearray(n)
                r.read_into(8, memoryview(raw))
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: data file is missing; the checkpoint was copied incompletely or files were deleted"
        ) from None
    except EOFError as e:
        raise CorruptCheckpointError(
            f"{path}: data file is truncated inside its header ({e}); the checkpoint was copied "
            "incompletely. Restore the file or load an earlier step"
        ) from None
    try:
        header = strict_json.loads(bytes(raw))
        meta = strict_json.loads(header.pop("__metadata__")["anyshard"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{path}: not an anyshard data file (bad header: {type(e).__name__}: {e})"
        ) from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != DATAFILE_VERSION:
        if type(version) is int:
            raise FormatVersionError(
                f"{path}: data file format_version {version} is not one this anyshard reads "
                f"({DATAFILE_VERSION}); upgrade anyshard to read it"
            )
        raise CorruptCheckpointError(
            f"{path}: not an anyshard data file (format_version {version!r})"
        )
    return DataFileHeader(path=path, shards=_shard_entries(path, header, meta, 8 + n))


def _shard_entries(path: str, header: dict, meta: dict, base: int) -> dict[str, ShardEntry]:
    """The header's tensor entries, checked: known dtype, whole sizes, bytes that fit the shape."""
    shards: dict[str, ShardEntry] = {}
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            crc = meta["crc32c"][name]
            ok = (
                dtype in ST_TO_DTYPE
                and all(type(x) is int and x >= 0 for x in (*shape, begin, end, crc))
                and end - begin == math.prod(shape) * ST_TO_DTYPE[dtype].itemsize
            )
        except (KeyError, TypeError, ValueError) as ex:
            raise CorruptCheckpointError(
                f"{path}: the header entry of {name!r} is malformed ({type(ex).__name__}: {ex}); "
                "the file is corrupt"
            ) from None
        if not ok:
            raise CorruptCheckpointError(
                f"{path}: the header entry of {name!r} is inconsistent (dtype {dtype!r}, shape "
                f"{list(shape)}, data_offsets {[begin, end]}); the file is corrupt"
            )
        shards[name] = ShardEntry(
            dtype=dtype, shape=shape, start=base + begin, stop=base + end, crc32c=crc
        )
    return shards


def data_path(path: str, manifest: Manifest, rank: int) -> str:
    """The data file of ``rank`` in the checkpoint at ``path``."""
    return storage.join(path, *manifest.files[rank].split("/"))


def read_headers(
    path: str, manifest: Manifest, ranks, *, threads: int = 16
) -> dict[int, DataFileHeader]:
    """Headers of the data files of ``ranks``, read in parallel."""
    ranks = sorted(set(ranks))
    for r in ranks:
        if r not in manifest.files:
            raise CorruptCheckpointError(
                f"{path}: the manifest names no data file for rank {r}, whose shards are needed"
            )
    if len(ranks) <= 1:
        return {r: read_header(data_path(path, manifest, r)) for r in ranks}
    pool = io_pool(threads)
    return dict(
        zip(
            ranks, pool.map(lambda r: read_header(data_path(path, manifest, r)), ranks), strict=True
        )
    )
