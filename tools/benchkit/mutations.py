"""Damaged checkpoints for the fuzzer (tools/fuzz_checkpoints.py): pristine ones of each kind
(`make_corpus`: anyshard plain, with a UCL spec, an incremental step; DCP; Hugging Face), and
`mutate`, which damages a copy once in a way drawn from `KINDS`; `every_byte` lists instead every
byte of the anyshard checkpoints' metadata. Edits of the manifest or a header as JSON are sealed
again (a hostile writer's checksum is right), so that what lies behind the seal is fuzzed too.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import pickle
import random
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import anyshard
from anyshard import ucl
from anyshard.format.checksum import seal

SPEC = """mesh tp;
"w" -> "w" [8, 6] : chunk(0, tp);
"b" -> "b" [6] : chunk(0, tp);
"norm" -> "norm" [4] : replicate(tp);
"""
HOSTILE = [-1, 0, 1, 7, 2**31, 2**63, 10**30, -(10**12), 0.5, 1e300, True, None, "", "x", "w\0"]
HOSTILE += ["../../outside", "/etc/passwd", "s3://bucket/key", "data/rank-00000.safetensors\n"]
HOSTILE += [[], {}, [1, 2, 3], {"a": 1}, "chunk(5, world)", "on(world, 99)", "F16", "BOGUS"]
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
    # [experts, rows, cols], 16 KiB rows: tiles of 1 KiB columns over its rows (data file v4)
    experts = torch.randn(2, 4, 4096, generator=g)
    state = {"w": w, "e": e, "n": n, "s": s, "wide": wide, "experts": experts}
    return state | copy.deepcopy(VALUES)


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


def every_byte(corpus: dict[str, str]):
    """(corpus name, file relative to its checkpoint, byte offset, mask) for every byte of the
    manifest and of each data file's header (its length and JSON) of each corpus given."""
    for name, path in sorted(corpus.items()):
        for full in [os.path.join(path, "manifest.json"), *_data_files(path)]:
            data = Path(full).read_bytes()
            end = len(data) if full.endswith(".json") else 8 + struct.unpack("<Q", data[:8])[0]
            for at in range(end):  # each byte once, the masks taking turns
                yield name, os.path.relpath(full, path), at, MASKS[at % len(MASKS)]
