"""tools/scale_sim.py's predictions, checked against the same save and load run for real on 8 ranks.

The toy model is saved under (pp, dp_shard, tp) = (2, 2, 2) and loaded under (1, 4, 2), the
simulator's N = 8 layouts; every loaded value is checked bit-exact inside the load task.
"""

import os
import sys

import pytest

from anyshard.format.manifest import read_manifest

HERE = os.path.dirname(__file__)
TASKS = os.path.join(HERE, "_scale_tasks.py")
sys.path.append(os.path.join(HERE, "..", "..", "tools"))  # after tests/dist
sys.path.insert(0, HERE)

import _scale_tasks as tasks  # noqa: E402
from benchkit import simulated_ranks  # noqa: E402


@pytest.fixture(scope="module")
def run(pool8, tmp_path_factory):
    """Save for real, load for real; the checkpoint and each loading rank's record."""
    ckpt = str(tmp_path_factory.mktemp("scale") / "ckpt")
    saved = pool8.run(TASKS, "save_task", ckpt)
    assert sum(saved) == len(tasks.model()) * 4  # each stage's tensors, on its 4 ranks
    return ckpt, pool8.run(TASKS, "load_task", ckpt)


@pytest.fixture(scope="module")
def sim():
    model = tasks.model()
    save, load = simulated_ranks.Layout(*tasks.SAVE), simulated_ranks.Layout(*tasks.LOAD)
    manifest, _ = simulated_ranks.build_manifest(model, save)
    layers = simulated_ranks.num_layers(model)
    stats = [simulated_ranks.plan_rank(manifest, model, save, load, r, layers) for r in range(8)]
    return manifest, stats


def test_real_save_writes_the_manifest_the_simulator_builds(run, sim):
    ckpt, _ = run
    real, (predicted, _) = read_manifest(ckpt), sim
    assert set(real.tensors) == set(predicted.tensors)
    for name, entry in predicted.tensors.items():
        got = real.tensors[name]
        want = (entry.mapping, entry.shape, entry.dtype)
        assert (got.mapping, got.shape, got.dtype) == want, name
        assert real.meshes[got.mesh] == predicted.meshes[entry.mesh], name
    assert sorted(real.files) == list(range(8))


def test_each_loading_rank_reads_what_the_simulator_predicts(run, sim):
    _, loads = run
    _, stats = sim
    for r, (got, want) in enumerate(zip(loads, stats, strict=True)):
        assert got["rank"] == r
        real = (len(got["headers"]), got["reads"], got["bytes_read"], got["bytes_needed"])
        predicted = (want.headers, want.reads, want.bytes_read, want.bytes_needed)
        assert real == predicted, f"rank {r}: (headers, reads, bytes read, bytes needed)"
        # every byte the target holds is read; verification widens reads of part of a shard to
        # its whole checksum blocks (these shards are small: one block each)
        assert want.bytes_needed >= want.target_bytes


def test_planning_reads_only_the_headers_of_files_holding_needed_shards(run):
    _, loads = run
    for r, got in enumerate(loads):
        assert got["headers"] == got["transfer_files"], f"rank {r}: headers of unused files read"
    assert min(len(got["headers"]) for got in loads) < 8  # other ranks' files stay unopened
