"""``anyshard.save``: every rank writes the shards it holds, as they are; one rank commits."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from anyshard import _collectives as coll
from anyshard._layout import TensorLayout, layout_of
from anyshard._state import flatten_state, json_roundtrip
from anyshard.errors import AnyshardError, SaveError
from anyshard.format import storage
from anyshard.format.datafile import DTYPE_TO_ST, write_datafile
from anyshard.format.manifest import MANIFEST_NAME, Manifest, MeshEntry, SpecEntry, TensorEntry
from anyshard.ucl.mapping import On

__all__ = ["save"]

DATA_DIR = "data"


def _file_name(rank: int) -> str:
    return f"{DATA_DIR}/rank-{rank:05d}.safetensors"


def _host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _is_representative(layout: TensorLayout) -> bool:
    pinned = {op.axis for op in layout.hold.ops if isinstance(op, On)}
    return all(c == 0 for axis, c in layout.coords.items() if axis not in pinned)


def _plan_local(
    flat: dict, holders: dict[str, list[int]], group, *, to_host: bool = True
) -> tuple[list[tuple[str, torch.Tensor]], dict, dict]:
    """This rank's shards to write (as contiguous host tensors when ``to_host``; an async save
    stages them itself, straight from the device), the tensor entries it reports, and its JSON
    values. ``flat`` is the flattened state, ``holders`` what `_plain_holders` found."""
    writes: list[tuple[str, torch.Tensor]] = []
    entries: dict[str, dict] = {}
    values: dict[str, Any] = {}
    meshes: dict = {}  # device mesh -> what layouts need of it, for this call only
    for fqn, leaf in flat.items():
        value = leaf.value
        if not isinstance(value, torch.Tensor):
            values[fqn] = json_roundtrip(value)
            continue
        if value.dtype not in DTYPE_TO_ST:
            raise AnyshardError(f"{fqn}: dtype {value.dtype} cannot be stored in safetensors")
        layout = layout_of(fqn, value, group, meshes, holders.get(fqn))
        write, part = layout.write_plan(fqn)
        if part is not None:
            writes.append((fqn, _host(part) if to_host else part))
        if _is_representative(layout):
            entries[fqn] = {
                "dtype": DTYPE_TO_ST[value.dtype],
                "shape": list(layout.global_shape),
                "mesh": layout.mesh.to_json(),
                "mapping": str(write),
            }
    return writes, entries, values


def _plan_spec(state_dict, spec, layout, coords, group):
    from anyshard import _spec
    from anyshard.ucl.evaluate import layout_for

    parsed = _spec.resolve_spec(spec)
    lay = layout_for(parsed, layout)
    me = _spec.rank_coords(lay, coords, group, saving=True)
    writes, entries, values = _spec.spec_writes(flatten_state(state_dict), parsed, lay, me, group)
    mesh = _spec.spec_mesh(lay).to_json()
    for e in entries.values():
        e["mesh"], e["mapping"] = mesh, None
    info = {
        "text": parsed.text or str(parsed),
        "layout": _spec.layout_json(parsed, lay),
        "mesh": mesh,
    }
    return writes, entries, values, info


def _plain_holders(flat: dict, group) -> dict[str, list[int]]:
    """The ranks holding each plain tensor that not every rank holds (the tensors of one
    pipeline stage, say). One 32-byte all-gather when every rank holds the same names."""
    import hashlib

    from torch.distributed.tensor import DTensor

    names = sorted(
        k
        for k, leaf in flat.items()
        if isinstance(leaf.value, torch.Tensor) and not isinstance(leaf.value, DTensor)
    )
    digest = hashlib.sha256("\n".join(names).encode()).digest()
    if coll.all_equal(digest, group):
        return {}
    lists = coll.gather_json(names, group)
    partial = None
    if lists is not None:
        held: dict[str, list[int]] = {}
        for r, ns in enumerate(lists):
            for n in ns:
                held.setdefault(n, []).append(r)
        partial = {n: rs for n, rs in held.items() if len(rs) < len(lists)}
    return coll.broadcast_json(partial, group)


def _merge(reports: list[dict], path: str) -> Manifest:
    """Rank 0: the manifest from every rank's report; raises SaveError on any failure."""
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if failed:
        lines = "\n".join(f"  rank {r}: {e.strip().splitlines()[-1]}" for r, e in failed[:8])
        raise SaveError(
            f"save to {path} failed on {len(failed)} rank(s); nothing was committed:\n{lines}"
        )
    meshes: list[MeshEntry] = []
    mesh_ids: dict[str, int] = {}
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    spec = None
    for rep in reports:
        if rep.get("spec") is not None and spec is None:
            key = repr(rep["spec"]["mesh"])
            mesh_ids[key] = len(meshes)
            meshes.append(MeshEntry.from_json(rep["spec"]["mesh"]))
            spec = SpecEntry(
                text=rep["spec"]["text"], layout=rep["spec"]["layout"], mesh=mesh_ids[key]
            )
    for rep in reports:
        for fqn, e in rep["entries"].items():
            if fqn in tensors:
                continue
            key = repr(e["mesh"])
            if key not in mesh_ids:
                mesh_ids[key] = len(meshes)
                meshes.append(MeshEntry.from_json(e["mesh"]))
            tensors[fqn] = TensorEntry(
                dtype=e["dtype"], shape=tuple(e["shape"]), mesh=mesh_ids[key], mapping=e["mapping"]
            )
        for k, v in rep["values"].items():
            values.setdefault(k, v)
    files = {r: rep["file"] for r, rep in enumerate(reports) if rep["file"]}
    manifest = Manifest(
        world_size=len(reports),
        meshes=tuple(meshes),
        files=files,
        tensors=dict(sorted(tensors.items())),
        values=dict(sorted(values.items())),
        library=_library(),
        spec=spec,
    )
    if spec is not None:
        from anyshard.format.stored import spec_index

        problems = spec_index(manifest).coverage_problems()
        if problems:
            raise SaveError(
                f"save to {path}: under this spec and layout the saved local tensors do not hold "
                "every logical tensor exactly once (a replicate() or on() missing or one too "
                "many?); nothing was committed. `anyshard ucl check SPEC --layout ...` shows "
                "all problems:\n  " + "\n  ".join(problems)
            )
    _check_writers(manifest, reports, path)
    return manifest


