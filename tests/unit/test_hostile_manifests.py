"""Hostile manifests and headers: every entry point refuses them with an `AnyshardError` that
names the file, fast, before allocating or enumerating anything an attacker sized.

Run: python -m pytest tests/unit/test_hostile_manifests.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest
import torch
from sealing import header_bytes, manifest_bytes, reseal

import anyshard
from anyshard import ucl
from anyshard.cli import main as cli
from anyshard.errors import AnyshardError, CorruptCheckpointError
from anyshard.format import strict_json
from anyshard.reshard.verify import verify_checkpoint

W = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
V = torch.arange(5, dtype=torch.int64)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "step-1")
    anyshard.save(path, {"w": W, "v": V, "step": 1})
    return path


@pytest.fixture
def ckpt(pristine, tmp_path) -> str:
    path = str(tmp_path / "step-1")
    shutil.copytree(pristine, path)
    return path


def edit_manifest(path: str, change) -> None:
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        m = json.load(f)
    text = change(m)
    with open(name, "wb") as f:
        f.write(reseal(text.encode()) if isinstance(text, str) else manifest_bytes(m))


def every_entry_point(path: str, capsys) -> None:
    """open + keys/metadata/get_tensor, load, verify and `anyshard inspect` (text and --json):
    each raises an AnyshardError (or exits 2 with one line), within 5 s."""
    start = time.monotonic()
    with pytest.raises(AnyshardError):
        with anyshard.open(path) as view:
            for name in view.keys():
                view.metadata(name)
                view.get_tensor(name)
            view.values  # noqa: B018
    with pytest.raises(AnyshardError):
        anyshard.load(
            path, {"w": torch.zeros(8, 16), "v": torch.zeros(5, dtype=torch.int64), "step": 0}
        )
    with pytest.raises(AnyshardError):
        verify_checkpoint(path)
    for extra in ([], ["--json"]):
        capsys.readouterr()
        assert cli(["inspect", path, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("anyshard inspect: ") and "Traceback" not in err, err
    assert time.monotonic() - start < 5


MUTATIONS = {
    "values is a list": lambda m: m.update(values=[1, 2]),
    "metadata is a string": lambda m: m.update(metadata="x"),
    "mesh offset is a string": lambda m: m["meshes"][0].update(offset="a"),
    "mesh strides are strings": lambda m: m["meshes"][0].update(strides=["x"]),
    "mesh sizes hold a float": lambda m: m["meshes"][0].update(sizes=[1.5]),
    "tensor shape holds a float": lambda m: m["tensors"]["w"].update(shape=[8.0, 16]),
    "tensor shape holds a bool": lambda m: m["tensors"]["w"].update(shape=[True, 16]),
    "a chunk of a dim the tensor lacks": lambda m: m["tensors"]["v"].update(
        mapping="chunk(5, world)"
    ),
    "a file name with a NUL": lambda m: m["files"].update({"0": "data/rank\u0000.safetensors"}),
    "a file name with a newline": lambda m: m["files"].update({"0": "data/rank\n.safetensors"}),
    "a tensor name with a NUL": lambda m: m["tensors"].update({"w\u0000": m["tensors"].pop("w")}),
    "a mesh rank outside the world": lambda m: m["meshes"][0].update(offset=7),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_hostile_manifest_is_refused_by_every_entry_point(ckpt, capsys, name):
    edit_manifest(ckpt, MUTATIONS[name])
    every_entry_point(ckpt, capsys)


def test_a_manifest_shape_far_larger_than_the_files_is_checked_before_memory_is_taken(ckpt):
    edit_manifest(ckpt, lambda m: m["tensors"]["w"].update(shape=[10**12, 16]))  # 64 TB
    with anyshard.open(ckpt) as view:
        assert view.metadata("w").shape == (10**12, 16)  # what the manifest says, unread
        with pytest.raises(CorruptCheckpointError, match="does not belong to this manifest"):
            view.get_tensor("w")
        with pytest.raises(CorruptCheckpointError, match="does not belong to this manifest"):
            view.get_slice("w")[: 10**11]
    with pytest.raises(CorruptCheckpointError):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize(
    "text",
    [
        lambda s: s.replace('"world_size":1', '"world_size":1e400'),
        lambda s: s.replace('"shape":[8,16]', '"shape":[NaN,16]'),
        lambda s: s.replace('"shape":[8,16]', '"shape":[Infinity,16]'),
        lambda s: s.replace('"values":{', '"values":{"deep":' + "[" * 100000 + "]" * 100000 + ","),
    ],
    ids=["1e400", "NaN", "Infinity", "deeply nested"],
)
def test_non_finite_numbers_and_deep_nesting_in_a_manifest_are_refused(ckpt, capsys, text):
    name = os.path.join(ckpt, "manifest.json")
    with open(name) as f:
        before = f.read()
    after = text(before)
    assert after != before
    with open(name, "wb") as f:  # sealed again: the parser, not the seal, is what refuses it
        f.write(reseal(after.encode()))
    every_entry_point(ckpt, capsys)


def test_a_deeply_nested_data_file_header_is_refused(ckpt):
    name = os.path.join(ckpt, "data", "rank-00000.safetensors")
    with open(name, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["deep"] = "x"
    text = header_bytes(header).decode()
    text = text.replace('"deep":"x"', '"deep":' + "[" * 100000 + "]" * 100000)
    body = reseal(text.encode())  # sealed again: the parser, not the seal, refuses it
    body += b" " * (-len(body) % 8)
    with open(name, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data[8 + n :])
    with pytest.raises(CorruptCheckpointError):
        anyshard.open(ckpt).get_tensor("w")
    with pytest.raises(CorruptCheckpointError):
        verify_checkpoint(ckpt)


def test_a_huge_mesh_in_a_tiny_manifest_costs_what_its_files_hold(ckpt, capsys):
    """world_size and mesh of 10**7 with one data file: refused at once (each stored shard,
    even an empty one, is in a data file), not enumerated."""

    def huge(m):
        m["world_size"] = 10**7
        m["meshes"][0].update(sizes=[10**7], strides=[1], offset=0)
        m["tensors"]["w"].update(mapping="chunk(0, world)")

    edit_manifest(ckpt, huge)
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="no data file for rank 1"):
        anyshard.open(ckpt)
    every_entry_point(ckpt, capsys)
    assert time.monotonic() - start < 5


def test_a_spec_layout_of_a_million_ranks_is_compiled_only_for_the_ranks_with_files(
    tmp_path, capsys
):
    path = str(tmp_path / "spec")
    spec = 'mesh tp; "w" -> "w" [4] : chunk(0, tp);'
    ucl.save_local_states(
        path, {0: {"w": torch.ones(2)}, 1: {"w": torch.ones(2)}}, spec=spec, layout={"tp": 2}
    )

    def huge(m):
        m["world_size"] = 10**6
        m["spec"]["layout"]["tp"] = 10**6
        m["meshes"][m["spec"]["mesh"]].update(sizes=[10**6], strides=[1], offset=0)

    edit_manifest(path, huge)
    start = time.monotonic()
    with anyshard.open(path) as view:
        assert view.keys() == ["w"]
        view.metadata("w")
        with pytest.raises(CorruptCheckpointError):
            view.get_tensor("w")  # the files hold 2 of the 4 elements under this layout
    with pytest.raises(AnyshardError):
        verify_checkpoint(path)
    assert cli(["inspect", path]) in (0, 2)
    assert time.monotonic() - start < 5


def _nest(depth: int, leaf: object) -> object:
    """``depth`` levels of containers, lists and dicts in turn, around ``leaf``, each beside a
    long run of scalars."""
    node = leaf
    for level in range(depth):
        node = (
            [*range(1000), node] if level % 2 else {**{f"k{i}": i for i in range(999)}, "n": node}
        )
    return node


@pytest.mark.parametrize("depth", [1, strict_json.MAX_DEPTH - 1, strict_json.MAX_DEPTH])
def test_json_nested_to_the_limit_passes_the_depth_check(depth):
    strict_json.loads(json.dumps(_nest(depth, 7)))  # the scalar leaf is not a level


@pytest.mark.parametrize("leaf", [[], {}, [[1]], {"a": [1, 2]}])
def test_json_nested_past_the_limit_is_refused_whatever_the_innermost_container(leaf):
    with pytest.raises(strict_json.FieldError, match="nests deeper than 64 levels"):
        strict_json.loads(json.dumps(_nest(strict_json.MAX_DEPTH, leaf)))
