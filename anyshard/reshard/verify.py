"""Verification of a committed checkpoint: every shard present, checksummed, covering once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from anyshard.errors import ChecksumError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.checksum import crc32c
from anyshard.format.datafile import data_path, read_headers
from anyshard.format.manifest import read_manifest
from anyshard.geometry.boxes import box_numel, intersect
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


def _check_blocks(reader: storage.FileReader, s, file: str, fqn: str) -> int:
    """Read shard ``s`` in parts of about `_BLOCK` bytes (whole checksum blocks) and check the
    crc32c of each of its blocks; the bytes read."""
    per = max(1, _BLOCK // s.block) * s.block
    k = 0
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
    headers = read_headers(path, manifest, wanted)
    total = sum(s.stop - s.start for h in headers.values() for s in h.shards.values())
    done = shards = 0
    for rank in sorted(wanted):
        header = headers[rank]
        file = data_path(path, manifest, rank)
        with storage.FileReader(file) as reader:
            for fqn, shape in sorted(wanted[rank].items()):
                s = header.shards.get(fqn)
                if s is None or s.shape != shape or s.dtype != dtypes[(rank, fqn)]:
                    raise CorruptCheckpointError(
                        f"{file}: the shard of {fqn!r} is missing or has the wrong shape/dtype"
                    )
                done += _check_blocks(reader, s, file, fqn)
                if progress:
                    progress(done, total)
                shards += 1
    return VerifyReport(
        tensors=len(manifest.tensors), shards=shards, files=len(headers), bytes_checked=done
    )