def _check_writers(manifest: Manifest, reports: list[dict], path: str) -> None:
    """Every rank wrote exactly the shards the manifest says it holds; else nothing commits."""
    expected = manifest.shards_per_rank().tolist()
    bad = [
        (r, rep["count"], expected[r])
        for r, rep in enumerate(reports)
        if rep["count"] != expected[r]
    ]
    if bad:
        r, got, want = bad[0]
        raise SaveError(
            f"save to {path}: rank {r} wrote {got} shard(s) but the layouts say it holds {want}; "
            "ranks hold different tensors under the same names (pipeline stages with local layer "
            "names, or a plain tensor that is not the same on every rank?). Name pipeline mesh "
            "dims 'pp' and give every logical tensor one global name"
        )


def _library() -> str:
    from anyshard import __version__

    return f"anyshard {__version__}"


def save(
    path: str,
    state_dict: dict[str, Any],
    *,
    process_group=None,
    async_: bool = False,
    spec=None,
    layout: dict[str, int] | None = None,
    coords: dict[str, int] | None = None,
):
    """Save ``state_dict`` to ``path`` (a directory or URL), collectively over ``process_group``.

    Each rank writes the shards it holds into its own safetensors file (replicated regions once,
    spread over their holders); then rank 0 writes ``manifest.json``, the commit.

    With ``spec`` (a UCL spec: text, path, shipped name or `anyshard.ucl.Spec`) and ``layout``
    (mesh dim sizes and params, e.g. ``{"tp": 2, "pp": 2, "hidden": 4096}``), ``state_dict``
    holds this rank's plain local tensors as the spec describes them (fused, padded, flattened,
    locally numbered); each rank writes them as they are and the manifest records the spec. The
    rank's mesh coordinates come from its rank in row-major order of the spec's mesh dims, or
    from ``coords``.

    With ``async_=True`` it returns a `SaveHandle` as soon as the shards are staged in host
    memory (pinned when CUDA is used): the caller may modify its tensors right away, and the
    files are written and committed in the background. One async save is in flight at a time:
    the next save waits for it, and a failure surfaces there or at ``handle.result()``.

    >>> import torch, anyshard, tempfile
    >>> d = tempfile.mkdtemp()
    >>> anyshard.save(d + "/step-1", {"w": torch.arange(6.0).reshape(2, 3), "step": 1})
    >>> anyshard.open(d + "/step-1").get_tensor("w")[1]
    tensor([3., 4., 5.])
    """
    from anyshard import _async

    _async.wait_for_previous()  # staging buffers are reused; a failure surfaces here
    me = coll.rank(process_group)
    report: dict[str, Any] = {"error": None, "file": None, "count": 0, "entries": {}, "values": {}}
    writes: list[tuple[str, torch.Tensor]] = []
    flat: dict | None = None
    try:
        if me == 0 and storage.exists(storage.join(path, MANIFEST_NAME)):
            raise SaveError(
                f"{path} already holds a committed checkpoint; save to a new path (e.g. the next step)"
            )
        if spec is None:
            flat = flatten_state(state_dict)
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        report["error"] = "".join(traceback.format_exception_only(type(e), e))
        report["exception"] = e
    # collective: every rank takes part, whatever happened to it above
    holders = _plain_holders(flat or {}, process_group) if spec is None else {}
    try:
        if report["error"] is not None:
            pass
        elif spec is not None:
            writes, entries, values, info = _plan_spec(
                state_dict, spec, layout or {}, coords, process_group
            )
            report["spec"] = info if me == 0 else None
        else:
            writes, entries, values = _plan_local(flat, holders, process_group, to_host=not async_)
        if report["error"] is None:
            report.update(
                entries=entries, values=values if me == 0 or values else {}, count=len(writes)
            )
    except Exception as e:  # reported to rank 0 so that no rank waits forever
        report["error"] = "".join(traceback.format_exception_only(type(e), e))
        report["exception"] = e
    if not async_:
        _write_and_commit(path, writes, report, process_group)
        return None
    staged = _async.stage(writes)
    group = _async.background_group(process_group)
    return _async.submit(lambda: _write_and_commit(path, staged, report, group))


