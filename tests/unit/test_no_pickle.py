"""anyshard never unpickles: loading a checkpoint cannot run code from it.

Two checks: save / load / open run with every pickle entry point made to raise, and a scan of
the source finds no pickle import, no ``torch.load`` without ``weights_only=True``, and no
``torch.distributed`` object collective (they pickle).

Run: python -m pytest tests/unit/test_no_pickle.py -q
"""

from __future__ import annotations

import ast
import pathlib
import pickle

import pytest
import torch
import torch.serialization

import anyshard
import anyshard.loaders.dcp  # noqa: F401  (its Unpickler subclass is made before any test patches pickle)

PACKAGE = pathlib.Path(anyshard.__file__).parent
PICKLE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "joblib",
    "shelve",
    "marshal",
}
OBJECT_COLLECTIVES = {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
}


class PickleUsed(AssertionError):
    pass


@pytest.fixture
def pickle_forbidden(monkeypatch):
    def refuse(*args, **kwargs):
        raise PickleUsed("anyshard must not pickle or unpickle")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    for name in ("loads", "load", "dumps", "dump"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(pickle, "Pickler", RefusingUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    monkeypatch.setattr(torch, "save", refuse)


def test_the_pickle_guard_itself_trips(pickle_forbidden):
    # These calls hit the guard, not pickle: that is what this test shows.
    with pytest.raises(PickleUsed):
        pickle.loads(b"")  # noqa: S301
    with pytest.raises(PickleUsed):
        pickle.Unpickler(None)  # noqa: S301
    with pytest.raises(PickleUsed):
        torch.load("x")


def test_save_load_and_open_run_with_pickle_disabled(tmp_path, pickle_forbidden):
    path = str(tmp_path / "step-1")
    w = torch.randn(4, 3)
    state = {
        "model": {"w": w, "b": torch.arange(3).to(torch.bfloat16)},
        "optim": {
            "state": {"0": {"step": torch.tensor(1.0)}},
            "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}],
        },
        "extra": ({"epoch": 2}, [1, 2]),
    }
    anyshard.save(path, state)
    dest = {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": {"state": {"0": {"step": torch.tensor(0.0)}}, "param_groups": []},
        "extra": None,
    }
    anyshard.load(path, dest)
    assert torch.equal(dest["model"]["w"], w)
    assert dest["optim"]["param_groups"] == [{"lr": 0.1, "betas": [0.9, 0.99]}]
    # JSON has no tuples: a JSON value comes back as lists (a tuple destination keeps its type).
    assert dest["extra"] == [{"epoch": 2}, [1, 2]]
    with anyshard.open(path) as view:
        assert torch.equal(view.get_slice("model.w")[1:3], w[1:3])


# --- source scan ---------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _weights_only(call: ast.Call) -> bool:
    return any(
        kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in call.keywords
    )


def pickle_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every place ``source`` imports a pickle module, unpickles through torch, or pickles
    through a collective; as ``file:line: what``."""
    tree = ast.parse(source, filename)
    torch_loads = {"torch.load", "torch.serialization.load"}
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in PICKLE_MODULES:
                report(node, f"from {module} import ...")
            for alias in node.names:
                if f"{module}.{alias.name}" in torch_loads:
                    torch_loads.add(alias.asname or alias.name)
                if alias.name in OBJECT_COLLECTIVES:
                    report(node, f"import of {alias.name} (it pickles)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in torch_loads and not _weights_only(node):
                report(node, f"{name}(...) without weights_only=True")
            if name.rsplit(".", 1)[-1] in OBJECT_COLLECTIVES:
                report(node, f"{name}(...) pickles its objects")
            if any(
                kw.arg == "allow_pickle"
                and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
                for kw in node.keywords
            ):
                report(node, f"{name}(..., allow_pickle=...)")
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_source_scan_covers_the_whole_package():
    names = {p.relative_to(PACKAGE).as_posix() for p in SOURCES}
    assert {
        "api/save.py",
        "api/load.py",
        "api/views.py",
        "api/collectives.py",
        "format/datafile.py",
        "reshard/executor.py",
    } <= names


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "import _pickle",
        "import cloudpickle",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "from torch import load\nload(f)",
        "from torch import load as tl\ntl(f)",
        "torch.serialization.load(f)",
        "import torch.distributed as dist\ndist.broadcast_object_list(x)",
        "from torch.distributed import all_gather_object",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
    ],
)
def test_source_scan_finds_each_way_to_unpickle(source):
    assert pickle_uses(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import json\njson.loads(s)",
        "import numpy as np\nnp.load(f)",
    ],
)
def test_source_scan_accepts_safe_loads(source):
    assert pickle_uses(source) == []


# The one exception, reviewed: PyTorch DCP's metadata *is* a pickle. Its reader subclasses
# pickle.Unpickler with a find_class that admits only DCP's metadata classes and torch's Size,
# dtypes and layouts (so a crafted file builds nothing else and runs no code; tested in
# tests/dist/test_dcp_interop.py and below). It may import pickle for that, and nothing else.
ALLOWED = {"anyshard/loaders/dcp.py": ["import pickle"]}


def test_no_module_of_anyshard_imports_pickle_or_unpickles():
    found = [
        use
        for path in SOURCES
        for use in pickle_uses(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    allowed = [f"{f}:" for f in ALLOWED]
    unexpected = [u for u in found if not any(u.startswith(a) for a in allowed)]
    assert unexpected == []
    for file, uses in ALLOWED.items():
        mine = [u.split(": ", 1)[1] for u in found if u.startswith(f"{file}:")]
        assert mine == uses, (file, mine)


def test_the_dcp_metadata_unpickler_builds_only_allowlisted_classes(tmp_path):
    import collections
    import os

    from anyshard.errors import CorruptCheckpointError
    from anyshard.loaders.dcp import DCPCheckpointView

    for i, evil in enumerate([os.system, eval, collections.Counter, pathlib.Path.unlink]):
        d = tmp_path / f"c{i}"
        d.mkdir()
        (d / ".metadata").write_bytes(pickle.dumps(evil))
        with pytest.raises(CorruptCheckpointError, match="refusing to load it"):
            DCPCheckpointView(str(d))
