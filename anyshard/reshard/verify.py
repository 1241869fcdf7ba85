"""Checksum verification: of the bytes a load reads, and of a whole committed checkpoint.

A load's reads are checked as they arrive (the executor calls these): the crc32c of the parts of
checksum blocks each request reads (`BlockChecksums`), combined into each block's and compared
with the header's (`check_read_blocks`); the tiles a column slice reads (`check_tiles`). Before
anything is read, a stored shard's header entry is checked against the manifest, a referenced
shard's content hash against the reference's (`check_stored`). `verify_checkpoint` re-reads
every stored shard of a checkpoint: every shard present, checksummed, covering its tensor once.
The crc32c itself, its combination and the content hashes are computed in
`anyshard.format.checksum`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from anyshard.errors import ChecksumError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.checksum import Digester, crc32c, crc32c_combine, same_algorithm
from anyshard.format.datafile import (
    DataFileHeader,
    ShardEntry,
    data_path,
    read_headers,
    tile_crcs,
)
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import Manifest, read_manifest
from anyshard.geometry.boxes import box_numel, intersect
from anyshard.reshard.read_plan import ReadPlan, Transfer
from anyshard.reshard.stored import describe_spec, stored_shards

__all__ = [
    "BlockChecksums",
    "VerifyReport",
    "check_read_blocks",
    "check_stored",
    "check_tiles",
    "verify_checkpoint",
]


# --------------------------------------------------------------------------- the bytes a load reads


class BlockChecksums:
    """The crc32c of each of ``checks`` (byte ranges of a request, sorted, not overlapping),
    run on over its bytes as they are read, in order."""

    def __init__(self, checks) -> None:
        self.checks = checks
        self.crcs = [0] * len(checks)
        self._first = 0  # the first check that may still overlap what is read next

    def update(self, buffers: list[memoryview], at: int) -> None:
        """Bytes ``buffers`` of the request, from byte ``at`` of it on."""
        checks, crcs, j = self.checks, self.crcs, self._first
        for buf in buffers:
            n = len(buf)
            while j < len(checks) and checks[j].stop <= at:
                j += 1
            k = j
            while k < len(checks) and checks[k].start < at + n:
                c = checks[k]
                lo, hi = max(c.start, at), min(c.stop, at + n)
                crcs[k] = crc32c(buf[lo - at : hi - at], crcs[k])
                k += 1
            at += n
        self._first = j

    def parts(self, offset: int) -> list[tuple[int, int, int, int]]:
        """The checked parts of checksum blocks as ``(block, file offset, length, crc32c)``, for
        a request that reads from byte ``offset`` of its file."""
        return [
            (c.shard, offset + c.start, c.stop - c.start, crc)
            for c, crc in zip(self.checks, self.crcs, strict=True)
        ]


def check_tiles(t: Transfer, staged: torch.Tensor, path: str) -> None:
    """The tiles ``t`` staged (a 2-d box of whole tiles of the stored shard's array of rows,
    every dim but the last flattened): their crc32c (`tile_crcs`) the header's, else a
    `ChecksumError` naming the first tile that differs (its rows those of the array of rows)."""
    assert t.tiles is not None
    band, width, expected = t.tiles
    got = tile_crcs(staged.view(torch.uint8), band, width * staged.element_size())
    if got == list(expected):
        return
    j = next(k for k, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    per_band = staged.shape[1] // width
    (lo, _), (clo, _) = t.src.array_box
    r, c = lo + j // per_band * band, clo + j % per_band * width
    r_end = min(r + band, t.src.array_box[0][1])
    raise ChecksumError(
        f"{path}: checksum mismatch in the stored shard of {t.fqn!r} (the tile of rows "
        f"{r}..{r_end}, columns {c}..{c + width}: crc32c {got[j]:#010x}, header says "
        f"{expected[j]:#010x}); the file is corrupt. Restore it from a replica or load an "
        "earlier step"
    )


def _chain(start: int, stop: int, got: list[tuple[int, int, int]]) -> int | None:
    """The crc32c of bytes ``[start, stop)`` from parts ``(offset, length, crc)`` that follow
    one another from ``start`` to ``stop`` (parts may repeat or overlap: two transfers widened
    into one block read it twice, cut differently); None when no parts chain through."""
    after: dict[int, list[tuple[int, int]]] = {}
    for offset, length, crc in got:
        after.setdefault(offset, []).append((length, crc))
    todo, seen = [(start, 0)], {start}
    while todo:
        pos, crc = todo.pop()
        if pos == stop:
            return crc
        for length, part in after.get(pos, ()):
            nxt = pos + length
            if nxt not in seen and nxt <= stop:
                seen.add(nxt)
                todo.append((nxt, crc32c_combine(crc, part, length)))
    return None


def check_read_blocks(plan: ReadPlan, parts: dict[int, list[tuple[int, int, int]]], paths) -> None:
    """Every checksum block that requests read part of: read whole, and its crc32c (combined
    from the parts) the header's."""
    for shard, got in parts.items():
        rank, fqn, start, stop, expected = plan.shards[shard]
        crc = _chain(start, stop, got)
        if crc is None:
            raise CorruptCheckpointError(
                f"{paths[rank]}: bytes {start}..{stop} of the stored shard of {fqn!r} were read "
                "only in part; they cannot be verified"
            )
        if crc != expected:
            raise ChecksumError(
                f"{paths[rank]}: checksum mismatch in the stored shard of {fqn!r} (bytes "
                f"{start}..{stop}: crc32c {crc:#010x}, header says {expected:#010x}); the file "
                "is corrupt. Restore it from a replica or load an earlier step"
            )


