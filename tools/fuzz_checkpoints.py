"""Mutation fuzzer: damaged and hostile checkpoints through every entry point of anyshard.

Run (100,000 mutations, about an hour on 2 cores; writes the reliability section of
docs/benchmarks.md):

    python tools/fuzz_checkpoints.py --mutations 100000 --write-docs

Smoke test: ``python tools/fuzz_checkpoints.py --mutations 300``. SIGINT or SIGTERM stops a run
early; it still reports (and with ``--write-docs`` writes) what the mutations done found.

It builds small pristine checkpoints (anyshard without and with a UCL spec, PyTorch DCP, a Hugging
Face safetensors file), then, for each mutation drawn from ``--seed``, copies one of them,
damages the copy in one structured way, and calls every entry point on it:

* ``anyshard.open`` with ``keys``, ``metadata``, ``values``, ``get_tensor`` of every tensor and
  ``get_slice`` of part of every tensor;
* ``anyshard.load`` in this process into a state dict of the pristine checkpoint's shapes
  (anyshard checkpoints), and in 4 gloo processes (``--procs``, kept alive across mutations;
  every ``--procs-every``-th anyshard mutation):
  DTensors sharded over a 1-D mesh of 4 for the plain checkpoint (uneven and empty shards
  included), each rank's local tensors under the spec at tp=4 for the spec checkpoint;
* ``verify_checkpoint`` (anyshard checkpoints);
* ``anyshard inspect`` (text and ``--json``) and ``anyshard convert --to hf``, through the CLI's
  ``main``.

Mutations: the manifest as JSON (a value anywhere replaced by a hostile one: negative, huge,
fractional, non-finite, the wrong type, a NUL or a path that climbs out, a deep nest; a key
removed), the manifest as bytes (a flipped bit, a cut), the spec's text, a data file's header as
JSON and as bytes, DCP's ``.metadata`` (paths, offsets, lengths, chunk sizes and offsets; bytes),
a Hugging Face header, and the data: one flipped bit anywhere in a data file's tensor bytes.

Recorded: every exception that is not an ``AnyshardError`` (the CLI's exit code 3), every call
over 5 s, every call that grows the peak RSS by more than 1 GiB, and, for flipped data bits, the
reads that returned a value other than the pristine one without an error, split by whether the
read covered the whole stored shard or part of it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import glob
import io
import json
import os
import pickle
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import anyshard  # noqa: E402
from anyshard import ucl  # noqa: E402
from anyshard.cli import main as cli_main  # noqa: E402
from anyshard.errors import AnyshardError  # noqa: E402
from anyshard.reshard.verify import verify_checkpoint  # noqa: E402

SLOW_S = 5.0
KILL_S = 30.0
RSS_GROWTH = 1 << 30
MEMORY_CAP = 8 << 30  # per process, for a full run (main): see cap_memory
SPEC = """mesh tp;
"w" -> "w" [8, 6] : chunk(0, tp);
"b" -> "b" [6] : chunk(0, tp);
"norm" -> "norm" [4] : replicate(tp);
"""

# --------------------------------------------------------------------------- pristine corpora


def make_corpus(root: str) -> dict[str, str]:
    """Pristine checkpoints of each kind, under ``root``; name -> path."""
    g = torch.Generator().manual_seed(0)
    out = {}
    plain = os.path.join(root, "plain")
    anyshard.save(
        plain,
        {
            "w": torch.randn(8, 16, generator=g),
            "e": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "n": torch.arange(6, dtype=torch.int64).reshape(3, 2),
            "s": torch.tensor(2.5),
            "step": 3,
            "cfg": {"lr": 0.1, "betas": [0.9, 0.95]},
        },
    )
    out["anyshard"] = plain
    spec = os.path.join(root, "spec")
    w, b, norm = torch.randn(8, 6, generator=g), torch.randn(6, generator=g), torch.ones(4)
    states = {
        r: {"w": w.chunk(2)[r].clone(), "b": b.chunk(2)[r].clone(), "norm": norm} for r in range(2)
    }
    ucl.save_local_states(spec, states, spec=SPEC, layout={"tp": 2})
    out["anyshard-spec"] = spec
    # an incremental step: "w" and "n" referenced in its base, a sibling directory
    inc = os.path.join(root, "incremental")
    state = {
        "w": torch.randn(8, 16, generator=g),
        "e": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "n": torch.arange(6, dtype=torch.int64).reshape(3, 2),
        "s": torch.tensor(2.5),
        "step": 3,
        "cfg": {"lr": 0.1, "betas": [0.9, 0.95]},
    }
    anyshard.save(os.path.join(inc, "step-1"), state, content_hash=True)
    state["e"] += 1
    state["s"] += 1
    anyshard.save(os.path.join(inc, "step-2"), state, base=os.path.join(inc, "step-1"))
    out["anyshard-incremental"] = os.path.join(inc, "step-2")
    d = os.path.join(root, "dcp")
    dcp.save({"w": torch.randn(6, 5, generator=g), "step": 7}, checkpoint_id=d, no_dist=True)
    out["dcp"] = d
    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    save_file(
        {"w": torch.randn(4, 8, generator=g), "v": torch.arange(5.0)},
        os.path.join(hf, "model.safetensors"),
        metadata={"format": "pt"},
    )
    out["hf"] = hf
    return out


def snapshot(path: str) -> dict[str, torch.Tensor]:
    with anyshard.open(path) as view:
        return {k: view.get_tensor(k) for k in view.keys()}


# --------------------------------------------------------------------------- mutations

HOSTILE = [
    -1,
    0,
    1,
    7,
    2**31,
    2**63,
    10**30,
    -(10**12),
    0.5,
    1e300,
    True,
    None,
    "",
    "x",
    "w\u0000",
    "../../outside",
    "/etc/passwd",
    "s3://bucket/key",
    "data/rank-00000.safetensors\n",
    [],
    {},
    [1, 2, 3],
    {"a": 1},
    "chunk(5, world)",
    "on(world, 99)",
    "F16",
    "BOGUS",
]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400]


def _paths(node, prefix=()):
    """Every path into a JSON document, depth first."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value, delete=False):
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value


