"""Mutation fuzzer: damaged and hostile checkpoints through every entry point of anyshard.

    python tools/fuzz_checkpoints.py --mutations 100000 --seed 0 --write-docs  # ~1.5 h, 2 cores
    python tools/fuzz_checkpoints.py --mutations 300 --seed 1                  # smoke test
    python tools/fuzz_checkpoints.py --every-byte --write-docs   # each metadata byte flipped

The seed draws the mutations (``--only N``: mutation N of it alone); SIGINT or SIGTERM stops a
run, which still reports. A mutation damages a copy of a pristine checkpoint (anyshard: plain,
with a UCL spec, an incremental step; DCP; Hugging Face) once (`KINDS`), then every entry point is
called on it (`run_entry_points`; `LoadPool`: loads in ``--procs`` gloo processes). Recorded:
every exception but an ``AnyshardError`` (the CLI's exit code 3), every call over 5 s or growing
the peak RSS by 1 GiB, and the reads after a flipped data bit that returned a wrong value.
Edits of the manifest or a header as JSON are sealed again (a hostile writer's checksum is
right), so that what lies behind the seal is fuzzed too. ``--every-byte`` instead flips every
byte of the manifest and of every data file's header (length and JSON) of the anyshard
checkpoints, one at a time (byte i XOR ``MASKS[i % 3]``), and runs each as above.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import json
import os
import pickle
import queue
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
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import anyshard  # noqa: E402
from anyshard import ucl  # noqa: E402
from anyshard.cli import main as cli_main  # noqa: E402
from anyshard.errors import AnyshardError  # noqa: E402
from anyshard.format.checksum import seal  # noqa: E402
from anyshard.geometry.shards import chunk_bounds  # noqa: E402
from anyshard.reshard.verify import verify_checkpoint  # noqa: E402

SLOW_S, KILL_S, RSS_GROWTH, MEMORY_CAP = 5.0, 30.0, 1 << 30, 8 << 30
SPEC = """mesh tp;
"w" -> "w" [8, 6] : chunk(0, tp);
"b" -> "b" [6] : chunk(0, tp);
"norm" -> "norm" [4] : replicate(tp);
"""
HOSTILE = [-1, 0, 1, 7, 2**31, 2**63, 10**30, -(10**12), 0.5, 1e300, True, None, "", "x", "w\0"]
HOSTILE += ["../../outside", "/etc/passwd", "s3://bucket/key", "data/rank-00000.safetensors\n"]
HOSTILE += [[], {}, [1, 2, 3], {"a": 1}, "chunk(5, world)", "on(world, 99)", "F16", "BOGUS"]
HEADING = "## Reliability: damaged and hostile checkpoints (`tools/fuzz_checkpoints.py`)"
INTRO = """Each mutation damages a copy of a small checkpoint (anyshard, with a UCL spec, DCP, Hugging Face)
and calls every entry point on it: `anyshard.open`, `anyshard.load` (in 1 and 4 processes),
`verify_checkpoint`, the CLI's `inspect` and `convert`. The seed draws the mutations."""
# what a mutation damages, drawn with these weights: the manifest as JSON (a value replaced by a
# hostile one, a key removed) or as bytes (a flipped bit, a cut), the spec's text, a data file's
# header as JSON or bytes, DCP's .metadata (paths, offsets, lengths, chunks; bytes), a Hugging
# Face header (JSON, bytes), or one bit of tensor data
KINDS = {"dcp": ["dcp-metadata"] * 3 + ["dcp-bytes"], "hf": ["hf-header"] * 3 + ["hf-bytes"]}
KINDS["anyshard"] = ["manifest-json"] * 4 + ["manifest-bytes", "header-json", "header-bytes"]
KINDS["anyshard"] += ["data-bits"] * 3
FILES = dict.fromkeys(["manifest-json", "manifest-bytes", "spec-text"], "manifest.json")
FILES |= dict.fromkeys(["hf-header", "hf-bytes"], "model.safetensors")
FILES["dcp-metadata"] = ".metadata"
ROWS = (
    "mutations; calls; calls refused with an `AnyshardError`",
    "exceptions other than `AnyshardError`",
    f"calls over {SLOW_S:.0f} s; calls growing the peak RSS by over 1 GiB",
    "flipped data bits; reads of a whole tensor after one that returned the pristine / a wrong value",
    "reads of part of a tensor after a flipped bit that returned a wrong value without an error",
    "tensors and JSON values returned after a flipped metadata byte; wrong ones",
)
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400]
MASKS = (0x01, 0x80, 0xFF)  # --every-byte: byte i XOR MASKS[i % 3]
SEALS = (b'{"format":"anyshard-checkpoint","format_version":4,"crc32c":"',
         b'{"__metadata__":{"anyshard_crc32c":"')  # fmt: skip
