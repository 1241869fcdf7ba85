"""Writers: Hugging Face safetensors and anyshard checkpoints from any lazy view, streamed.

A view is what `anyshard.open` returns (`CheckpointView`, `HFCheckpointView`): names, shapes,
dtypes and region reads. The writers hold one tensor at a time (a Hugging Face tensor larger
than 64 MiB is copied in row blocks of about that size), never the model.

- `write_hf` writes what transformers' ``save_pretrained`` writes: ``model.safetensors``, or
  shards ``model-00001-of-0000N.safetensors`` split as huggingface_hub's
  ``split_torch_state_dict_into_shards`` splits them, with ``model.safetensors.index.json``.
  Each file has the bytes ``safetensors.torch.save_file`` would write for its tensors (same
  header, same data order: by dtype alignment, then name).
- `write_anyshard` writes an anyshard checkpoint: under a UCL spec and layout, every rank's
  data file exactly as if that layout had saved it (built one local tensor at a time from the
  logical regions the spec says it holds); without a spec, one plain single-rank checkpoint.

Run: ``python -m pytest tests/unit/test_loaders_hf.py -q``
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from anyshard.errors import AnyshardError, SaveError, StateDictMismatchError
from anyshard.format import storage
from anyshard.format.commit import (
    ReportedSpec,
    ReportedTensor,
    SaveReport,
    build_manifest,
    commit_manifest,
    data_file_name,
    refuse_committed,
)
from anyshard.format.datafile import (
    block_crcs,
    block_size,
    header_bytes,
    shard_tile_crcs,
    tensor_bytes,
    tile_count,
)
from anyshard.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE
from anyshard.format.mesh import MeshEntry
from anyshard.geometry.boxes import Piece, box_shape, full_box
from anyshard.loaders._shared import ExportItem, ExportReport, Progress, export_items, parse_size
from anyshard.ucl.evaluate import compile, coords_of_rank, layout_for
from anyshard.ucl.library import load_spec

__all__ = ["write_anyshard", "write_hf"]

_BLOCK = 64 << 20  # a tensor larger than this is copied to a Hugging Face file in row blocks
# safetensors orders a file's data by dtype alignment, largest first, then by name: the rank
# of each dtype in its ordering (safetensors' Dtype enum order).
_ST_ORDER = {
    code: i
    for i, code in enumerate(
        "BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64".split()
    )
}
_PLAIN_MESH = MeshEntry(dims=("world",), sizes=(1,), offset=0, strides=(1,))


def _blocks(view, item: ExportItem) -> Iterator[torch.Tensor]:
    """The tensor, whole or in row blocks of about `_BLOCK` bytes, as written."""
    shape = item.shape
    row = math.prod(shape[1:]) * item.src_dtype.itemsize if shape else 0
    if not shape or row * shape[0] <= _BLOCK:
        boxes: Iterable = [full_box(shape)]
    else:  # lazily: a shape is not trusted to size a list
        step = max(1, _BLOCK // max(row, 1))
        rest = full_box(shape[1:])
        boxes = (((lo, min(lo + step, shape[0])),) + rest for lo in range(0, shape[0], step))
    for box in boxes:
        t = view.read_region(item.source, box).to(item.dtype).contiguous()
        yield t
        del t


# --- Hugging Face -------------------------------------------------------------------------------


def _split_shards(items: list[ExportItem], max_size: int) -> list[tuple[str, list[ExportItem]]]:
    """Files and their tensors, as huggingface_hub splits a state dict: in order, a new shard
    when the next tensor would pass ``max_size``; a tensor larger than that alone in a shard
    (placed before the shard being filled)."""
    shards: list[list[ExportItem]] = []
    current: list[ExportItem] = []
    size = 0
    for it in items:
        if it.nbytes > max_size:
            shards.append([it])
            continue
        if size + it.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(it)
        size += it.nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return [("model.safetensors", shards[0])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)]


def _hf_header(items: list[ExportItem]) -> bytes:
    """The header safetensors writes for ``items`` (already in file order)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for it in items:
        header[it.target] = {
            "dtype": DTYPE_TO_ST[it.dtype],
            "shape": list(it.shape),
            "data_offsets": [offset, offset + it.nbytes],
        }
        offset += it.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return raw + b" " * (-len(raw) % 8)


def _refuse_existing_hf(root: str, single: str | None) -> None:
    if single is not None:
        path = storage.join(root, single) if root else single
        if storage.exists(path):
            raise SaveError(f"{path} exists; write to a new file")
        return
    if not storage.exists(root):
        return
    try:
        names = storage.listdir(root)
    except NotADirectoryError:
        raise SaveError(
            f"{root} is a file; pass a directory (or a path ending in .safetensors)"
        ) from None
    present = [n for n in names if n.endswith((".safetensors", ".safetensors.index.json"))]
    if present:
        raise SaveError(
            f"{root} already holds {', '.join(sorted(present)[:4])}; write to a new or empty "
            "directory (a stale shard would be read with the new ones)"
        )


