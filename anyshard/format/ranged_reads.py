"""Ranged reads of an object, for `anyshard.format.storage`: near ranges coalesced into one GET,
GETs concurrent; on S3 each GET's body streamed straight into the caller's buffers, a failed GET
going on from the byte it reached. Every GET runs under `object_store.retry`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from anyshard._compat import s3_call, s3_request_params
from anyshard.errors import StorageError
from anyshard.format.object_store import call, is_transient, retry

__all__ = ["MAX_GAP", "read_spans"]

Span = tuple[int, memoryview]  # (offset in the object, buffer to fill)

MAX_GAP = 1 << 20  # ranges closer than this are fetched as one GET, gap included
MAX_BLOCK = 16 << 20  # ... but no GET is larger: big ranges split into concurrent GETs
WAVE_BYTES = 64 << 20  # bytes in flight per batch of concurrent GETs of one reader
MAX_STREAM = 256 << 20  # S3: a streamed GET covers at most this many bytes
STREAMS = 8  # S3: streamed GETs in flight per call
CHUNK = 1 << 20  # S3: a streamed GET reads its body this much at a time (gaps: into a junk buffer)


def read_spans(fs, path: str, url: str, spans: Sequence[Span]) -> None:
    """Fill each buffer of ``spans`` from its offset in the object, near spans sharing a GET.

    On S3 each GET streams its body straight into the buffers (memory: a chunk per GET, not the
    range), so one GET may cover up to `MAX_STREAM` bytes; a GET that fails goes on from the
    byte it reached. Elsewhere (and for spans that overlap) GETs of at most `MAX_BLOCK` are read
    whole, `WAVE_BYTES` at a time.
    """
    if s3_call(fs) is not None and not getattr(fs, "asynchronous", False):
        blocks = list(_blocks(spans, MAX_STREAM))
        if not _overlapping(blocks):
            _stream(fs, path, url, blocks)
            return
    wave: list = []
    for block in _blocks(spans, MAX_BLOCK):
        wave.append(block)
        if sum(b - a for a, b, _ in wave) >= WAVE_BYTES:
            _fetch(fs, path, url, wave)
            wave = []
    if wave:
        _fetch(fs, path, url, wave)


def _blocks(spans: Sequence[Span], most: int) -> Iterator[tuple[int, int, list[Span]]]:
    """(start, stop, spans) of the GETs that cover ``spans``: near ones merged, none longer
    than ``most`` bytes."""
    pieces = []
    for offset, buf in spans:
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        for a in range(0, len(buf), most):
            pieces.append((offset + a, buf[a : a + most]))
    pieces.sort(key=lambda s: s[0])
    block: list | None = None
    for offset, buf in pieces:
        stop = offset + len(buf)
        if block and offset - block[1] <= MAX_GAP and max(stop, block[1]) - block[0] <= most:
            block[1] = max(block[1], stop)
            block[2].append((offset, buf))
            continue
        if block:
            yield tuple(block)
        block = [offset, stop, [(offset, buf)]]
    if block:
        yield tuple(block)


def _fetch(fs, path: str, url: str, blocks: list[tuple[int, int, list[Span]]]) -> None:
    """GET ``blocks`` concurrently (on a retry, only those that failed); scatter the bytes."""
    done: set[int] = set()

    def attempt(timeout: float) -> None:
        todo = [i for i in range(len(blocks)) if i not in done]
        starts = [blocks[i][0] for i in todo]
        ends = [blocks[i][1] for i in todo]
        got = call(fs, "cat_ranges", timeout, [path] * len(todo), starts, ends)
        failed = []
        for i, data in zip(todo, got, strict=True):
            if isinstance(data, BaseException):
                failed.append(data)
            else:
                _scatter(*blocks[i], data)
                done.add(i)
        if failed:  # the one to act on: a missing object first, then one retrying cannot fix
            failed.sort(key=lambda e: (not isinstance(e, FileNotFoundError), is_transient(e)))
            raise failed[0]

    retry(url, f"read of bytes [{blocks[0][0]}, {blocks[-1][1]})", attempt)


def _scatter(start: int, stop: int, spans: list[Span], data: bytes) -> None:
    if len(data) < stop - start:
        raise EOFError(
            f"expected {stop - start} bytes at offset {start}, the object ends at {start + len(data)}"
        )
    view = memoryview(data)
    for offset, buf in spans:
        buf[:] = view[offset - start : offset - start + len(buf)]


class _Stream:
    """One streamed GET of ``[start, stop)``: ``done`` bytes of it are in their buffers."""

    def __init__(self, start: int, stop: int, spans: list[Span]):
        self.start, self.stop, self.spans = start, stop, spans
        self.done = 0

    async def run(self, fs, bucket: str, key: str, kwargs: dict, stall: float) -> None:
        pos = self.start + self.done
        get = s3_call(fs)
        assert get is not None  # `read_spans` streams from S3 filesystems only
        resp = await asyncio.wait_for(
            get(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={pos}-{self.stop - 1}", **kwargs
            ),
            stall,
        )
        body = resp["Body"]
        got = resp.get("ContentRange") or ""
        if not got.startswith(f"bytes {pos}-"):  # a server that ignored the Range header
            await _close(body)
            raise StorageError(
                f"s3://{bucket}/{key}: asked for bytes {pos}-{self.stop - 1}, the server answered "
                f"{got or 'without a Content-Range'}; it does not serve byte ranges as S3 does"
            )
        junk = None
        try:
            for offset, buf in self.spans:
                end = offset + len(buf)
                if end <= pos:
                    continue
                if offset > pos:  # a gap between spans: read through it
                    junk = junk if junk is not None else memoryview(bytearray(min(CHUNK, MAX_GAP)))
                    while pos < offset:
                        pos = await self._into(body, junk[: min(len(junk), offset - pos)], stall)
                while pos < end:
                    a = pos - offset
                    pos = await self._into(body, buf[a : min(len(buf), a + CHUNK)], stall)
        finally:
            await _close(body)

    async def _into(self, body, buf: memoryview, stall: float) -> int:
        n = await asyncio.wait_for(body.readinto(buf), stall)
        if n == 0:
            end = self.start + self.done
            raise EOFError(
                f"expected {self.stop - self.start} bytes at offset {self.start}, the object ends at {end}"
            )
        self.done += n
        return self.start + self.done


async def _close(body) -> None:
    """Release a response body's connection (``aclose`` where the backend has it)."""
    closer = getattr(body, "aclose", None)
    if closer is not None:
        await closer()
    else:
        body.close()


