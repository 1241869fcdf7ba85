"""PyTorch Lightning 2.6 with anyshard checkpoints: `AnyshardModelParallelStrategy` (Lightning's
ModelParallelStrategy, FSDP2 x TP) trains an MLP for an epoch on 4 gloo ranks, ModelCheckpoint
saves it as an anyshard checkpoint (no pickle), and `trainer.fit(ckpt_path=...)` resumes it under
tp=4, dp_shard=4 and on 2 ranks: the restored parameters and AdamW moments are the saved ones,
bit for bit, and the losses go on as an uninterrupted run's, within the cross-layout noise floor.

Run: python -m pytest tests/dist/test_lightning.py -q
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

import anyshard
from anyshard.cli import main as cli

# found, not imported: importing lightning costs each of the suite's workers about 4 CPU s while
# collecting, and only the pool's processes use it
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="needs lightning (pip install -e '.[dev]')",
)

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_lightning_tasks.py")


@pytest.fixture(scope="module")
def trained(pool4, tmp_path_factory):
    """An uninterrupted two-epoch run (the reference) and a one-epoch run that checkpoints."""
    ref_root = str(tmp_path_factory.mktemp("lightning-ref"))
    root = str(tmp_path_factory.mktemp("lightning"))
    ref = pool4.run(TASKS, "fit", 2, 2, ref_root, 2, timeout=300)[0]
    first = pool4.run(TASKS, "fit", 2, 2, root, 1, timeout=300)[0]
    return ref_root, root, ref, first


def _meta(path: str) -> dict:
    with anyshard.open(path) as view:
        return json.loads(view.get_value("lightning"))


def test_modelcheckpoint_writes_anyshard_checkpoints_with_no_pickle(trained):
    ref_root, root, ref, first = trained
    assert sorted(os.listdir(root)) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert first["step"] == 3 and len(first["losses"]) == 3
    for name in os.listdir(root):
        path = os.path.join(root, name)
        files = sorted(os.listdir(path))
        assert files == ["data", "manifest.json"], files  # no meta.pt, no .metadata
        assert all(f.endswith(".safetensors") for f in os.listdir(os.path.join(path, "data")))
        assert cli(["verify", path]) == 0
        meta = _meta(path)
        assert meta["global_step"] == 3 and meta["epoch"] == 0
    # last.ckpt of the two-epoch run was saved over at the second epoch's end
    assert _meta(os.path.join(ref_root, "last.ckpt"))["global_step"] == 6
    assert not [n for n in os.listdir(ref_root) if n.endswith((".incoming", ".replaced"))]
    assert first["losses"] == ref["losses"][:3]  # the same layout, the same run


@pytest.mark.parametrize(
    "pool,dp,tp",
    [("pool4", 1, 4), ("pool4", 4, 1), ("pool2", 1, 2), ("pool2", 2, 1)],
    ids=["tp4", "dp_shard4", "2ranks-tp2", "2ranks-dp_shard2"],
)
def test_fit_resumes_under_another_layout_bit_exact_and_the_losses_go_on(
    request, trained, tmp_path, pool, dp, tp
):
    _, root, ref, _ = trained
    last = os.path.join(root, "last.ckpt")
    out = request.getfixturevalue(pool).run(
        TASKS, "fit", dp, tp, str(tmp_path), 2, last, timeout=300
    )[0]
    assert out["step"] == 6
    with anyshard.open(last) as view:
        assert set(out["restored"]) == {
            f"{kind}model.{p}.weight" for kind in ("", "exp_avg.", "exp_avg_sq.") for p in ("w1", "w2")
        }
        for name, got in out["restored"].items():
            kind, _, fqn = name.rpartition("model.")
            stored = (
                f"optimizer_0.state.model.{fqn}.{kind[:-1]}" if kind else f"state_dict.model.{fqn}"
            )
            assert torch.equal(got, view.get_tensor(stored)), name
    # steps 4-6 as the uninterrupted run had them: only the summation order differs
    assert len(out["losses"]) == 3
    for got, want in zip(out["losses"], ref["losses"][3:], strict=True):
        assert math.isclose(got, want, rel_tol=1e-5), (out["losses"], ref["losses"])
