"""``torch.save`` files as the same lazy view as `anyshard.open`, read without running code.

A checkpoint is one ``*.pt`` / ``*.pth`` / ``*.bin`` file (Hugging Face's legacy
``pytorch_model.bin``), or shards listed by ``pytorch_model.bin.index.json`` (its
``weight_map``), or a directory holding either. Files are read only with
``torch.load(weights_only=True)``: tensors, dicts, lists, tuples, numbers, strings and a few
torch types (dtypes, sizes) are rebuilt; a file that names anything else (a class instance, a
function) is refused before any of it is built. Local files in the zip format ``torch.save``
writes since 1.6 are memory-mapped (``mmap=True``): a region read touches only the pages it
covers. Files in the legacy (pre-1.6) format cannot be mapped and are read whole into memory,
with a warning; so are URLs (``s3://...``), whose objects are fetched whole, one sharded file in
memory at a time.

Nested containers are flattened as anyshard names a nested state dict: ``{"model": {"w": t}}``
is ``model.w``, list items are numbered; a dict or list without tensors whose content is JSON
(numbers, strings, lists, string-keyed dicts) is one JSON value. A file holding a bare tensor
names it by the file's stem. Leaves that load but are neither (a ``torch.dtype``, bytes, a
sparse tensor) are listed in ``skipped`` with the reason.

Run: ``python -m pytest tests/unit/test_loaders_torchsave.py -q``
"""

from __future__ import annotations

import io
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from anyshard.api.state import has_tensor, is_json_value, json_roundtrip
from anyshard.api.views import BaseView
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from anyshard.format import storage, strict_json
from anyshard.format.dtypes import DTYPE_TO_ST
from anyshard.geometry.boxes import Box, box_shape
from anyshard.loaders._shared import check_file_name, checked_region, not_there, split_path
from anyshard.loaders.hf import HFTensorMetadata

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "SINGLE_NAME",
    "LoadedFile",
    "TorchSaveView",
    "load_weights_only",
    "looks_like_torch_save",
]

FORMAT = "torch-save"
INDEX_NAME = "pytorch_model.bin.index.json"
SINGLE_NAME = "pytorch_model.bin"
_SUFFIXES = (".pt", ".pth", ".bin")
_INDEX_SUFFIXES = tuple(s + ".index.json" for s in _SUFFIXES)
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def looks_like_file(path: str) -> bool:
    """Whether ``path`` names a torch.save file or a shard index (by its name alone)."""
    return path.endswith(_SUFFIXES + _INDEX_SUFFIXES)


def looks_like_torch_save(path: str) -> bool:
    """Whether ``path`` is a ``*.pt`` / ``*.pth`` / ``*.bin`` file, a ``*.bin.index.json``, or a
    directory with Hugging Face's ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``."""
    if looks_like_file(path):
        return True
    try:
        names = storage.listdir(path)
    except OSError as e:
        return not_there(path, "a torch.save checkpoint", e)
    found = {n.rstrip("/").rsplit("/", 1)[-1] for n in names}
    return SINGLE_NAME in found or INDEX_NAME in found


def _refusal(path: str, e: Exception) -> CorruptCheckpointError:
    text = str(e)
    m = _GLOBAL.search(text)
    if m:
        found = f"its pickle names {m.group(1)}"
    else:
        after = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        found = f"torch's weights-only unpickler: {after[0][:200] if after else text[:200]}"
    return CorruptCheckpointError(
        f"{path}: holds objects other than tensors and plain containers ({found}), which "
        "anyshard will not unpickle (unpickling them runs code the file chooses); if you trust "
        "the file, load it with torch and save its tensors as safetensors or with anyshard.save"
    )


def _kind(head: bytes) -> str:
    """``"zip"`` (torch.save since 1.6), ``"legacy"`` (a pickle of torch's magic number first),
    or ``""``."""
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head[:1] == b"\x80" and head[2:4] == b"\x8a\x0a" and head[4:14] == _LEGACY_MAGIC:
        return "legacy"
    return ""