def mutate_json(rng: random.Random, doc) -> str:
    """``doc`` with one value somewhere replaced (or removed), as JSON text."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    path = rng.choice(paths)
    what = rng.random()
    if what < 0.1:
        _set(doc, path, None, delete=True)
        return json.dumps(doc)
    if what < 0.2:
        marker = "@@RAW@@"
        _set(doc, path, marker)
        return json.dumps(doc).replace(json.dumps(marker), rng.choice(RAW_NUMBERS), 1)
    if what < 0.25:
        marker = "@@DEEP@@"
        _set(doc, path, marker)
        depth = rng.choice([70, 1000, 100000])
        return json.dumps(doc).replace(json.dumps(marker), "[" * depth + "]" * depth, 1)
    _set(doc, path, copy.deepcopy(rng.choice(HOSTILE)))
    return json.dumps(doc)


def flip_bit(
    rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None
) -> tuple[bytes, int]:
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data, -1
    at = rng.randrange(lo, hi)
    out = bytearray(data)
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out), at


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _data_files(root: str) -> list[str]:
    """The data files of the checkpoint at ``root``, and of the steps beside it that an
    incremental checkpoint references."""
    out = []
    for step in [root] + sorted(glob.glob(os.path.join(os.path.dirname(root), "step-*"))):
        d = os.path.join(step, "data")
        if os.path.isdir(d) and (step == root or os.path.basename(root).startswith("step-")):
            out += [os.path.join(d, n) for n in sorted(os.listdir(d))]
    return sorted(set(out))


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _safetensors_bytes(header_text: str, body: bytes) -> bytes:
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


@dataclass
class Mutation:
    corpus: str
    kind: str
    detail: str = ""
    flipped: tuple[str, int] | None = None  # data file, byte offset of a flipped data bit


def mutate(rng: random.Random, corpus: str, path: str) -> Mutation:
    """Damage the checkpoint at ``path`` (a copy of corpus ``corpus``) in one way."""
    if corpus.startswith("anyshard"):
        kinds = ["manifest-json"] * 4 + ["manifest-bytes", "header-json", "header-bytes"]
        kinds += ["data-bits"] * 3 + (["spec-text"] * 2 if corpus == "anyshard-spec" else [])
    elif corpus == "dcp":
        kinds = ["dcp-metadata"] * 3 + ["dcp-bytes"]
    else:
        kinds = ["hf-header"] * 3 + ["hf-bytes"]
    kind = rng.choice(kinds)
    m = Mutation(corpus, kind)
    if kind == "manifest-json":
        name = os.path.join(path, "manifest.json")
        _write(name, mutate_json(rng, json.loads(_read(name))).encode())
    elif kind == "manifest-bytes":
        name = os.path.join(path, "manifest.json")
        data = _read(name)
        if rng.random() < 0.3:
            _write(name, data[: rng.randrange(len(data))])
        else:
            _write(name, flip_bit(rng, data)[0])
    elif kind == "spec-text":
        name = os.path.join(path, "manifest.json")
        doc = json.loads(_read(name))
        text = doc["spec"]["text"]
        at = rng.randrange(len(text) + 1)
        edit = rng.choice(["del", "ins", "rep"])
        junk = rng.choice("(){}[];:|,.-+*/%\"'\\ 0123456789abcxyz\n\u0000")
        if edit == "del" and at < len(text):
            text = text[:at] + text[at + 1 :]
        elif edit == "ins":
            text = text[:at] + junk + text[at:]
        else:
            text = text[:at] + junk + text[at + 1 :]
        doc["spec"]["text"] = text
        _write(name, json.dumps(doc).encode())
    elif kind in ("header-json", "header-bytes", "data-bits"):
        name = rng.choice(_data_files(path))
        data = _read(name)
        header, body = _safetensors_parts(data)
        if kind == "header-json":
            inner = json.loads(header["__metadata__"]["anyshard"])
            if rng.random() < 0.4:
                header["__metadata__"]["anyshard"] = mutate_json(rng, inner)
                text = json.dumps(header)
            else:
                text = mutate_json(rng, header)
            _write(name, _safetensors_bytes(text, body))
        elif kind == "header-bytes":
            (n,) = struct.unpack("<Q", data[:8])
            _write(name, flip_bit(rng, data, 0, 8 + n)[0])
        else:
            (n,) = struct.unpack("<Q", data[:8])
            flipped, at = flip_bit(rng, data, 8 + n, len(data))
            _write(name, flipped)
            m.flipped = (name, at)
    elif kind == "dcp-metadata":
        name = os.path.join(path, ".metadata")
        md = pickle.loads(_read(name))  # noqa: S301 - the tool's own file, written by DCP above
        key = rng.choice(list(md.storage_data))
        info = md.storage_data[key]
        field_name = rng.choice(["relative_path", "offset", "length", "chunk", "size"])
        value = rng.choice(HOSTILE + [10**15, 1 << 40])
        if field_name in ("relative_path", "offset", "length"):
            md.storage_data[key] = dataclasses.replace(info, **{field_name: value})
        else:
            meta = md.state_dict_metadata.get(key.fqn)
            if hasattr(meta, "chunks") and meta.chunks:
                c = meta.chunks[0]
                n = rng.choice([-1, 0, 10**9, 10**15])
                if field_name == "chunk":
                    meta.chunks[0] = dataclasses.replace(
                        c, offsets=torch.Size([n] * len(c.offsets))
                    )
                else:
                    meta.chunks[0] = dataclasses.replace(c, sizes=torch.Size([n] * len(c.sizes)))
        m.detail = f"{field_name}={value!r:.40}"
        _write(name, pickle.dumps(md))
    elif kind == "dcp-bytes":
        name = os.path.join(path, rng.choice([".metadata", "__0_0.distcp"]))
        _write(name, flip_bit(rng, _read(name))[0])
    elif kind == "hf-header":
        name = os.path.join(path, "model.safetensors")
        header, body = _safetensors_parts(_read(name))
        _write(name, _safetensors_bytes(mutate_json(rng, header), body))
    else:  # hf-bytes
        name = os.path.join(path, "model.safetensors")
        data = _read(name)
        (n,) = struct.unpack("<Q", data[:8])
        _write(name, flip_bit(rng, data, 0, 8 + n)[0])
    return m


# --------------------------------------------------------------------------- entry points


class _Timeout(BaseException):
    """A call ran past KILL_S (a BaseException: no `except Exception` in the library takes it)."""


def _alarm(signum, frame):
    raise _Timeout()


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
    kinds: Counter = field(default_factory=Counter)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def call(f: Findings, label: str, entry: str, fn) -> tuple[bool, object]:
    """Run ``fn``; True and its result, or False when it raised (recorded unless an
    AnyshardError, the refusal every entry point owes a damaged checkpoint)."""
    f.calls += 1
    before = _maxrss()
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, KILL_S)
    try:
        return True, fn()
    except AnyshardError:
        f.refused += 1
        return False, None
    except _Timeout as e:
        where = [fr for fr in traceback.extract_tb(e.__traceback__) if "anyshard" in fr.filename]
        at = f" at {where[-1].filename.split('/')[-1]}:{where[-1].lineno}" if where else ""
        f.slow.append((label, entry + at, KILL_S))
        return False, None
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        tb = traceback.extract_tb(e.__traceback__)[-1]
        f.internal.append(
            (
                label,
                entry,
                f"{type(e).__name__}: {str(e)[:160]} ({tb.filename.split('/')[-1]}:{tb.lineno})",
            )
        )
        return False, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        took = time.monotonic() - start
        if SLOW_S < took < KILL_S:
            f.slow.append((label, entry, round(took, 2)))
        if _maxrss() - before > RSS_GROWTH:
            f.rss.append((label, entry, _maxrss() - before))


def _cli(args: list[str]) -> int:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(args)
    if code == 3:
        raise RuntimeError(err.getvalue().strip().splitlines()[-2][:200])
    return code


def _partial_box(shape) -> tuple:
    """The first half (at least one) of dim 0, everything else: a read of part of a shard."""
    return tuple(slice(0, max(1, n // 2)) if i == 0 else slice(None) for i, n in enumerate(shape))


def run_entry_points(f: Findings, m: Mutation, label: str, path: str, pristine, tmp: str) -> None:
    returned: list[tuple[str, bool, torch.Tensor, object]] = []  # (name, whole?, value, index)

    def names():
        with anyshard.open(path) as view:
            for name in view.keys():
                view.metadata(name)
            view.values  # noqa: B018
            return list(view.keys())

    ok, keys = call(f, label, "open", names)
    for name in keys if ok else pristine:
        # each read on its own: a whole read that refuses must not hide a part read after it

        def part(name=name):
            with anyshard.open(path) as view:
                shape = view.metadata(name).shape
                if len(shape):
                    index = _partial_box(shape)
                    returned.append((name, False, view.get_slice(name)[index], index))

        def whole(name=name):
            with anyshard.open(path) as view:
                returned.append((name, True, view.get_tensor(name), None))

        call(f, label, "get_slice", part)
        call(f, label, "get_tensor", whole)
    if m.corpus.startswith("anyshard"):

        def load():
            if m.corpus == "anyshard-spec":  # each rank's local tensors under the spec
                for r in range(2):
                    state = {k: torch.zeros_like(v.chunk(2)[r]) for k, v in pristine.items()}
                    state["norm"] = torch.zeros_like(pristine["norm"])
                    anyshard.load(path, state, spec=SPEC, layout={"tp": 2}, coords={"tp": r})
                return
            state = {k: torch.zeros_like(v) for k, v in pristine.items()}
            state.update(step=0, cfg={})
            anyshard.load(path, state)
            for k in pristine:
                returned.append((k, True, state[k], None))

        call(f, label, "load", load)
        call(f, label, "verify", lambda: verify_checkpoint(path))
    call(f, label, "inspect", lambda: _cli(["inspect", path]))
    call(f, label, "inspect --json", lambda: _cli(["inspect", path, "--json"]))
    out = os.path.join(tmp, "converted")
    shutil.rmtree(out, ignore_errors=True)
    call(f, label, "convert", lambda: _cli(["convert", path, out, "--to", "hf"]))
    if m.flipped is not None:
        for name, whole, value, index in returned:
            want = pristine.get(name)
            if want is None:
                continue
            want = want if index is None else want[index]
            same = _same_bytes(value, want)
            if whole:
                f.flips_returned_full += 1
                if not same:
                    f.flips_undetected_full.append(f"{label}: {name}")
            else:
                f.flips_returned_part += 1
                f.flips_undetected_part += not same


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _scratch_copy(work: str, pristine: str) -> str:
    """A copy of the checkpoint at ``pristine`` (with its root, for an incremental step that
    references the steps beside it) to damage; the copy's path."""
    shutil.rmtree(os.path.join(work, "case"), ignore_errors=True)
    if os.path.basename(pristine).startswith("step-"):
        root = os.path.join(work, "case", os.path.basename(os.path.dirname(pristine)))
        shutil.copytree(os.path.dirname(pristine), root)
        return os.path.join(root, os.path.basename(pristine))
    path = os.path.join(work, "case", os.path.basename(pristine))
    shutil.copytree(pristine, path)
    return path