VALUES = {"step": 3, "cfg": {"lr": 0.1, "betas": [0.9, 0.95]}}  # `_state`'s JSON values


def reseal(data: bytes) -> bytes:
    """A manifest or JSON header edited as JSON, sealed again where it begins with a seal."""
    for prefix in SEALS:
        if data.startswith(prefix):
            return seal(data[: len(prefix)] + b"00000000" + data[len(prefix) + 8 :], prefix)
    return data


def _state(g: torch.Generator) -> dict:
    w, e = torch.randn(8, 16, generator=g), torch.randn(5, 3, generator=g).to(torch.bfloat16)
    n, s = torch.arange(6, dtype=torch.int64).reshape(3, 2), torch.tensor(2.5)
    wide = torch.randn(16, 8192, generator=g)  # 32 KiB rows: checksum tiles of 2 KiB columns
    return {"w": w, "e": e, "n": n, "s": s, "wide": wide, **copy.deepcopy(VALUES)}


def make_corpus(root: str) -> dict[str, str]:
    """Pristine checkpoints of each kind, under ``root``; name -> path."""
    g, step_1 = torch.Generator().manual_seed(0), os.path.join(root, "incremental", "step-1")
    names = ["anyshard", "anyshard-spec", "anyshard-incremental", "dcp", "hf"]
    dirs = ["plain", "spec", "incremental/step-2", "dcp", "hf"]
    out = {k: os.path.join(root, d) for k, d in zip(names, dirs, strict=True)}
    anyshard.save(out["anyshard"], _state(g))
    w, b, norm = torch.randn(8, 6, generator=g), torch.randn(6, generator=g), torch.ones(4)
    parts = zip(w.chunk(2), b.chunk(2), strict=True)
    states = dict(enumerate({"w": x.clone(), "b": y.clone(), "norm": norm} for x, y in parts))
    ucl.save_local_states(out["anyshard-spec"], states, spec=SPEC, layout={"tp": 2})
    state = _state(g)  # step-2 references step-1's w, n
    anyshard.save(step_1, state, content_hash=True)
    state.update({k: state[k] + 1 for k in ("e", "s")})
    anyshard.save(out["anyshard-incremental"], state, base=step_1)
    dcp_state = {"w": torch.randn(6, 5, generator=g), "step": 7}
    dcp.save(dcp_state, checkpoint_id=out["dcp"], no_dist=True)
    os.makedirs(out["hf"])
    hf = {"w": torch.randn(4, 8, generator=g), "v": torch.arange(5.0)}
    save_file(hf, os.path.join(out["hf"], "model.safetensors"), metadata={"format": "pt"})
    return out


def snapshot(path: str) -> dict[str, torch.Tensor]:
    with anyshard.open(path) as view:
        return {k: view.get_tensor(k) for k in view.keys()}


def _slots(node):
    """Every (container, key) of a JSON document, depth first."""
    if isinstance(node, (dict, list)):
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            yield node, k
            yield from _slots(v)


def mutate_json(rng: random.Random, doc, compact: bool = False) -> str:
    """``doc`` with one value somewhere replaced (or removed), as JSON text (``compact``: with
    no spaces, as the writer writes it, so that a seal at its start stays in place)."""
    doc, raw = copy.deepcopy(doc), None
    (node, key), what = rng.choice(list(_slots(doc))), rng.random()
    if what < 0.1 and isinstance(node, dict):
        del node[key]
    elif 0.1 <= what < 0.25:  # a raw number JSON cannot hold, or a deep nest, in its place
        depth = 0 if what < 0.2 else rng.choice([70, 1000, 100000])
        raw = rng.choice(RAW_NUMBERS) if what < 0.2 else "[" * depth + "]" * depth
        node[key] = "@@MARK@@"
    else:
        node[key] = None if what < 0.1 else copy.deepcopy(rng.choice(HOSTILE))
    text = json.dumps(doc, separators=(",", ":") if compact else None)
    return text if raw is None else text.replace('"@@MARK@@"', raw, 1)


