"""Each private torch and s3fs API that `anyshard._compat` wraps still behaves as anyshard relies
on. Runs under any torch from 2.6 on (tools/check_compat.sh runs it under the oldest torch
pyproject.toml allows and the newest on the index).

The checks that need a device mesh run in one child process (a process group is process-wide
state): ranks 1 and 2 of a 2 x 2 mesh on torch's fake backend, which builds meshes and groups
without peers, then a gloo world of one for the differentiable collectives.

Run: python -m pytest tests/unit/test_compat.py -q
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import pickle
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from anyshard import _compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mesh_facts() -> dict:
    """In the child process: what each wrapped mesh API gives, on ranks 1 and 2 of 2 x 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    strided = _compat.strided_shard_type()
    facts: dict = {}
    for rank in (1, 2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        flat = _compat.flatten_mesh(mesh["dp", "tp"], "dp_tp")
        place = [strided(0, split_factor=2), Shard(0)] if strided else None
        dt = DTensor.from_local(torch.arange(4.0), mesh["tp"], [Replicate()], run_check=False)
        _ = dt + 1  # an op: fills DTensor's placement cache
        _ = dt.redistribute(mesh["tp"], [Shard(0)])  # fills its redistribution caches
        _compat.clear_dtensor_sharding_cache()
        from torch.distributed.tensor import _redistribute

        planners = getattr(_redistribute, "_planner_cache", None)
        infos = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_info", None)
        cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        info = getattr(cached, "cache_info", None)
        before = _compat.process_groups()
        group = dist.new_group([0, 1, 2, 3])
        facts[rank] = {
            "flat": [flat.size(), list(flat.mesh_dim_names), flat.get_local_rank()],
            "root_of_slice": _compat.root_mesh(mesh["tp"]) is mesh,
            "root_of_root": _compat.root_mesh(mesh) is mesh,
            "strided": place and _compat.compute_local_shape_and_global_offset((8, 3), mesh, place),
            "plain": _compat.compute_local_shape_and_global_offset(
                (8, 4), mesh, [Shard(0), Shard(1)]
            ),
            "local": [
                type(_compat.local_tensor(dt)) is torch.Tensor,
                _compat.local_tensor(dt).data_ptr() == dt.to_local().data_ptr(),
            ],
            "cache_left": info().currsize if info is not None else None,
            "redistribute_left": [
                None if planners is None else len(planners),
                None if infos is None else infos().currsize,
            ],
            "groups": [
                dist.group.WORLD in before,
                group in _compat.process_groups(),
                group not in before,
            ],
        }
        dist.destroy_process_group()
    assert _compat.process_groups() == set()

    # differentiable collectives, on a gloo world of one
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    gathered = _compat.all_gather_single_autograd(x, gather_dim=0, group=dist.group.WORLD)
    (gathered * 2).sum().backward()
    y = torch.arange(4.0).reshape(4, 1).requires_grad_()
    moved = _compat.all_to_all_single_autograd(y, [4], [4], dist.group.WORLD)
    (moved * 3).sum().backward()
    facts["gather"] = [gathered.tolist(), x.grad.tolist()]
    facts["all_to_all"] = [moved.tolist(), y.grad.tolist()]

    # a DCP save by this process alone, while a process group is initialised
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        _compat.dcp_save_here({"w": torch.arange(4.0)}, dcp.FileSystemWriter(d))
        back = {"w": torch.zeros(4)}
        dcp.load(back, storage_reader=dcp.FileSystemReader(d))
        facts["dcp_save_here"] = [sorted(os.listdir(d)), back["w"].tolist()]
    dist.destroy_process_group()
    return facts


@pytest.fixture(scope="module")
def facts() -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _coords(rank: int) -> tuple[int, int]:
    return rank // 2, rank % 2  # (dp, tp), row-major


def test_strided_shard_splits_within_the_later_dims_chunk(facts):
    """FSDP2 over TP on rows: TP's chunks first, then dp's chunk inside this rank's TP chunk."""
    strided = _compat.strided_shard_type()
    assert strided is not None, "torch has no _StridedShard: anyshard's FSDP2+TP path is untested"
    p = strided(0, split_factor=2)
    assert (p.dim, p.split_factor) == (0, 2)
    for rank in (1, 2):
        dp, tp = _coords(rank)
        shape, offset = facts[str(rank)]["strided"]
        assert (tuple(shape), tuple(offset)) == ((2, 3), (tp * 4 + dp * 2, 0))


def test_flatten_mesh_gives_one_dim_of_the_product_size(facts):
    for rank in (1, 2):
        assert facts[str(rank)]["flat"] == [4, ["dp_tp"], rank]
    with pytest.raises(RuntimeError, match=r"DeviceMesh\._flatten.*install"):
        _compat.flatten_mesh(object(), "x")


def test_root_mesh_of_a_slice_is_the_mesh_it_was_cut_from(facts):
    for rank in (1, 2):
        assert facts[str(rank)]["root_of_slice"] and facts[str(rank)]["root_of_root"]


def test_compute_local_shape_and_global_offset_of_plain_shards(facts):
    for rank in (1, 2):
        dp, tp = _coords(rank)
        shape, offset = facts[str(rank)]["plain"]
        assert (tuple(shape), tuple(offset)) == ((4, 2), (dp * 4, tp * 2))


def test_local_tensor_is_the_dtensors_own_storage(facts):
    for rank in (1, 2):
        assert facts[str(rank)]["local"] == [True, True]
    t = torch.zeros(2)
    assert _compat.local_tensor(t) is t


def test_clear_dtensor_sharding_cache_finds_a_cache_and_empties_it(facts):
    from torch.distributed.tensor import DTensor

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    clear = getattr(cached, "cache_clear", None) or getattr(cached.cache, "cache_clear", None)
    assert native is not None or clear is not None, "no placement cache to clear"
    for rank in (1, 2):
        assert facts[str(rank)]["cache_left"] in (None, 0)


def test_clear_dtensor_sharding_cache_empties_the_redistribution_caches(facts):
    # they hold meshes, and the meshes their process groups: a destroyed group's gloo threads
    # lived on while any entry named its mesh
    from torch.distributed.tensor import _redistribute

    assert any(_compat._redistribute_caches()), "no redistribution cache found"
    assert hasattr(_redistribute, "_planner_cache") or hasattr(
        _redistribute, "_gen_transform_infos"
    )
    for rank in (1, 2):
        assert all(n in (None, 0) for n in facts[str(rank)]["redistribute_left"])


def test_process_groups_lists_the_default_group_and_new_ones(facts):
    for rank in (1, 2):
        assert facts[str(rank)]["groups"] == [True, True, True]


def test_all_gather_single_autograd_gathers_and_sends_gradients_back(facts):
    rows = torch.arange(6.0).reshape(3, 2).tolist()
    assert facts["gather"] == [rows, [[2.0, 2.0]] * 3]


def test_all_to_all_single_autograd_moves_rows_and_gradients(facts):
    assert facts["all_to_all"] == [[[0.0], [1.0], [2.0], [3.0]], [[3.0]] * 4]


def test_dcp_save_here_saves_alone_while_a_process_group_is_initialised(facts):
    files, loaded = facts["dcp_save_here"]
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
    assert loaded == [0.0, 1.0, 2.0, 3.0]


def test_set_nccl_timeout_sets_the_options_timeout():
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None:
        opts = nccl.Options()
        _compat.set_nccl_timeout(opts, timedelta(seconds=17))
        assert opts._timeout == timedelta(seconds=17)

    class Fixed:
        __slots__ = ()

    with pytest.raises(RuntimeError, match=r"ProcessGroupNCCL\.Options\._timeout.*install"):
        _compat.set_nccl_timeout(Fixed(), timedelta(seconds=1))
    if nccl is None:
        pytest.skip("this torch has no NCCL: only the missing-field path ran")


def test_flatten_state_dict_names_leaves_as_dcps_planner_does():
    state = {"meta": {"step": 3}, "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}}
    flat, paths = _compat.flatten_state_dict(state)
    assert flat == {
        "meta.step": 3,
        "optim.param_groups.0.lr": 0.1,
        "optim.param_groups.0.params": [0, 1],
    }
    assert paths["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")


def test_set_element_writes_along_a_path_creating_containers():
    root: dict = {"a": {"x": 1}}
    _compat.set_element(root, ("a", "b", 1), 5)
    _compat.set_element(root, ("c",), "v")
    assert root == {"a": {"x": 1, "b": [None, 5]}, "c": "v"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_private_names_dcp_pickles_are_the_allowed_ones(tmp_path):
    """A real DCP save's ``.metadata`` names no private global beyond `DCP_PICKLED_PRIVATE`,
    and every listed name still exists."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    _compat.dcp_save_here(state, dcp.FileSystemWriter(str(tmp_path)))
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as f:
        metadata = Recording(f).load()
    private = {(m, n) for m, n in named if n.startswith("_") or "._" in m}
    assert private <= _compat.DCP_PICKLED_PRIVATE, private - _compat.DCP_PICKLED_PRIVATE
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in private
    info = next(iter(metadata.storage_data.values()))  # what the DCP reader reads of it
    assert isinstance(info.relative_path, str) and info.offset >= 0 and info.length > 0
    made = _compat.dcp_storage_info(info.relative_path, info.offset, info.length)
    assert type(made) is type(info) and made == info
    for module, name in _compat.DCP_PICKLED_PRIVATE | _compat.DCP_PLAN_PRIVATE:
        assert hasattr(importlib.import_module(module), name), (module, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsspec_writer_writes_a_dcp_checkpoint_to_a_url(tmp_path):
    """`anyshard.loaders.write_dcp` to a URL goes through DCP's fsspec writer; DCP's fsspec
    reader loads what it wrote."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import StorageWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    import anyshard
    from anyshard.loaders import write_dcp

    assert issubclass(_compat.fsspec_writer(), StorageWriter)
    assert _compat.fsspec_reader() is FsspecReader
    w = torch.arange(12.0).reshape(3, 4)
    anyshard.save(str(tmp_path / "ckpt"), {"model": {"w": w}, "step": 9})
    url = f"memory://anyshard-compat-{os.getpid()}/dcp"
    try:
        with anyshard.open(str(tmp_path / "ckpt")) as view:
            report = write_dcp(view, url)
        assert ".metadata" in report.files
        state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
        dcp.load(state, storage_reader=FsspecReader(url))
        assert torch.equal(state["model"]["w"], w) and state["step"] == 9
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


def test_storage_offset_in_file_points_at_the_tensors_bytes():
    import io

    t = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    buf = io.BytesIO()
    torch.save(t, buf)
    meta = torch.load(io.BytesIO(buf.getvalue()), map_location="meta", weights_only=True)
    offset = _compat.storage_offset_in_file(meta)
    assert _compat.storage_offset_in_file(t) is None  # not loaded from a file
    if offset is None:
        pytest.skip(f"torch {torch.__version__} records no storage offsets: whole chunks are read")
    nbytes = t.numel() * t.element_size()
    assert buf.getvalue()[offset : offset + nbytes] == t.numpy().tobytes()


def test_module_members_are_a_modules_own_children_parameters_and_buffers():
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    bn = m[1]
    modules, parameters, buffers = _compat.module_members(bn)
    assert dict(modules) == dict(bn.named_children())
    assert dict(parameters) == dict(bn.named_parameters(recurse=False))
    assert dict(buffers) == dict(bn.named_buffers(recurse=False))
    assert dict(_compat.module_members(m)[0]) == dict(m.named_children())


def test_the_dynamo_module_name_imports():
    assert importlib.import_module(_compat.DYNAMO_MODULE).__name__ == _compat.DYNAMO_MODULE


def test_the_redistribute_logger_is_the_one_torch_logs_to():
    module = importlib.import_module(_compat.REDISTRIBUTE_LOGGER)
    assert module.logger is logging.getLogger(_compat.REDISTRIBUTE_LOGGER)


def test_s3_call_is_s3fs_coroutine_taking_a_method_name_and_parameters():
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(anon=True, endpoint_url="http://127.0.0.1:9", skip_instance_cache=True)
    call = _compat.s3_call(fs)
    assert call is not None and inspect.iscoroutinefunction(call)
    params = list(inspect.signature(call).parameters.values())
    assert params[0].name == "method"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    from fsspec.implementations.local import LocalFileSystem

    assert _compat.s3_call(LocalFileSystem()) is None


def test_s3_request_is_s3fs_blocking_call_and_request_params_its_extra_parameters():
    s3fs = pytest.importorskip("s3fs")
    from fsspec.implementations.local import LocalFileSystem

    def fs(**kw):
        return s3fs.S3FileSystem(
            anon=True, endpoint_url="http://127.0.0.1:9", skip_instance_cache=True, **kw
        )

    request = _compat.s3_request(fs())
    assert callable(request) and not inspect.iscoroutinefunction(request)
    assert list(inspect.signature(request).parameters)[0] == "method"
    assert _compat.s3_request(LocalFileSystem()) is None
    assert _compat.s3_request_params(fs()) == {}
    assert _compat.s3_request_params(fs(requester_pays=True)) == {"RequestPayer": "requester"}
    assert _compat.s3_request_params(LocalFileSystem()) == {}


# --- nothing else reaches into private APIs -----------------------------------------------------

# private names that carry no underscore, so the rule below cannot tell them: s3fs's blocking S3
# call (`s3_request`) and the parameters it adds to each request (`s3_request_params`)
_PRIVATE_WITHOUT_UNDERSCORE = {"call_s3", "req_kw"}

_PRIVATE_ATTRIBUTES = {
    "_StridedShard",
    "_flatten",
    "_get_root_mesh",
    "_mesh_resources",
    "_local_tensor",
    "_call_s3",
    "_world",
    "_timeout",
    "_op_dispatcher",
    "_modules",
    "_parameters",
    "_buffers",
    "_C",
    "_StorageInfo",
    "_StoragePrefix",
    "_MEM_FORMAT_ENCODING",
    "_get_layout",
    "_clear_DTensor_sharding_propagator_cache",
    "_checkpoint_offset",
}  # fmt: skip  (attributes, or names in strings: getattr(x, "_call_s3"), pickled names)
_PRIVATE_NAMES = _PRIVATE_ATTRIBUTES | _PRIVATE_WITHOUT_UNDERSCORE

_SCANNED = ("anyshard", "tests", "tools")

# the uses outside _compat allowed on purpose, by file, each with why
_ALLOWED: dict[str, set[str] | None] = {
    # the module that wraps them all
    "anyshard/_compat.py": None,
    # this file: it checks each private API that _compat wraps, and lists their names
    "tests/unit/test_compat.py": None,
    # ShardedTensor, DCP's legacy sharded type, saved and loaded through AnyshardWriter and
    # AnyshardReader: the test exercises that private torch API on purpose
    "tests/dist/_dcp_backend_tasks.py": {
        "from torch.distributed._shard import sharded_tensor",
        "from torch.distributed._shard.sharding_spec import ChunkShardingSpec, "
        "EnumerableShardingSpec, ShardMetadata",
    },
    # DCP's own rebuild of a whole state dict from a checkpoint (what its dcp_to_torch_save
    # does), run over AnyshardReader on purpose: the test holds the reader to what DCP expects
    "tests/unit/test_dcp_writer_behaviours.py": {
        "from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner",
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict",
    },
    # DCP's own load path (its traversal, planners and `_load_state_dict`) run over AnyshardReader
    # and FileSystemReader side by side: the test holds the byte-values contract to DCP's
    "tests/unit/test_dcp_load_bytes.py": {
        "from torch.distributed.checkpoint._traverse import set_element",
        "from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, "
        "DefaultSavePlanner, _EmptyStateDictLoadPlanner",
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict",
    },
    # the straggler measurement's wrappers checked on the real functions they wrap
    "tests/unit/test_straggler.py": {"from torch.distributed import _functional_collectives"},
    # torchtitan's CPU shims: it picks its device and triton's absence through these
    "tests/dist/_torchtitan_tasks.py": {"'torch._dynamo'"},
    # a message check: the error names the torch call that clears the cache; nothing is used
    "tests/unit/test_manifest_counts.py": {"'_clear_DTensor_sharding_propagator_cache'"},
}


def _private_uses(path: str) -> list[tuple[int, str]]:
    """(line, what) of each private torch or s3fs name ``path`` uses."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and node.module:
            third_party = node.module.split(".")[0] in ("torch", "s3fs")
            names = [a.name for a in node.names]
            if third_party and ("._" in node.module or any(n.startswith("_") for n in names)):
                found.append((line, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Import):
            found += [
                (line, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in ("torch", "s3fs") and "._" in a.name
            ]
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_NAMES:
            found.append((line, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = node.value.startswith(("torch.", "s3fs.")) and "._" in node.value
            if node.value in _PRIVATE_NAMES or (named and " " not in node.value):
                found.append((line, repr(node.value)))  # a name, not a message
    return sorted(found)


def _python_files() -> list[str]:
    """The Python files of anyshard/, tests/ and tools/, relative to the checkout."""
    out = []
    for top in _SCANNED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            out += [os.path.join(folder, n) for n in sorted(files) if n.endswith(".py")]
    return [os.path.relpath(p, ROOT).replace(os.sep, "/") for p in out]


def test_no_module_but_compat_uses_private_torch_or_s3fs_names():
    found = []
    for rel in _python_files():
        allowed = _ALLOWED.get(rel, set())
        if allowed is None:
            continue
        uses = _private_uses(os.path.join(ROOT, rel))
        found += [f"{rel}:{line}: {what}" for line, what in uses if what not in allowed]
    assert not found, "use anyshard._compat instead:\n" + "\n".join(found)


def test_the_guard_sees_private_names_where_they_are_used():
    """The check finds what _compat wraps, the names without an underscore included; every
    allowed use is still there (an entry whose use is gone is dropped from `_ALLOWED`)."""
    seen = {what for _, what in _private_uses(os.path.join(ROOT, "anyshard", "_compat.py"))}
    assert {"'call_s3'", "'req_kw'", "'_call_s3'"} <= seen
    files = set(_python_files())
    for rel, allowed in _ALLOWED.items():
        assert rel in files, f"{rel} is allowed private uses but is gone"
        if allowed:
            uses = {what for _, what in _private_uses(os.path.join(ROOT, rel))}
            assert allowed <= uses, (rel, allowed - uses)


if __name__ == "__main__":  # the child process of the `facts` fixture
    print(json.dumps(_mesh_facts()))
