"""Hugging Face Accelerate 1.15 with anyshard checkpoints: an MLP under FSDP2 on 2 gloo ranks
trains 3 steps; ``Accelerator.save_state`` inside `anyshard_checkpoints` writes anyshard
checkpoints (verified, no pickle in them), and ``load_state`` resumes from them bit-exact: the same
restored state and the same next losses as resuming from Accelerate's own DCP checkpoint of the
same moment. On 1 rank, a fresh FSDP2 model loads the 2-rank checkpoint bit-exact, as DCP loads
Accelerate's own. Also: where the context does not apply, and what it patches, when, for whom.

Run: python -m pytest tests/dist/test_trainer_accelerate.py -q
"""

from __future__ import annotations

import math
import os
import pickle
import threading
import types

import pytest
import torch

pytest.importorskip("accelerate")

import torch.distributed.checkpoint as dist_cp  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

from anyshard.cli import main as cli  # noqa: E402
from anyshard.dcp import AnyshardReader, AnyshardWriter  # noqa: E402
from anyshard.dcp.accelerate import (  # noqa: E402
    NothingRoutedWarning,
    NotRoutedError,
    anyshard_checkpoints,
)
from anyshard.reshard.verify import verify_checkpoint  # noqa: E402

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_accelerate_tasks.py")
PARTS = ("pytorch_model_fsdp_0", "optimizer_0")  # the two DCP checkpoints save_state writes


@pytest.fixture(scope="module")
def two_ranks(pool2, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("accelerate"))
    out = pool2.run(TASKS, "save_and_resume", root, timeout=240)[0]
    return root, out


@pytest.fixture(scope="module")
def one_rank(two_ranks, tmp_path_factory):
    from harness import DistPool

    root, _ = two_ranks
    tmp = str(tmp_path_factory.mktemp("accelerate-1"))
    pool = DistPool(1, tmp, init=False)
    try:
        store = os.path.join(tmp, "store")
        yield pool.run(TASKS, "resume_on_one_rank", root, store, timeout=240)[0]
    finally:
        pool.close()


def test_save_state_writes_anyshard_checkpoints_that_verify(two_ranks):
    root, _ = two_ranks
    for part in PARTS:
        path = os.path.join(root, "anyshard", part)
        assert sorted(os.listdir(path)) == ["data", "manifest.json"], part  # no .metadata
        data = sorted(os.listdir(os.path.join(path, "data")))
        assert len(data) == 2 and all(f.endswith(".safetensors") for f in data), data
        report = verify_checkpoint(path)
        assert report.files == 2 and report.tensors > 0
        assert cli(["verify", path]) == 0
        # Accelerate's own save of the same moment is DCP's format: the context made the change
        assert ".metadata" in os.listdir(os.path.join(root, "stock", part))
    # Accelerate's other files (RNG states) are its own, in both directories alike
    rest = {
        name: set(os.listdir(os.path.join(root, name))) - set(PARTS)
        for name in ("anyshard", "stock")
    }
    assert rest["anyshard"] and rest["anyshard"] == rest["stock"]


def test_load_state_resumes_bit_exact_as_accelerates_own_checkpoint(two_ranks):
    root, out = two_ranks
    # every parameter and AdamW state was restored bit for bit, from either checkpoint, and by
    # AnyshardReader from Accelerate's own (DCP's format) too
    assert out["differs"] == {"anyshard": [], "stock": [], "stock read by anyshard": []}
    assert {k.split(".")[0] for k in out["saved"]} == {"param", "step", "exp_avg", "exp_avg_sq"}
    resumed = out["resumed"]
    assert resumed["anyshard"] == resumed["stock"] == resumed["stock read by anyshard"]
    assert resumed["anyshard"] == out["uninterrupted"]  # the same layout: the same floats
    assert out["uninterrupted"] != out["first"]
    assert out["names_after"] == []  # DCP's names are DCP's again after the contexts


def test_two_ranks_resume_on_one_rank_bit_exact(two_ranks, one_rank):
    _, out = two_ranks
    saved = out["saved"]
    for name, want in saved.items():
        got = one_rank["anyshard"][name]
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert torch.equal(one_rank["stock"][name], want), name  # DCP's own relayout agrees
    assert set(one_rank["anyshard"]) == set(saved)
    # the fresh model started elsewhere: the load is what made the states equal
    assert not torch.equal(one_rank["fresh"]["param.w1.weight"], saved["param.w1.weight"])
    # and trains on as the 2-rank run did, but for the summation order of a layout of 1 rank
    assert len(one_rank["next_losses"]) == 3
    for got, want in zip(one_rank["next_losses"], out["uninterrupted"], strict=True):
        assert math.isclose(got, want, rel_tol=1e-5), (one_rank["next_losses"], out)


