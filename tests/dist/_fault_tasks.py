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


def skipping_checkpointer_task(root: str, mode: str, failing: list[int], fault_rank: int) -> dict:
    """A Checkpointer with ``on_error="skip"`` saving steps 1-6 while the data file writes of
    rank ``fault_rank`` fail with EIO at the steps in ``failing``: what each save returned, the
    failures recorded, what raised (and at which step), the committed steps left and whether
    the newest loads bit-exact."""
    import time
    import warnings

    from anyshard.format.steps import list_steps
    from anyshard.trainer_integration.checkpointer import Checkpointer

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ckpt = Checkpointer(root, async_=mode == "async", on_error="skip", max_failures=3)
    returned, raised = {}, None
    weights = {}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(1, 7):
            # sharded: every rank writes a data file
            w = DTensor.from_local(torch.full((512,), float(step * 10 + rank)), mesh, [Shard(0)])
            weights[step] = w.to_local().clone()
            try:
                with inject("eio" if rank == fault_rank and step in failing else None):
                    returned[step] = ckpt.save(step, {"model": {"w": w}, "step": step})
                    # an async save writes in the background: the fault stays injected until
                    # it is done (its error surfaces at the next save, as in training)
                    while not all(h.done() for h in ckpt._pending):  # noqa: SLF001
                        time.sleep(0.01)
            except AnyshardError as e:
                raised = {"step": step, "type": type(e).__name__, "text": str(e)}
                break
        if raised is None:
            try:
                ckpt.wait()
            except AnyshardError as e:
                raised = {"step": "wait", "type": type(e).__name__, "text": str(e)}
    committed = [s.step for s in list_steps(root) if s.committed]
    debris = [s.step for s in list_steps(root) if not s.committed]
    newest = None
    if committed:
        into = DTensor.from_local(torch.zeros(512), mesh, [Shard(0)])
        back = {"model": {"w": into}, "step": 0}
        Checkpointer(root).restore_latest(back)
        newest = bool(torch.equal(into.to_local(), weights[committed[-1]]))
    return {
        "returned": returned,
        "failures": [f["step"] for f in ckpt.failures],
        "raised": raised,
        "committed": committed,
        "debris": debris,
        "newest_loads": newest,
        "warned": sum("training goes on" in str(w.message) for w in warned),
    }


