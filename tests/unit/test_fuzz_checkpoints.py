"""A seeded subset of the mutation fuzzer (tools/fuzz_checkpoints.py; its engine, the harness's
benchkit.fuzzing) runs with the suite: damaged and hostile checkpoints through every entry point
raise only AnyshardError, each call returns within 5 s, and a flipped data bit never comes back in
a read of a whole tensor or of part of one, over two seeds. A smaller run also loads every damaged
anyshard checkpoint in 4 gloo processes. The corpus holds checksum tiles of a 2-d and of a 3-d
tensor (data file version 4), which the column slices read.

Run: python -m pytest tests/unit/test_fuzz_checkpoints.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "tools"))


@pytest.fixture(scope="module")
def fuzz():
    if TOOLS not in sys.path:  # spawned load processes import the fuzzer by name
        sys.path.append(TOOLS)
    from benchkit import fuzzing

    return fuzzing


@pytest.mark.parametrize("seed", [0, 1])
def test_a_thousand_mutations_raise_only_anyshard_errors_promptly(fuzz, tmp_path, seed):
    f = fuzz.fuzz(1000, seed, str(tmp_path), progress=False)
    assert f.mutations == 1000 and f.calls > 5000
    assert f.refused > 1000  # the mutations do damage: most are refused
    assert not f.internal, "\n".join(map(str, f.internal[:10]))
    assert not f.slow, f.slow[:10]
    assert not f.rss, f.rss[:10]
    assert f.flips > 50 and f.flips_returned_full > 50
    assert not f.flips_undetected_full, f.flips_undetected_full[:10]
    assert f.flips_returned_part > 50 and f.flips_undetected_part == 0  # reads of part, too


def test_loads_in_four_processes_raise_only_anyshard_errors(fuzz, tmp_path):
    f = fuzz.fuzz(200, 2, str(tmp_path), progress=False, procs=4, procs_every=1)
    assert f.mutations == 200
    assert not f.internal, "\n".join(map(str, f.internal[:10]))
    assert not f.slow, f.slow[:10]
    assert f.flips > 10 and f.flips_returned_part > 50 and f.flips_undetected_part == 0


def test_the_corpus_holds_tiles_of_a_2d_and_a_3d_tensor_that_column_slices_read(
    fuzz, tmp_path, monkeypatch
):
    from benchkit.mutations import make_corpus

    import anyshard
    from anyshard.api import views
    from anyshard.format.datafile import read_header

    corpus = make_corpus(str(tmp_path))
    header = read_header(os.path.join(corpus["anyshard"], "data", "rank-00000.safetensors"))
    wide, experts = header.shards["wide"], header.shards["experts"]
    assert len(wide.shape) == 2 and len(experts.shape) == 3
    assert wide.tiles > 1 and experts.tiles > 1
    plans, real = [], views.execute_fills
    monkeypatch.setattr(views, "execute_fills", lambda *a, **k: plans.append(real(*a, **k)))
    with anyshard.open(corpus["anyshard"]) as view:  # the fuzzer's "get_slice columns"
        part = view.get_slice("experts")[..., : experts.shape[-1] // 4]
    with anyshard.open(corpus["anyshard"]) as view:
        assert torch.equal(part, view.get_tensor("experts")[..., : experts.shape[-1] // 4])
    assert plans and any(t.tiles is not None for t in plans[0].transfers)
