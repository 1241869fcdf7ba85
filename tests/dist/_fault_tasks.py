"""Task functions: saves that meet a storage fault (a full disk, EIO, EACCES) and loads of a
damaged checkpoint, on gloo ranks."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import anyshard
from anyshard.errors import AnyshardError

CODES = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}


class _FailingWriter:
    """A data file's stream that writes part of the first block it is given, then fails."""

    def __init__(self, f, code: int):
        self._f, self._code = f, code

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view[: max(1, len(view) // 2)])
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name):
        return getattr(self._f, name)


@contextmanager
def inject(kind: str | None) -> Iterator[None]:
    """Make this rank's data file writes fail with ``kind`` (None: no fault), below the storage
    layer (its module's ``open``): ENOSPC and EIO halfway through the first write (a partial
    file is left), EACCES when the file is opened."""
    if kind is None:
        yield
        return
    import builtins

    from anyshard.format import storage

    code = CODES[kind]

    def failing_open(path, mode="r", *args, **kwargs):
        if "w" not in mode or f"{os.sep}data{os.sep}" not in str(path):
            return builtins.open(path, mode, *args, **kwargs)
        if code == errno.EACCES:
            raise PermissionError(code, os.strerror(code), path)
        return _FailingWriter(builtins.open(path, mode, *args, **kwargs), code)

    storage.open = failing_open  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del storage.open  # type: ignore[attr-defined]


def _files(path: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names
    )


def failed_save_task(root: str, kind: str | None, fault_ranks: list[int], mode: str, mib: float):
    """Commit a small step 1; save a step 2 of ``mib`` MiB per rank while ``kind`` is injected
    on ``fault_ranks`` (None: the disk itself is full); then a small step 3. Returns what this
    rank raised, the files step 2 left, and whether step 1 and step 3 load back bit-exact."""
    rank = dist.get_rank()
    small = {"small": torch.arange(8.0), "step": 1}
    anyshard.save(f"{root}/step-1", small)
    big = {f"big{rank}": torch.rand(int(mib * 2**18)), "step": 2}
    raised = None
    with inject(kind if rank in fault_ranks else None):
        try:
            handle = anyshard.save(f"{root}/step-2", big, async_=mode == "async")
            if handle is not None:
                handle.result()
        except AnyshardError as e:
            raised = {"type": type(e).__name__, "text": str(e)}
        except Exception as e:  # noqa: BLE001 - what the test asserts against
            raised = {"type": f"not an AnyshardError: {type(e).__name__}", "text": str(e)}
    dist.barrier()
    left = _files(f"{root}/step-2") if os.path.exists(f"{root}/step-2") else None
    target = {"small": torch.zeros(8), "step": 0}
    anyshard.load(f"{root}/step-1", target)
    loads = torch.equal(target["small"], small["small"]) and target["step"] == 1
    third = {"small": torch.arange(8.0) * 3, "step": 3}
    anyshard.save(f"{root}/step-3", third)
    back = {"small": torch.zeros(8), "step": 0}
    anyshard.load(f"{root}/step-3", back)
    next_ok = torch.equal(back["small"], third["small"]) and back["step"] == 3
    return {"raised": raised, "left": left, "step1_loads": loads, "step3_saved": next_ok}


def damaged_read_once_task(path: str, numel: int) -> dict:
    """Save a plain tensor of ``numel`` floats (whole on every rank), flip the last byte of its
    data file (in the part the last rank fetches under read-once), then load it with
    ``read_once=True`` on every rank: what each rank raised and how long it took."""
    import time

    rank = dist.get_rank()
    w = torch.arange(float(numel))
    anyshard.save(path, {"w": w, "step": 1})
    if rank == 0:
        data = os.path.join(path, "data", os.listdir(os.path.join(path, "data"))[0])
        with open(data, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x40]))
    dist.barrier()
    target = {"w": torch.zeros(numel), "step": 0}
    t0 = time.monotonic()
    raised = None
    try:
        anyshard.load(path, target, read_once=True)
    except AnyshardError as e:
        raised = {"type": type(e).__name__, "text": str(e)}
    except Exception as e:  # noqa: BLE001 - what the test asserts against
        raised = {"type": f"not an AnyshardError: {type(e).__name__}", "text": str(e)}
    return {"raised": raised, "seconds": time.monotonic() - t0}