def _write_and_commit(path: str, writes, report: dict[str, Any], group) -> None:
    """Write this rank's data file, agree with every rank, commit on rank 0, raise on failure."""
    me = coll.rank(group)
    local_error: BaseException | None = report.pop("exception", None)
    if local_error is None:
        try:
            if writes:
                storage.makedirs(storage.join(path, DATA_DIR))
                write_datafile(storage.join(path, *_file_name(me).split("/")), writes)
                report["file"] = _file_name(me)
        except Exception as e:
            local_error = e
            report["error"] = "".join(traceback.format_exception_only(type(e), e))
    reports = coll.gather_json(report, group)
    outcome: dict[str, Any] = {"ok": True}
    if me == 0:
        try:
            manifest = _merge(reports, path)
            storage.makedirs(path)  # a save of JSON values only has no data directory
            target = storage.join(path, MANIFEST_NAME)
            try:  # exclusive: a concurrent save to the same path cannot commit over this one
                storage.write_bytes_atomic(target, manifest.dumps(), exclusive=True)
            except FileExistsError:
                raise SaveError(
                    f"{path} already holds a committed checkpoint; save to a new path"
                ) from None
        except Exception as e:
            outcome = {"ok": False, "error": str(e)}
    outcome = coll.broadcast_json(outcome, group)
    if local_error is not None:
        raise local_error
    if not outcome["ok"]:
        raise SaveError(outcome["error"])


def save_local_states(
    path: str,
    states: dict[int, dict[str, Any]],
    *,
    spec,
    layout: dict[str, int],
) -> None:
    """Write a checkpoint for a whole layout from one process: ``states[rank]`` holds the local
    tensors of that rank (row-major over the spec's mesh dims), exactly as if every rank had
    called `save` with ``spec`` and ``layout``. Every rank of the layout must be given."""
    from anyshard import _spec
    from anyshard.ucl.evaluate import coords_of_rank, layout_for

    parsed = _spec.resolve_spec(spec)
    lay = layout_for(parsed, layout)
    if sorted(states) != list(range(lay.world_size)):
        raise AnyshardError(
            f"save_local_states needs the states of ranks 0..{lay.world_size - 1} of the layout "
            f"{dict(lay.sizes)}; got ranks {sorted(states)}"
        )
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        raise SaveError(f"{path} already holds a committed checkpoint; save to a new path")
    flats = {r: flatten_state(s) for r, s in states.items()}
    averaged = _average_locally(parsed, lay, flats)
    mesh = _spec.spec_mesh(lay).to_json()
    reports = []
    for rank in range(lay.world_size):
        coords = coords_of_rank(lay.sizes, rank)
        writes, entries, values = _spec.spec_writes(
            averaged.get(rank, flats[rank]), parsed, lay, coords, None, distributed=False
        )
        for e in entries.values():
            e["mesh"], e["mapping"] = mesh, None
        report: dict[str, Any] = {
            "error": None,
            "file": None,
            "count": len(writes),
            "entries": entries,
            "values": values,
            "spec": None,
        }
        if rank == 0:
            report["spec"] = {
                "text": parsed.text or str(parsed),
                "layout": _spec.layout_json(parsed, lay),
                "mesh": mesh,
            }
        if writes:
            storage.makedirs(storage.join(path, DATA_DIR))
            write_datafile(storage.join(path, *_file_name(rank).split("/")), writes)
            report["file"] = _file_name(rank)
        reports.append(report)
    manifest = _merge(reports, path)
    storage.makedirs(path)
    try:
        storage.write_bytes_atomic(
            storage.join(path, MANIFEST_NAME), manifest.dumps(), exclusive=True
        )
    except FileExistsError:
        raise SaveError(
            f"{path} already holds a committed checkpoint; save to a new path"
        ) from None


def _average_locally(parsed, lay, flats: dict) -> dict:
    """``average(axis)`` tensors replaced, in copies of the states, by their mean over ``axis``."""
    from anyshard import _spec
    from anyshard._state import Leaf
    from anyshard.ucl.evaluate import compile, coords_of_rank

    mesh = _spec.spec_mesh(lay)
    out: dict[int, dict] = {}
    for rank in flats:
        coords = coords_of_rank(lay.sizes, rank)
        for name, t in compile(parsed, lay, coords).items():
            if not t.average or name not in flats[rank]:
                continue
            members = {rank}
            for axis in t.average:
                members = {
                    mesh.rank({**coords_of_rank(lay.sizes, m), axis: i})
                    for m in members
                    for i in range(lay.sizes[axis])
                }
            values = [flats[m][name].value for m in sorted(members)]
            mean = torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
            out.setdefault(rank, dict(flats[rank]))[name] = Leaf({}, name, mean)
    return out