def flip_bit(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None):
    """``data`` with one bit of ``data[lo:hi]`` flipped, and its offset (-1: none there)."""
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data, -1
    out, at = bytearray(data), rng.randrange(lo, hi)
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out), at


def _data_files(root: str) -> list[str]:
    """The data files of the checkpoint at ``root`` and of the steps an incremental one references."""
    out = []
    for step in [root] + sorted(glob.glob(os.path.join(os.path.dirname(root), "step-*"))):
        d = os.path.join(step, "data")
        if os.path.isdir(d) and (step == root or os.path.basename(root).startswith("step-")):
            out += [os.path.join(d, n) for n in sorted(os.listdir(d))]
    return sorted(set(out))


@dataclass
class Mutation:
    corpus: str
    kind: str
    detail: str = ""
    flipped: tuple[str, int] | None = None  # data file, byte offset of a flipped data bit


def mutate(rng: random.Random, corpus: str, path: str) -> Mutation:
    """Damage the checkpoint at ``path`` (a copy of corpus ``corpus``) in one way."""
    kinds = KINDS[corpus.split("-")[0]] + (["spec-text"] * 2 if corpus == "anyshard-spec" else [])
    m = Mutation(corpus, rng.choice(kinds))
    if m.kind in FILES:
        name = os.path.join(path, FILES[m.kind])
    elif m.kind == "dcp-bytes":
        name = os.path.join(path, rng.choice([".metadata", "__0_0.distcp"]))
    else:
        name = rng.choice(_data_files(path))
    data = Path(name).read_bytes()
    end = 8 + struct.unpack("<Q", data[:8])[0]  # a safetensors file's header ends there
    if m.kind == "manifest-json":
        data = reseal(mutate_json(rng, json.loads(data), compact=True).encode())
    elif m.kind == "manifest-bytes":
        data = data[: rng.randrange(len(data))] if rng.random() < 0.3 else flip_bit(rng, data)[0]
    elif m.kind == "spec-text":  # a character of the spec deleted, inserted or replaced
        doc = json.loads(data)
        text, at = doc["spec"]["text"], rng.randrange(len(doc["spec"]["text"]) + 1)
        edit = rng.choice(["del", "ins", "rep"])
        junk = rng.choice("(){}[];:|,.-+*/%\"'\\ 0123456789abcxyz\n\0")
        junk = "" if edit == "del" and at < len(text) else junk  # a deletion past the end replaces
        doc["spec"]["text"] = text[:at] + junk + text[at + (edit != "ins") :]
        data = reseal(json.dumps(doc, separators=(",", ":")).encode())
    elif m.kind in ("header-json", "hf-header"):
        header = json.loads(data[8:end])
        if m.kind == "header-json" and rng.random() < 0.4:
            meta = header["__metadata__"]
            meta["anyshard"] = mutate_json(rng, json.loads(meta["anyshard"]))
            text = json.dumps(header, separators=(",", ":"))
        else:
            text = mutate_json(rng, header, compact=True)
        raw = reseal(text.encode())
        raw += b" " * (-len(raw) % 8)
        data = struct.pack("<Q", len(raw)) + raw + data[end:]
    elif m.kind in ("header-bytes", "hf-bytes"):
        data = flip_bit(rng, data, 0, end)[0]
    elif m.kind == "data-bits":
        data, at = flip_bit(rng, data, end, len(data))
        m.flipped = (name, at)
    elif m.kind == "dcp-bytes":
        data = flip_bit(rng, data)[0]
    else:  # DCP's .metadata: an entry's path, offset or length, or a chunk's offsets or sizes
        md = pickle.loads(data)  # noqa: S301 - the file DCP wrote above
        key = rng.choice(list(md.storage_data))
        what = rng.choice(["relative_path", "offset", "length", "chunk", "size"])
        value = rng.choice(HOSTILE + [10**15, 1 << 40])
        if what in ("relative_path", "offset", "length"):
            md.storage_data[key] = replace(md.storage_data[key], **{what: value})
        elif getattr(meta := md.state_dict_metadata.get(key.fqn), "chunks", None):
            c, n = meta.chunks[0], rng.choice([-1, 0, 10**9, 10**15])
            attr = "offsets" if what == "chunk" else "sizes"
            meta.chunks[0] = replace(c, **{attr: torch.Size([n] * len(getattr(c, attr)))})
        m.detail = f"{what}={value!r:.40}"
        data = pickle.dumps(md)
    Path(name).write_bytes(data)
    return m


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
    """The state a rank of ``world`` loads, and the call that loads it: DTensors on a 1-D mesh,
    or (``anyshard-spec``) its local tensors under SPEC at tp = ``world`` (torch.chunk's parts:
    the last ranks may hold none)."""
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
        place = [Shard(0) if v.dim() else Replicate()]
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