def check_stored(
    path: str,
    manifest: Manifest,
    rank: int,
    key: str,
    header: DataFileHeader,
    dtype: str,
    shape: Sequence[int],
) -> ShardEntry:
    """The header entry of rank ``rank``'s stored shard ``key`` in ``header`` (its own data file
    or the one it references), checked against the manifest: `CorruptCheckpointError` when it
    is missing, has another dtype or shape, or (referenced) lies elsewhere than the reference
    says."""
    stored = header.shards.get(key)
    if stored is None or stored.shape != tuple(shape) or stored.dtype != dtype:
        found = "nothing" if stored is None else f"{stored.dtype} {list(stored.shape)}"
        raise CorruptCheckpointError(
            f"{header.path}: expected the stored tensor {key!r} as {dtype} {list(shape)}, found {found}; "
            "the data file does not belong to this manifest"
        )
    ref = manifest.refs.get(rank, {}).get(key)
    if ref is not None and (ref.start, ref.stop) != (stored.start, stored.stop):
        raise CorruptCheckpointError(
            f"{header.path}: {path} references the stored tensor {key!r} at bytes "
            f"{ref.start}..{ref.stop} of this file, but it lies at {stored.start}..{stored.stop}; "
            "the referenced file was replaced. Load another step"
        )
    if (
        ref is not None
        and stored.digest is not None
        and same_algorithm(stored.digest, ref.digest)
        and stored.digest != ref.digest
    ):
        raise ChecksumError(
            f"{header.path}: {path} references the stored tensor {key!r} with hash "
            f"{ref.digest[:24]}..., but this file records {stored.digest[:24]}...; the "
            "referenced file was replaced. Load another step"
        )
    return stored


# --------------------------------------------------------------------------- a whole checkpoint

_BLOCK = 16 << 20


@dataclass(frozen=True, slots=True)
class VerifyReport:
    tensors: int
    shards: int
    files: int
    bytes_checked: int


def _coverage(manifest, fqn: str, entry) -> Iterator[tuple[int, str, tuple[int, ...]]]:
    """(rank, key, shape) of every stored shard; raises if they do not cover the tensor once."""
    boxes = []
    for s in stored_shards(manifest, fqn):
        boxes += [p.logical_box for p in s.shard.pieces if box_numel(p.logical_box)]
        yield s.rank, s.key, s.shard.shape
    total = sum(box_numel(b) for b in boxes)
    want = 1
    for n in entry.shape:
        want *= n
    overlap = total != want or (
        len(boxes) <= 4096
        and any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    )
    if overlap:
        raise CorruptCheckpointError(
            f"{fqn}: stored shards hold {total} elements of {want} "
            f"({'mapping ' + repr(entry.mapping) if entry.mapping else describe_spec(manifest)}); "
            "the tensor is not covered exactly once"
        )