def write_hf(
    view,
    dst: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    progress: Progress | None = None,
) -> ExportReport:
    """Write the view's tensors as a Hugging Face safetensors checkpoint in directory ``dst``
    (or into the one file ``dst`` when it ends in ``.safetensors``).

    Tensors are assigned to shards in name order (the order of the index's ``weight_map``), so
    the result does not depend on the source's format. ``dtype`` casts floating-point tensors
    only (integer buffers keep theirs), as transformers' ``torch_dtype`` does. ``only`` and
    ``rename`` choose and rename tensors (`select_names`).

    >>> import torch, tempfile, anyshard
    >>> from anyshard.loaders import write_hf
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/ckpt", {"w": torch.ones(4, 4), "b": torch.zeros(4)})
    >>> with anyshard.open(d + "/ckpt") as view:
    ...     report = write_hf(view, d + "/hf", max_shard_size=64)
    >>> report.files
    ('model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json')
    >>> anyshard.open(d + "/hf").get_tensor("w").sum().item()
    16.0
    """
    items = sorted(export_items(view, only, rename, dtype), key=lambda it: it.target)
    single = dst.endswith(".safetensors")
    if single:
        root, name = os.path.split(dst) if not storage.is_url(dst) else dst.rsplit("/", 1)
        shards = [(name, items)]
    else:
        root = dst
        shards = _split_shards(items, parse_size(max_shard_size))
    _refuse_existing_hf(root, shards[0][0] if single else None)
    if root:
        storage.makedirs(root)
    total = sum(it.nbytes for it in items)
    done = [0, 0]
    for name, group in shards:
        ordered = sorted(group, key=lambda it: (-_ST_ORDER[DTYPE_TO_ST[it.dtype]], it.target))
        header = _hf_header(ordered)
        path = storage.join(root, name) if root else name
        with storage.open_writer(path) as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for it in ordered:
                for block in _blocks(view, it):
                    if block.numel():
                        f.write(tensor_bytes(block))
                    del block  # not alive while the next block is read
                done[0] += 1
                done[1] += it.nbytes
                if progress is not None:
                    progress(done[0], len(items), done[1], total)
    files = tuple(name for name, _ in shards)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {it.target: name for name, group in shards for it in group},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        storage.write_bytes_atomic(
            storage.join(root, "model.safetensors.index.json"), text.encode()
        )
        files += ("model.safetensors.index.json",)
    return ExportReport(dst, "huggingface-safetensors", files, len(items), total)


# --- anyshard -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _LocalWrite:
    """One stored tensor of a rank's data file, and where its data comes from."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[str, tuple[Piece, ...]], ...]  # (source name in the view, pieces)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _plain_plan(
    items: list[ExportItem], values: dict
) -> tuple[list[list[_LocalWrite]], list[SaveReport]]:
    writes, entries = [], {}
    for it in sorted(items, key=lambda it: it.target):
        box = full_box(it.shape)
        piece = Piece(0, it.shape, box, box)
        writes.append(_LocalWrite(it.target, it.shape, it.dtype, ((it.source, (piece,)),)))
        entries[it.target] = ReportedTensor(
            dtype=DTYPE_TO_ST[it.dtype], shape=it.shape, mesh=_PLAIN_MESH, mapping="on(world, 0)"
        )
    return [writes], [_report(0, writes, entries, values, None)]


def _report(
    rank: int, writes: list, entries: dict, values: dict, spec: ReportedSpec | None
) -> SaveReport:
    return SaveReport(
        file=data_file_name(rank) if writes else None,
        count=len(writes),
        tensors=entries,
        values=values,
        spec=spec,
    )


def _spec_plan(
    items: list[ExportItem], spec, layout: Mapping[str, int], values: dict
) -> tuple[list[list[_LocalWrite]], list[SaveReport]]:
    """Every rank's writes and report under ``spec``; all mismatches with the view at once."""
    parsed = load_spec(spec)
    lay = layout_for(parsed, layout)
    recorded = ReportedSpec.of(parsed, lay)
    by_name = {it.target: it for it in items}
    problems: set[str] = set()
    saved: set[str] = set()
    plan, reports = [], []
    for rank in range(lay.world_size):
        local = compile(parsed, lay, coords_of_rank(lay.sizes, rank))
        writes, entries = [], {}
        for name in sorted(local):
            t = local[name]
            if not t.written:
                continue
            w = _local_write(t, by_name, problems)
            if w is None:
                continue
            writes.append(w)
            for part in t.parts:
                if part.primary:
                    saved.add(part.logical)
                    entries[part.logical] = ReportedTensor(
                        dtype=DTYPE_TO_ST[w.dtype],
                        shape=part.logical_shape,
                        mesh=recorded.mesh,
                        mapping=None,
                    )
        plan.append(writes)
        first = rank == 0
        reports.append(
            _report(rank, writes, entries, values if first else {}, recorded if first else None)
        )
    unsaved = sorted(set(by_name) - saved)
    if unsaved:
        problems.add(
            f"the spec saves no part of {len(unsaved)} tensor(s) of the source: "
            f"{', '.join(unsaved[:8])}{' ...' if len(unsaved) > 8 else ''}; add rules for them, "
            "or leave them out with only="
        )
    if problems:
        lines = sorted(problems)
        raise StateDictMismatchError(
            "the source does not fit the spec and layout:\n  "
            + "\n  ".join(lines[:20])
            + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        )
    return plan, reports