def every_byte(corpus: dict[str, str]):
    """(corpus name, file relative to its checkpoint, byte offset, mask) for every byte of the
    manifest and of each data file's header (its length and JSON) of each corpus given."""
    for name, path in sorted(corpus.items()):
        for full in [os.path.join(path, "manifest.json"), *_data_files(path)]:
            data = Path(full).read_bytes()
            end = len(data) if full.endswith(".json") else 8 + struct.unpack("<Q", data[:8])[0]
            for at in range(end):  # each byte once, the masks taking turns
                yield name, os.path.relpath(full, path), at, MASKS[at % len(MASKS)]


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


def summary(f: Findings) -> list:
    """The counts as a table, and a line per finding (the first few of each kind)."""
    wrong_full = len(f.flips_undetected_full)
    counts = [f"{f.mutations}; {f.calls}; {f.refused}", len(f.internal)]
    counts += [f"{len(f.slow)}; {len(f.rss)}"]
    counts += [f"{f.flips}; {f.flips_returned_full - wrong_full} / {wrong_full}"]
    counts += [f"{f.flips_undetected_part} of {f.flips_returned_part}"]
    counts += [f"{f.meta_returned}; {len(f.meta_wrong)}"]
    lines = [f"- internal: {entry} on {label}: {what}" for label, entry, what in f.internal[:20]]
    lines += [f"- slow: {entry} on {label}: {took} s" for label, entry, took in f.slow[:10]]
    lines += [f"- peak RSS +{n >> 20} MiB: {entry} on {label}" for label, entry, n in f.rss[:10]]
    lines += [f"- undetected whole read: {item}" for item in f.flips_undetected_full[:10]]
    lines += [f"- wrong after a metadata byte: {item}" for item in f.meta_wrong[:10]]
    return [(["what", "count"], list(zip(ROWS, counts, strict=True))), "\n".join(lines)]


def main(argv: list[str] | None = None) -> int:
    import benchkit as h

    p = h.parser(__doc__, records=False)
    p.add_argument("--mutations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="draws the mutations (default: 0)")
    p.add_argument("--only", type=int, default=None, help="run mutation number N of the seed alone")
    p.add_argument("--procs", type=int, default=4, help="gloo processes that also load (0: none)")
    p.add_argument("--procs-every", type=int, default=10, help="load in them every N-th round")
    p.add_argument("--every-byte", action="store_true", help="instead: each metadata byte flipped")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # an absurd allocation: a MemoryError
    if hard == resource.RLIM_INFINITY or hard > MEMORY_CAP:  # recorded, not the OOM killer
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, hard))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    print(f"seed {args.seed}", flush=True)
    load = h.RunLoad()
    with tempfile.TemporaryDirectory(prefix="anyshard-fuzz-") as work:
        f = fuzz(args.mutations, args.seed, work, True, args.only, args.procs, args.procs_every,
                 args.every_byte)  # fmt: skip
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(f.kinds.items()))
    run, blocks = f"seed {args.seed}; mutations: {kinds}", summary(f)
    opts = ["--mutations", args.mutations, "--seed", args.seed]
    opts = [*(["--every-byte"] if args.every_byte else opts), "--procs", args.procs]
    opts = [str(x) for x in [*opts, "--procs-every", args.procs_every]]
    if args.every_byte:  # a section under the same heading
        h.report(args, opts, __file__, "fuzz_every_byte", run, blocks, load)
    else:
        h.report(args, opts, __file__, "fuzz", run, blocks, load, heading=HEADING, intro=INTRO)
    return 1 if f.internal or f.slow or f.rss or f.flips_undetected_full or f.meta_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