def load_weights_only(path: str, *, what: str = "torch.save file") -> tuple[Any, bool]:
    """The object in the torch.save file ``path``, loaded with ``weights_only=True``; and
    whether its tensors are memory-mapped (a local file in the zip format)."""
    remote = storage.is_url(path)
    local = path[len("file://") :] if path.startswith("file://") else path
    if remote:
        data = storage.read_bytes(path)  # FileNotFoundError when missing
        head = data[:16]
    else:
        with open(local, "rb") as f:
            head = f.read(16)
    kind = _kind(head)
    if not kind:
        raise CorruptCheckpointError(
            f"{path}: not a {what} (neither torch.save's zip format nor its legacy one)"
        )
    if kind == "legacy" and not remote:
        warnings.warn(
            f"{path}: a torch.save file in the legacy (pre-1.6, non-zip) format, which cannot be "
            "memory-mapped; it is read whole into memory",
            stacklevel=3,
        )
    try:
        if remote:
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), False
        if kind == "zip":
            return torch.load(local, weights_only=True, mmap=True, map_location="cpu"), True
        return torch.load(local, weights_only=True, map_location="cpu"), False
    except Exception as e:
        if type(e).__name__ == "UnpicklingError" and "Weights only load failed" in str(e):
            raise _refusal(path, e) from None
        raise CorruptCheckpointError(
            f"{path}: not a readable {what} ({type(e).__name__}: {str(e)[:300]})"
        ) from None


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """The flattened content of one torch.save file."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    skipped: dict[str, str]  # name -> why it is not exposed
    mapped: bool

    @classmethod
    def flatten(cls, obj: Any, stem: str, where: str, mapped: bool) -> LoadedFile:
        out = cls({}, {}, {}, mapped)
        if isinstance(obj, (dict, list, tuple)):  # the top level is walked always
            out._walk(obj, "", where)
        else:
            out._leaf(stem, obj, where)
        return out

    def _walk(self, node: Any, prefix: str, where: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            fqn = f"{prefix}.{key}" if prefix else str(key)
            if (
                isinstance(value, dict)
                and value
                and (has_tensor(value) or not is_json_value(value))
            ):
                self._walk(value, fqn, where)
            elif isinstance(value, (list, tuple)) and has_tensor(value):
                self._walk(value, fqn, where)
            else:
                self._leaf(fqn, value, where)

    def _leaf(self, fqn: str, value: Any, where: str) -> None:
        if fqn in self.tensors or fqn in self.values or fqn in self.skipped:
            raise CorruptCheckpointError(
                f"{where}: two entries flatten to the same name {fqn!r} (a key containing '.' "
                "next to a nested dict)"
            )
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                self.skipped[fqn] = f"a {value.layout} tensor (only dense tensors are read)"
            elif value.dtype not in DTYPE_TO_ST:
                self.skipped[fqn] = (
                    f"a tensor of dtype {value.dtype}, which anyshard does not store"
                )
            else:
                self.tensors[fqn] = value
        elif is_json_value(value):
            self.values[fqn] = json_roundtrip(value)
        else:
            self.skipped[fqn] = f"a {type(value).__qualname__}, neither a tensor nor a JSON value"


def _stem(file: str) -> str:
    name = file.rsplit("/", 1)[-1]
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


@dataclass(frozen=True, slots=True)
class _Entry:
    shape: tuple[int, ...]
    torch_dtype: torch.dtype
    file: str

    @property
    def dtype(self) -> str:
        """The safetensors dtype code, as anyshard's tensor entries give it."""
        return DTYPE_TO_ST[self.torch_dtype]


