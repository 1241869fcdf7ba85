"""Conventions the package keeps: every view answers the same interface, the package ships its
type information (``py.typed``) and a type check covers every module of the public API.

Run: python -m pytest tests/unit/test_conventions.py -q
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import anyshard
import anyshard.loaders
from anyshard.api.views import BaseView

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _views() -> list[type]:
    found, todo = [], [BaseView]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("anyshard."):
                found.append(sub)
    return sorted(set(found), key=lambda c: c.__qualname__)


@pytest.mark.parametrize("view", _views(), ids=lambda c: c.__name__)
def test_every_view_has_values_as_a_property(view):
    assert isinstance(inspect.getattr_static(view, "values"), property), view


def test_a_zarr_stores_values_read_back_as_a_dict(tmp_path):
    pytest.importorskip("tensorstore")
    values = {"step": 7, "cfg": {"lr": 0.1, "name": "x"}}
    anyshard.save(str(tmp_path / "ckpt"), {"w": torch.ones(2, 3), **values})
    with anyshard.open(str(tmp_path / "ckpt")) as view:
        anyshard.loaders.write_zarr(view, str(tmp_path / "zarr"))
    with anyshard.open(str(tmp_path / "zarr")) as z:
        assert type(z).__name__ == "ZarrView"
        assert z.values == values and z.value_keys() == sorted(values)


# --- type information ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_ships_py_typed():
    assert (ROOT / "anyshard" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["anyshard"]


def _public_objects():
    import anyshard.dcp
    import anyshard.trainer_integration

    for module in (anyshard, anyshard.ucl, anyshard.loaders, anyshard.dcp):
        for name in module.__all__:
            yield f"{module.__name__}.{name}", getattr(module, name)
    yield "anyshard.trainer_integration.Checkpointer", anyshard.trainer_integration.Checkpointer


def test_the_type_check_covers_every_module_of_the_public_api():
    """Each public name's defining module (and each package exporting one) is in the files
    that ``python -m mypy`` checks."""
    checked = [ROOT / f for f in _pyproject()["tool"]["mypy"]["files"]]

    def covered(path: Path) -> bool:
        return any(path == c or c in path.parents for c in checked)

    missing = set()
    for name, obj in _public_objects():
        where = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        if where is None:  # a plain value (__version__)
            continue
        module = sys.modules[where]
        if module.__name__.startswith("anyshard") and not covered(Path(module.__file__)):
            missing.add(f"{name} ({module.__name__})")
    for package in ("anyshard", "anyshard.ucl", "anyshard.loaders", "anyshard.dcp"):
        if not covered(Path(sys.modules[package].__file__)):
            missing.add(package)
    assert not missing, sorted(missing)


def test_ci_runs_the_type_check_then_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == "pip install -e '.[dev]' && python -m pytest"
    assert lines[-2] == "pip install -e '.[dev]' && python -m mypy"
    assert "python -m pytest" in (ROOT / "README.md").read_text()
    dev = _pyproject()["project"]["optional-dependencies"]["dev"]
    assert any(d.split(">")[0].split("=")[0] == "mypy" for d in dev)