# --------------------------------------------------------------------------- 4-process loads


def _pool_state(corpus: str, pristine: dict, rank: int, world: int):
    """The state a rank of ``world`` loads: DTensors on a 1-D mesh, or spec-local tensors."""
    if corpus == "anyshard-spec":
        from anyshard.geometry.shards import chunk_bounds

        state = {}
        for k in ("w", "b"):  # torch.chunk's parts: the last ranks may hold none
            lo, hi = chunk_bounds(pristine[k].shape[0], world, rank)
            state[k] = torch.zeros_like(pristine[k][lo:hi])
        state["norm"] = torch.zeros_like(pristine["norm"])
        return state, lambda path, st: anyshard.load(
            path, st, spec=SPEC, layout={"tp": world}, coords={"tp": rank}
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0) if v.dim() else Replicate()])
        for k, v in pristine.items()
    }
    state.update(step=0, cfg={})
    return state, lambda path, st: anyshard.load(path, st)


def _pool_worker(rank: int, world: int, store_path: str, corpora: dict, inbox, outbox) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    signal.signal(signal.SIGALRM, _alarm)
    pristine = {k: snapshot(p) for k, p in corpora.items()}
    expected = {}
    for name in corpora:
        # the pristine values, laid out as this rank holds them
        st, load = _pool_state(name, pristine[name], rank, world)
        load(corpora[name], st)
        expected[name] = {
            k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
        }
    outbox.put((rank, "ready", "", 0, 0))
    while True:
        job = inbox.get()
        if job is None:
            break
        corpus, path = job
        state, load = _pool_state(corpus, pristine[corpus], rank, world)
        signal.setitimer(signal.ITIMER_REAL, KILL_S)
        start = time.monotonic()
        returned = wrong = 0
        try:
            load(path, state)
            status, detail = "ok", ""
            for k, want in expected[corpus].items():
                got = state[k].to_local() if hasattr(state[k], "to_local") else state[k]
                returned += 1
                wrong += not _same_bytes(got, want)
        except AnyshardError:
            status, detail = "refused", ""
        except _Timeout:
            status, detail = "slow", f"{KILL_S} s"
        except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
            tb = traceback.extract_tb(e.__traceback__)[-1]
            status = "internal"
            detail = (
                f"{type(e).__name__}: {str(e)[:160]} ({tb.filename.split('/')[-1]}:{tb.lineno})"
            )
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        took = time.monotonic() - start
        if status == "ok" and took > SLOW_S:
            status, detail = "slow", f"{took:.2f} s"
        outbox.put((rank, status, detail, returned, wrong))
    dist.destroy_process_group()


