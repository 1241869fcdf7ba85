"""Every private API of torch and s3fs that anyshard uses, in one place.

Each name below says what it stands for, the versions it is known to work with, and what
happens where it is missing: a fallback, or an error that says which torch to install.
tests/unit/test_compat.py checks that each still behaves as anyshard relies on, and
tools/check_compat.sh runs that test under the oldest torch pyproject.toml allows and the
newest on the index. Every other module of anyshard imports these names from here; this module
imports only torch, s3fs and the standard library, and those lazily where they are heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.checkpoint.storage import StorageWriter
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "DCP_PICKLED_PRIVATE",
    "DCP_PLAN_PRIVATE",
    "DYNAMO_MODULE",
    "REDISTRIBUTE_LOGGER",
    "all_gather_single_autograd",
    "all_to_all_single_autograd",
    "clear_dtensor_sharding_cache",
    "compute_local_shape_and_global_offset",
    "dcp_save_here",
    "dcp_storage_info",
    "flatten_mesh",
    "flatten_state_dict",
    "fsspec_reader",
    "fsspec_writer",
    "local_tensor",
    "module_members",
    "process_groups",
    "root_mesh",
    "s3_call",
    "s3_request",
    "s3_request_params",
    "set_element",
    "set_nccl_timeout",
    "storage_offset_in_file",
    "strided_shard_type",
]

TESTED = "torch 2.6 to 2.14"  # what tests/unit/test_compat.py has run under


def _missing(what: str, error: Exception) -> RuntimeError:
    import torch

    return RuntimeError(
        f"torch {torch.__version__} lacks {what}, which anyshard uses ({type(error).__name__}: "
        f"{error}); anyshard is tested with {TESTED}: install one of those"
    )


# --- DTensor and DeviceMesh -------------------------------------------------------------------


def strided_shard_type() -> type[_StridedShard] | None:
    """``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP2 gives a
    mesh dim that shards a tensor dim another (later) mesh dim already shards, with a
    ``split_factor`` (torch 2.6-2.14: a subclass of ``Shard`` in 2.6, not in 2.13-2.14, so
    test for it first); None where torch has none (it never makes one then)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    return _StridedShard


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``DeviceMesh._flatten(name)``: a 1-d mesh over all the dims of ``mesh`` (a slice of a
    root mesh), of their product size, named ``name`` (torch 2.6-2.14); a clear error where
    missing."""
    try:
        flatten = mesh._flatten
    except AttributeError as e:
        raise _missing("DeviceMesh._flatten", e) from None
    return flatten(name)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from: ``DeviceMesh._get_root_mesh()`` (torch 2.13-2.14,
    not 2.6), else ``device_mesh._mesh_resources.get_root_mesh`` (torch 2.6); ``mesh`` itself
    where torch has neither (then every mesh is described on its own)."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    try:
        from torch.distributed.device_mesh import _mesh_resources
    except ImportError:
        return mesh
    get = getattr(_mesh_resources, "get_root_mesh", None)
    return get(mesh) if get is not None else mesh


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: Any, placements: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: this rank's
    shard of a tensor of ``global_shape`` under ``placements`` on ``mesh``, as (local shape,
    offset of its first element) (torch 2.6-2.14); a clear error where missing."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as f
    except ImportError as e:
        raise _missing(
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset", e
        ) from None
    shape, offset = f(tuple(global_shape), mesh, placements)
    return tuple(shape), tuple(offset)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's ``_local_tensor`` (the local shard itself, no autograd view: torch
    2.6-2.14); ``t`` itself for a plain tensor, or where a DTensor has no such attribute
    (``to_local()`` then, which views the same storage)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def clear_dtensor_sharding_cache() -> None:
    """Empty DTensor's caches of each op's output placements and redistribution: the C++ cache,
    ``torch._C._clear_DTensor_sharding_propagator_cache`` (torch 2.13-2.14), and the Python
    one, ``DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding``: its
    ``cache_clear()`` (torch 2.13-2.14) or its ``cache.cache_clear()`` (torch 2.6); each is
    skipped where torch lacks it (it has no such cache then)."""
    import torch
    from torch.distributed.tensor import DTensor

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    cached = getattr(propagator, "propagate_op_sharding", None)
    clear = getattr(cached, "cache_clear", None) or getattr(
        getattr(cached, "cache", None), "cache_clear", None
    )
    if clear is not None:
        clear()
    # caches keyed by meshes: each keeps the meshes, and through them their process groups
    # (and each gloo group's threads), alive after the groups are destroyed (torch 2.13)
    meta = getattr(propagator, "_propagate_tensor_meta_cached", None)
    for fn in (getattr(meta, "cache_clear", None), *_redistribute_caches()):
        if fn is not None:
            fn()


def _redistribute_caches() -> list:
    """The clear functions of DTensor's redistribution caches: its planners
    (``clear_redistribute_planner_cache``, torch 2.13-2.14), transform infos
    (``_gen_transform_infos.cache_clear``, torch 2.6-2.14) and mesh topologies
    (``MeshTopoInfo.build_from_mesh.cache_clear``, torch 2.6-2.14); absent ones are left out."""
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute
    except ImportError:
        return []
    infos = getattr(_redistribute, "_gen_transform_infos", None)
    topology = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    return [
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(infos, "cache_clear", None),
        getattr(topology, "cache_clear", None),
    ]


REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger of DTensor's redistribution (torch 2.6-2.14), which advises about torch's own
internals; a logger of that name is harmless where the module has moved."""


