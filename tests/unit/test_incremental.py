"""Incremental checkpoints: a shard whose bytes an earlier step of the same root holds is
referenced there, not written again; loads, verify, ls, gc, retention and conversion keep
working, and a reference can neither leave the root nor go unchecked.

Run: python -m pytest tests/unit/test_incremental.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from sealing import header_bytes, manifest_bytes

import anyshard
import anyshard.format.incremental as incremental
from anyshard.cli import main as cli
from anyshard.errors import AnyshardError, ChecksumError, CorruptCheckpointError
from anyshard.format.steps import list_steps, remove_step
from anyshard.reshard.verify import verify_checkpoint
from anyshard.trainer_integration import Checkpointer


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "base": {
            "emb": torch.randn(300, 64, generator=g),
            "proj": torch.randn(64, 64, generator=g),
        },
        "lora": {"a": torch.randn(8, 64, generator=g), "b": torch.zeros(64, 8)},
        "meta": {"step": 0},
    }


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _data_bytes(path: str) -> int:
    data = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))


def _assert_state(path: str, state: dict) -> None:
    with anyshard.open(path) as view:
        for group in ("base", "lora"):
            for k, t in state[group].items():
                assert torch.equal(view.get_tensor(f"{group}.{k}"), t), f"{group}.{k}"


def _step(state: dict, n: int) -> None:
    state["lora"]["a"] += 0.5 * n
    state["lora"]["b"] += 0.25 * n
    state["meta"]["step"] = n


def test_unchanged_shards_are_referenced_and_read_back_bit_exact(tmp_path):
    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    _step(state, 1)
    anyshard.save(s2, state, base=s1)
    m = _manifest(s2)
    assert m["format_version"] == 4  # sealed, with references
    assert sorted(m["refs"]["0"]) == ["base.emb", "base.proj"]
    assert all(
        r["file"] == "../step-1/data/rank-00000.safetensors" for r in m["refs"]["0"].values()
    )
    # the new step's own data file holds only the adapters
    assert _data_bytes(s2) < 0.1 * _data_bytes(s1)
    _assert_state(s2, state)
    with anyshard.open(s2) as view:  # a partial read of a referenced shard, verified
        assert torch.equal(view.get_slice("base.emb")[17:33, 5:9], state["base"]["emb"][17:33, 5:9])
    target = {k: {n: torch.empty_like(t) for n, t in state[k].items()} for k in ("base", "lora")}
    target["meta"] = {"step": -1}
    anyshard.load(s2, target)
    assert target["meta"]["step"] == 1 and torch.equal(target["base"]["emb"], state["base"]["emb"])
    assert verify_checkpoint(s2).shards == 4


def test_references_never_chain_and_outlive_their_base(tmp_path):
    state = _state()
    paths = [str(tmp_path / f"step-{i}") for i in range(4)]
    anyshard.save(paths[0], state, content_hash=True)
    for i in range(1, 4):
        _step(state, i)
        anyshard.save(paths[i], state, base=paths[i - 1])
    # step 3 references step 0's file directly, not step 2 (which referenced it too)
    refs = _manifest(paths[3])["refs"]["0"]
    assert {r["file"] for r in refs.values()} == {"../step-0/data/rank-00000.safetensors"}
    for p in paths[1:3]:
        remove_step(p)
    remove_step(paths[0])  # the manifest goes; the referenced file stays
    assert os.path.exists(os.path.join(paths[0], "data", "rank-00000.safetensors"))
    assert not os.path.exists(os.path.join(paths[0], "manifest.json"))
    assert not os.path.exists(paths[1]) and not os.path.exists(paths[2])
    _assert_state(paths[3], state)
    assert verify_checkpoint(paths[3]).bytes_checked > 0


def test_frozen_names_skip_hashing(tmp_path, monkeypatch):
    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    hashed = []
    real = incremental.hash_shard
    monkeypatch.setattr(
        incremental, "hash_shard", lambda mv, block: hashed.append(mv.nbytes) or real(mv, block)
    )
    _step(state, 1)
    anyshard.save(s2, state, base=s1, frozen=["base.emb", "base.proj"])
    assert sorted(hashed) == [8 * 64 * 4, 64 * 8 * 4]  # only the adapters
    assert sorted(_manifest(s2)["refs"]["0"]) == ["base.emb", "base.proj"]
    _assert_state(s2, state)


def test_a_base_saved_without_hashes_is_compared_byte_for_byte(tmp_path):
    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state)  # a plain save: no hashes recorded
    state["base"]["proj"][3, 3] += 1.0  # one element changed: written again
    _step(state, 1)
    anyshard.save(s2, state, base=s1)
    assert sorted(_manifest(s2)["refs"]["0"]) == ["base.emb"]
    _assert_state(s2, state)


def test_base_must_be_a_committed_sibling(tmp_path):
    state = _state()
    anyshard.save(str(tmp_path / "a" / "step-1"), state)
    with pytest.raises(AnyshardError, match="same root"):
        anyshard.save(str(tmp_path / "b" / "step-2"), state, base=str(tmp_path / "a" / "step-1"))
    with pytest.raises(AnyshardError, match="not a committed checkpoint|no such checkpoint"):
        anyshard.save(str(tmp_path / "a" / "step-3"), state, base=str(tmp_path / "a" / "step-2"))
    assert not os.path.exists(tmp_path / "a" / "step-3" / "manifest.json")


def test_checkpointer_retention_keeps_referenced_files_until_no_step_needs_them(tmp_path):
    root = str(tmp_path / "ckpt")
    state = _state()
    ckpt = Checkpointer(root, keep_last=2, incremental=True, frozen=["base.emb"])
    for n in range(1, 6):
        _step(state, n)
        ckpt.save(n, state)
    ckpt.wait()
    listed = list_steps(root, refs=True)
    assert [(s.step, s.committed, s.referenced) for s in listed] == [
        (1, False, True),
        (4, True, False),
        (5, True, False),
    ]
    assert all(s.shared == (300 + 64) * 64 * 4 for s in listed if s.committed)
    assert listed[-1].bytes < 0.1 * listed[0].bytes
    fresh = _state(seed=9)
    assert Checkpointer(root).restore_latest(fresh) == 5
    assert torch.equal(fresh["base"]["emb"], state["base"]["emb"])
    assert torch.equal(fresh["lora"]["a"], state["lora"]["a"])
    # full saves from here on: once no kept step references step 1's file, retention drops it
    plain = Checkpointer(root, keep_last=2)
    for n in range(6, 8):
        plain.save(n, state)
    plain.wait()
    assert [s.step for s in list_steps(root)] == [6, 7]


def test_a_restarted_checkpointer_bases_its_first_save_on_the_restored_step(tmp_path):
    root = str(tmp_path / "ckpt")
    state = _state()
    Checkpointer(root, incremental=True).save(1, state)
    again = Checkpointer(root, incremental=True)
    restored = _state(seed=3)
    assert again.restore_latest(restored) == 1
    _step(restored, 2)
    again.save(2, restored)
    assert sorted(_manifest(os.path.join(root, "step-000000002"))["refs"]["0"]) == [
        "base.emb",
        "base.proj",
    ]


def test_ls_shows_owned_and_shared_bytes_and_gc_keeps_referenced_files(tmp_path, capsys):
    root = tmp_path / "ckpt"
    state = _state()
    anyshard.save(str(root / "step-000000001"), state, content_hash=True)
    _step(state, 2)
    anyshard.save(str(root / "step-000000002"), state, base=str(root / "step-000000001"))
    os.remove(root / "step-000000001" / "manifest.json")  # an interrupted retention
    assert cli(["gc", str(root)]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and (root / "step-000000001" / "data").exists()
    assert cli(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "referenced" in out and "references" in out
    assert cli(["ls", str(root), "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert steps[1]["shared_bytes"] == (300 + 64) * 64 * 4 and steps[0]["referenced"]
    assert cli(["verify", str(root / "step-000000002")]) == 0
    _assert_state(str(root / "step-000000002"), state)


def test_conversion_of_an_incremental_step_is_self_contained(tmp_path):
    from anyshard.loaders.convert import convert

    state = _state()
    anyshard.save(str(tmp_path / "r" / "step-1"), state, content_hash=True)
    _step(state, 1)
    anyshard.save(str(tmp_path / "r" / "step-2"), state, base=str(tmp_path / "r" / "step-1"))
    convert(str(tmp_path / "r" / "step-2"), str(tmp_path / "out"), to="anyshard")
    convert(str(tmp_path / "r" / "step-2"), str(tmp_path / "hf"), to="hf")
    shutil.rmtree(tmp_path / "r")
    _assert_state(str(tmp_path / "out"), state)
    assert "refs" not in _manifest(str(tmp_path / "out"))
    from safetensors.torch import load_file

    hf = {}
    for f in os.listdir(tmp_path / "hf"):
        if f.endswith(".safetensors"):
            hf.update(load_file(str(tmp_path / "hf" / f)))
    assert torch.equal(hf["base.emb"], state["base"]["emb"])


# --- hostile and damaged references -----------------------------------------------------------


def _incremental_pair(tmp_path) -> tuple[str, str, dict]:
    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    _step(state, 1)
    anyshard.save(s2, state, base=s1)
    return s1, s2, state


@pytest.mark.parametrize(
    "file",
    [
        "../../outside/data/rank-00000.safetensors",
        "/etc/passwd",
        "../step-1/data/../../x.safetensors",
        "../step-1/rank-00000.safetensors",
        "s3://bucket/step-1/data/rank-00000.safetensors",
        "../../../../../etc/data/passwd",
        "../step-1/data/",
    ],
)
def test_a_reference_outside_the_root_is_refused(tmp_path, file):
    _, s2, _ = _incremental_pair(tmp_path)
    outside = tmp_path.parent / "outside" / "data"
    outside.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(s2, "..", "step-1", "data", "rank-00000.safetensors"), outside)
    m = _manifest(s2)
    m["refs"]["0"]["base.emb"]["file"] = file
    with open(os.path.join(s2, "manifest.json"), "wb") as f:
        f.write(manifest_bytes(m))
    with pytest.raises(CorruptCheckpointError, match="refusing to read it"):
        anyshard.open(s2)
    assert cli(["verify", s2]) != 0


def test_references_need_format_version_3(tmp_path):
    _, s2, _ = _incremental_pair(tmp_path)
    m = _manifest(s2)
    m["format_version"] = 2
    del m["crc32c"]  # as a version-2 writer wrote it
    with open(os.path.join(s2, "manifest.json"), "wb") as f:
        f.write(manifest_bytes(m))
    with pytest.raises(CorruptCheckpointError, match="format_version 3"):
        anyshard.open(s2)


def test_a_flipped_bit_in_a_referenced_file_is_a_checksum_error(tmp_path):
    s1, s2, _ = _incremental_pair(tmp_path)
    ref = _manifest(s2)["refs"]["0"]["base.emb"]
    with open(os.path.join(s1, "data", "rank-00000.safetensors"), "r+b") as f:
        f.seek(ref["offsets"][0] + 100)
        byte = f.read(1)
        f.seek(ref["offsets"][0] + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    with anyshard.open(s2) as view, pytest.raises(ChecksumError):
        view.get_slice("base.emb")[0:2]
    with pytest.raises(ChecksumError):
        verify_checkpoint(s2)


def _strip_hashes(path: str) -> None:
    """Remove the content hashes from a data file's header, keeping its length (spaces pad
    the header), so that its offsets and crc32c stay valid: a file written without hashes."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["anyshard"])
        for entry in meta["blocks"].values():
            entry.pop("hash", None)
        header["__metadata__"]["anyshard"] = json.dumps(meta, separators=(",", ":"))
        raw = header_bytes(header)
        assert len(raw) <= n
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def test_a_replaced_referenced_file_is_a_checksum_error(tmp_path):
    """The base's data file swapped for another valid one of the same layout (every crc32c
    consistent, the same offsets): the content hash the reference records tells them apart."""
    s1, s2, state = _incremental_pair(tmp_path)
    other = _state(seed=11)
    anyshard.save(str(tmp_path / "other"), other, content_hash=True)
    swapped = tmp_path / "other" / "data" / "rank-00000.safetensors"
    shutil.copy(swapped, os.path.join(s1, "data"))
    # the file records its own hashes: a load compares them with the reference's, reading nothing
    with anyshard.open(s2) as view, pytest.raises(ChecksumError, match="replaced"):
        view.get_tensor("base.emb")
    with pytest.raises(ChecksumError):
        verify_checkpoint(s2)
    # a file that records none: verify hashes the referenced bytes
    _strip_hashes(str(swapped))
    shutil.copy(swapped, os.path.join(s1, "data"))
    with pytest.raises(ChecksumError, match="content hash mismatch"):
        verify_checkpoint(s2)
    assert cli(["verify", s2]) != 0