# --- what the context applies to, and what it patches --------------------------------------


def _fake(kind: str, state_dict_type: str | None = "SHARDED_STATE_DICT") -> object:
    from accelerate.utils import DistributedType

    plugin = types.SimpleNamespace(state_dict_type=state_dict_type)
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    return types.SimpleNamespace(distributed_type=DistributedType[kind], state=state)


@pytest.mark.parametrize(
    "kind,sdt,says",
    [
        ("MULTI_CPU", None, "distributed_type is MULTI_CPU, not FSDP"),
        ("NO", None, "distributed_type is NO, not FSDP"),
        ("FSDP", "FULL_STATE_DICT", "state_dict_type is FULL_STATE_DICT"),
    ],
)
def test_where_accelerate_does_not_save_through_dcp_it_says_so(kind, sdt, says):
    with pytest.raises(NotRoutedError, match=says):
        with anyshard_checkpoints(_fake(kind, sdt)):
            pytest.fail("entered")
    assert dist_cp.FileSystemWriter is filesystem.FileSystemWriter  # nothing left patched


def test_a_block_that_routes_nothing_warns():
    with pytest.warns(NothingRoutedWarning, match="nothing in this block"):
        with anyshard_checkpoints(_fake("FSDP")):
            pass
    assert dist_cp.FileSystemWriter is filesystem.FileSystemWriter


def _construct_as(module: str, name: str, path: str) -> object:
    """``dist_cp.<name>(path)`` called from code whose module is ``module``."""
    scope = {"__name__": module, "dist_cp": dist_cp}
    exec(f"made = dist_cp.{name}({path!r})", scope)  # noqa: S102
    return scope["made"]


def test_only_accelerates_constructions_on_the_entering_thread_are_routed(tmp_path):
    path = str(tmp_path)
    seen: dict[str, object] = {}
    with anyshard_checkpoints(_fake("FSDP")):
        writer = _construct_as("accelerate.utils.fsdp_utils", "FileSystemWriter", path)
        reader = _construct_as("accelerate.utils.fsdp_utils", "FileSystemReader", path)
        assert type(writer) is AnyshardWriter and writer.path == path
        assert type(reader) is AnyshardReader and reader.path == path
        mine = _construct_as("train", "FileSystemWriter", path)  # the user's own: DCP's own
        assert type(mine) is filesystem.FileSystemWriter
        assert isinstance(mine, dist_cp.FileSystemWriter)  # as the patched name too
        assert pickle.loads(pickle.dumps(mine)).fs is not None  # noqa: S301 (sent to a saver process)

        class Derived(dist_cp.FileSystemWriter):  # derived while patched: built as usual
            pass

        assert Derived(path).fs is not None
        worker = threading.Thread(
            target=lambda: seen.update(
                other=_construct_as("accelerate.utils.fsdp_utils", "FileSystemWriter", path)
            )
        )
        worker.start()
        worker.join()
        assert type(seen["other"]) is filesystem.FileSystemWriter  # another thread: DCP's
    assert dist_cp.FileSystemWriter is filesystem.FileSystemWriter
    assert dist_cp.FileSystemReader is filesystem.FileSystemReader
    outside = _construct_as("accelerate.utils.fsdp_utils", "FileSystemWriter", path)
    assert type(outside) is filesystem.FileSystemWriter


def test_nested_and_concurrent_contexts_restore_the_names_last_and_after_exceptions():
    routed = anyshard_checkpoints(_fake("FSDP"))  # one context, entered in two threads, nested
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with routed:
            _construct_as("accelerate.utils.fsdp_utils", "FileSystemReader", "x")
            entered.set()
            release.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    entered.wait(10)
    with pytest.raises(RuntimeError, match="boom"):
        with routed, routed:
            raise RuntimeError("boom")
    assert dist_cp.FileSystemWriter is not filesystem.FileSystemWriter  # the thread's is open
    release.set()
    other.join()
    assert dist_cp.FileSystemWriter is filesystem.FileSystemWriter
    assert dist_cp.FileSystemReader is filesystem.FileSystemReader
    with routed:  # and again, after all closed
        reader = _construct_as("accelerate.utils.fsdp_utils", "FileSystemReader", "x")
    assert type(reader) is AnyshardReader
