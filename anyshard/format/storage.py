"""The one path abstraction: every file operation of anyshard goes through here.

Paths are ``str`` end to end: a plain path uses the local OS (``os.pread`` into caller buffers,
no intermediate copies); anything with a URL scheme goes through fsspec.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from anyshard.errors import StorageError

__all__ = [
    "exists",
    "is_url",
    "join",
    "listdir",
    "makedirs",
    "open_writer",
    "read_bytes",
    "read_into",
    "remove_tree",
    "size",
    "write_bytes_atomic",
    "FileReader",
]


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def join(root: str, *parts: str) -> str:
    if is_url(root):
        return posixpath.join(root.rstrip("/"), *parts)
    return os.path.join(_local(root), *parts)


def _fs(path: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise StorageError(f"cannot open {path}: {e}") from e


def exists(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.exists(p)
    return os.path.exists(_local(path))


def size(path: str) -> int:
    try:
        if is_url(path):
            fs, p = _fs(path)
            return int(fs.size(p))
        return os.path.getsize(_local(path))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StorageError(f"cannot stat {path}: {e}") from e


def makedirs(path: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(_local(path), exist_ok=True)


def listdir(path: str) -> list[str]:
    if is_url(path):
        fs, p = _fs(path)
        return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))
    return sorted(os.listdir(_local(path)))


def remove_tree(path: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        fs.rm(p, recursive=True)
    else:
        import shutil

        shutil.rmtree(_local(path))


def read_bytes(path: str) -> bytes:
    try:
        if is_url(path):
            fs, p = _fs(path)
            return fs.cat_file(p)
        with open(_local(path), "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError):  # callers say what the path should have been
        raise
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e}") from e


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write a small document so that readers see either nothing or all of it."""
    try:
        if is_url(path):
            fs, p = _fs(path)
            fs.pipe_file(p, data)  # one PUT: object stores make it visible whole or not at all
            return
        local = _local(path)
        tmp = f"{local}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local)
        _fsync_dir(os.path.dirname(local) or ".")
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e}") from e


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def open_writer(path: str, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary stream for a new file; flushed (and fsynced, locally) when the block ends."""
    try:
        if is_url(path):
            fs, p = _fs(path)
            with fs.open(p, "wb") as f:
                yield f
            return
        with open(_local(path), "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e}") from e


class FileReader:
    """Positional reads from one file into caller-provided buffers; thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._file = None
        self._lock = threading.Lock()
        try:
            if is_url(path):
                fs, p = _fs(path)
                self._fs, self._p = fs, p
            else:
                self._fd = os.open(_local(path), os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"cannot open {path}: {e}") from e

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; `EOFError` when the file ends first, `StorageError` on I/O errors."""
        n = buf.nbytes
        try:
            if self._fd is not None:
                done = 0
                while done < n:
                    got = os.preadv(self._fd, [buf[done:]], offset + done)
                    if got == 0:
                        raise EOFError(
                            f"expected {n} bytes at offset {offset}, the file ends at {offset + done}"
                        )
                    done += got
                return
            data = self._fs.cat_file(self._p, start=offset, end=offset + n)
        except FileNotFoundError:  # a URL is opened lazily: callers say which file is missing
            raise
        except OSError as e:
            raise StorageError(
                f"{self.path}: read of {n} bytes at offset {offset} failed: {e}"
            ) from e
        if len(data) != n:
            raise EOFError(f"expected {n} bytes at offset {offset}, got {len(data)}")
        buf[:] = data

    @property
    def fd(self) -> int | None:
        """The OS file descriptor of a local file (None for URLs)."""
        return self._fd

    def readv(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from the contiguous bytes at ``offset`` (one ``preadv``)."""
        if self._fd is not None:
            total = sum(len(b) for b in buffers) if len(buffers) > 1 else len(buffers[0])
            try:
                got = os.preadv(self._fd, buffers, offset)
            except OSError as e:
                raise StorageError(
                    f"{self.path}: read of {total} bytes at offset {offset} failed: {e}"
                ) from e
            if got != total:
                self._finish_short(offset, buffers, got)
            return
        if len(buffers) == 1:
            self.read_into(offset, buffers[0])
            return
        data = memoryview(bytearray(sum(len(b) for b in buffers)))
        self.read_into(offset, data)
        pos = 0
        for b in buffers:
            b[:] = data[pos : pos + len(b)]
            pos += len(b)

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


def read_into(path: str, offset: int, buf: memoryview) -> None:
    with FileReader(path) as r:
        r.read_into(offset, buf)