# --- distributed --------------------------------------------------------------------------------


def all_gather_single_autograd(t: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_gather_single_autograd``: an all-gather
    along ``gather_dim`` whose backward sends each rank its gradient (torch 2.13-2.14); in
    torch 2.6 the same op is ``all_gather_tensor_autograd``."""
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return gather(t, gather_dim=gather_dim, group=group)


def all_to_all_single_autograd(
    t: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_to_all_single_autograd``: an
    all-to-all of rows with the given split sizes, differentiable (torch 2.6-2.14)."""
    from torch.distributed import _functional_collectives as fc

    return fc.all_to_all_single_autograd(t, output_split_sizes, input_split_sizes, group)


def functional_collectives() -> Any:
    """``torch.distributed._functional_collectives``, the module whose ``wait_tensor`` ends
    every functional collective (the straggler measurement times it)."""
    from torch.distributed import _functional_collectives as fc

    return fc


def process_groups() -> set[Any]:
    """Every process group of this process, the default one included: the keys of c10d's
    ``_world.pg_map`` (torch 2.6-2.14); an empty set before ``init_process_group``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return set()
    from torch.distributed import distributed_c10d as c10d

    try:
        return set(c10d._world.pg_map)
    except AttributeError as e:
        raise _missing("torch.distributed.distributed_c10d._world.pg_map", e) from None


def set_nccl_timeout(options: Any, timeout: timedelta) -> None:
    """Set the timeout of ``ProcessGroupNCCL.Options``: its ``_timeout`` field (torch
    2.6-2.14, which has no public setter); a clear error where missing."""
    try:
        options._timeout = timeout
    except AttributeError as e:
        raise _missing("ProcessGroupNCCL.Options._timeout", e) from None


DYNAMO_MODULE = "torch._dynamo"
"""torch's compiler package (torch 2.6-2.14), imported ahead by the reference trainer's
forkserver so that a restarted rank does not import it again."""


# --- DCP ----------------------------------------------------------------------------------------


def flatten_state_dict(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: a nested state dict
    as DCP's planner flattens it (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``), and the path of each
    key (torch 2.6-2.14); a clear error where missing."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict as f
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint._nested_dict.flatten_state_dict", e) from None
    return f(dict(state))


def set_element(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    """``torch.distributed.checkpoint._traverse.set_element``: write ``value`` at ``path`` (a
    key path as `flatten_state_dict` gives) into the nested ``root``, creating containers on
    the way (torch 2.6-2.14); a clear error where missing."""
    try:
        from torch.distributed.checkpoint._traverse import set_element as f
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint._traverse.set_element", e) from None
    f(root, tuple(path), value)


def storage_offset_in_file(t: torch.Tensor) -> int | None:
    """Where the bytes of ``t``'s storage begin in the archive ``torch.load`` read it from,
    recorded as ``UntypedStorage._checkpoint_offset`` when loading to the meta device (torch
    2.13-2.14); None where torch records none (2.6): the reader then reads the whole chunk."""
    offset = getattr(t.untyped_storage(), "_checkpoint_offset", None)
    return offset if isinstance(offset, int) else None


def fsspec_writer() -> type[FileSystemWriter]:
    """DCP's ``FsspecWriter`` (its `FileSystemWriter` onto any fsspec URL), which
    ``torch.distributed.checkpoint`` does not export: its private ``_fsspec_filesystem``
    module (torch 2.6-2.14); a clear error where missing."""
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter", e) from None
    return FsspecWriter


def fsspec_reader() -> type[FileSystemReader]:
    """DCP's ``FsspecReader`` (its `FileSystemReader` of any fsspec URL), from the same private
    ``_fsspec_filesystem`` module as `fsspec_writer` (torch 2.6-2.14); a clear error where
    missing."""
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint._fsspec_filesystem.FsspecReader", e) from None
    return FsspecReader


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's ``filesystem._StorageInfo``: where an item's bytes lie in a checkpoint
    FileSystemWriter wrote (a file, an offset, a length), as its ``.metadata`` records it, for
    tools that write such metadata themselves (torch 2.6-2.14); a clear error where missing."""
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint.filesystem._StorageInfo", e) from None
    return _StorageInfo(relative_path, offset, length)


def dcp_save_here(
    state: dict[str, Any], storage_writer: StorageWriter, planner: SavePlanner | None = None
) -> None:
    """``torch.distributed.checkpoint.save`` by this process alone, whether or not a process
    group is initialised: ``save(..., no_dist=True)`` (torch 2.13-2.14); torch 2.6's ``save``
    has no ``no_dist``, and its private ``state_dict_saver._save_state_dict(no_dist=True)``
    does the same."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.save).parameters:
        dcp.save(state, storage_writer=storage_writer, planner=planner, no_dist=True)
        return
    try:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint.save(no_dist=True)", e) from None
    _save_state_dict(state, storage_writer, no_dist=True, planner=planner)


DCP_PICKLED_PRIVATE = frozenset(
    {
        # an Enum of memory formats, in TensorProperties
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        # where an item's bytes lie (file, offset, length)
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # a layout by name, in TensorProperties
        ("torch.serialization", "_get_layout"),
    }
)
"""Private (module, name) pairs that DCP's ``.metadata`` pickle names (torch 2.6-2.14): the
DCP reader allows them when it unpickles; a name torch renames is refused as unknown there."""

DCP_PLAN_PRIVATE = frozenset({("torch.distributed.checkpoint.filesystem", "_StoragePrefix")})
"""Private classes of the save plans some writers add to DCP's metadata (torch 2.6-2.14),
read as inert placeholders."""


# --- torch.nn -----------------------------------------------------------------------------------


def module_members(
    m: torch.nn.Module,
) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]:
    """A module's own ``_modules``, ``_parameters`` and ``_buffers`` dicts (every torch):
    what ``named_children()``, ``named_parameters(recurse=False)`` and
    ``named_buffers(recurse=False)`` walk, without their generators (entries may be None)."""
    return m._modules, m._parameters, m._buffers


# --- s3fs ---------------------------------------------------------------------------------------


def s3_call(fs: Any) -> Callable[..., Any] | None:
    """s3fs's ``S3FileSystem._call_s3(method, **params)``: the coroutine that sends one S3 API
    call (a botocore method name and its parameters) through the filesystem's session, with
    its retries and credentials (s3fs 2024.12-2026.9); None for a filesystem without it (not
    S3), which reads whole ranges instead of streaming."""
    return getattr(fs, "_call_s3", None)


def s3_request(fs: Any) -> Callable[..., Any] | None:
    """s3fs's ``S3FileSystem.call_s3(method, **params)``: `s3_call` as a blocking call (fsspec's
    sync wrapper, which runs it on the filesystem's event loop and takes fsspec's ``timeout``)
    (s3fs 2024.12-2026.9); private though it has no underscore. None for a filesystem without
    it (not S3), which gets fsspec's plain writes: no conditional PUT, no multipart upload."""
    return getattr(fs, "call_s3", None)


def s3_request_params(fs: Any) -> dict[str, Any]:
    """s3fs's ``S3FileSystem.req_kw``: the parameters s3fs adds to each of its own S3 calls
    (``RequestPayer`` for a requester-pays filesystem), for calls anyshard sends itself (s3fs
    2024.12-2026.9); private though it has no underscore. Empty where missing."""
    return dict(getattr(fs, "req_kw", None) or {})
