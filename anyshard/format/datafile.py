"""Data files: plain safetensors files, one per writing rank, with crc32c checksums of every
block of every shard, and, when the save asked for it (an incremental save), each shard's
SHA-256: the content hash by which a later save recognises an unchanged shard and references it.

The file is written straight from tensor memory (no serialised copy of the tensors is built):
an 8-byte little-endian header size, the JSON header padded with spaces to a multiple of 8,
then each shard's bytes back to back. The header's ``__metadata__["anyshard"]`` is a JSON
string holding the format version and, for each shard, its checksum block size and the crc32c
of each block (`block_size`): a read of part of a shard reads whole blocks and verifies them.
Version 1 files hold one crc32c per shard, and stay readable.

Since version 3 the header is sealed: it begins ``{"__metadata__":{"anyshard_crc32c":"<crc>"``
where <crc> is the crc32c of the header's JSON as written with "00000000" there (the padding
after it excluded; `anyshard.format.checksum.seal`), checked before anything in it is parsed.
Versions 1 and 2 (unsealed) still load, with a warning that their header is unverified.

A shard whose rows (its last dim) are long enough also carries checksum tiles: each checksum
block cut into column blocks, the crc32c of each tile recorded (`tile_count`, `tile_crcs`), so
that a verified read of some columns reads only the tiles it needs. Version 3 tiles 2-d shards;
version 4 tiles shards of any rank of at least 2, a shard of more dims tiled as the 2-d array of
its rows (every dim but the last flattened). A writer records the lowest version that describes
the file: 4 only where a shard of 3 or more dims has tiles, so a file without one stays
byte-identical to what version 3 wrote.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from anyshard.errors import ChecksumError, CorruptCheckpointError, FormatVersionError
from anyshard.format import storage, strict_json
from anyshard.format.checksum import check_seal, is_digest, seal
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.manifest import Manifest, is_sha256
from anyshard.format.pool import io_pool

__all__ = [
    "BLOCK_BYTES",
    "DATAFILE_VERSION",
    "DataFileHeader",
    "ShardEntry",
    "block_crcs",
    "block_size",
    "tile_count",
    "tile_crcs",
    "shard_tile_crcs",
    "header_bytes",
    "data_path",
    "read_headers",
    "read_header",
    "tensor_bytes",
    "write_datafile",
]

# 1: one crc32c per shard; 2: one per block of each shard; 3: and the header's own (sealed),
# and tiles of 2-d shards; 4: tiles of shards of any rank (written only where one has them)
DATAFILE_VERSION = 4
KNOWN_DATAFILE_VERSIONS = (1, 2, 3, 4)
SEALED_SINCE = 3
TILES_ND_SINCE = 4
_SEAL_PREFIX = b'{"__metadata__":{"anyshard_crc32c":"'

BLOCK_BYTES = 256 << 10  # a checksum block's bytes, at most (unless one row is longer)
WHOLE_BELOW = 64 << 10  # a shard smaller than this is one block
TILE_COUNTS = (16, 8, 4, 2)  # column blocks of a tiled shard: splits 2..16 ways fall on edges
TILE_MIN_BYTES = 512  # a tile's row segment, at least: shorter ones cost more than they save
# a tiled shard's rows, at least: a split of a narrower row skips under a page of it, which a
# local read would not skip (anyshard.reshard.planner.TILE_SKIP_LOCAL): tiles would cost the
# save their checksums and save no read
TILE_MIN_ROW = 8 << 10
# bytes made tile-major at a time, to checksum them while in cache: 256 KiB (one checksum
# block) took 0.044 CPU s for 256 MiB here, 1 MiB 0.049 (a 2 MiB L2 holds source and copy)
_TILE_CHUNK = 256 << 10
_FIRST_READ = 64 * 1024
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """Where one stored shard's bytes lie in a data file (absolute byte offsets), and the
    crc32c of each of its checksum blocks: bytes ``[start + k * block, ...)``, ``block`` bytes
    each, the last one possibly shorter (a version-1 file has one block, the whole shard)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    block: int
    crcs: tuple[int, ...]
    digest: str | None = None  # content hash, "ALGORITHM:HEX", when the writer recorded it
    # a tiled shard (version 3: 2 dims; version 4: 2 or more, its rows every dim but the last
    # flattened): its last dim in ``tiles`` column blocks, and the crc32c of each tile (block
    # k's rows x column block c, its bytes in C order) at ``k * tiles + c``
    tiles: int = 1
    tile_crcs: tuple[int, ...] = ()

    def block_span(self, k: int) -> tuple[int, int]:
        """Absolute bytes ``[a, b)`` of block ``k``."""
        a = self.start + k * self.block
        return a, min(a + self.block, self.stop)


