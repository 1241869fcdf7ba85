"""Execute a read plan: parallel positional reads into target memory, checksums on the way."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping as MappingType
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from anyshard.errors import ChecksumError, CorruptCheckpointError, StorageError
from anyshard.format import storage
from anyshard.format.checksum import crc32c, crc32c_combine
from anyshard.format.datafile import tensor_bytes
from anyshard.reshard.boxes import Piece, box_shape
from anyshard.reshard.planner import ReadPlan, Request

__all__ = ["execute_plan", "piece_view"]


def piece_view(t: torch.Tensor, p: Piece) -> torch.Tensor:
    """The view of ``t`` that ``p.array_box`` of ``p`` denotes."""
    slices = tuple(slice(lo, hi) for lo, hi in p.array_box)
    if p.base == 0 and tuple(p.array_shape) == tuple(t.shape):
        return t[slices]
    n = 1
    for s in p.array_shape:
        n *= s
    return t.reshape(-1)[p.base : p.base + n].view(p.array_shape)[slices]


class _Readers:
    """One open reader per file, shared by the worker threads."""

    def __init__(self, paths: MappingType[int, str]):
        self._paths = paths
        self._open: dict[int, storage.FileReader] = {}
        self._lock = threading.Lock()

    def get(self, rank: int) -> storage.FileReader:
        with self._lock:
            r = self._open.get(rank)
            if r is None:
                path = self._paths[rank]
                try:
                    r = storage.FileReader(path)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{path}: data file is missing; the checkpoint was copied incompletely or "
                        "files were deleted"
                    ) from None
                self._open[rank] = r
            return r

    def close(self) -> None:
        for r in self._open.values():
            r.close()


def execute_plan(
    plan: ReadPlan,
    targets: Sequence[torch.Tensor],
    src_dtypes: MappingType[tuple[int, str], torch.dtype],
    paths: MappingType[int, str],
    *,
    threads: int = 8,
) -> None:
    """Fill ``targets`` as ``plan`` says; verify every stored shard that was read in full."""
    readers = _Readers(paths)
    parts: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for batch in plan.batches:
                memory = _batch_memory(plan, batch, targets, src_dtypes)
                for checks in pool.map(lambda r, memory=memory: _run_request(r, memory, readers), batch):
                    for shard, offset, length, crc in checks:
                        parts[shard].append((offset, length, crc))
                staged = sorted({s.transfer for r in batch for s in r.segments if not plan.direct[s.transfer]})
                list(pool.map(lambda i, memory=memory: _finish(plan, i, memory[i], targets, src_dtypes), staged))
    finally:
        readers.close()
    _verify(plan, parts, paths)


def _batch_memory(plan, batch: list[Request], targets, src_dtypes) -> dict[int, memoryview]:
    memory: dict[int, memoryview] = {}
    for r in batch:
        for s in r.segments:
            i = s.transfer
            if i in memory:
                continue
            t = plan.transfers[i]
            itemsize = src_dtypes[(t.rank, t.fqn)].itemsize
            if plan.direct[i]:
                (start, n), = t.dst.runs()
                memory[i] = tensor_bytes(targets[t.target])[start * itemsize : (start + n) * itemsize]
            else:
                memory[i] = memoryview(torch.empty(t.numel * itemsize, dtype=torch.uint8).numpy()).cast("B")
    return memory


def _run_request(r: Request, memory: dict[int, memoryview], readers: _Readers) -> list[tuple[int, int, int, int]]:
    reader = readers.get(r.rank)
    try:
        if len(r.segments) == 1:
            s = r.segments[0]
            buf = memory[s.transfer][s.pos : s.pos + s.length]
            reader.read_into(r.offset, buf)
        else:
            buf = memoryview(bytearray(r.length))
            reader.read_into(r.offset, buf)
            for s in r.segments:
                a = s.offset - r.offset
                memory[s.transfer][s.pos : s.pos + s.length] = buf[a : a + s.length]
    except EOFError as e:
        raise CorruptCheckpointError(
            f"{reader.path}: data file is truncated ({e}); the checkpoint was copied incompletely "
            "or the file was cut short. Restore the file or load an earlier step"
        ) from None
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"{reader.path}: read of {r.length} bytes at {r.offset} failed: {e}") from e
    return [(c.shard, r.offset + c.start, c.stop - c.start, crc32c(buf[c.start : c.stop])) for c in r.checks]


def _finish(plan: ReadPlan, i: int, mem: memoryview, targets, src_dtypes) -> None:
    t = plan.transfers[i]
    dtype = src_dtypes[(t.rank, t.fqn)]
    src = torch.frombuffer(mem, dtype=torch.uint8) if len(mem) else torch.empty(0, dtype=torch.uint8)
    src = src.view(dtype).reshape(box_shape(t.src.logical_box))
    piece_view(targets[t.target], t.dst).copy_(src)


def _verify(plan: ReadPlan, parts: dict[int, list[tuple[int, int, int]]], paths) -> None:
    for shard, got in parts.items():
        rank, fqn, start, stop, expected = plan.shards[shard]
        got.sort()
        pos, crc = start, 0
        for offset, length, part_crc in got:
            if offset != pos:
                break
            crc = crc32c_combine(crc, part_crc, length)
            pos += length
        if pos == stop and crc != expected:
            raise ChecksumError(
                f"{paths[rank]}: checksum mismatch in the stored shard of {fqn!r} "
                f"(crc32c {crc:#010x}, header says {expected:#010x}); the file is corrupt. "
                "Restore it from a replica or load an earlier step"
            )
