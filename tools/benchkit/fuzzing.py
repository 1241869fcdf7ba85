"""The fuzzer's engine (tools/fuzz_checkpoints.py): each mutation (`benchkit.mutations`) of a
pristine checkpoint, then every entry point called on it (`run_entry_points`; `LoadPool`: loads in
gloo processes). Recorded (`Findings`): every exception but an ``AnyshardError``, every call over
`SLOW_S` or growing the peak RSS by `RSS_GROWTH`, and the reads after a flipped data bit that
returned a wrong value.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import random
import resource
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

import anyshard
from anyshard.cli import main as cli_main
from anyshard.errors import AnyshardError
from anyshard.geometry.shards import chunk_bounds
from anyshard.reshard.verify import verify_checkpoint

from .mutations import SPEC, VALUES, Mutation, every_byte, make_corpus, mutate, snapshot

SLOW_S, KILL_S, RSS_GROWTH = 5.0, 30.0, 1 << 30


class _Timeout(BaseException):
    """A call ran past KILL_S (a BaseException: no `except Exception` in the library takes it)."""


def _alarm(signum, frame):
    raise _Timeout()


def attempt(fn) -> tuple[str, object, float]:
    """``fn()`` under a KILL_S alarm: (outcome, value, seconds); outcome ``ok`` (value: what it
    returned), ``refused`` (an AnyshardError), ``timeout`` (value: where in anyshard) or
    ``internal`` (value: the exception and where it was raised)."""
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, KILL_S)
    try:
        out = "ok", fn()
    except AnyshardError:
        out = "refused", None
    except _Timeout as e:
        at = [fr for fr in traceback.extract_tb(e.__traceback__) if "anyshard" in fr.filename]
        out = "timeout", "".join(f" at {fr.filename.split('/')[-1]}:{fr.lineno}" for fr in at[-1:])
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        fr = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{fr.filename.split('/')[-1]}:{fr.lineno}"
        out = "internal", f"{type(e).__name__}: {str(e)[:160]} ({where})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return (*out, time.monotonic() - start)


@dataclass
class Findings:
    mutations: int = 0
    calls: int = 0
    refused: int = 0
    internal: list[tuple[str, str, str]] = field(default_factory=list)
    slow: list[tuple[str, str, float]] = field(default_factory=list)
    rss: list[tuple[str, str, int]] = field(default_factory=list)
    flips: int = 0
    flips_returned_full: int = 0
    flips_undetected_full: list[str] = field(default_factory=list)
    flips_returned_part: int = 0
    flips_undetected_part: int = 0
    # --every-byte: tensors and JSON values returned after a flipped metadata byte; wrong ones
    meta_returned: int = 0
    meta_wrong: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)

    def note(self, label: str, entry: str, outcome: str, value, took: float) -> None:
        """Record an `attempt` that raised other than an AnyshardError, or took too long."""
        if outcome == "internal":
            self.internal.append((label, entry, value))
        if outcome == "timeout":
            self.slow.append((label, entry + value, KILL_S))
        elif took > SLOW_S:
            self.slow.append((label, entry, round(took, 2)))


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def call(f: Findings, label: str, entry: str, fn) -> tuple[bool, object]:
    """Run ``fn``; True and its result, or False when it raised (recorded unless an
    AnyshardError, the refusal every entry point owes a damaged checkpoint)."""
    before = _maxrss()
    outcome, value, took = attempt(fn)
    f.calls, f.refused = f.calls + 1, f.refused + (outcome == "refused")
    f.note(label, entry, outcome, value, took)
    if _maxrss() - before > RSS_GROWTH:
        f.rss.append((label, entry, _maxrss() - before))
    return outcome == "ok", value


def _cli(args: list[str]) -> int:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(args)
    if code == 3:
        raise RuntimeError(err.getvalue().strip().splitlines()[-2][:200])
    return code


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs included)."""
    x, y = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(x, y)


