"""The commit check's per-rank shard counts agree with enumerating every stored shard."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from anyshard.format.manifest import Manifest, TensorEntry
from anyshard.format.mesh import MeshEntry
from anyshard.ucl.lowering import enumerate_shards

OPS = [
    "chunk(0, a)",
    "chunk(1, b)",
    "on(a, 1)",
    "on(b, 0)",
    "on(c, 2)",
    "chunk(0, c)",
    "chunk(1, a)",
]


@st.composite
def manifests(draw):
    sizes = {
        "a": draw(st.integers(2, 3)),
        "b": draw(st.integers(1, 3)),
        "c": draw(st.integers(3, 4)),
    }
    strided = draw(st.booleans())
    dims = tuple(sizes)
    shape = tuple(sizes.values())
    if strided:
        mesh = MeshEntry(
            dims=dims, sizes=shape, offset=0, strides=(shape[1] * shape[2], shape[2], 1)
        )
    else:
        n = shape[0] * shape[1] * shape[2]
        mesh = MeshEntry(dims=dims, sizes=shape, ranks=tuple(draw(st.permutations(range(n)))))
    tensors = {}
    for k in range(draw(st.integers(1, 6))):
        ops = draw(st.lists(st.sampled_from(OPS), max_size=3, unique=True))
        axes_on = [o.split("(")[1].split(",")[0] for o in ops if o.startswith("on")]
        if len(axes_on) != len(set(axes_on)):
            continue
        tensors[f"t{k}"] = TensorEntry(dtype="F32", shape=(12, 12), mesh=0, mapping=" | ".join(ops))
    world = shape[0] * shape[1] * shape[2]
    return Manifest(world_size=world, meshes=(mesh,), files={}, tensors=tensors)


@settings(max_examples=150, deadline=None)
@given(manifests())
def test_shards_per_rank_counts_every_stored_shard_of_every_tensor(m):
    brute = Counter()
    for t in m.tensors.values():
        mesh = m.meshes[t.mesh]
        for coords, _ in enumerate_shards(t.parsed, t.shape, mesh.axis_sizes):
            brute[mesh.rank(coords)] += 1
    assert m.shards_per_rank().tolist() == [brute[r] for r in range(m.world_size)]


def test_rank_grid_matches_rank_for_affine_and_listed_meshes():
    affine = MeshEntry(dims=("x", "y"), sizes=(2, 3), offset=4, strides=(3, 1))
    listed = MeshEntry(dims=("x", "y"), sizes=(2, 3), ranks=(5, 0, 3, 1, 4, 2))
    for mesh in (affine, listed):
        grid = mesh.rank_grid()
        assert [[mesh.rank({"x": i, "y": j}) for j in range(3)] for i in range(2)] == grid.tolist()


def test_a_rank_that_wrote_other_shards_than_the_layouts_say_stops_the_commit():
    """The error names the rank, both counts and the likely causes, among them a DTensor that
    DTensor's op cache put on an older mesh hierarchy."""
    import pytest

    from anyshard.errors import SaveError
    from anyshard.format.commit import SaveReport, _check_writers

    mesh = MeshEntry(dims=("pp", "dp"), sizes=(2, 2), offset=0, strides=(2, 1))
    tensors = {"w": TensorEntry(dtype="F32", shape=(4,), mesh=0, mapping="on(pp, 0)")}
    m = Manifest(world_size=4, meshes=(mesh,), files={}, tensors=tensors)
    assert m.shards_per_rank().tolist() == [1, 0, 0, 0]  # one writer per replica set
    _check_writers(m, [SaveReport(count=c) for c in (1, 0, 0, 0)], "ck")
    with pytest.raises(
        SaveError, match=r"rank 2 wrote 1 shard\(s\) but the layouts say it holds 0"
    ) as e:
        _check_writers(m, [SaveReport(count=c) for c in (1, 0, 1, 0)], "ck")
    assert "more than one DeviceMesh hierarchy" in str(e.value)
    assert "_clear_DTensor_sharding_propagator_cache" in str(e.value)
