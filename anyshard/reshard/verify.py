"""Verification of a committed checkpoint: every shard present, checksummed, covering once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from anyshard.errors import ChecksumError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.checksum import Digester, crc32c
from anyshard.format.datafile import data_path, read_headers, tile_crcs
from anyshard.format.dtypes import ST_TO_DTYPE
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import box_numel, intersect
from anyshard.reshard.fill import check_stored
from anyshard.reshard.stored import describe_spec, stored_shards

__all__ = ["VerifyReport", "verify_checkpoint"]

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