class LoadPool:
    """``world`` gloo processes that load each damaged anyshard checkpoint, as a job's ranks do."""

    def __init__(self, world: int, corpora: dict, work: str) -> None:
        self.world, self.corpora, self.work = world, corpora, work
        self._start()

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        store = tempfile.mktemp(prefix="store-", dir=self.work)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world, store, self.corpora, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for proc in self.procs:
            proc.start()
        for _ in range(self.world):
            self.outbox.get(timeout=120)

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def load(self, f: Findings, label: str, corpus: str, path: str, flipped: bool) -> None:
        import queue

        f.calls += 1
        for q in self.inboxes:
            q.put((corpus, path))
        results = []
        try:
            for _ in range(self.world):
                results.append(self.outbox.get(timeout=KILL_S + 30))
        except queue.Empty:
            f.slow.append((label, f"load in {self.world} processes", KILL_S))
            for proc in self.procs:
                proc.kill()
            self._start()
            return
        entry = f"load in {self.world} processes"
        statuses = {status for _, status, *_ in results}
        if statuses == {"refused"} or ("refused" in statuses and statuses <= {"refused", "ok"}):
            f.refused += 1
        for rank, status, detail, returned, wrong in results:
            if status == "internal":
                f.internal.append((label, f"{entry}, rank {rank}", detail))
            elif status == "slow":
                f.slow.append((label, f"{entry}, rank {rank}", detail))
            elif status == "ok" and flipped:
                f.flips_returned_part += returned
                f.flips_undetected_part += wrong


