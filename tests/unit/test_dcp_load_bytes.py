"""DCP's contract for byte values, through `AnyshardReader`: a load planner that overrides
``load_bytes`` (Megatron-Core's does, to turn its ShardedObjects back into objects) receives every
byte item's bytes exactly as `FileSystemReader` hands them; a planner that keeps DCP's
``load_bytes`` (which unpickles with ``weights_only=False``) gets the values set directly, never
through that method, and nothing is unpickled. The truth is DCP's own FileSystemWriter /
FileSystemReader on the same state.

Run: python -m pytest tests/unit/test_dcp_load_bytes.py -q
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from anyshard.dcp import AnyshardReader, AnyshardWriter
from anyshard.dcp.reader import overrides_load_bytes
from anyshard.errors import AnyshardError


def _object_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # what Megatron-Core stores for a list of ShardedObjects' data
    return buf.getvalue()


OBJECT = [{"seed": 1234, "calls": [0, 2]}]


class PassBytesThrough(DefaultSavePlanner):
    """Megatron-Core's save planner in this respect: an ``io.BytesIO`` value is already
    serialised, so it is stored as it is (DCP's default would ``torch.save`` it again)."""

    def transform_object(self, write_item, object):
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


class ReadsItsOwnBytes(DefaultLoadPlanner):
    """A DefaultLoadPlanner subclass with its own ``load_bytes``, as Megatron-Core's: records
    what it is handed, and reads it back with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, bytes] = {}

    def load_bytes(self, read_item, value) -> None:
        data = value.read()
        self.got[read_item.dest_index.fqn] = data
        value = torch.load(io.BytesIO(data), weights_only=True)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)


def _state() -> dict:
    return {
        "w": torch.arange(6.0).reshape(2, 3),
        "obj": io.BytesIO(_object_bytes(OBJECT)),
        "step": 7,
        "sched": {"max_lr": 3e-4, "style": "cosine"},
    }


def _target() -> dict:
    return {
        "w": torch.zeros(2, 3),
        "obj": io.BytesIO(),
        "step": 0,
        "sched": {"max_lr": 0.0, "style": ""},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same state saved by both writers, with a planner that passes BytesIO through."""
    root = tmp_path_factory.mktemp("load-bytes")
    ours, theirs = str(root / "anyshard"), str(root / "dcp")
    dcp.save(
        _state(), storage_writer=AnyshardWriter(ours), planner=PassBytesThrough(), no_dist=True
    )
    dcp.save(
        _state(), storage_writer=FileSystemWriter(theirs), planner=PassBytesThrough(), no_dist=True
    )
    return ours, theirs


def _load(reader, planner) -> dict:
    back = _target()
    dcp.load(back, storage_reader=reader, planner=planner, no_dist=True)
    return back


def test_a_planner_overriding_load_bytes_receives_what_filesystemreader_hands_it(saved):
    ours, theirs = saved
    truth = ReadsItsOwnBytes()
    want = _load(FileSystemReader(theirs), truth)
    for reader in (AnyshardReader(ours), AnyshardReader(theirs)):  # anyshard's, DCP's files
        planner = ReadsItsOwnBytes()
        back = _load(reader, planner)
        assert set(planner.got) == set(truth.got) == {"obj", "step", "sched.max_lr", "sched.style"}
        # the ShardedObject-style value: the very bytes stored
        assert planner.got["obj"] == truth.got["obj"] == _object_bytes(OBJECT)
        for fqn in truth.got:  # JSON values: the torch.save DCP's default planner stores
            assert planner.got[fqn] == truth.got[fqn], fqn
            got = torch.load(io.BytesIO(planner.got[fqn]), weights_only=True)
            assert got == torch.load(io.BytesIO(truth.got[fqn]), weights_only=True), fqn
        assert back["obj"] == OBJECT and back["step"] == 7
        assert back["sched"] == {"max_lr": 3e-4, "style": "cosine"}
        assert torch.equal(back["w"], want["w"])


def _refuse(*args, **kwargs):
    raise AssertionError("unpickled")


@pytest.mark.parametrize("planner", [None, "subclass"], ids=["default", "subclass-keeping-it"])
def test_a_planner_keeping_dcps_load_bytes_gets_values_set_and_nothing_unpickled(
    saved, monkeypatch, planner
):
    ours, _ = saved

    class KeepsLoadBytes(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            return super().resolve_tensor(read_item)

    chosen = KeepsLoadBytes() if planner else None
    assert not overrides_load_bytes(chosen or DefaultLoadPlanner())
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", _refuse)
    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _refuse)
    back = _load(AnyshardReader(ours), chosen)
    assert isinstance(back["obj"], io.BytesIO)  # the same type, the same bytes
    assert back["obj"].getvalue() == _object_bytes(OBJECT)
    assert back["step"] == 7 and back["sched"] == {"max_lr": 3e-4, "style": "cosine"}


def test_the_empty_state_dict_planner_keeps_the_safe_path(saved, monkeypatch):
    ours, _ = saved
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", _refuse)
    assert not overrides_load_bytes(_EmptyStateDictLoadPlanner())
    back: dict = {}
    _load_state_dict(
        back,
        storage_reader=AnyshardReader(ours),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    assert back["obj"].getvalue() == _object_bytes(OBJECT) and back["step"] == 7


class Opaque:
    """An object DCP pickles and weights-only loading refuses (no library registers it as safe;
    megatron-core, once imported, registers io.BytesIO and argparse.Namespace)."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_a_filesystemwriter_value_weights_only_cannot_read_is_refused_by_its_key(saved):
    _, theirs = saved
    path = theirs + "-pickled"
    dcp.save({"blob": Opaque(5)}, storage_writer=FileSystemWriter(path), no_dist=True)
    with pytest.raises((AnyshardError, CheckpointException), match="blob: .*weights_only=True"):
        dcp.load({"blob": 0}, storage_reader=AnyshardReader(path), no_dist=True)
    # a planner with its own load_bytes reads it its own way, as through FileSystemReader
    mine, truth = ReadsItsOwnBytesRaw(), ReadsItsOwnBytesRaw()
    dcp.load({"blob": 0}, storage_reader=AnyshardReader(path), planner=mine, no_dist=True)
    dcp.load({"blob": 0}, storage_reader=FileSystemReader(path), planner=truth, no_dist=True)
    assert mine.got == truth.got and len(mine.got["blob"]) > 3


class ReadsItsOwnBytesRaw(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, bytes] = {}

    def load_bytes(self, read_item, value) -> None:
        self.got[read_item.dest_index.fqn] = value.read()