def _local_write(t, by_name: dict[str, ExportItem], problems: set[str]) -> _LocalWrite | None:
    parts, dtypes = [], set()
    ok = True
    for part in t.parts:
        it = by_name.get(part.logical)
        if it is None:
            problems.add(
                f"{t.name}: holds {part.logical!r} {list(part.logical_shape)}, which the source "
                "lacks (is the spec for this model? a rename needed?)"
            )
            ok = False
            continue
        if it.shape != part.logical_shape:
            problems.add(
                f"{t.name}: holds {part.logical!r} of shape {list(part.logical_shape)} under this "
                f"layout, but the source's is {list(it.shape)} (check the layout's sizes)"
            )
            ok = False
            continue
        dtypes.add(it.dtype)
        parts.append((it.source, part.shard.pieces))
    if not ok:
        return None
    if t.dtype is not None:
        dtype = ST_TO_DTYPE[t.dtype]
    elif len(dtypes) == 1:
        dtype = dtypes.pop()
    else:
        problems.add(
            f"{t.name}: fuses tensors of dtypes {sorted(map(str, dtypes))}; give the rule a cast()"
        )
        return None
    return _LocalWrite(t.name, t.stored_shape, dtype, tuple(parts))


def _build_local(view, w: _LocalWrite) -> torch.Tensor:
    """One rank's stored tensor, filled from the logical regions its pieces hold (padding 0)."""
    from anyshard.api.views import CheckpointView
    from anyshard.reshard.executor import piece_view
    from anyshard.reshard.fill import Fill, fill_regions

    covered = sum(math.prod(box_shape(p.logical_box)) for _, pieces in w.parts for p in pieces)
    # padding is zero; a tensor its pieces fill whole is not written twice
    out = (torch.empty if covered == math.prod(w.shape) else torch.zeros)(w.shape, dtype=w.dtype)
    direct = _reads_into(view)
    for source, pieces in w.parts:
        if (
            isinstance(view, CheckpointView)
            and w.dtype == ST_TO_DTYPE[view.get_slice(source).get_dtype()]
        ):
            # the reshard planner reads straight into the pieces, coalescing their byte ranges
            fill_regions(
                view.path,
                view.manifest,
                [Fill(source, out, tuple(pieces))],
                headers=view._headers,
                verify=view.verify,
            )
            continue
        for p in pieces:
            dest = piece_view(out, p)
            if direct and dest.is_contiguous():
                if dest.dtype == ST_TO_DTYPE[view.get_slice(source).get_dtype()]:
                    view.read_region(source, p.logical_box, out=dest)  # no copy in between
                    continue
            dest.copy_(view.read_region(source, p.logical_box))
    return out


def _reads_into(view) -> bool:
    """Whether the view's ``read_region`` fills a given tensor (``out=``)."""
    import inspect

    try:
        return "out" in inspect.signature(view.read_region).parameters
    except (TypeError, ValueError):
        return False


def _datafile_header(
    writes: list[_LocalWrite], crcs: dict[str, list[int]], tiles: dict[str, list[int]]
) -> bytes:
    return header_bytes(
        [(w.name, DTYPE_TO_ST[w.dtype], w.shape) for w in writes], crcs, None, tiles
    )


