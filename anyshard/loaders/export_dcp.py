"""Writer: a PyTorch DCP (torch.distributed.checkpoint) checkpoint from any lazy view, streamed.

`write_dcp` hands DCP's own writer (``FileSystemWriter``, or ``FsspecWriter`` for a URL) a state
dict of meta tensors -- names, shapes and dtypes, no data -- and a planner whose
``resolve_data`` reads each tensor from the view only when DCP is about to write it. DCP writes
one ``.distcp`` file per tensor (``single_file_per_rank=False``: with one file per rank DCP
keeps every tensor of a file alive until the file is closed) and its ``.metadata`` last, so at
most one tensor is held at a time and the result is exactly what ``torch.distributed.checkpoint
.save`` writes: ``torch.distributed.checkpoint.load`` reads it into tensors or DTensors of any
layout. DCP's format pickles its metadata and each non-tensor value; anyshard itself never
unpickles (its DCP reader, `DCPCheckpointView`, reads them through an allowlist).

Run: ``python -m pytest tests/unit/test_export_dcp.py -q``
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence

import torch

from anyshard._compat import dcp_save_here, fsspec_writer
from anyshard.errors import AnyshardError, SaveError
from anyshard.format import storage
from anyshard.loaders._shared import ExportReport, Progress, export_items, select_names

__all__ = ["write_dcp"]

METADATA = ".metadata"


def _refuse_existing(dst: str) -> None:
    if not storage.exists(dst):
        return
    try:
        names = storage.listdir(dst)
    except NotADirectoryError:
        raise SaveError(f"{dst} is a file; pass a new or empty directory") from None
    present = [n for n in names if n == METADATA or n.endswith(".distcp")]
    if present:
        raise SaveError(
            f"{dst} already holds a DCP checkpoint ({', '.join(sorted(present)[:3])}); write "
            "to a new or empty directory"
        )


def write_dcp(
    view,
    dst: str,
    *,
    dtype: torch.dtype | str | None = None,
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    progress: Progress | None = None,
) -> ExportReport:
    """Write the view's tensors and JSON values as a PyTorch DCP checkpoint in directory
    ``dst`` (a local path or an fsspec URL), from this one process.

    Names are kept (anyshard's dotted names are DCP's flattened keys, so
    ``dcp.load({"model": model.state_dict()}, checkpoint_id=dst)`` finds ``model.*``); each
    tensor is one whole chunk. ``dtype``, ``only`` and ``rename`` are as for `write_hf`.

    >>> import torch, tempfile, anyshard
    >>> import torch.distributed.checkpoint as dcp
    >>> from anyshard.loaders import write_dcp
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/ckpt", {"model": {"w": torch.ones(2, 3)}, "step": 7})
    >>> with anyshard.open(d + "/ckpt") as view:
    ...     report = write_dcp(view, d + "/dcp")
    >>> state = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    >>> dcp.load(state, checkpoint_id=d + "/dcp", no_dist=True)
    >>> state["model"]["w"].sum().item(), state["step"]
    (6.0, 7)
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    items = {it.target: it for it in export_items(view, only, rename, dtype)}
    values = {
        target: view.get_value(source)
        for target, source in select_names(view.value_keys(), only, rename).items()
    }
    clash = sorted(set(items) & set(values))
    if clash:
        raise AnyshardError(f"{clash[0]} names both a tensor and a value; rename one")
    _refuse_existing(dst)
    state: dict[str, object] = {
        name: torch.empty(it.shape, dtype=it.dtype, device="meta") for name, it in items.items()
    }
    state.update(values)
    total = sum(it.nbytes for it in items.values())
    done = [0, 0]

    class _ViewPlanner(DefaultSavePlanner):
        # DCP asks for each tensor right before it writes it: read it from the view then.
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            it = items[write_item.index.fqn]
            t = view.get_tensor(it.source).to(it.dtype).contiguous()
            done[0] += 1
            done[1] += it.nbytes
            if progress is not None:
                progress(done[0], len(items), done[1], total)
            return t

    if storage.is_url(dst) and not dst.startswith("file://"):
        # an object is durable once its upload completes: no fsync (torch 2.6 would call it on
        # the object's stream, which has no file descriptor, and fail)
        writer = fsspec_writer()(dst, single_file_per_rank=False, sync_files=False, thread_count=1)
    else:
        local = dst.removeprefix("file://")
        storage.makedirs(local)
        writer = FileSystemWriter(local, single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": as meant.
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        dcp_save_here(state, writer, _ViewPlanner())
    files = tuple(sorted(n for n in storage.listdir(dst) if n.endswith(".distcp"))) + (METADATA,)
    return ExportReport(dst, "pytorch-dcp", files, len(items), total)
