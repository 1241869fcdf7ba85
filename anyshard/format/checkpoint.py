"""Reading a committed checkpoint's manifest and data-file headers, with clear errors."""

from __future__ import annotations

from anyshard._pool import io_pool
from anyshard.errors import CheckpointNotFoundError, StorageError
from anyshard.format import storage
from anyshard.format.datafile import DataFileHeader, read_header
from anyshard.format.manifest import MANIFEST_NAME, Manifest

__all__ = ["data_path", "read_headers", "read_manifest"]


def read_manifest(path: str) -> Manifest:
    where = storage.join(path, MANIFEST_NAME)
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError:
        if not storage.exists(path):
            raise CheckpointNotFoundError(f"{path}: no such checkpoint directory") from None
        raise CheckpointNotFoundError(
            f"{path}: not a committed checkpoint (no {MANIFEST_NAME}); an interrupted save? "
            "Load an earlier step, or remove the directory with `anyshard gc`"
        ) from None
    except IsADirectoryError:
        raise CheckpointNotFoundError(f"{where} is a directory, not a manifest") from None
    except StorageError:
        raise
    return Manifest.loads(data, where)


def data_path(path: str, manifest: Manifest, rank: int) -> str:
    return storage.join(path, *manifest.files[rank].split("/"))


def read_headers(
    path: str, manifest: Manifest, ranks, *, threads: int = 16
) -> dict[int, DataFileHeader]:
    """Headers of the data files of ``ranks``, read in parallel."""
    ranks = sorted(set(ranks))
    for r in ranks:
        if r not in manifest.files:
            from anyshard.errors import CorruptCheckpointError

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