def run_entry_points(f: Findings, m: Mutation, label: str, path: str, pristine, tmp: str) -> None:
    returned: list[tuple[str, bool, torch.Tensor, object]] = []  # (name, whole?, value, index)
    values: list[dict] = []  # the JSON values a load returned

    def names():
        with anyshard.open(path) as view:
            for name in view.keys():
                view.metadata(name)
            view.values  # noqa: B018
            return list(view.keys())

    def read(name, entry):
        with anyshard.open(path) as view:
            if entry == "get_tensor":
                returned.append((name, True, view.get_tensor(name), None))
                return
            shape = view.metadata(name).shape
            if entry == "get_slice" and shape:  # the first half (at least one) of dim 0
                index = (slice(0, max(1, shape[0] // 2)),) + (slice(None),) * (len(shape) - 1)
            elif entry == "get_slice columns" and len(shape) >= 2:  # a 4-way split of the last
                index = (Ellipsis, slice(0, max(1, shape[-1] // 4)))  # dim: the tiles it touches
            else:
                return
            returned.append((name, False, view.get_slice(name)[index], index))

    ok, keys = call(f, label, "open", names)
    for name in keys if ok else pristine:  # each read alone: a refused one hides no other
        for entry in ("get_slice", "get_slice columns", "get_tensor"):
            call(f, label, entry, lambda name=name, entry=entry: read(name, entry))
    if m.corpus.startswith("anyshard"):

        def load():
            if m.corpus == "anyshard-spec":  # each rank's local tensors under the spec
                for r in range(2):
                    state, load_as = _rank_state(m.corpus, pristine, r, 2)
                    load_as(path, state)
                return
            state = {k: torch.zeros_like(v) for k, v in pristine.items()} | {"step": 0, "cfg": {}}
            anyshard.load(path, state)
            returned.extend((k, True, state[k], None) for k in pristine)
            values.append({"step": state["step"], "cfg": state["cfg"]})

        call(f, label, "load", load)
        call(f, label, "verify", lambda: verify_checkpoint(path))
    call(f, label, "inspect", lambda: _cli(["inspect", path]))
    call(f, label, "inspect --json", lambda: _cli(["inspect", path, "--json"]))
    out = os.path.join(tmp, "converted")
    shutil.rmtree(out, ignore_errors=True)
    call(f, label, "convert", lambda: _cli(["convert", path, out, "--to", "hf"]))
    meta = m.kind == "metadata-byte"  # whatever a read returned must be the pristine value
    for name, whole, value, index in returned if meta or m.flipped is not None else ():
        if (want := pristine.get(name)) is None:
            continue
        same = _same_bytes(value, want if index is None else want[index])
        if meta:
            f.meta_returned += 1
            f.meta_wrong += [] if same else [f"{label}: {name}"]
        elif whole:
            f.flips_returned_full += 1
            f.flips_undetected_full += [] if same else [f"{label}: {name}"]
        else:
            f.flips_returned_part += 1
            f.flips_undetected_part += not same
    if meta:
        f.meta_returned += len(values)
        f.meta_wrong += [f"{label}: JSON values {v}" for v in values if v != VALUES]


def _scratch_copy(work: str, pristine: str) -> str:
    """A copy to damage of the checkpoint at ``pristine`` (with the steps beside it, which an
    incremental step references); the copy's path."""
    case, name = os.path.join(work, "case"), os.path.basename(pristine)
    shutil.rmtree(case, ignore_errors=True)
    src = os.path.dirname(pristine) if name.startswith("step-") else pristine
    shutil.copytree(src, copy := os.path.join(case, os.path.basename(src)))
    return copy if src == pristine else os.path.join(copy, name)


def _rank_state(corpus: str, pristine: dict, rank: int, world: int):
    """The state a rank of ``world`` loads, and the call that loads it: DTensors on a 1-D mesh
    (split along dim 0; a tensor of 3 or more dims along its last, which reads its tiles), or
    (``anyshard-spec``) its local tensors under SPEC at tp = ``world`` (torch.chunk's parts: the
    last ranks may hold none)."""
    if corpus == "anyshard-spec":
        state = {"norm": torch.zeros_like(pristine["norm"])}
        for k in ("w", "b"):
            lo, hi = chunk_bounds(pristine[k].shape[0], world, rank)
            state[k] = torch.zeros_like(pristine[k][lo:hi])
        kw = {"spec": SPEC, "layout": {"tp": world}, "coords": {"tp": rank}}
        return state, lambda path, st: anyshard.load(path, st, **kw)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, state = init_device_mesh("cpu", (world,)), {"step": 0, "cfg": {}}
    for k, v in pristine.items():
        place = [Shard(v.dim() - 1 if v.dim() >= 3 else 0) if v.dim() else Replicate()]
        state[k] = distribute_tensor(torch.zeros_like(v), mesh, place)
    return state, anyshard.load


def _pool_worker(rank: int, inbox, outbox, world: int, store_path: str, corpora: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    local_of = lambda v: v.to_local() if hasattr(v, "to_local") else v  # noqa: E731
    pristine, expected = {k: snapshot(p) for k, p in corpora.items()}, {}
    for name, path in corpora.items():  # the pristine values, laid out as this rank holds them
        st, load = _rank_state(name, pristine[name], rank, world)
        load(path, st)
        expected[name] = {k: local_of(v).clone() for k, v in st.items() if torch.is_tensor(v)}
    outbox.put(rank)
    while (job := inbox.get()) is not None:
        corpus, path = job
        state, load = _rank_state(corpus, pristine[corpus], rank, world)
        outcome, value, took = attempt(lambda: load(path, state))  # noqa: B023
        got = [(local_of(state[k]), v) for k, v in expected[corpus].items() if outcome == "ok"]
        wrong = sum(not _same_bytes(a, b) for a, b in got)
        outbox.put((rank, outcome, value, took, len(got), wrong))
    dist.destroy_process_group()


class LoadPool:
    """``world`` gloo processes that load each damaged anyshard checkpoint, as a job's ranks do."""

    def __init__(self, world: int, corpora: dict, work: str) -> None:
        self.world, self.corpora, self.work = world, corpora, work
        self._start()

    def _start(self) -> None:
        import torch.multiprocessing as mp

        # forked from a server that imported torch and anyshard once, not four interpreters
        ctx, store = mp.get_context("forkserver"), tempfile.mktemp(prefix="store-", dir=self.work)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "anyshard"])
        self.outbox, self.inboxes = ctx.Queue(), [ctx.Queue() for _ in range(self.world)]
        shared, self.procs = (self.outbox, self.world, store, self.corpora), []
        for r, q in enumerate(self.inboxes):
            self.procs.append(ctx.Process(target=_pool_worker, args=(r, q, *shared), daemon=True))
            self.procs[-1].start()
        for _ in self.procs:
            self.outbox.get(timeout=120)

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def load(self, f: Findings, label: str, corpus: str, path: str, flipped: bool) -> None:
        entry = f"load in {self.world} processes"
        f.calls += 1
        for q in self.inboxes:
            q.put((corpus, path))
        try:
            results = [self.outbox.get(timeout=KILL_S + 30) for _ in range(self.world)]
        except queue.Empty:
            f.slow.append((label, entry, KILL_S))
            for proc in self.procs:
                proc.kill()
            return self._start()
        outcomes = {r[1] for r in results}
        f.refused += "refused" in outcomes and outcomes <= {"refused", "ok"}
        for rank, outcome, value, took, returned, wrong in results:
            f.note(label, f"{entry}, rank {rank}", outcome, value, took)
            f.flips_returned_part += returned if flipped else 0
            f.flips_undetected_part += wrong if flipped else 0


def fuzz(mutations: int, seed: int, work: str, progress=True, only=None, procs=0, procs_every=1,
         exhaustive: bool = False):  # fmt: skip
    """``mutations`` mutations drawn from ``seed`` (``only``: that one alone, the others drawn
    but not run); the anyshard ones also loaded in ``procs`` processes every ``procs_every``-th
    round of the corpora. ``exhaustive``: instead every byte of the metadata (`every_byte`)."""
    corpus = make_corpus(os.path.join(work, "pristine"))
    pristine = {k: snapshot(p) for k, p in corpus.items()}
    f, rng, names, start = Findings(), random.Random(seed), sorted(corpus), time.monotonic()
    own = {k: p for k, p in corpus.items() if k.startswith("anyshard")}
    pool = LoadPool(procs, own, work) if procs else None
    flips = list(every_byte(own)) if exhaustive else []
    mutations = len(flips) if exhaustive else mutations
    try:
        for i in range(mutations):
            name = flips[i][0] if exhaustive else names[i % len(names)]
            path = _scratch_copy(work, corpus[name])
            if exhaustive:
                _, file, at, mask = flips[i]
                data = bytearray(Path(path, file).read_bytes())
                data[at] ^= mask
                Path(path, file).write_bytes(data)
                m = Mutation(name, "metadata-byte", f"{file}@{at}^{mask:#04x}")
            else:
                m = mutate(rng, name, path)
            if only is not None and i != only:
                continue
            f.mutations, f.flips = f.mutations + 1, f.flips + (m.flipped is not None)
            f.kinds[m.kind] += 1
            label = f"#{i} {name} {m.kind} {m.detail}".strip()
            run_entry_points(f, m, label, path, pristine[name], work)
            if pool and name.startswith("anyshard") and i % (procs_every * len(names)) < len(names):
                pool.load(f, label, name, path, m.flipped is not None)
            if progress and (i + 1) % 500 == 0:
                rate, found = (i + 1) / (time.monotonic() - start), len(f.internal)
                line = f"  {i + 1}/{mutations} mutations, {f.calls} calls, {found} internal, "
                line += f"{len(f.slow)} slow, {rate:.0f}/s, peak RSS {_maxrss() >> 20} MiB"
                print(line, flush=True)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: stop, and report the mutations done
        print(f"  stopped after {f.mutations} mutations", flush=True)
    finally:
        if pool is not None:
            pool.close()
    return f