def _write_datafile_local(path: str, view, writes: list[_LocalWrite], on_tensor) -> None:
    """An anyshard data file, one tensor in memory at a time: the header's space is reserved
    for the widest checksums, the data streamed, then the header written in place (padded with
    spaces, which JSON and safetensors allow). A shard with checksum tiles gets them, as a save
    writes them (its block and tile checksums in one pass)."""
    blocks = {w.name: block_size(w.shape, w.dtype.itemsize) for w in writes}
    widest = {w.name: [2**32 - 1] * max(1, -(-w.nbytes // blocks[w.name])) for w in writes}
    tiled = {w.name: tile_count(w.shape, w.dtype.itemsize) for w in writes}
    widest_tiles = {n: [2**32 - 1] * len(widest[n]) * k for n, k in tiled.items() if k > 1}
    reserved = len(_datafile_header(writes, widest, widest_tiles))
    reserved += -reserved % 8
    crcs: dict[str, list[int]] = {}
    tiles: dict[str, list[int]] = {}
    with storage.open_writer(path) as f:
        f.write(b"\0" * (8 + reserved))
        for w in writes:
            t = _build_local(view, w)
            mv = tensor_bytes(t)
            if tiled[w.name] > 1:
                crcs[w.name] = []
                tiles[w.name] = shard_tile_crcs(
                    mv, w.shape, w.dtype.itemsize, blocks[w.name], crcs[w.name]
                )
            else:
                crcs[w.name] = block_crcs(mv, blocks[w.name])
            if mv.nbytes:
                f.write(mv)
            del t, mv
            on_tensor(w)
        raw = _datafile_header(writes, crcs, tiles)
        f.seek(0)
        f.write(struct.pack("<Q", reserved))
        f.write(raw + b" " * (reserved - len(raw)))


def _write_datafile(path: str, view, writes: list[_LocalWrite], on_tensor) -> None:
    if not storage.is_url(path):
        _write_datafile_local(path, view, writes, on_tensor)
        return
    # An object can't be rewritten in place: build the file locally, then stream it up.
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", prefix="anyshard-")
    os.close(fd)
    try:
        _write_datafile_local(tmp, view, writes, on_tensor)
        storage.upload(tmp, path)
    finally:
        os.unlink(tmp)


def write_anyshard(
    view,
    dst: str,
    *,
    spec=None,
    layout: Mapping[str, int] | None = None,
    dtype: torch.dtype | str | None = None,
    only: str | re.Pattern | None = None,
    rename: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    progress: Progress | None = None,
) -> ExportReport:
    """Write the view as an anyshard checkpoint at ``dst``, from this one process.

    With ``spec`` (a UCL spec: text, ``.ucl`` path, shipped name or `anyshard.ucl.Spec`) and
    ``layout``, every rank's data file is what that rank would write with
    ``anyshard.save(..., spec=, layout=)``: its local tensors (fused, padded, flattened, locally
    named) are built one at a time from the logical regions the spec says they hold. The
    source's tensors (after ``only`` and ``rename``) must be exactly the spec's logical tensors
    with the spec's shapes; every mismatch is reported at once, before anything is written.
    Without ``spec``, a plain single-rank checkpoint (as ``anyshard.save`` in one process).
    JSON values of the source are kept. ``dtype`` casts floating-point tensors.

    >>> import torch, tempfile, anyshard
    >>> from safetensors.torch import save_file
    >>> from anyshard.loaders import write_anyshard
    >>> d = tempfile.mkdtemp()
    >>> save_file({"w": torch.arange(8.0).reshape(4, 2)}, d + "/model.safetensors")
    >>> spec = 'mesh tp; "w" -> "w" [4, 2] : chunk(0, tp);'
    >>> with anyshard.open(d) as view:
    ...     r = write_anyshard(view, d + "/ckpt", spec=spec, layout={"tp": 2})
    >>> r.files, anyshard.open(d + "/ckpt").get_tensor("w")[3].tolist()
    (('data/rank-00000.safetensors', 'data/rank-00001.safetensors'), [6.0, 7.0])
    """
    refuse_committed(dst)
    items = export_items(view, only, rename, dtype)
    values = {k: view.get_value(k) for k in view.value_keys()}
    if spec is None:
        if layout:
            raise AnyshardError("a layout needs a spec: pass spec= (a UCL spec) with layout=")
        plan, reports = _plain_plan(items, values)
    else:
        plan, reports = _spec_plan(items, spec, layout or {}, values)
    manifest = build_manifest(
        reports, dst
    )  # checks, before any write, that every element is kept once
    total_n = sum(len(ws) for ws in plan)
    total_b = sum(w.nbytes for ws in plan for w in ws)
    done = [0, 0]

    def on_tensor(w: _LocalWrite) -> None:
        done[0] += 1
        done[1] += w.nbytes
        if progress is not None:
            progress(done[0], total_n, done[1], total_b)

    files = []
    for rank, writes in enumerate(plan):
        if not writes:
            continue
        rel = reports[rank].file
        assert rel is not None  # a rank with writes has its data file
        storage.makedirs(storage.join(dst, *rel.split("/")[:-1]))
        _write_datafile(storage.join(dst, *rel.split("/")), view, writes, on_tensor)
        files.append(rel)
    commit_manifest(dst, manifest)
    return ExportReport(dst, "anyshard", tuple(files), len(items), total_b)