def cap_memory(limit: int = MEMORY_CAP) -> None:
    """Cap this process's address space: an allocation a hostile checkpoint provokes then fails
    as a MemoryError (recorded, with the mutation that caused it) instead of drawing the
    kernel's OOM killer onto the run."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or hard > limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def fuzz(
    mutations: int,
    seed: int,
    work: str,
    progress: bool = True,
    only: int | None = None,
    procs: int = 0,
    procs_every: int = 1,
) -> Findings:
    signal.signal(signal.SIGALRM, _alarm)
    corpus = make_corpus(os.path.join(work, "pristine"))
    pristine = {k: snapshot(p) for k, p in corpus.items()}
    f = Findings()
    rng = random.Random(seed)
    names = sorted(corpus)
    pool = None
    if procs:
        anyshard_corpora = {k: p for k, p in corpus.items() if k.startswith("anyshard")}
        pool = LoadPool(procs, anyshard_corpora, work)
    try:
        _fuzz_loop(
            f, corpus, pristine, names, rng, mutations, work, progress, only, pool, procs_every
        )
    except KeyboardInterrupt:  # SIGINT or SIGTERM: stop, and report the mutations done
        print(f"  stopped after {f.mutations} mutations", flush=True)
    finally:
        if pool is not None:
            pool.close()
    return f


def _fuzz_loop(
    f, corpus, pristine, names, rng, mutations, work, progress, only, pool, procs_every
) -> None:
    start = time.monotonic()
    for i in range(mutations):
        name = names[i % len(names)]
        if only is not None and i != only:
            mutate(rng, name, _scratch_copy(work, corpus[name]))  # keep the draws in step
            continue
        path = _scratch_copy(work, corpus[name])
        m = mutate(rng, name, path)
        f.mutations += 1
        f.kinds[m.kind] += 1
        f.flips += m.flipped is not None
        label = f"#{i} {name} {m.kind} {m.detail}".strip()
        run_entry_points(f, m, label, path, pristine[name], work)
        if (
            pool is not None
            and name.startswith("anyshard")
            and i % (procs_every * len(names)) < len(names)
        ):
            pool.load(f, label, name, path, m.flipped is not None)
        if progress and (i + 1) % 500 == 0:
            rate = (i + 1) / (time.monotonic() - start)
            print(
                f"  {i + 1}/{mutations} mutations, {f.calls} calls, {len(f.internal)} internal, "
                f"{len(f.slow)} slow, {rate:.0f}/s, peak RSS {_maxrss() >> 20} MiB",
                flush=True,
            )


def summary(f: Findings) -> list[str]:
    flips_full = f.flips_returned_full - len(f.flips_undetected_full)
    lines = [
        f"- mutations: {f.mutations} ({', '.join(f'{k} {n}' for k, n in sorted(f.kinds.items()))})",
        f"- calls: {f.calls}; refused with an AnyshardError: {f.refused}",
        f"- exceptions other than AnyshardError: {len(f.internal)}",
        f"- calls over {SLOW_S:.0f} s: {len(f.slow)}; calls growing the peak RSS by over 1 GiB: {len(f.rss)}",
        f"- flipped data bits: {f.flips}; reads of a whole tensor that returned: {f.flips_returned_full}, "
        f"of which {flips_full} returned the pristine value and {len(f.flips_undetected_full)} a wrong one",
        f"- reads of part of a tensor after a flipped data bit: {f.flips_returned_part}, of which "
        f"{f.flips_undetected_part} returned a wrong value without an error",
    ]
    for label, entry, what in f.internal[:20]:
        lines.append(f"  - internal: {entry} on {label}: {what}")
    for label, entry, took in f.slow[:10]:
        lines.append(f"  - slow: {entry} on {label}: {took} s")
    for label, entry, grew in f.rss[:10]:
        lines.append(f"  - peak RSS +{grew >> 20} MiB: {entry} on {label}")
    for item in f.flips_undetected_full[:10]:
        lines.append(f"  - undetected whole read: {item}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mutations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", type=int, default=None, help="run mutation number N alone")
    p.add_argument(
        "--procs",
        type=int,
        default=4,
        help="also load every damaged anyshard checkpoint in this many gloo processes (0: none)",
    )
    p.add_argument(
        "--procs-every",
        type=int,
        default=10,
        help="load every N-th round of mutations in the processes too (1: every one)",
    )
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None)
    args = p.parse_args()
    cap_memory()

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="anyshard-fuzz-") as work:
        start = time.monotonic()
        f = fuzz(
            args.mutations,
            args.seed,
            work,
            only=args.only,
            procs=args.procs,
            procs_every=args.procs_every,
        )
        took = time.monotonic() - start
    lines = summary(f)
    print("\n".join(lines))
    print(f"took {took:.0f} s")
    if args.write_docs:
        from markdown_section import replace_section

        command = (
            f"python tools/fuzz_checkpoints.py --mutations {args.mutations} --seed {args.seed} "
            f"--procs {args.procs} --procs-every {args.procs_every} --write-docs"
        )
        replace_section(
            args.write_docs,
            "<!-- fuzz:begin -->",
            "<!-- fuzz:end -->",
            [
                "## Reliability: damaged and hostile checkpoints (`tools/fuzz_checkpoints.py`)",
                "",
                f"Command: `{command}` ({took:.0f} s on this machine). Every mutation damages one copy of a",
                "small pristine checkpoint (anyshard, anyshard under a UCL spec, DCP, Hugging Face) and",
                "calls every entry point on it; see the tool's header for the mutations and entry points.",
                "",
                *lines,
            ],
        )
        print(f"wrote {args.write_docs}")
    return 1 if f.internal or f.slow or f.rss or f.flips_undetected_full else 0


if __name__ == "__main__":
    sys.exit(main())