def test_a_missing_referenced_file_is_a_clear_error(tmp_path):
    s1, s2, _ = _incremental_pair(tmp_path)
    shutil.rmtree(s1)
    with anyshard.open(s2) as view, pytest.raises(CorruptCheckpointError, match="missing"):
        view.get_tensor("base.emb")
    with anyshard.open(s2) as view:  # what the step holds itself still reads
        assert view.get_tensor("lora.a").shape == (8, 64)


def test_the_remembered_index_of_a_base_equals_the_one_read_from_storage(tmp_path):
    """The index a process keeps of a step it committed is what reading the step gives; a base
    replaced since (another manifest at the same path) is read again."""
    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    _step(state, 1)
    anyshard.save(s2, state, base=s1)
    _step(state, 2)
    anyshard.save(str(tmp_path / "step-3"), state, base=s2)  # from the remembered index
    incremental._index_cache.clear()
    anyshard.save(str(tmp_path / "step-4"), state, base=s2)  # read from storage
    got = [_manifest(str(tmp_path / s))["refs"] for s in ("step-3", "step-4")]
    assert got[0] == got[1] and "lora.a" not in got[0]["0"]
    # step 2 replaced by a plain save at the same path (nothing remembered of it): the index
    # remembered of the old step 2 (references into step 1) no longer applies
    shutil.rmtree(s2)
    anyshard.save(s2, state)
    anyshard.save(str(tmp_path / "step-5"), state, base=s2)
    refs = _manifest(str(tmp_path / "step-5"))["refs"]["0"]
    assert {r["file"] for r in refs.values()} == {"../step-2/data/rank-00000.safetensors"}
    _assert_state(str(tmp_path / "step-5"), state)


