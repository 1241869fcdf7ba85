"""Object storage, for `anyshard.format.storage`: every call under a retry with a deadline,
whole objects read and written, the commit's exclusive write (`put_if_absent`: one conditional
PUT), and streamed S3 multipart writes. Ranged reads of an object are `ranged_reads`'.

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
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import cache
from typing import Any, TypeVar

from anyshard._compat import s3_request
from anyshard.errors import StorageError

__all__ = [
    "MultipartWriter",
    "call",
    "is_transient",
    "object_exists",
    "put_if_absent",
    "put_object",
    "read_object",
    "retry",
    "speaks_s3",
]

T = TypeVar("T")

PART_BYTES = 32 << 20  # multipart part size (S3 needs >= 5 MiB); doubles every 1000 parts
PARTS_IN_FLIGHT = 4  # a writer holds at most this many parts (+ the one it fills) in memory
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


def call(fs, method: str | Callable[..., Any], timeout: float, *args, **kwargs):
    """``fs.method(...)`` (``method``: a name, or a method of ``fs`` itself), cut off after
    ``timeout`` seconds where fsspec can (async backends)."""
    if getattr(fs, "async_impl", False) and not getattr(fs, "asynchronous", False):
        kwargs["timeout"] = timeout
    return (getattr(fs, method) if isinstance(method, str) else method)(*args, **kwargs)


def speaks_s3(fs) -> bool:
    """Whether ``fs`` sends S3 API calls of anyshard's own (s3fs): conditional PUTs and
    multipart uploads; other fsspec backends get their plain writes."""
    return s3_request(fs) is not None


# --- whole objects, and the commit ------------------------------------------------------------


def object_exists(fs, path: str, url: str) -> bool:
    fs.invalidate_cache(path)  # another process may have written it since this one listed
    try:
        retry(url, "stat", lambda t: call(fs, "info", t, path))
    except FileNotFoundError:
        return False
    return True


def read_object(fs, path: str, url: str) -> bytes:
    try:  # a range from 0, not the whole object: s3fs would HEAD it first
        return retry(url, "read", lambda t: call(fs, "cat_file", t, path, start=0))
    except EOFError:  # S3 answers 416 to a range over an empty object
        return b""


def put_object(fs, path: str, url: str, data: bytes) -> None:
    """One PUT: an object store makes it visible whole or not at all."""
    retry(url, "write", lambda t: call(fs, "pipe_file", t, path, data))


def put_if_absent(fs, path: str, url: str, data: bytes) -> None:
    """The commit to object storage: ``data`` written at ``url`` only where no object is there,
    else `FileExistsError`, so that two writers cannot both commit.

    On S3 one conditional PUT (``If-None-Match: *``, s3fs's ``mode="create"``) decides it
    atomically; a refusal where the object holds ``data`` is a retry after this writer's own PUT,
    whose answer was lost. Other stores are checked first, then written (not atomic).
    """
    if not speaks_s3(fs):
        if object_exists(fs, path, url):
            raise FileExistsError(f"{url} exists")
        put_object(fs, path, url, data)
        return
    try:
        retry(url, "write", lambda t: call(fs, "pipe_file", t, path, data, mode="create"))
    except FileExistsError:
        if read_object(fs, path, url) != data:  # else: a retry after our own PUT
            raise FileExistsError(f"{url} exists") from None


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
        request = s3_request(self._fs)
        return retry(self._url, what, lambda t: call(self._fs, request, t, method, **kwargs))

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
