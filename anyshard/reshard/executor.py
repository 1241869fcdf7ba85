"""Execute a read plan: parallel positional reads into target memory, checksums on the way
(checked against the headers' by `anyshard.reshard.verify`)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingType

import torch

from anyshard.errors import CorruptCheckpointError, StorageError
from anyshard.format import storage
from anyshard.format.datafile import tensor_bytes
from anyshard.format.pool import cpu_share, io_pool
from anyshard.geometry.boxes import Piece, box_shape
from anyshard.reshard.read_plan import GAP, STAGING, TARGET, ReadPlan, Request
from anyshard.reshard.verify import BlockChecksums, check_read_blocks, check_tiles

__all__ = ["execute_plan", "piece_view"]

# A worker task holds consecutive requests worth at least this many bytes (or this many
# requests), so that thousands of row-sized reads do not each pay a thread-pool round trip.
_TASK_BYTES = 8 << 20
_TASK_REQUESTS = 256


def piece_view(t: torch.Tensor, p: Piece) -> torch.Tensor:
    """The view of ``t`` that ``p.array_box`` of ``p`` denotes."""
    slices = tuple(slice(lo, hi) for lo, hi in p.array_box)
    if p.base == 0 and tuple(p.array_shape) == tuple(t.shape):
        return t[slices]
    n = 1
    for s in p.array_shape:
        n *= s
    return t.reshape(-1)[p.base : p.base + n].view(p.array_shape)[slices]


def _open_reader(path: str) -> storage.FileReader:
    try:
        return storage.FileReader(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: data file is missing; the checkpoint was copied incompletely "
            "or files were deleted. Restore the file or load an earlier step"
        ) from None


def _tasks(batch: list[Request]) -> list[list[Request]]:
    tasks: list[list[Request]] = []
    size = 0
    for r in batch:
        if not tasks or size >= _TASK_BYTES or len(tasks[-1]) >= _TASK_REQUESTS:
            tasks.append([])
            size = 0
        tasks[-1].append(r)
        size += r.length * r.count
    return tasks


def execute_plan(
    plan: ReadPlan,
    targets: Sequence[torch.Tensor],
    src_dtypes: MappingType[tuple[int, str], torch.dtype],
    paths: MappingType[int, str],
    *,
    threads: int = 8,
) -> None:
    """Fill ``targets`` as ``plan`` says; verify every stored shard that was read in full.

    At most ``threads`` reading threads; when every file is local, at most this process's share
    of the CPUs (`cpu_share`): page-cache reads are bound by the CPU, not by waiting."""
    if not any(storage.is_url(p) for p in paths.values()):
        threads = min(threads, cpu_share())
    parts: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    u8_cache: dict[int, torch.Tensor] = {}

    def target_u8(i: int) -> torch.Tensor:
        t = u8_cache.get(i)
        if t is None:
            t = u8_cache[i] = torch.frombuffer(target_bytes[i], dtype=torch.uint8)
        return t

    target_bytes = [
        tensor_bytes(t) if t.device.type == "cpu" and t.is_contiguous() else None for t in targets
    ]
    pool = io_pool(threads)
    bounces: dict[int, torch.Tensor] = {}  # thread -> its bounce buffer, for this plan
    for batch in plan.batches:
        staging = _staging(plan, batch, src_dtypes, paths)
        memory = (target_bytes, staging, target_u8, bounces, targets, src_dtypes)
        run = lambda task, memory=memory: _run_task(plan, task, memory, paths)  # noqa: E731
        for checks in pool.map(run, _tasks(batch)):
            for shard, offset, length, crc in checks:
                parts[shard].append((offset, length, crc))
        finish = lambda i, staging=staging: _finish(plan, i, staging[i], targets, src_dtypes, paths)  # noqa: E731
        list(pool.map(finish, sorted(staging)))
    check_read_blocks(plan, parts, paths)


def _staging(plan: ReadPlan, batch: list[Request], src_dtypes, paths) -> dict[int, memoryview]:
    """Staging buffers of the batch's staged transfers, except those that one span of a request
    on a local file reads whole: those go through the reading thread's bounce buffer and are
    copied into place as soon as they are read (`_run_streamed`), so that a load does not fault
    in fresh memory for every byte it stages."""
    staging: dict[int, memoryview] = {}
    for r in batch:
        if not r.staged:
            continue
        local = not storage.is_url(paths[r.rank])
        for kind, i, offset, n in r.spans:
            if kind != STAGING or i in staging:
                continue
            t = plan.transfers[i]
            nbytes = t.numel * src_dtypes[(t.rank, t.fqn)].itemsize
            if local and offset == 0 and n == nbytes:
                continue
            if (
                local
                and offset == 0
                and r.repeat is not None
                and r.repeat[0] * n == nbytes == r.repeat[0] * r.repeat[2]
            ):
                continue  # one repeated read fills it (a tiled transfer's rows): streamed too
            staging[i] = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy()).cast("B")
    return staging


# A request scattering at least this many equal rows into a target reads them into one
# contiguous bounce buffer and scatters with one strided copy: a checksum over one buffer and one
# copy beat hundreds of small iovecs and per-row checksum calls. The rows go through the bounce
# buffer at most _BOUNCE_BYTES at a time (one row at a time when a row is larger), and each thread
# keeps its buffer for the whole plan: a fresh buffer per request would fault in (and zero) as
# many pages as the request reads. Local files only: on a URL each part would be a GET.
_BOUNCE_MIN_SPANS = 16
_BOUNCE_BYTES = 1 << 20


class _Task:
    """State of one worker task: its own file descriptions (so that each stream of reads keeps
    its own readahead state in the kernel), a bounce buffer and a buffer for the bytes of gaps,
    reused."""

    def __init__(self, paths, bounces: dict[int, torch.Tensor]):
        self.paths = paths
        self.readers: dict[int, storage.FileReader] = {}
        self.bounces = bounces  # per thread, kept for the whole plan
        self.junk: memoryview | None = None

    def reader(self, rank: int) -> storage.FileReader:
        reader = self.readers.get(rank)
        if reader is None:
            reader = self.readers[rank] = _open_reader(self.paths[rank])
        return reader

    def bounce_for(self, n: int) -> torch.Tensor:
        me = threading.get_ident()
        bounce = self.bounces.get(me)
        if bounce is None or bounce.numel() < n:
            bounce = self.bounces[me] = torch.empty(n, dtype=torch.uint8)
        return bounce[:n]

    def gaps_for(self, r: Request) -> Iterator[memoryview]:
        """Buffers for the gaps of request ``r``, in order: separate bytes for each, since each
        gap is checksummed after the read."""
        sizes = [n for kind, _, _, n in r.spans if kind == GAP]
        if self.junk is None or len(self.junk) < sum(sizes):
            self.junk = memoryview(bytearray(max(sum(sizes), 1 << 16)))
        at = 0
        for n in sizes:
            yield self.junk[at : at + n]
            at += n

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def _run_task(
    plan: ReadPlan, task: list[Request], memory, paths
) -> list[tuple[int, int, int, int]]:
    """Run consecutive requests; returns the checksums of the parts of shards they read."""
    target_bytes, staging, target_u8, bounces, _, _ = memory
    transfers = plan.transfers
    state = _Task(paths, bounces)
    out = []
    try:
        for r in task:
            if r.repeat is not None:
                _run_repeated(plan, r, memory, state)
                continue
            if r.staged and any(kind == STAGING and i not in staging for kind, i, _, _ in r.spans):
                out += _run_streamed(plan, r, memory, state)
                continue
            rows = r.rows
            if (
                rows is not None
                and len(r.spans) >= _BOUNCE_MIN_SPANS
                and state.reader(r.rank).fd is not None
            ):
                out += _run_rows(r, rows, state, target_u8)
                continue
            # (a URL streams the rows straight into place with one GET: no bounce buffer)
            buffers = []
            gaps = state.gaps_for(r)
            for kind, i, offset, n in r.spans:
                if kind == TARGET:
                    buffers.append(target_bytes[transfers[i].target][offset : offset + n])
                elif kind == GAP:
                    buffers.append(next(gaps))
                else:
                    buffers.append(staging[i][offset : offset + n])
            reader = state.reader(r.rank)
            summer = BlockChecksums(r.checks)
            if reader.fd is None or not r.checks:
                _read(reader, r, buffers)
                if r.checks:
                    summer.update(buffers, 0)
            else:  # a local file: checksum each part while its bytes are still in the cache
                for part, at in _parts(buffers, _CHECK_PART):
                    _read(reader, r, part, at=at)
                    summer.update(part, at)
            out += summer.parts(r.offset)
    finally:
        state.close()
    return out


def _run_rows(
    r: Request, rows: tuple[int, int, int, int], state: _Task, target_u8
) -> list[tuple[int, int, int, int]]:
    """A request of equal rows, contiguous in the file, scattered at a fixed stride into one
    target: read through the thread's bounce buffer, at most `_BOUNCE_BYTES` at a time, each
    part copied into place with one strided copy; the checksums run on over the parts."""
    target, first, stride, n = rows
    count = len(r.spans)
    per = max(1, _BOUNCE_BYTES // n)
    dest = target_u8(target)
    reader = state.reader(r.rank)
    summer = BlockChecksums(r.checks)
    for k0 in range(0, count, per):
        k = min(per, count - k0)
        lo = k0 * n
        bounce = state.bounce_for(k * n)
        mv = memoryview(bounce.numpy())
        _read(reader, r, [mv], at=lo)
        dest.as_strided((k, n), (stride, 1), first + k0 * stride).copy_(bounce.view(k, n))
        summer.update([mv], lo)
    return summer.parts(r.offset)


def _run_streamed(
    plan: ReadPlan, r: Request, memory, state: _Task
) -> list[tuple[int, int, int, int]]:
    """A request on a local file with staged transfers that it reads whole: the spans between
    those transfers in one read each, each such transfer through the thread's bounce buffer and
    copied into place at once; the checksums run on over the reads."""
    target_bytes, staging, _, _, targets, src_dtypes = memory
    reader = state.reader(r.rank)
    summer = BlockChecksums(r.checks)

    def read(buffers: list[memoryview], at: int) -> None:
        for part, part_at in _parts(buffers, _CHECK_PART, at):
            _read(reader, r, part, at=part_at)
            summer.update(part, part_at)

    pending: list[memoryview] = []
    gaps = state.gaps_for(r)
    at = start = 0
    for kind, i, offset, n in r.spans:
        if kind == STAGING and i not in staging:
            if pending:
                read(pending, start)
                pending = []
            buf = memoryview(state.bounce_for(n).numpy())
            read([buf], at)
            _finish(plan, i, buf, targets, src_dtypes, state.paths)
            start = at + n
        elif kind == TARGET:
            pending.append(target_bytes[plan.transfers[i].target][offset : offset + n])
        elif kind == GAP:
            pending.append(next(gaps))
        else:
            pending.append(staging[i][offset : offset + n])
        at += n
    if pending:
        read(pending, start)
    return summer.parts(r.offset)


def _run_repeated(plan: ReadPlan, r: Request, memory, state: _Task) -> None:
    """``count`` reads of one span at a fixed stride (the rows of a strided region); a staged
    transfer that they fill whole (`_staging`) goes through the thread's bounce buffer and is
    copied into place at once."""
    target_bytes, staging, _, _, targets, src_dtypes = memory
    ((kind, i, offset, n),) = r.spans
    assert r.repeat is not None
    count, file_stride, dst_stride = r.repeat
    streamed = kind == STAGING and i not in staging
    if streamed:
        mem = memoryview(state.bounce_for(count * n).numpy())
    else:
        mem = target_bytes[plan.transfers[i].target] if kind == TARGET else staging[i]
    reader = state.reader(r.rank)
    if reader.fd is None:  # a URL: near rows share ranged GETs, issued concurrently
        spans = [
            (r.offset + k * file_stride, mem[offset + k * dst_stride :][:n]) for k in range(count)
        ]
        try:
            reader.read_scattered(spans)
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{reader.path}: data file is truncated ({e}); restore it or load an earlier step"
            ) from None
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{reader.path}: data file is missing; restore it or load an earlier step"
            ) from None
    else:
        fd, pos, dst = reader.fd, r.offset, offset
        preadv = os.preadv
        try:
            for _ in range(count):
                if preadv(fd, [mem[dst : dst + n]], pos) != n:
                    reader.read_into(pos, mem[dst : dst + n])  # short read or end of file
                pos += file_stride
                dst += dst_stride
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{reader.path}: data file is truncated ({e}); restore it or load an earlier step"
            ) from None
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise StorageError(f"{reader.path}: read of {n} bytes at {pos} failed: {e}") from e
    t = plan.transfers[i]
    if streamed:
        _finish(plan, i, mem, targets, src_dtypes, state.paths)
    elif kind == TARGET and t.tiles is not None:  # read straight into place
        check_tiles(t, piece_view(targets[t.target], t.dst), state.paths[t.rank])


def _read(reader: storage.FileReader, r: Request, buffers: list[memoryview], at: int = 0) -> None:
    """Fill ``buffers`` from the bytes of request ``r``, starting ``at`` bytes into it."""
    try:
        reader.readv(r.offset + at, buffers)
    except EOFError as e:
        raise CorruptCheckpointError(
            f"{reader.path}: data file is truncated ({e}); the checkpoint was copied "
            "incompletely or the disk filled up. Restore the file or load an earlier step"
        ) from None
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{reader.path}: data file is missing; the checkpoint was copied incompletely "
            "or files were deleted. Restore the file or load an earlier step"
        ) from None
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        length = sum(len(b) for b in buffers)
        raise StorageError(
            f"{reader.path}: read of {length} bytes at {r.offset + at} failed: {e}"
        ) from e


# Reads of a local file that carry checksums go in parts of about this many bytes, each
# checksummed right after it is read, while its bytes are still in the CPU's cache: reading
# 256 MiB of page cache and then checksumming it took 56 ms here, in 1 MiB parts 48 ms.
_CHECK_PART = 1 << 20


def _parts(
    buffers: list[memoryview], size: int, at: int = 0
) -> Iterator[tuple[list[memoryview], int]]:
    """``buffers`` (consecutive bytes from ``at`` on) in consecutive parts of about ``size``
    bytes, each ``(buffers, where it starts)``: small buffers grouped, large ones cut."""
    part: list[memoryview] = []
    start = filled = at
    for buf in buffers:
        n = len(buf)
        if filled - start + n <= size:
            part.append(buf)
            filled += n
            continue
        lo = 0
        while lo < n:
            take = min(n - lo, max(size - (filled - start), 0))
            if take == 0:
                yield part, start
                part, start = [], filled
                take = min(n - lo, size)
            part.append(buf[lo : lo + take])
            lo += take
            filled += take
    if part:
        yield part, start


def _finish(plan: ReadPlan, i: int, mem: memoryview, targets, src_dtypes, paths) -> None:
    t = plan.transfers[i]
    dtype = src_dtypes[(t.rank, t.fqn)]
    src = (
        torch.frombuffer(mem, dtype=torch.uint8) if len(mem) else torch.empty(0, dtype=torch.uint8)
    )
    src = src.view(dtype).reshape(box_shape(t.src.logical_box))
    if t.tiles is not None:
        check_tiles(t, src, paths[t.rank])
    if t.window is not None:  # whole checksum blocks were read: the needed piece of them
        w = t.window
        strides, step = [], 1
        for n in reversed(w.array_shape):
            strides.append(step)
            step *= n
        strides.reverse()
        offset = w.base + sum(lo * s for (lo, _), s in zip(w.array_box, strides, strict=True))
        src = src.as_strided(box_shape(w.array_box), strides, src.storage_offset() + offset)
    piece_view(targets[t.target], t.dst).copy_(src)