def test_the_example_in_docs_api_md_runs(capsys):
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")
    blocks = open(doc).read().split("```python\n")[1:]
    example = next(b.split("```")[0] for b in blocks if "content_hash=True" in b)
    exec(compile(example, "docs/api.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "['base']"


@pytest.mark.parametrize("defer", [False, True])
def test_an_async_save_never_stages_the_frozen_shards_its_base_holds(tmp_path, monkeypatch, defer):
    from anyshard.api import async_save

    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    staged: list[str] = []
    real = async_save.stage
    monkeypatch.setattr(
        async_save,
        "stage",
        lambda writes, *a: staged.extend(k for k, _ in writes) or real(writes, *a),
    )
    _step(state, 1)
    handle = anyshard.save(
        s2, state, base=s1, frozen=["base.emb", "base.proj"], async_=True, defer_staging=defer
    )
    handle.result()
    assert sorted(staged) == ["lora.a", "lora.b"]
    assert sorted(_manifest(s2)["refs"]["0"]) == ["base.emb", "base.proj"]
    _assert_state(s2, state)


def test_hashes_are_xxh3_128_computed_in_one_pass_with_the_block_checksums(tmp_path):
    """The content hash recorded in the header and in the references is xxh3-128 of the shard's
    bytes (recomputed here with xxhash itself), and the crc32c blocks written beside it are the
    ones a plain save computes."""
    import xxhash

    from anyshard.format.datafile import read_header

    s1, s2, state = _incremental_pair(tmp_path)
    header = read_header(os.path.join(s1, "data", "rank-00000.safetensors"))
    plain = str(tmp_path / "plain")
    anyshard.save(plain, state)
    header_plain = read_header(os.path.join(plain, "data", "rank-00000.safetensors"))
    with open(os.path.join(s1, "data", "rank-00000.safetensors"), "rb") as f:
        raw = f.read()
    for key, e in header.shards.items():
        assert e.digest == "xxh3-128:" + xxhash.xxh3_128(raw[e.start : e.stop]).hexdigest(), key
    emb = header.shards["base.emb"]
    assert emb.crcs == header_plain.shards["base.emb"].crcs and len(emb.crcs) > 1
    refs = _manifest(s2)["refs"]["0"]
    assert refs and all(r["hash"].startswith("xxh3-128:") for r in refs.values())


def test_a_base_that_recorded_sha256_is_compared_byte_for_byte(tmp_path):
    """A base whose header records SHA-256 (as data-file version 2 did): no hash to compare
    with, so the unchanged shards are read back and compared, then referenced under xxh3-128."""
    import hashlib

    state = _state()
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    anyshard.save(s1, state, content_hash=True)
    data = os.path.join(s1, "data", "rank-00000.safetensors")
    with open(data, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        f.seek(0)
        raw = f.read()
        meta = json.loads(header["__metadata__"]["anyshard"])
        for name, entry in meta["blocks"].items():
            a, b = header[name]["data_offsets"]
            entry.pop("hash")
            entry["sha256"] = hashlib.sha256(raw[8 + n + a : 8 + n + b]).hexdigest()
        header["__metadata__"]["anyshard"] = json.dumps(meta, separators=(",", ":"))
        new = header_bytes(header)
        new += b" " * (-len(new) % 8)  # a longer header: the data moves with it
        f.seek(0)
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    incremental._index_cache.clear()  # as another process would: the base read from storage
    _step(state, 1)
    anyshard.save(s2, state, base=s1)
    refs = _manifest(s2)["refs"]["0"]
    assert sorted(refs) == ["base.emb", "base.proj"]
    assert all(r["hash"].startswith("xxh3-128:") for r in refs.values())
    _assert_state(s2, state)
    assert verify_checkpoint(s2).bytes_checked > 0
