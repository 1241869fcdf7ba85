"""Test helpers: manifests and data file headers edited by a test, written back as a writer
seals them (its checksum right, its content what the test made): so that the checks behind the
seal (a hostile or buggy writer's content) stay tested. A document that had no seal keeps none."""

from __future__ import annotations

import json
from typing import Any

from anyshard.format.checksum import seal

_MANIFEST_KEY = b'"crc32c":"'
_HEADER_PREFIX = b'{"__metadata__":{"anyshard_crc32c":"'


def manifest_bytes(manifest: Any) -> bytes:
    """``manifest`` (as `json.load` gave it, edited) serialised as a writer does, sealed if it
    carries a ``crc32c`` field after ``format`` and ``format_version``."""
    if not (isinstance(manifest, dict) and list(manifest)[2:3] == ["crc32c"]):
        return json.dumps(manifest).encode()
    data = json.dumps({**manifest, "crc32c": "00000000"}, separators=(",", ":")).encode()
    return seal(data, data[: data.index(_MANIFEST_KEY) + len(_MANIFEST_KEY)])


def header_bytes(header: Any) -> bytes:
    """A data file's header (as `json.loads` gave it, edited), sealed if its ``__metadata__``
    comes first and starts with ``anyshard_crc32c``; not padded."""
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not (
        isinstance(meta, dict)
        and list(header)[:1] == ["__metadata__"]
        and list(meta)[:1] == ["anyshard_crc32c"]
    ):
        return json.dumps(header).encode()
    header = {**header, "__metadata__": {**meta, "anyshard_crc32c": "00000000"}}
    return seal(json.dumps(header, separators=(",", ":")).encode(), _HEADER_PREFIX)


def reseal(data: bytes) -> bytes:
    """Raw manifest or header bytes edited as text, sealed again if they begin with a seal."""
    for prefix in (
        _HEADER_PREFIX,
        b'{"format":"anyshard-checkpoint","format_version":4,"crc32c":"',
    ):
        if data.startswith(prefix):
            n = len(prefix)
            return seal(data[:n] + b"00000000" + data[n + 8 :], prefix)
    return data
