"""The one path abstraction: every file operation of anyshard goes through here.

Paths are ``str`` end to end: a plain path uses the local OS (``os.preadv`` into caller buffers,
no intermediate copies); anything with a URL scheme goes through fsspec, configured the standard
ways (AWS_* variables, AWS_ENDPOINT_URL included; fsspec configuration such as FSSPEC_S3_*), never
by code. On URLs a transient failure (dropped connection, timeout, HTTP 5xx or 429) is retried
with exponential backoff until ``ANYSHARD_STORAGE_DEADLINE`` seconds (default 120) have passed,
each attempt cut off after ``ANYSHARD_STORAGE_ATTEMPT_TIMEOUT`` (default a quarter of the
deadline); then a `StorageError` names the object and the last cause. A missing object raises
`FileNotFoundError` at once, for the caller to say what it should have been. The URL machinery
lives in `anyshard.format.object_store` (retries, whole objects, the commit's exclusive PUT
`put_if_absent`, S3 multipart streams) and `anyshard.format.ranged_reads` (coalesced ranged
reads).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import BinaryIO

from anyshard.errors import StorageError
from anyshard.format.object_store import (
    MultipartWriter,
    call,
    object_exists,
    put_if_absent,
    put_object,
    read_object,
    retry,
    speaks_s3,
)
from anyshard.format.ranged_reads import read_spans

__all__ = [
    "exists",
    "is_url",
    "join",
    "listdir",
    "makedirs",
    "normalize",
    "open_writer",
    "parent",
    "read_bytes",
    "remove_file",
    "remove_tree",
    "size",
    "upload",
    "write_bytes_atomic",
    "FileReader",
]

# Object stores have no directories: creating one is a no-op there.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"}


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def join(root: str, *parts: str) -> str:
    if is_url(root):
        return posixpath.join(root.rstrip("/"), *parts)
    return os.path.join(_local(root), *parts)


def normalize(path: str) -> str:
    """``path`` in one spelling (absolute, normalised; a URL without a trailing slash), so that
    two spellings of one file compare equal."""
    if is_url(path):
        return path.rstrip("/")
    return os.path.abspath(os.path.normpath(_local(path)))


def parent(path: str) -> str:
    """The directory holding ``path`` (a checkpoint's root, for a step directory)."""
    if is_url(path):
        return posixpath.dirname(path.rstrip("/"))
    return os.path.dirname(os.path.normpath(_local(path)))


def _fs(path: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise StorageError(f"cannot open {path}: {e}") from e


def _url_op(path: str, what: str, method: str, *args, **kwargs):
    fs, p = _fs(path)
    return retry(path, what, lambda t: call(fs, method, t, p, *args, **kwargs))


# --- whole files ------------------------------------------------------------------------------


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(_local(path))
    fs, p = _fs(path)
    return object_exists(fs, p, path)


def size(path: str) -> int:
    try:
        if is_url(path):
            fs, p = _fs(path)
            fs.invalidate_cache(p)
            return int(retry(path, "stat", lambda t: call(fs, "size", t, p)))
        return os.path.getsize(_local(path))
    except (FileNotFoundError, StorageError):
        raise
    except OSError as e:
        raise StorageError(f"cannot stat {path}: {e}") from e


def makedirs(path: str) -> None:
    """Create ``path`` and its missing parents; locally, durably: the parent of every directory
    created is synced, so that a crash cannot lose the directory under files written into it."""
    if not is_url(path):
        local = os.path.abspath(_local(path))
        missing = []
        while not os.path.isdir(local):
            missing.append(local)
            parent = os.path.dirname(local)
            if parent == local:
                break
            local = parent
        if not missing:
            return
        os.makedirs(missing[0], exist_ok=True)
        for d in reversed(missing):
            _fsync_dir(os.path.dirname(d))
        return
    fs, p = _fs(path)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if not protocols & _OBJECT_STORES:
        retry(path, "makedirs", lambda t: call(fs, "makedirs", t, p, exist_ok=True))


def modified(path: str) -> float:
    """When the file ``path`` was last written (seconds since the epoch)."""
    if not is_url(path):
        return os.stat(_local(path)).st_mtime
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    info = retry(path, "stat", lambda t: call(fs, "info", t, p))
    stamp = info.get("LastModified", info.get("mtime", info.get("last_modified")))
    if stamp is None:
        raise StorageError(f"{path}: the store gives no modification time")
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def listdir(path: str) -> list[str]:
    if not is_url(path):
        return sorted(os.listdir(_local(path)))
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    names = retry(path, "list", lambda t: call(fs, "ls", t, p, detail=False))
    return sorted(posixpath.basename(e.rstrip("/")) for e in names)


def remove_file(path: str) -> None:
    """Remove one file (locally, durably: the directory entry is synced)."""
    if is_url(path):
        _url_op(path, "remove", "rm_file")
        return
    local = _local(path)
    os.unlink(local)
    _fsync_dir(os.path.dirname(local) or ".")


def remove_tree(path: str) -> None:
    if is_url(path):
        _url_op(path, "remove", "rm", recursive=True)
    else:
        import shutil

        shutil.rmtree(_local(path))


def read_bytes(path: str) -> bytes:
    try:
        if is_url(path):
            fs, p = _fs(path)
            return read_object(fs, p, path)
        with open(_local(path), "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, StorageError):  # callers say what it should be
        raise
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e}") from e


def _no_bucket(path: str) -> StorageError:
    return StorageError(
        f"cannot write {path}: the bucket (or parent directory) does not exist; create it first"
    )


def write_bytes_atomic(path: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write a small document so that readers see either nothing or all of it.

    With ``exclusive``, `FileExistsError` if ``path`` exists, decided atomically where the
    backend can (local files: a hard link; S3: a conditional PUT, ``If-None-Match: *``, in
    `object_store.put_if_absent`), so two writers cannot both commit; other URL schemes only
    check first.
    """
    try:
        if is_url(path):
            fs, p = _fs(path)
            (put_if_absent if exclusive else put_object)(fs, p, path, data)
            return
        local = _local(path)
        tmp = f"{local}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # a full disk keeps no half-written document
                os.unlink(tmp)
            raise
        if exclusive:
            try:
                os.link(tmp, local)  # fails if ``local`` exists, unlike a rename
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, local)
        _fsync_dir(os.path.dirname(local) or ".")
    except FileExistsError:
        raise
    except FileNotFoundError:
        raise _no_bucket(path) from None
    except StorageError as e:
        if is_url(path) and _bucket_missing(path):  # some stores answer 403, not NoSuchBucket
            raise _no_bucket(path) from e
        raise
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e}") from e


def _bucket_missing(path: str) -> bool:
    """Whether the bucket of the URL ``path`` does not exist (False when that cannot be told)."""
    try:
        fs, p = _fs(path)
        return not fs.exists(p.split("/", 1)[0])
    except Exception:
        return False


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- streamed writes --------------------------------------------------------------------------


@contextmanager
def open_writer(path: str, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary stream for a new file; flushed (and fsynced, locally) when the block ends.

    On S3 the object is written as a multipart upload with bounded memory, and appears only
    when the block ends without an error; other URL schemes use fsspec's buffered writer.
    """
    try:
        if not is_url(path):
            with open(_local(path), "wb") as f:
                yield f
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            if fsync:  # the new file's directory entry, too
                _fsync_dir(os.path.dirname(_local(path)) or ".")
            return
        fs, p = _fs(path)
        if not speaks_s3(fs):
            with fs.open(p, "wb") as f:
                yield f
            return
        writer = MultipartWriter(fs, p, path)
        try:
            yield writer
            writer.commit()
        except BaseException:
            writer.abort()
            raise
    except FileNotFoundError:
        raise _no_bucket(path) from None
    except StorageError:
        raise
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e}") from e


def upload(src: str, dst: str, *, block: int = 8 << 20) -> int:
    """Copy the file ``src`` to ``dst`` (either may be a URL) as a stream of ``block``-byte
    parts, in bounded memory; returns the bytes copied."""
    done = 0
    buf = bytearray(block)
    with FileReader(src) as reader, open_writer(dst) as out:
        total = size(src)
        while done < total:
            n = min(block, total - done)
            view = memoryview(buf)[:n]
            reader.read_into(done, view)
            out.write(view)
            done += n
    return done


# --- positional reads -------------------------------------------------------------------------


class FileReader:
    """Positional reads from one file into caller-provided buffers; thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        try:
            if is_url(path):
                self._fs, self._p = _fs(path)
            else:
                self._fd = os.open(_local(path), os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"cannot open {path}: {e}") from e

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; `EOFError` when the file ends first, `StorageError` on I/O errors."""
        n = buf.nbytes
        if self._fd is None:  # a URL opens lazily: a missing object raises FileNotFoundError here
            self.read_scattered([(offset, buf)])
            return
        try:
            done = 0
            while done < n:
                got = os.preadv(self._fd, [buf[done:]], offset + done)
                if got == 0:
                    raise EOFError(
                        f"expected {n} bytes at offset {offset}, the file ends at {offset + done}"
                    )
                done += got
        except OSError as e:
            raise StorageError(
                f"{self.path}: read of {n} bytes at offset {offset} failed: {e}"
            ) from e

    def read_prefix(self, n: int) -> bytes:
        """Up to ``n`` bytes from the start of the file (fewer when it is shorter): one read
        or one GET for a header, whatever its length turns out to be."""
        if self._fd is None:
            try:
                return _url_op(self.path, "read", "cat_file", start=0, end=n)
            except EOFError:  # a range over an empty object
                return b""
        try:
            return os.pread(self._fd, n, 0)
        except OSError as e:
            raise StorageError(f"{self.path}: read of {n} bytes failed: {e}") from e

    @property
    def fd(self) -> int | None:
        """The OS file descriptor of a local file (None for URLs)."""
        return self._fd

    def readv(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from the contiguous bytes at ``offset`` (one ``preadv``)."""
        if self._fd is None:
            spans, pos = [], offset
            for b in buffers:
                spans.append((pos, b))
                pos += len(b)
            self.read_scattered(spans)
            return
        total = sum(len(b) for b in buffers) if len(buffers) > 1 else len(buffers[0])
        try:
            got = os.preadv(self._fd, buffers, offset)
        except OSError as e:
            raise StorageError(
                f"{self.path}: read of {total} bytes at offset {offset} failed: {e}"
            ) from e
        if got != total:
            self._finish_short(offset, buffers, got)

    def read_scattered(self, spans: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each buffer with the bytes at its offset.

        On a URL, spans closer than 1 MiB are fetched as one GET (see `ranged_reads.read_spans`
        for the sizes of GETs and how many run at once): a thousand row-sized spans cost a few
        requests, not a thousand round trips. Locally, one ``preadv`` per span.
        """
        if self._fd is not None:
            for offset, buf in spans:
                self.read_into(offset, buf)
            return
        read_spans(self._fs, self._p, self.path, spans)

    def _finish_short(self, offset: int, buffers: list[memoryview], got: int) -> None:
        """After a short ``preadv`` (rare on regular files): finish buffer by buffer."""
        pos = 0
        for b in buffers:
            n = len(b)
            if pos + n > got:
                skip = max(got - pos, 0)
                self.read_into(offset + pos + skip, b[skip:])
            pos += n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
