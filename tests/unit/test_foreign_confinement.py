"""Foreign readers confine every path their metadata names to the checkpoint, and bound every
length by the file's real size, before reading or allocating anything.

Run: python -m pytest tests/unit/test_foreign_confinement.py -q
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

import anyshard
from anyshard.errors import CorruptCheckpointError


def dcp_checkpoint(tmp_path) -> str:
    out = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "step": 7}, checkpoint_id=out, no_dist=True)
    return out


def rewrite_storage(path: str, change) -> None:
    """Rewrite every storage record of DCP's .metadata with ``change(fqn, info) -> info``."""
    name = os.path.join(path, ".metadata")
    with open(name, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - the test's own file, written just above by DCP
    md.storage_data = {k: change(k.fqn, v) for k, v in md.storage_data.items()}
    with open(name, "wb") as f:
        pickle.dump(md, f)


def test_a_dcp_path_that_leaves_the_checkpoint_is_refused_at_open(tmp_path):
    path = dcp_checkpoint(tmp_path)
    with open(tmp_path / "outside.distcp", "wb") as f:
        f.write(b"\0" * 4096)
    rewrite_storage(path, lambda fqn, v: dataclasses.replace(v, relative_path="../outside.distcp"))
    with pytest.raises(CorruptCheckpointError, match="not a relative path inside the checkpoint"):
        anyshard.open(path)


@pytest.mark.parametrize("bad", ["/etc/passwd", "a/../../b", "x\x00y", "s3://bucket/k"])
def test_absolute_climbing_nul_and_url_paths_are_refused(tmp_path, bad):
    path = dcp_checkpoint(tmp_path)
    rewrite_storage(path, lambda fqn, v: dataclasses.replace(v, relative_path=bad))
    with pytest.raises(CorruptCheckpointError):
        anyshard.open(path)


def test_a_dcp_length_past_the_end_of_its_file_is_refused_before_allocating(tmp_path):
    path = dcp_checkpoint(tmp_path)
    rewrite_storage(
        path, lambda fqn, v: dataclasses.replace(v, length=1 << 40) if fqn == "step" else v
    )
    with anyshard.open(path) as view, pytest.raises(CorruptCheckpointError, match="past the end"):
        view.get_value("step")


def test_a_dcp_chunk_past_the_end_of_its_file_is_refused_before_allocating(tmp_path):
    path = dcp_checkpoint(tmp_path)
    rewrite_storage(
        path, lambda fqn, v: dataclasses.replace(v, offset=1 << 40) if fqn == "w" else v
    )
    with anyshard.open(path) as view, pytest.raises(CorruptCheckpointError, match="past the end"):
        view.get_tensor("w")


def test_negative_or_fractional_offsets_are_refused(tmp_path):
    path = dcp_checkpoint(tmp_path)
    rewrite_storage(path, lambda fqn, v: dataclasses.replace(v, offset=-8))
    with pytest.raises(CorruptCheckpointError, match="not whole numbers"):
        anyshard.open(path)


def test_a_deeply_nested_hugging_face_header_is_a_corrupt_checkpoint(tmp_path):
    body = ('{"__metadata__": {"a": "b"}, "x": ' + "[" * 100000 + "]" * 100000 + "}").encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CorruptCheckpointError):
        anyshard.open(str(path)).keys()
