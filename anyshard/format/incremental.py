"""Incremental saves: a stored shard whose bytes an earlier step of the same root already holds
is referenced there rather than written again.

A save with a base step hashes each shard it would write (xxh3-128, in the same pass as its
crc32c block checksums; crc32c is no identity) and compares it with the shard the same rank
stored under the same key in the base: in the base's own data file (whose header records the
hash when that save hashed) or, when the base itself
referenced it, where the base's reference points, so that references always name the file that
holds the bytes and never chain. A base shard without a recorded hash is read and compared byte
for byte. Names the caller declares frozen skip the hashing when the base records their hash.

Everything here is per rank: no collective, nothing read beyond the base's manifest and the
headers of the data files this rank's base shards lie in; and not even those when this process
saved the base itself (the Checkpointer's case): its index is remembered, keyed by the SHA-256 of
the manifest it committed, and used when the base's manifest still has those bytes. A base hash
under another algorithm (SHA-256, as format_version 3 recorded it) is no match: the shard is
then compared byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from anyshard._lru import LRU
from anyshard.errors import AnyshardError, CorruptCheckpointError
from anyshard.format import storage
from anyshard.format.checksum import HASH_WRITTEN, digest_and_crcs, digest_of, same_algorithm
from anyshard.format.datafile import block_size, data_path, read_header, tensor_bytes
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    Ref,
    check_ref_file,
    read_manifest,
)
from anyshard.format.pool import io_pool

__all__ = ["Incremental", "hash_shard"]

_POOL_BYTES = 4 << 20  # shards at least this large are hashed in the I/O pool, others inline
_REMEMBERED = 8  # indexes of steps this process saved, kept for the saves based on them
# (step path, rank) -> (SHA-256 of the step's manifest, the rank's stored shards there); locked:
# the save thread (async saves) and the thread that calls save share it
_index_cache: LRU[tuple[str, int], tuple[str, dict[str, _BaseShard]]] = LRU(_REMEMBERED)


def hash_shard(data: memoryview, block: int | None) -> tuple[str, list[int] | None]:
    """A shard's content hash and, given its checksum ``block``, its crc32c block checksums,
    in one pass over its bytes."""
    if block is None:
        return digest_of(data), None
    return digest_and_crcs(data, block)


def _comparable(b: _BaseShard | None, t: torch.Tensor) -> bool:
    """Whether the base shard ``b`` can be matched to ``t`` by the content hash written now."""
    return (
        b is not None
        and b.dtype == DTYPE_TO_ST[t.dtype]
        and b.shape == tuple(t.shape)
        and bool(b.ref.digest)
        and same_algorithm(b.ref.digest, HASH_WRITTEN + ":")
    )


def _basename(path: str) -> str:
    if storage.is_url(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.normpath(path))


@dataclass(frozen=True, slots=True)
class _BaseShard:
    ref: Ref  # where the bytes lie, relative to a sibling step (digest "" when not recorded)
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Incremental:
    """How a save treats unchanged shards: ``base`` (a committed step in the same root as the
    save, or None: hash only, for a later save to reference) and ``frozen`` (stored keys
    referenced without hashing when the base records their hash)."""

    base: str | None = None
    frozen: frozenset[str] = frozenset()
    # (path, rank) -> the base's shards, read once per save (before staging, and at writing)
    _read: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, base: str | None, frozen: Collection[str] | None, hashed: bool):
        """The policy of a save, or None when it neither hashes nor references."""
        if base is None and not hashed and not frozen:
            return None
        return cls(base=None if base is None else str(base), frozen=frozenset(frozen or ()))

    def frozen_part(
        self, path: str, rank: int, writes: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, _BaseShard]]:
        """``writes`` (this rank's stored shards, on any device) without the frozen ones that
        the base holds with a recorded hash, and those: referenced without hashing, so that
        an async save need not even stage them."""
        if self.base is None or not self.frozen:
            return list(writes), {}
        return self._frozen_part(self._base_shards(path, rank), writes)

    def _frozen_part(
        self, base: dict[str, _BaseShard], writes: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, _BaseShard]]:
        rest: list[tuple[str, torch.Tensor]] = []
        held: dict[str, _BaseShard] = {}
        for key, t in writes:
            b = base.get(key)
            if (
                key in self.frozen
                and b is not None
                and b.ref.digest
                and b.dtype == DTYPE_TO_ST[t.dtype]
                and b.shape == tuple(t.shape)
            ):
                held[key] = b
            else:
                rest.append((key, t))
        return rest, held

    def split(
        self, path: str, rank: int, writes: Sequence[tuple[str, torch.Tensor]], *, threads: int = 4
    ) -> tuple[
        list[tuple[str, torch.Tensor]], dict[str, Ref], dict[str, str], dict[str, list[int]]
    ]:
        """``writes`` (this rank's stored shards, contiguous host tensors) split into those to
        write, with their content hashes and crc32c block checksums (one pass over each shard),
        and references to the base's copies of the others."""
        base = self._base_shards(path, rank) if self.base is not None else {}
        todo, held = self._frozen_part(base, writes)
        refs: dict[str, Ref] = {k: b.ref for k, b in held.items()}
        views = [tensor_bytes(t) for _, t in todo]
        # a shard the base likely holds is hashed alone (its checksums are only needed if it
        # changed: then the write computes them); any other is hashed in the checksums' pass
        blocks = [
            None if _comparable(base.get(key), t) else block_size(tuple(t.shape), t.element_size())
            for key, t in todo
        ]
        large = [i for i, v in enumerate(views) if v.nbytes >= _POOL_BYTES]
        hashed = io_pool(threads).map(
            hash_shard, [views[i] for i in large], [blocks[i] for i in large]
        )
        pooled = dict(zip(large, hashed, strict=True))
        results = [
            pooled[i] if i in pooled else hash_shard(v, blocks[i]) for i, v in enumerate(views)
        ]
        out: list[tuple[str, torch.Tensor]] = []
        hashes: dict[str, str] = {}
        crcs: dict[str, list[int]] = {}
        for (key, t), view, (digest, block_crcs) in zip(todo, views, results, strict=True):
            b = base.get(key)
            if (
                b is not None
                and b.dtype == DTYPE_TO_ST[t.dtype]
                and b.shape == tuple(t.shape)
                and (
                    b.ref.digest == digest
                    if b.ref.digest and same_algorithm(b.ref.digest, digest)
                    else self._same_bytes(path, b, view)
                )
            ):
                refs[key] = Ref(file=b.ref.file, start=b.ref.start, stop=b.ref.stop, digest=digest)
                continue
            out.append((key, t))
            hashes[key] = digest
            if block_crcs is not None:
                crcs[key] = block_crcs
        return out, refs, hashes, crcs

    def _base_shards(self, path: str, rank: int) -> dict[str, _BaseShard]:
        """Rank ``rank``'s stored shards in the base: key -> where the bytes lie."""
        if (path, rank) not in self._read:
            self._read[(path, rank)] = self._read_base_shards(path, rank)
        return self._read[(path, rank)]

    def _read_base_shards(self, path: str, rank: int) -> dict[str, _BaseShard]:
        base = self.base
        assert base is not None
        if storage.parent(base) != storage.parent(path) or _basename(base) == _basename(path):
            raise AnyshardError(
                f"save to {path}: base {base} is not another step of the same root; an "
                "incremental save references files of an earlier step in the same directory "
                f"({storage.parent(path)})"
            )
        try:
            data = storage.read_bytes(storage.join(base, MANIFEST_NAME))
        except (FileNotFoundError, IsADirectoryError):
            read_manifest(base)  # raises the error that says what is there instead
            raise
        digest = hashlib.sha256(data).hexdigest()
        known = _index_cache.get((storage.normalize(base), rank))
        if known is not None and known[0] == digest:
            return known[1]
        manifest = Manifest.loads(data, storage.join(base, MANIFEST_NAME))
        out: dict[str, _BaseShard] = {}
        refs = manifest.refs.get(rank, {})
        if rank in manifest.files:
            rel = f"../{_basename(base)}/{manifest.files[rank]}"
            try:
                check_ref_file(rel, base)
            except CorruptCheckpointError:
                raise AnyshardError(
                    f"save to {path}: base {base}'s data file {rel!r} cannot be referenced (a "
                    "step directory name of letters, digits, '.', '_' and '-' can)"
                ) from None
            header = read_header(data_path(base, manifest, rank))
            for key, e in header.shards.items():
                if key not in refs:
                    ref = Ref(file=rel, start=e.start, stop=e.stop, digest=e.digest or "")
                    out[key] = _BaseShard(ref, e.dtype, e.shape)
        headers: dict[int, object] = {}
        for key, ref in refs.items():
            source = manifest.source_of(rank, key)
            if source not in headers:
                headers[source] = read_header(data_path(base, manifest, source))
            e = headers[source].shards.get(key)  # type: ignore[attr-defined]
            if e is not None and (e.start, e.stop) == (ref.start, ref.stop):
                out[key] = _BaseShard(ref, e.dtype, e.shape)
        return out

    @staticmethod
    def remember(
        path: str,
        rank: int,
        manifest_sha256: str,
        writes: Sequence[tuple[str, torch.Tensor]],
        spans: dict[str, tuple[int, int]],
        file: str | None,
        refs: dict[str, Ref],
        hashes: dict[str, str],
        ref_kinds: dict[str, tuple[str, tuple[int, ...]]],
    ) -> None:
        """Keep the index of rank ``rank`` in the step this process just committed at ``path``
        (its manifest's SHA-256 ``manifest_sha256``), for a save based on it."""
        index: dict[str, _BaseShard] = {}
        if file is not None:
            rel = f"../{_basename(path)}/{file}"
            for key, t in writes:
                start, stop = spans[key]
                ref = Ref(file=rel, start=start, stop=stop, digest=hashes[key])
                index[key] = _BaseShard(ref, DTYPE_TO_ST[t.dtype], tuple(t.shape))
        for key, ref in refs.items():
            index[key] = _BaseShard(ref, *ref_kinds[key])
        _index_cache.put((storage.normalize(path), rank), (manifest_sha256, index))

    @staticmethod
    def _same_bytes(path: str, b: _BaseShard, view: memoryview) -> bool:
        """Whether the base shard ``b`` (no hash recorded) holds exactly ``view``'s bytes."""
        if b.ref.stop - b.ref.start != view.nbytes:
            return False
        file = storage.join(storage.parent(path), *b.ref.file.split("/")[1:])
        buf = bytearray(view.nbytes)
        try:
            with storage.FileReader(file) as r:
                r.read_into(b.ref.start, memoryview(buf))
        except (FileNotFoundError, EOFError):
            return False
        return buf == view