def _check_blocks(
    reader: storage.FileReader, s, file: str, fqn: str, expected: str | None = None
) -> int:
    """Read shard ``s`` in parts of about `_BLOCK` bytes (whole checksum blocks) and check the
    crc32c of each of its blocks and, when given, the content hash of the whole ("ALGORITHM:HEX");
    the bytes read."""
    per = max(1, _BLOCK // s.block) * s.block
    k = 0
    digest = Digester(expected.partition(":")[0]) if expected else None
    row = s.shape[-1] * ST_TO_DTYPE[s.dtype].itemsize if s.tiles > 1 else 0
    for a in range(s.start, s.stop, per):
        buf = memoryview(bytearray(min(per, s.stop - a)))
        try:
            reader.read_into(a, buf)
        except EOFError as e:
            raise CorruptCheckpointError(f"{file}: data file is truncated ({e})") from None
        for b in range(0, len(buf), s.block):
            if crc32c(buf[b : b + s.block]) != s.crcs[k]:
                lo, hi = s.block_span(k)
                raise ChecksumError(
                    f"{file}: checksum mismatch in the stored shard of {fqn!r} (bytes {lo}..{hi} "
                    "of the file); the file is corrupt. Restore it or load an earlier step"
                )
            k += 1
        if row:  # the tiles of these blocks, as a column split reads them
            k0 = (a - s.start) // s.block
            rows = torch.frombuffer(buf, dtype=torch.uint8).view(-1, row)
            sums = tile_crcs(rows, s.block // row, row // s.tiles)
            if sums != list(s.tile_crcs[k0 * s.tiles : k0 * s.tiles + len(sums)]):
                raise ChecksumError(
                    f"{file}: checksum mismatch in a tile of the stored shard of {fqn!r} (bytes "
                    f"{a}..{a + len(buf)} of the file); the file is corrupt. Restore it or load "
                    "an earlier step"
                )
        if digest is not None:
            digest.update(buf)
    if digest is not None and digest.digest() != expected:
        raise ChecksumError(
            f"{file}: content hash mismatch in the stored shard of {fqn!r} (bytes {s.start}..{s.stop} "
            "of the file); the file is corrupt or was replaced. Restore it or load an earlier step"
        )
    return s.stop - s.start


def verify_checkpoint(
    path: str, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Re-read every stored shard of the checkpoint at ``path``; raise on the first problem."""
    manifest = read_manifest(path)
    wanted: dict[int, dict[str, tuple[int, ...]]] = {}
    dtypes: dict[tuple[int, str], str] = {}
    for fqn, entry in manifest.tensors.items():
        for rank, key, shape in _coverage(manifest, fqn, entry):
            wanted.setdefault(rank, {})[key] = tuple(shape)
            dtypes[(rank, key)] = entry.dtype
    # each stored shard where it is read: its rank's own data file or a referenced one
    by_source: dict[int, list[tuple[int, str, tuple[int, ...]]]] = {}
    for rank, keys in wanted.items():
        for key, shape in keys.items():
            by_source.setdefault(manifest.source_of(rank, key), []).append((rank, key, shape))
    headers = read_headers(path, manifest, by_source)
    total = sum(
        headers[src].shards[key].stop - headers[src].shards[key].start
        for src, items in by_source.items()
        for _, key, _ in items
        if key in headers[src].shards
    )
    done = shards = 0
    for src in sorted(by_source):
        header = headers[src]
        file = data_path(path, manifest, src)
        with storage.FileReader(file) as reader:
            for rank, key, shape in sorted(by_source[src], key=lambda x: x[1]):
                s = check_stored(path, manifest, rank, key, header, dtypes[(rank, key)], shape)
                ref = manifest.refs.get(rank, {}).get(key)
                digest = ref.digest if ref is not None else s.digest
                done += _check_blocks(reader, s, file, key, digest)
                if progress:
                    progress(done, total)
                shards += 1
    return VerifyReport(
        tensors=len(manifest.tensors), shards=shards, files=len(headers), bytes_checked=done
    )
