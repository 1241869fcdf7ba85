"""The URL half of `anyshard.format.storage`: retries until a deadline, streamed S3 multipart
writes, and coalesced concurrent ranged reads. Only `storage` imports this module.

Every call to a remote object goes through `retry`: transient failures (dropped connections,
timeouts, HTTP 5xx, 408 and 429) are retried with jittered exponential backoff until
``ANYSHARD_STORAGE_DEADLINE`` seconds (default 120), each attempt cut off after
``ANYSHARD_STORAGE_ATTEMPT_TIMEOUT`` (default a quarter of the deadline). A streamed S3 read is
cut off after that long without a byte, and its deadline restarts after each failed attempt that
moved bytes. fsspec backends retry
a little on their own (botocore: ``AWS_MAX_ATTEMPTS``); this layer is the one with a deadline.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import cache
from typing import TypeVar

from anyshard._compat import s3_call
from anyshard.errors import StorageError

__all__ = ["MultipartWriter", "call", "read_spans", "retry"]

T = TypeVar("T")
Span = tuple[int, memoryview]  # (offset in the object, buffer to fill)

PART_BYTES = 32 << 20  # multipart part size (S3 needs >= 5 MiB); doubles every 1000 parts
PARTS_IN_FLIGHT = 4  # a writer holds at most this many parts (+ the one it fills) in memory
MAX_GAP = 1 << 20  # ranges closer than this are fetched as one GET, gap included
MAX_BLOCK = 16 << 20  # ... but no GET is larger: big ranges split into concurrent GETs
WAVE_BYTES = 64 << 20  # bytes in flight per batch of concurrent GETs of one reader
MAX_STREAM = 256 << 20  # S3: a streamed GET covers at most this many bytes
STREAMS = 8  # S3: streamed GETs in flight per call
CHUNK = 1 << 20  # S3: a streamed GET reads its body this much at a time (gaps: into a junk buffer)
FIRST_BACKOFF, MAX_BACKOFF = 0.1, 5.0


# --- what to retry ----------------------------------------------------------------------------


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise StorageError(
            f"{name}={raw!r} is not a positive number of seconds; set e.g. {name}=120"
        )
    return value


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _http(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code behind ``e`` (botocore or aiohttp), if any."""
    for x in _chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return status, response.get("Error", {}).get("Code")
        if isinstance(getattr(x, "status", None), int):
            return x.status, None
    return None, None


@cache
def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    try:
        from botocore import exceptions, parsers

        names = ("HTTPClientError", "ConnectionError", "IncompleteReadError")
        types += [getattr(exceptions, n) for n in names if hasattr(exceptions, n)]
        types.append(parsers.ResponseParserError)
    except ImportError:
        pass
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT_ERRNOS = {
    errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", errno.EIO),
}  # fmt: skip
_TRANSIENT_CODES = {"SlowDown", "Throttling", "RequestTimeout", "InternalError"}


