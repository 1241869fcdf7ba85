"""`write_dcp`: any view written as a PyTorch DCP checkpoint that torch.distributed.checkpoint
itself loads, bit-exact, one tensor read at a time.

Run: python -m pytest tests/unit/test_export_dcp.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import anyshard
from anyshard.errors import AnyshardError, CorruptCheckpointError, SaveError
from anyshard.loaders import DCPCheckpointView, write_dcp

pytestmark = pytest.mark.filterwarnings("ignore:.*single process.*:UserWarning")


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(9, 5, generator=g),
            "emb": torch.randn(7, 4, generator=g).to(torch.bfloat16),
            "ids": torch.arange(6, dtype=torch.int64),
            "scale": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
        },
        "step": 11,
        "lr": 0.125,
        "tag": "run-a",
    }


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    anyshard.save(path, state())
    return path


def zeros_like(s):
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "step": 0,
        "lr": 0.0,
        "tag": "",
    }


def test_dcp_loads_what_write_dcp_wrote_bit_exact(ckpt, tmp_path):
    out = str(tmp_path / "dcp")
    seen = []
    with anyshard.open(ckpt) as view:
        report = write_dcp(view, out, progress=lambda k, n, b, t: seen.append((k, n, b, t)))
    assert report.format == "pytorch-dcp" and report.num_tensors == 5
    assert seen[-1][0] == seen[-1][1] == 5 and seen[-1][2] == seen[-1][3] == report.num_bytes
    truth = state()
    got = zeros_like(truth)
    dcp.load(got, checkpoint_id=out, no_dist=True)
    for k, t in truth["model"].items():
        assert got["model"][k].dtype == t.dtype and torch.equal(got["model"][k], t), k
    assert (got["step"], got["lr"], got["tag"]) == (11, 0.125, "run-a")
    # and anyshard's own DCP reader (no unpickling of code) reads it back the same
    with anyshard.open(out) as back:
        assert isinstance(back, DCPCheckpointView)
        assert torch.equal(back.get_tensor("model.w"), truth["model"]["w"])
        assert back.get_value("step") == 11


def test_dtype_only_and_rename(ckpt, tmp_path):
    out = str(tmp_path / "dcp")
    with anyshard.open(ckpt) as view:
        write_dcp(view, out, dtype="bf16", only=r"^model\.(w|ids)$", rename={r"^model\.": "m."})
    got = {
        "m": {
            "w": torch.zeros(9, 5, dtype=torch.bfloat16),
            "ids": torch.zeros(6, dtype=torch.int64),
        }
    }
    dcp.load(got, checkpoint_id=out, no_dist=True)
    assert torch.equal(got["m"]["w"], state()["model"]["w"].to(torch.bfloat16))
    assert torch.equal(got["m"]["ids"], torch.arange(6))  # integers keep their dtype
    with anyshard.open(out) as back:
        assert sorted(back.keys()) == ["m.ids", "m.w"]


def test_refuses_a_directory_holding_a_dcp_checkpoint(ckpt, tmp_path):
    out = str(tmp_path / "dcp")
    with anyshard.open(ckpt) as view:
        write_dcp(view, out)
        before = sorted(p.name for p in (tmp_path / "dcp").iterdir())
        with pytest.raises(SaveError, match="already holds a DCP checkpoint"):
            write_dcp(view, out)
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == before


def test_a_name_that_is_a_tensor_and_a_value_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    anyshard.save(path, {"a": torch.ones(2), "b": 3})
    with (
        anyshard.open(path) as view,
        pytest.raises(AnyshardError, match="both a tensor and a value"),
    ):
        write_dcp(view, str(tmp_path / "dcp"), rename={"^b$": "a"})


def test_the_module_examples_run():
    import doctest

    from anyshard.loaders import export_dcp

    result = doctest.testmod(export_dcp, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_dcp_reader_reads_regions_of_contiguous_and_strided_chunks(tmp_path):
    """Regions of a C-order chunk are read straight from its bytes; a chunk DCP stored with
    other strides (a transposed tensor) is read whole; both equal DCP's own load."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 9, generator=g)
    state = {"c": torch.randn(7, 5, 3, generator=g), "t": base.t(), "s": torch.tensor(4.0)}
    out = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=out, no_dist=True)
    with anyshard.open(out) as view:
        assert isinstance(view, DCPCheckpointView)
        for name, t in state.items():
            assert torch.equal(view.get_tensor(name), t), name
        assert torch.equal(view.get_slice("c")[2:5, 1:4, 2], state["c"][2:5, 1:4, 2])
        assert torch.equal(view.get_slice("t")[3:8, 1:2], state["t"][3:8, 1:2])
        assert view._layout("c", view._entry("c").chunks[0], view._entry("c")).start is not None
        assert view._layout("t", view._entry("t").chunks[0], view._entry("t")).start is None


def test_dcp_reader_names_a_truncated_data_file(tmp_path):
    out = tmp_path / "dcp"
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=str(out), no_dist=True)
    data = next(p for p in out.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:2000])
    with anyshard.open(str(out)) as view, pytest.raises(CorruptCheckpointError, match=data.name):
        view.get_tensor("w")
