"""The end of a `anyshard.save` on every rank: write this rank's data file, agree with every
rank, commit on rank 0 (the manifest), raise on failure after removing what the failed save
wrote."""

from __future__ import annotations

import hashlib
import os
from typing import Any, NoReturn

from anyshard.api import collectives as coll
from anyshard.api.save_plan import LocalPlan, error_text
from anyshard.errors import SaveError
from anyshard.format import storage
from anyshard.format.commit import (
    DATA_DIR,
    SaveReport,
    build_manifest,
    commit_manifest,
    data_file_name,
)
from anyshard.format.datafile import write_datafile
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.format.manifest import MANIFEST_NAME, Ref

__all__ = ["write_and_commit"]


def write_and_commit(path: str, plan: LocalPlan, error: BaseException | None, group) -> None:
    """Write this rank's data file, agree with every rank, commit on rank 0, raise on failure."""
    me = coll.rank(group)
    file = begun = None
    writes = plan.writes
    refs: dict[str, Ref] = {}
    hashes: dict[str, str] | None = None
    crcs: dict[str, list[int]] | None = None  # computed with the hashes, in the same pass
    spans: dict[str, tuple[int, int]] = {}
    if error is None and plan.incremental is not None:
        try:
            writes, refs, hashes, crcs = plan.incremental.split(path, me, plan.writes)
            refs.update((k, b.ref) for k, b in plan.held.items())
        except Exception as e:
            error = e
    if error is None and (plan.writes or plan.held):
        try:
            storage.makedirs(storage.join(path, DATA_DIR))
            file = begun = data_file_name(me)  # written even when it references every shard
            write_datafile(
                storage.join(path, *file.split("/")),
                writes,
                hashes=hashes,
                spans=spans,
                crcs_of=crcs,
            )
        except Exception as e:
            error, file = e, None
    report = SaveReport(
        error=error_text(error) if error is not None else None,
        file=file,
        count=len(plan.writes) + len(plan.held) if error is None else 0,
        tensors=plan.tensors if error is None else {},
        values=plan.values if error is None else {},
        spec=plan.spec if error is None else None,
        refs=refs if error is None else {},
    )
    outcome = _commit(path, report, group)
    if error is not None or not outcome["ok"]:
        failed = error if error is not None else SaveError(outcome["error"])
        _fail(path, begun, plan.new_dir, failed, group)
    if plan.incremental is not None and hashes is not None:  # the base of the next save
        kinds = {k: (DTYPE_TO_ST[t.dtype], tuple(t.shape)) for k, t in plan.writes}
        kinds.update((k, (b.dtype, b.shape)) for k, b in plan.held.items())
        plan.incremental.remember(
            path, me, outcome["manifest_sha256"], writes, spans, file, refs, hashes, kinds
        )


def _commit(path: str, report: SaveReport, group) -> dict[str, Any]:
    """Gather every rank's ``report``; rank 0 builds and commits the manifest. The outcome, the
    same on every rank: ``ok``, and the manifest's sha256 or the error."""
    reports = coll.gather_json(report.to_json(), group)
    outcome: dict[str, Any] = {"ok": True}
    if coll.rank(group) == 0:
        assert reports is not None  # rank 0 gathers every rank's report
        try:
            manifest = build_manifest([SaveReport.from_json(r) for r in reports], path)
            data = manifest.dumps()
            commit_manifest(path, manifest, data)
            outcome["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        except Exception as e:
            outcome = {"ok": False, "error": str(e)}
    return coll.broadcast_json(outcome, group)


def _fail(path: str, begun: str | None, new_dir: bool, error: BaseException, group) -> NoReturn:
    """Remove the failed save's files (collective), then raise ``error``, naming what could not
    be removed."""
    left = _remove_failed(path, begun, new_dir, group)
    if left:
        raise SaveError(
            f"{error_text(error).strip()}\nthe failed save's files could not all be removed "
            f"({'; '.join(left)}): remove them, or run `anyshard gc` on the root"
        ) from error
    raise error


def _remove_failed(path: str, begun: str | None, new_dir: bool, group) -> list[str]:
    """After a failed save (collective): every rank removes the data file it wrote or began,
    then rank 0 the data directory and, if this save made it, the checkpoint's directory, each
    only when nothing else is left in it. Returns what could not be removed, with why (the same
    list on every rank). Where a manifest is there after all (a commit that landed although it
    reported an error, or another save's), nothing is touched."""
    left: list[str] = []
    committed: bool | str | None = None
    if coll.rank(group) == 0:  # a late commit (ours or another save's): touch nothing
        try:
            committed = storage.exists(storage.join(path, MANIFEST_NAME))
        except Exception as e:
            committed = f"cannot tell whether {path} committed ({e})"
    committed = coll.broadcast_json(committed, group)
    if committed:
        return [] if committed is True else [f"{path}: left as it is: {committed}"]
    if begun is not None:
        target = storage.join(path, *begun.split("/"))
        try:
            if storage.exists(target):
                storage.remove_file(target)
        except Exception as e:  # best effort: named in the error instead
            left.append(f"{target}: {e}")
    gathered = coll.gather_json(left, group)
    if gathered is not None:  # rank 0, once every rank has removed its own
        left = [x for rank_left in gathered for x in rank_left]
        dirs = [storage.join(path, DATA_DIR)] + ([path] if new_dir else [])
        for d in dirs:
            try:
                if not storage.is_url(d) and storage.exists(d) and not storage.listdir(d):
                    os.rmdir(d)  # only while empty: a concurrent writer's file stays
            except Exception as e:
                left.append(f"{d}: {e}")
    return coll.broadcast_json(left, group)