def _damage(path: str, kind: str, rank_file: int) -> None:
    """Damage the data file of rank ``rank_file``: a flipped byte of its data, a cut to half its
    size, a flipped byte of its header's JSON, or the file removed."""
    data = os.path.join(path, "data", f"rank-{rank_file:05d}.safetensors")
    if kind == "missing":
        os.remove(data)
        return
    with open(data, "r+b") as f:
        raw = bytearray(f.read())
        if kind == "truncate":
            f.truncate(len(raw) // 2)
            return
        at = len(raw) - 100 if kind == "flip" else 40  # the data's end, or inside the header
        raw[at] ^= 0x10
        f.seek(0)
        f.write(raw)


def fail_together_task(root: str, kind: str, entry: str) -> dict:
    """Save a state sharded over every rank (1 Mi floats: each rank's shard is several checksum
    blocks), damage the last rank's data file (``kind``), then load it through ``entry`` on every
    rank ("load": anyshard.load; "read_once": the same with read_once; "spec": a load of plain
    local tensors under a UCL spec, "spec_read_once" the same with read_once; "dcp": dcp.load
    through AnyshardReader, "dcp_read_once" the same reading once): what each raised and how
    long it took."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from anyshard.dcp import AnyshardReader, AnyshardWriter

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n = (1 << 20) // world
    local = torch.arange(float(n)) + rank * n
    spec = f'mesh tp;\n"w" -> "w" [{n * world}] : chunk(0, tp);\n'
    path = os.path.join(root, f"{kind}-{entry}")
    if entry.startswith("dcp"):
        dcp.save(
            {"w": DTensor.from_local(local, mesh, [Shard(0)])}, storage_writer=AnyshardWriter(path)
        )
    elif entry.startswith("spec"):
        anyshard.save(path, {"w": local, "step": 1}, spec=spec, layout={"tp": world})
    else:
        anyshard.save(path, {"w": DTensor.from_local(local, mesh, [Shard(0)]), "step": 1})
    dist.barrier()
    if rank == 0:
        _damage(path, kind, world - 1)
    dist.barrier()
    into = DTensor.from_local(torch.zeros(n), mesh, [Shard(0)])
    t0, raised = time.monotonic(), None
    try:
        if entry.startswith("dcp"):
            reader = AnyshardReader(path, read_once=entry == "dcp_read_once")
            dcp.load({"w": into}, storage_reader=reader)
        elif entry.startswith("spec"):
            state = {"w": torch.zeros(n), "step": 0}
            once = entry == "spec_read_once"
            anyshard.load(path, state, spec=spec, layout={"tp": world}, read_once=once)
        else:
            anyshard.load(path, {"w": into, "step": 0}, read_once=entry == "read_once")
    except AnyshardError as e:
        raised = {"type": type(e).__name__, "text": str(e)}
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raised = {"type": type(e).__name__, "text": str(e)}
    return {"raised": raised, "seconds": time.monotonic() - t0}


def save_over_committed_task(path: str) -> dict:
    """Save a sharded state to ``path``, then another to the same path: what each rank raised,
    and whether the first state still loads bit-exact (no rank wrote into it or removed a file)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    first = torch.arange(64.0) + 100 * rank
    anyshard.save(path, {"w": DTensor.from_local(first.clone(), mesh, [Shard(0)])})
    raised = None
    try:
        anyshard.save(path, {"w": DTensor.from_local(first * 0 - 1, mesh, [Shard(0)])})
    except AnyshardError as e:
        raised = {"type": type(e).__name__, "text": str(e)}
    into = DTensor.from_local(torch.zeros(64), mesh, [Shard(0)])
    anyshard.load(path, {"w": into})
    return {"raised": raised, "intact": bool(torch.equal(into.to_local(), first))}


def fault_soak_task(root: str, seed: int, rounds: int) -> dict:
    """Seeded storage faults, the same choices on every rank: each round commits a step, then
    saves the next while a fault (ENOSPC, EIO or EACCES) is injected on some ranks (sync or
    async), then saves that step again once the fault has cleared. Counts the faults, the saves
    that failed on every rank as an AnyshardError within 10 s, the files they left, the saves
    that succeeded after the fault cleared, and every committed step loaded back at the end
    (lost: missing or failing; wrong: loaded values that differ)."""
    import random
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    out = {"faults": 0, "failed": 0, "slow": 0, "left": 0, "retried": 0, "lost": 0, "wrong": 0}
    committed: dict[str, dict] = {}

    key = f"w{rank}"  # per-rank state, under per-rank names

    def state(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        return {key: torch.rand(4096 + 512 * rank, generator=g), "step": step}

    for i in range(rounds):
        good, bad = f"{root}/step-{2 * i + 1}", f"{root}/step-{2 * i + 2}"
        anyshard.save(good, state(2 * i + 1))
        committed[good] = state(2 * i + 1)
        kind = rng.choice(sorted(CODES))
        ranks = rng.sample(range(world), rng.randint(1, world))
        mode = rng.choice(["sync", "async"])
        out["faults"] += 1
        t0, raised = time.monotonic(), False
        with inject(kind if rank in ranks else None):
            try:
                handle = anyshard.save(bad, state(2 * i + 2), async_=mode == "async")
                if handle is not None:
                    handle.result()
            except AnyshardError:
                raised = True
        out["failed"] += raised
        out["slow"] += time.monotonic() - t0 > 10
        dist.barrier()
        out["left"] += len(_files(bad)) if os.path.exists(bad) else 0
        dist.barrier()
        anyshard.save(bad, state(2 * i + 2))  # the fault has cleared: no manual step
        committed[bad] = state(2 * i + 2)
        out["retried"] += 1
    for path, want in committed.items():
        got = {key: torch.zeros_like(want[key]), "step": 0}
        try:
            anyshard.load(path, got, strict=False)
        except AnyshardError:
            out["lost"] += 1
            continue
        out["wrong"] += not (torch.equal(got[key], want[key]) and got["step"] == want["step"])
    return out