def is_transient(e: BaseException) -> bool:
    status, code = _http(e)
    if status is not None:
        return status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES
    if isinstance(e, (PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, _transient_types()):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def _why(e: BaseException) -> str:
    status, code = _http(e)
    code = "" if code in (None, str(status)) else f" {code}"
    http = f"HTTP {status}{code}, " if status else ""
    return f"{http}{type(e).__name__}: {e}" if str(e) else f"{http}{type(e).__name__}"


def retry(
    url: str,
    what: str,
    attempt: Callable[[float], T],
    progress: Callable[[], int] | None = None,
) -> T:
    """``attempt(timeout)`` until it succeeds or ``ANYSHARD_STORAGE_DEADLINE`` passes.

    `FileNotFoundError` and `FileExistsError` pass through at once, a range past the end of the
    object becomes an `EOFError`; an error that retrying cannot fix (denied access, bad request,
    no credentials) becomes a `StorageError` at once. With ``progress`` (a count of bytes done
    that failed attempts may advance), the deadline counts from the last attempt that advanced
    it: a long transfer that keeps moving is never cut off for its length.
    """
    deadline = _seconds("ANYSHARD_STORAGE_DEADLINE", 120.0)
    per_attempt = _seconds("ANYSHARD_STORAGE_ATTEMPT_TIMEOUT", max(deadline / 4, 1.0))
    start, backoff, attempts = time.monotonic(), FIRST_BACKOFF, 0
    mark = progress() if progress is not None else 0
    while True:
        attempts += 1
        left = deadline - (time.monotonic() - start)
        try:
            return attempt(max(min(per_attempt, left), 0.05))
        except (FileNotFoundError, FileExistsError, EOFError, StorageError):
            raise
        except Exception as e:
            status, code = _http(e)
            if code == "InvalidRange":
                raise EOFError(f"{what} reaches past the end of the object") from None
            if status == 412 or code == "PreconditionFailed":  # a conditional PUT: it exists
                raise FileExistsError(f"{url} exists") from None
            if code == "NoSuchBucket":
                raise FileNotFoundError(f"{url}: no such bucket") from None
            if not is_transient(e):
                raise StorageError(f"{url}: {what} failed: {_why(e)}") from e
            last = e
        if progress is not None and progress() != mark:
            mark, start, backoff = progress(), time.monotonic(), FIRST_BACKOFF
        pause = random.uniform(backoff / 2, backoff)
        elapsed = time.monotonic() - start
        if elapsed + pause >= deadline:
            raise StorageError(
                f"{url}: {what} failed {attempts} time(s) within {elapsed:.1f}s, the deadline "
                f"(ANYSHARD_STORAGE_DEADLINE={deadline:g}); last error: {_why(last)}"
            ) from last
        time.sleep(pause)
        backoff = min(backoff * 2, MAX_BACKOFF)


def call(fs, method: str, timeout: float, *args, **kwargs):
    """``fs.method(...)``, cut off after ``timeout`` seconds where fsspec can (async backends)."""
    if getattr(fs, "async_impl", False) and not getattr(fs, "asynchronous", False):
        kwargs["timeout"] = timeout
    return getattr(fs, method)(*args, **kwargs)


# --- streamed writes --------------------------------------------------------------------------

_POOL_LOCK = threading.Lock()
_POOL: list = [None, None]  # [pid, executor]: part uploads, apart from callers' own pools


def _uploads() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if _POOL[0] != os.getpid():
            _POOL[:] = [os.getpid(), ThreadPoolExecutor(16, thread_name_prefix="anyshard-upload")]
        return _POOL[1]


class MultipartWriter:
    """A streamed S3 object: parts upload concurrently as they fill, each retried on its own
    (re-sending a part number replaces it); nothing is visible until `commit`."""

    def __init__(self, fs, path: str, url: str):
        self._fs, self._path, self._url = fs, path, url
        self._bucket, self._key = fs.split_path(path)[:2]
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._size = 0

    def _s3(self, what: str, method: str, **kwargs):
        kwargs.update(Bucket=self._bucket, Key=self._key)
        return retry(self._url, what, lambda t: call(self._fs, "call_s3", t, method, **kwargs))

    def _part_bytes(self) -> int:
        return PART_BYTES << (len(self._parts) // 1000)  # S3 allows 10,000 parts

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self._part_bytes() - len(self._buf), len(mv) - pos)
            self._buf += mv[pos : pos + take]
            pos += take
            if len(self._buf) >= self._part_bytes():
                self._send_part()
        self._size += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        """Parts upload as they fill; the rest goes at `commit`."""

    def _send_part(self) -> None:
        if self._upload_id is None:
            started = self._s3("start of a multipart upload", "create_multipart_upload")
            self._upload_id = started["UploadId"]
        pending = [f for f in self._parts if not f.done()]
        while len(pending) >= PARTS_IN_FLIGHT:  # bounded memory: wait for a part to finish
            pending = list(wait(pending, return_when=FIRST_COMPLETED).not_done)
        for f in self._parts:  # fail early, not after writing everything
            if f.done() and f.exception() is not None:
                raise f.exception()
        body, self._buf = self._buf, bytearray()
        self._parts.append(_uploads().submit(self._upload, len(self._parts) + 1, body))

    def _upload(self, number: int, body: bytearray) -> dict:
        out = self._s3(
            f"upload of part {number}",
            "upload_part",
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def commit(self) -> None:
        """Make the object visible: one PUT if it fits in a part, else complete the upload."""
        if self._upload_id is None:
            self._s3("write", "put_object", Body=self._buf)
        else:
            if self._buf:
                self._send_part()
            parts = [f.result() for f in self._parts]
            try:
                self._s3(
                    "completion of the multipart upload",
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except FileNotFoundError:  # a retry after a completion whose answer was lost?
                self._fs.invalidate_cache(self._path)
                size = retry(self._url, "stat", lambda t: call(self._fs, "size", t, self._path))
                if size != self._size:
                    raise
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        for f in self._parts:
            f.cancel()
        wait(self._parts)
        if self._upload_id is not None:
            try:
                self._s3("abort of an upload", "abort_multipart_upload", UploadId=self._upload_id)
            except (OSError, EOFError):
                pass  # best effort: a bucket lifecycle rule removes what remains


# --- ranged reads -----------------------------------------------------------------------------


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
    kwargs = dict(getattr(fs, "req_kw", None) or {})
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