class TorchSaveView(BaseView):
    """Read-only view of ``torch.save`` files (same methods as `CheckpointView`).

    >>> import torch, tempfile, anyshard
    >>> from anyshard.loaders.torchsave import TorchSaveView
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"model": {"emb": torch.arange(12.0).reshape(4, 3)}, "step": 7}, d + "/ckpt.pt")
    >>> with TorchSaveView(d + "/ckpt.pt") as ckpt:
    ...     print(ckpt.format, ckpt.keys(), ckpt.get_slice("model.emb")[1:3, 0], ckpt.get_value("step"))
    torch-save ['model.emb'] tensor([3., 6.]) 7
    """

    format = FORMAT

    def __init__(self, path: str):
        self.path = path
        self.index: dict[str, Any] | None = None  # the index document, when there is one
        self.index_name = ""
        self._root, self._files, self._weight_map = self._find(path)
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedFile] = {}
        if self._weight_map is None:
            self._load(self._files[0])  # its names; and a refused file fails here

    # --- finding and loading the files ------------------------------------------------------

    def _find(self, path: str) -> tuple[str, list[str], dict[str, str] | None]:
        if path.endswith(_INDEX_SUFFIXES):
            root, name = split_path(path)
            return (root, *self._read_index(root, name))
        if path.endswith(_SUFFIXES):
            if not storage.exists(path):
                raise CheckpointNotFoundError(f"{path}: no such torch.save file")
            root, name = split_path(path)
            return root, [name], None
        try:
            names = {n.rstrip("/").rsplit("/", 1)[-1] for n in storage.listdir(path)}
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint directory") from None
        except (OSError, StorageError) as e:
            raise CheckpointNotFoundError(f"{path}: not a checkpoint directory ({e})") from None
        if INDEX_NAME in names:
            return (path, *self._read_index(path, INDEX_NAME))
        if SINGLE_NAME in names:
            return path, [SINGLE_NAME], None
        raise CheckpointNotFoundError(
            f"{path}: no {INDEX_NAME} and no {SINGLE_NAME}; open a torch.save file by its path"
        )

    def _read_index(self, root: str, name: str) -> tuple[list[str], dict[str, str]]:
        where = storage.join(root, name) if root else name
        try:
            doc = strict_json.loads(storage.read_bytes(where))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where}: no such index file") from None
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise CorruptCheckpointError(
                f'{where}: expected an object with a "weight_map" of tensor name -> file name'
            )
        files: list[str] = []
        for tensor, file in weight_map.items():
            check_file_name(file, f"{where} (tensor {tensor!r})")
            if file not in files:
                files.append(file)
        self.index, self.index_name = doc, name
        return sorted(files), dict(weight_map)

    def _file_path(self, file: str) -> str:
        return storage.join(self._root, *file.split("/")) if self._root else file

    def _load(self, file: str) -> LoadedFile:
        with self._lock:
            got = self._loaded.get(file)
        if got is not None:
            return got
        path = self._file_path(file)
        try:
            obj, mapped = load_weights_only(path)
        except FileNotFoundError:
            by = f", which {self.index_name} lists" if self._weight_map is not None else ""
            raise CorruptCheckpointError(f"{path}: missing{by}") from None
        got = LoadedFile.flatten(obj, _stem(file), path, mapped)
        with self._lock:
            if not mapped:  # a file in memory: keep one at a time
                for f in [f for f, v in self._loaded.items() if not v.mapped]:
                    del self._loaded[f]
            self._loaded[file] = got
        return got

    def _all(self) -> list[LoadedFile]:
        return [self._load(f) for f in self._files]

    # --- the view ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._loaded.clear()  # drops the mappings

    def keys(self) -> list[str]:
        """Names of the tensors (an index's ``weight_map`` order, or the file's)."""
        if self._weight_map is not None:
            return list(self._weight_map)
        return list(self._load(self._files[0]).tensors)

    def value_keys(self) -> list[str]:
        """Names of the JSON values (for a sharded checkpoint, every file is opened)."""
        return [k for f in self._all() for k in f.values]

    def get_value(self, name: str) -> Any:
        for f in self._all():
            if name in f.values:
                return f.values[name]
        raise KeyError(f"{self.path}: no JSON value named {name!r}")

    @property
    def values(self) -> dict[str, Any]:
        return {k: v for f in self._all() for k, v in f.values.items()}

    @property
    def memory_mapped(self) -> bool:
        """Whether every file opened so far is memory-mapped (local, zip format)."""
        with self._lock:
            return all(f.mapped for f in self._loaded.values())

    @property
    def skipped(self) -> dict[str, str]:
        """Entries that load but are neither tensors nor JSON values, with the reason."""
        return {k: v for f in self._all() for k, v in f.skipped.items()}

    def _tensor(self, name: str) -> tuple[str, torch.Tensor]:
        if self._weight_map is not None:
            file = self._weight_map.get(name)
            if file is None:
                raise KeyError(f"{self.path}: no tensor named {name!r}")
        else:
            file = self._files[0]
        t = self._load(file).tensors.get(name)
        if t is None:
            if self._weight_map is not None:
                raise CorruptCheckpointError(
                    f"{self._file_path(file)}: holds no tensor {name!r}, which "
                    f"{self.index_name} places there"
                )
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return file, t

    def _entry(self, name: str) -> _Entry:
        file, t = self._tensor(name)
        return _Entry(tuple(t.shape), t.dtype, file)

    def metadata(self, name: str) -> HFTensorMetadata:
        e = self._entry(name)
        return HFTensorMetadata(name, e.shape, e.torch_dtype, e.file)

    def read_region(self, name: str, box: Box, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` of tensor ``name``; of a mapped file, only its pages are read."""
        _, t = self._tensor(name)
        box = checked_region(name, box, tuple(t.shape))
        src = t[tuple(slice(lo, hi) for lo, hi in box)]
        dest = torch.empty(box_shape(box), dtype=t.dtype) if out is None else out
        return dest.copy_(src)