def block_size(shape: Sequence[int], itemsize: int) -> int:
    """The checksum block of a shard of ``shape``: bands of whole rows (dim 0), a power of two
    of them that divides an eighth of the rows, so that splits of dim 0 up to 8 ways read whole
    blocks; at most `BLOCK_BYTES` unless one row is longer. A small shard is one block."""
    nbytes = math.prod(shape) * itemsize
    if not shape or nbytes <= WHOLE_BELOW:
        return max(nbytes, 1)
    row = nbytes // shape[0]
    rows = max(1, min(BLOCK_BYTES // row, shape[0] // 8))
    return (1 << (rows.bit_length() - 1)) * row


def tile_count(shape: Sequence[int], itemsize: int) -> int:
    """The column blocks of a shard's checksum tiles (its last dim, cut across every row): the
    most of `TILE_COUNTS` that divides its columns into segments of at least `TILE_MIN_BYTES`;
    1 (no tiles) for a shard of under 2 dims, of one block, or of rows under `TILE_MIN_ROW`
    bytes. A shard of 3 or more dims has tiles since data file version 4."""
    nbytes = math.prod(shape) * itemsize
    if len(shape) < 2 or nbytes <= WHOLE_BELOW or shape[-1] * itemsize < TILE_MIN_ROW:
        return 1
    cols = shape[-1]
    return next(
        (c for c in TILE_COUNTS if cols % c == 0 and cols // c * itemsize >= TILE_MIN_BYTES), 1
    )


def tile_crcs(
    rows: torch.Tensor | np.ndarray, band: int, width: int, bands: list[int] | None = None
) -> list[int]:
    """The crc32c of every tile of ``rows``, a 2-d uint8 array (rows of bytes, each row
    contiguous, whole column blocks of ``width`` bytes), cut into bands of ``band`` rows (the
    last one possibly shorter): row-major, band by band. A few bands at a time are made
    tile-major by one numpy copy into a buffer that stays in cache, then each tile is one
    crc32c call. Given ``bands`` (``rows`` contiguous), the crc32c of each band's bytes is
    appended to it on the way, each band just before its copy reads it again from the cache: a
    shard's block checksums, in the same pass.

    The copy is numpy's, on the calling thread: torch's copy spreads over its intra-op threads,
    which on a loaded host (several ranks a host, the save's writer threads) cost 10-30x the
    CPU of the copy itself. Chaining a running crc32c over each tile's row segments in place
    (``crc32c.crc32c(segment, value=running)``) took 0.10-0.16 CPU s for 256 MiB of 1 KiB
    segments here (a Python call a segment), against 0.044 for copy and checksums together.

    What a tiled shard costs over its block checksums alone is the copy and one more crc32c
    pass, both from the cache: 0.014 and 0.020 CPU s for 256 MiB (16 KiB tiles), 0.049 in all
    against 0.018 for the block checksums alone. The block checksums cost nothing measurable
    here (tiles alone took 0.051): each band is read from memory once, by its block checksum,
    and the copy then reads it from the cache, so a format without block checksums for tiled
    shards would save no CPU. Chunks of 2 or 4 bands, or the copy as 8-byte words, measured
    within the noise of this one."""
    a = rows.detach().numpy() if isinstance(rows, torch.Tensor) else rows
    n_rows, n_bytes = a.shape
    if n_rows == 0 or n_bytes == 0:
        return []
    tiles = n_bytes // width
    step = max(1, _TILE_CHUNK // (band * n_bytes)) * band  # rows a copy
    scratch = np.empty(min(step, n_rows) * n_bytes, dtype=np.uint8)
    flat = scratch.data
    crc = crc32c.crc32c
    size = band * width  # a whole band's tile; its views into the scratch made once
    views = [flat[j * size : (j + 1) * size] for j in range(len(flat) // size)]
    out: list[int] = []
    for r in range(0, n_rows, step):
        part = a[r : r + step]
        full, rest = divmod(part.shape[0], band)
        k = full * band
        if bands is not None:
            raw = part.reshape(-1).data
            whole = band * n_bytes  # a block's bytes
            bands += [crc(raw[x : x + whole]) for x in range(0, len(raw), whole)]
        if full:
            np.copyto(
                scratch[: k * n_bytes].reshape(full, tiles, band, width),
                part[:k].reshape(full, band, tiles, width).transpose(0, 2, 1, 3),
            )
            out += map(crc, views[: full * tiles])
        if rest:
            at = k * n_bytes
            np.copyto(
                scratch[at : at + rest * n_bytes].reshape(tiles, rest, width),
                part[k:].reshape(rest, tiles, width).transpose(1, 0, 2),
            )
            tail = rest * width  # a shorter band's tile
            out += [crc(flat[at + j * tail : at + (j + 1) * tail]) for j in range(tiles)]
    return out


def shard_tile_crcs(
    data: memoryview,
    shape: Sequence[int],
    itemsize: int,
    block: int,
    blocks: list[int] | None = None,
) -> list[int]:
    """The tile checksums a writer records for a stored shard of ``shape`` (bytes ``data``, its
    checksum blocks of ``block`` bytes); none for a shard without tiles (`tile_count`). Given
    ``blocks``, its block checksums are appended to it in the same pass (`tile_crcs`)."""
    tiles = tile_count(shape, itemsize)
    if tiles == 1:
        return []
    row = shape[-1] * itemsize
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, row)
    return tile_crcs(rows, block // row, row // tiles, blocks)


def block_crcs(data: memoryview, block: int) -> list[int]:
    """The crc32c of every ``block`` bytes of ``data`` (one, of nothing, when it is empty)."""
    if not data.nbytes:
        return [0]
    return [crc32c.crc32c(data[a : a + block]) for a in range(0, data.nbytes, block)]


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


def header_bytes(
    shards: Sequence[tuple[str, str, tuple[int, ...]]],
    crcs: dict[str, list[int]],
    hashes: dict[str, str] | None = None,
    tiles: dict[str, list[int]] | None = None,
) -> bytes:
    """The JSON header of a data file holding ``shards`` (name, safetensors dtype, shape), back
    to back in that order, with ``crcs[name]`` the crc32c of each checksum block of each and
    ``hashes[name]``, where given, its content hash ("ALGORITHM:HEX")."""
    # first, so that the seal is the header's beginning; `seal` fills the placeholder in
    header: dict[str, object] = {"__metadata__": {"anyshard_crc32c": "00000000"}}
    offset = 0
    blocks = {}
    version = SEALED_SINCE  # the lowest that describes the file: 4 where tiles need it
    for name, code, shape in shards:
        nbytes = math.prod(shape) * ST_TO_DTYPE[code].itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        blocks[name] = {
            "bytes": block_size(shape, ST_TO_DTYPE[code].itemsize),
            "crc32c": crcs[name],
        }
        if hashes and name in hashes:
            blocks[name]["hash"] = hashes[name]
        if tiles and name in tiles:
            blocks[name]["tiles"] = tile_count(shape, ST_TO_DTYPE[code].itemsize)
            blocks[name]["tile_crc32c"] = tiles[name]
            if len(shape) > 2:
                version = TILES_ND_SINCE
    meta = {"format_version": version, "blocks": blocks}
    header["__metadata__"] = {
        "anyshard_crc32c": "00000000",
        "format": "pt",
        "anyshard": json.dumps(meta, separators=(",", ":")),
    }
    return seal(json.dumps(header, separators=(",", ":")).encode(), _SEAL_PREFIX)


def write_datafile(
    path: str,
    shards: Sequence[tuple[str, torch.Tensor]],
    *,
    threads: int = 4,
    hashes: dict[str, str] | None = None,
    spans: dict[str, tuple[int, int]] | None = None,
    crcs_of: dict[str, list[int]] | None = None,
) -> int:
    """Write ``shards`` (contiguous CPU tensors) into a new safetensors file, recording
    ``hashes[name]`` (content hashes) where given; returns its size, and fills ``spans`` (when
    given) with each shard's absolute byte range in the file. ``crcs_of[name]``, where given,
    are the shard's block checksums, computed with its hash in one pass (`digest_and_crcs`)."""
    views = [tensor_bytes(t) for _, t in shards]
    blocks = [block_size(tuple(t.shape), t.element_size()) for _, t in shards]
    known = crcs_of or {}
    todo = [i for i, (name, _) in enumerate(shards) if name not in known]
    tiled = [
        i for i, (_, t) in enumerate(shards) if tile_count(tuple(t.shape), t.element_size()) > 1
    ]
    # one job a shard, largest first, over the pool: block checksums, tile checksums, or both in
    # one pass (a tiled shard whose block checksums are not known yet)
    kinds = {i: 0 for i in todo} | {i: 1 if i not in todo else 2 for i in tiled}
    jobs = sorted(kinds, key=lambda i: -views[i].nbytes)

    def run(i: int) -> tuple[list[int], list[int]]:
        if kinds[i] == 0:
            return block_crcs(views[i], blocks[i]), []
        t, sums = shards[i][1], [] if kinds[i] == 2 else None
        tile_sums = shard_tile_crcs(views[i], tuple(t.shape), t.element_size(), blocks[i], sums)
        return sums or [], tile_sums

    done = dict(zip(jobs, io_pool(threads).map(run, jobs), strict=True))
    crcs = [known[name] if i not in todo else done[i][0] for i, (name, _) in enumerate(shards)]
    tile_sums = {shards[i][0]: done[i][1] for i in tiled}
    layout = [(name, DTYPE_TO_ST[t.dtype], tuple(t.shape)) for name, t in shards]
    raw = header_bytes(
        layout, dict(zip((n for n, _ in shards), crcs, strict=True)), hashes, tile_sums
    )
    offset = sum(mv.nbytes for mv in views)
    raw += b" " * (-len(raw) % 8)
    if spans is not None:
        at = 8 + len(raw)
        for (name, _), mv in zip(shards, views, strict=True):
            spans[name] = (at, at + mv.nbytes)
            at += mv.nbytes
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
            # an object store: one GET that most headers fit in; a local file: the 8-byte
            # length, then exactly the header (no speculative bytes of shard data)
            prefix = r.read_prefix(_FIRST_READ if storage.is_url(path) else 8)
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
    sealed = bytes(raw[: len(_SEAL_PREFIX)]) == _SEAL_PREFIX
    if sealed:  # before anything in it is parsed; the padding after the JSON is not sealed
        if n % 8:  # writers pad to a multiple of 8: the 8-byte length itself was changed
            raise ChecksumError(
                f"{path}: the data file header's length {n} is not a multiple of 8; the file is "
                "corrupt. Restore it from a replica or load an earlier step"
            )
        check_seal(bytes(raw).rstrip(b" "), _SEAL_PREFIX, path, "data file header")
    try:
        header = strict_json.loads(bytes(raw))
        meta = strict_json.loads(header.pop("__metadata__")["anyshard"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{path}: not an anyshard data file (bad header: {type(e).__name__}: {e})"
        ) from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in KNOWN_DATAFILE_VERSIONS or type(version) is not int:
        if type(version) is int:
            raise FormatVersionError(
                f"{path}: data file format_version {version} is not one this anyshard reads "
                f"({', '.join(map(str, KNOWN_DATAFILE_VERSIONS))}); upgrade anyshard to read it"
            )
        raise CorruptCheckpointError(
            f"{path}: not an anyshard data file (format_version {version!r})"
        )
    if (version >= SEALED_SINCE) != sealed:  # the header's beginning was changed
        raise ChecksumError(
            f"{path}: the data file header's checksum is missing or damaged (format_version "
            f"{version}); the file is corrupt. Restore it from a replica or load an earlier step"
        )
    if not sealed:
        warnings.warn(
            f"anyshard: {path} is data file format_version {version}, written before headers "
            "were checksummed: its header loads unverified (the tensors' bytes are verified)",
            stacklevel=2,
        )
    return DataFileHeader(path=path, shards=_shard_entries(path, header, meta, 8 + n, version))


def _blocks_of(
    meta: dict, name: str, version: int, nbytes: int
) -> tuple[int, tuple[int, ...], str | None]:
    """The block size, block checksums and content hash (or None) of shard ``name`` (checked by
    the caller: None also for a malformed hash)."""
    if version == 1:
        return max(nbytes, 1), (meta["crc32c"][name],), None
    entry = meta["blocks"][name]
    if "hash" in entry:  # version 3
        return entry["bytes"], tuple(entry["crc32c"]), entry["hash"]
    if "sha256" in entry:  # version 2: a bare SHA-256
        sha = entry["sha256"]
        return entry["bytes"], tuple(entry["crc32c"]), f"sha256:{sha}" if is_sha256(sha) else sha
    return entry["bytes"], tuple(entry["crc32c"]), None


def _shard_entries(
    path: str, header: dict, meta: dict, base: int, version: int
) -> dict[str, ShardEntry]:
    """The header's tensor entries, checked: known dtype, whole sizes, bytes that fit the shape,
    one checksum per block."""
    shards: dict[str, ShardEntry] = {}
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            block, crcs, sha = _blocks_of(meta, name, version, end - begin)
            tiles, tile_sums = 1, ()
            if version >= 3 and "tiles" in meta["blocks"][name]:
                tiles = meta["blocks"][name]["tiles"]
                tile_sums = tuple(meta["blocks"][name]["tile_crc32c"])
            ok = (
                dtype in ST_TO_DTYPE
                and all(type(x) is int and x >= 0 for x in (*shape, begin, end, block))
                and _u32s(crcs)
                and block >= 1
                and len(crcs) == max(1, -(-(end - begin) // block))
                and end - begin == math.prod(shape) * ST_TO_DTYPE[dtype].itemsize
                and (sha is None or is_digest(sha))
                and _tiles_ok(
                    shape, ST_TO_DTYPE[dtype].itemsize, block, len(crcs), tiles, tile_sums
                )
                and (tiles == 1 or len(shape) == 2 or version >= TILES_ND_SINCE)
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
            dtype=dtype,
            shape=shape,
            start=base + begin,
            stop=base + end,
            block=block,
            crcs=crcs,
            digest=sha,
            tiles=tiles,
            tile_crcs=tile_sums,
        )
    return shards


def _tiles_ok(shape, itemsize: int, block: int, blocks: int, tiles, sums) -> bool:
    """Whether a shard's tiles are as a writer lays them out: none, or `tile_count`'s column
    blocks over blocks of whole rows of the last dim, with a crc32c for each tile (that its
    rank is one the file's version tiles, the caller checks)."""
    if tiles == 1 and not sums:
        return True
    return (
        type(tiles) is int
        and tiles == tile_count(shape, itemsize)
        and tiles > 1
        and block % (shape[-1] * itemsize) == 0
        and len(sums) == blocks * tiles
        and _u32s(sums)
    )


def _u32s(xs: Sequence[object]) -> bool:
    """Whether every item of ``xs`` is an int in ``[0, 2**32)`` (a bool is not an int here);
    checked by the items' set of types and their extremes, not one by one."""
    return not xs or (set(map(type, xs)) == {int} and min(xs) >= 0 and max(xs) < 1 << 32)


def data_path(path: str, manifest: Manifest, source: int) -> str:
    """The data file of ``source`` in the checkpoint at ``path``: a rank's own file, or (a
    source number past the world size, `Manifest.source_of`) a file of an earlier step of the
    same root that the checkpoint references."""
    if source >= manifest.world_size:
        return manifest.ref_file_path(path, source)
    return storage.join(path, *manifest.files[source].split("/"))


def read_headers(
    path: str, manifest: Manifest, ranks, *, threads: int = 16
) -> dict[int, DataFileHeader]:
    """Headers of the data files of ``ranks``, read in parallel."""
    ranks = sorted(set(ranks))
    for r in ranks:
        if r not in manifest.files and r < manifest.world_size:
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