def _overlapping(blocks: list[tuple[int, int, list[Span]]]) -> bool:
    """Whether two spans of a block share bytes (a stream fills each byte once, in order)."""
    for _, _, spans in blocks:
        end = -1
        for offset, buf in spans:
            if offset < end:
                return True
            end = max(end, offset + len(buf))
    return False


def _stream(fs, path: str, url: str, blocks: list[tuple[int, int, list[Span]]]) -> None:
    """GET ``blocks`` from S3, `STREAMS` at a time, each body streamed into its spans; on a
    retry every unfinished GET goes on from the byte it reached. An attempt is cut off when a
    GET makes no progress for the attempt's timeout, and the deadline counts from the last
    attempt that moved bytes."""
    from fsspec.asyn import sync

    bucket, key, version = fs.split_path(path)
    kwargs = s3_request_params(fs)
    if version:
        kwargs["VersionId"] = version
    streams = [_Stream(*b) for b in blocks]

    async def all_of(stall: float) -> list:
        gate = asyncio.Semaphore(STREAMS)

        async def one(st: _Stream) -> None:
            async with gate:
                await st.run(fs, bucket, key, kwargs, stall)

        todo = [st for st in streams if st.start + st.done < st.stop]
        return await asyncio.gather(*(one(st) for st in todo), return_exceptions=True)

    def attempt(timeout: float) -> None:
        got = sync(fs.loop, all_of, timeout)
        failed = [e for e in got if isinstance(e, BaseException)]
        if failed:  # the one to act on: a missing object first, then one retrying cannot fix
            failed.sort(key=lambda e: (not isinstance(e, FileNotFoundError), is_transient(e)))
            raise failed[0]

    if not blocks:
        return
    first, last = blocks[0][0], blocks[-1][1]
    done = lambda: sum(st.done for st in streams)  # noqa: E731
    retry(url, f"read of bytes [{first}, {last})", attempt, progress=done)
