"""Flattening nested state dicts into ``fqn -> leaf`` and writing leaves back in place."""

from __future__ import annotations

import json
from typing import Any

import torch

from anyshard.errors import AnyshardError

__all__ = [
    "Leaf",
    "copy_containers",
    "flatten_state",
    "has_tensor",
    "is_json_value",
    "json_roundtrip",
]

_SCALARS = (type(None), bool, int, float, str)
# what `copy_containers` keeps as it is without a call: the scalars, and the tensor types met so
# far (a subclass such as DTensor joins the first time it is met)
_KEPT: set[type] = {*_SCALARS, torch.Tensor, torch.nn.Parameter}


class Leaf:
    """A leaf of a state dict: its value, and the container slot to write a loaded value to.

    ``owner`` is the leaf-like slot that holds ``container`` when ``container`` is a tuple:
    a tuple cannot be assigned into, so a loaded value rebuilds it and writes it there.
    """

    __slots__ = ("container", "key", "owner", "value")

    def __init__(self, container: Any, key: Any, value: Any, owner: Leaf | None = None):
        self.container, self.key, self.value, self.owner = container, key, value, owner

    def _current_container(self) -> Any:
        return self.container if self.owner is None else self.owner.get()

    def get(self) -> Any:
        return self._current_container()[self.key]

    def replace(self, value: Any) -> None:
        if isinstance(self.value, tuple) and isinstance(value, list):
            value = tuple(value)
        container = self._current_container()
        if not isinstance(container, tuple):
            container[self.key] = value
            return
        if self.owner is None:
            raise AnyshardError(
                f"cannot write the loaded value at index {self.key} into the top-level tuple of the "
                "state dict; pass a dict (or a list) instead"
            )
        items = list(container)
        items[self.key] = value
        rebuilt = (
            type(container)(*items) if hasattr(container, "_fields") else type(container)(items)
        )
        self.owner.replace(rebuilt)


def has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v) for v in value)
    return False


def is_json_value(value: Any) -> bool:
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v) for k, v in value.items())
    return False


def flatten_state(state: Any, prefix: str = "") -> dict[str, Leaf]:
    """``{"model": {"w": t}, "optim": [...]}`` -> ``{"model.w": Leaf, "optim.0": Leaf, ...}``.

    Dicts are walked always; lists and tuples only where they hold tensors, otherwise they
    are one JSON value. Two paths that flatten to the same name are an error.
    """
    out: dict[str, Leaf] = {}
    _flatten_into(out, state, prefix, None)
    return out


def _flatten_into(out: dict[str, Leaf], node: Any, prefix: str, owner: Leaf | None) -> None:
    if isinstance(node, dict):
        keys: Any = node.keys()
    elif isinstance(node, (list, tuple)):
        keys = range(len(node))
    else:
        raise AnyshardError(f"state must be a dict, got {type(node).__name__}")
    # Only a tuple child needs its slot: loading rebuilds the tuple and writes it there.
    holder = owner if isinstance(node, tuple) else None
    for key in keys:
        value = node[key]
        name = key if type(key) is str else str(key)
        fqn = f"{prefix}.{name}" if prefix else name
        slot = Leaf(node, key, value, holder)
        # the common leaves first: tensors and plain scalars
        if not (isinstance(value, torch.Tensor) or type(value) in _SCALARS):
            if (
                isinstance(value, dict)
                and value
                and (has_tensor(value) or not is_json_value(value))
            ):
                _flatten_into(out, value, fqn, slot)
                continue
            if isinstance(value, (list, tuple)) and has_tensor(value):
                _flatten_into(out, value, fqn, slot)
                continue
            if not is_json_value(value):
                raise AnyshardError(
                    f"{fqn}: a value of type {type(value).__qualname__} cannot be stored; anyshard "
                    "stores tensors and JSON values (numbers, strings, lists, dicts) and never "
                    "pickles. Convert it to one of those (e.g. a tensor or a dict) before saving"
                )
        if fqn in out:
            raise AnyshardError(
                f"two entries of the state dict flatten to the same name {fqn!r} "
                "(a key containing '.' next to a nested dict); rename one of them"
            )
        out[fqn] = slot


def copy_containers(node: Any) -> Any:
    """``node`` with its dicts and lists copied, to any depth, and everything else (tensors,
    scalars, other objects) as it is: a snapshot of a state dict's structure and plain values
    that later changes to the caller's containers do not reach, for a fraction of what
    flattening costs. Tuples are kept unless they hold a dict or a list; dict subclasses become
    plain dicts.

    >>> state = {"model": {"w": 1}, "lrs": [0.1, 0.2]}
    >>> snap = copy_containers(state)
    >>> state["lrs"][0] = 9.0; state["model"]["w"] = 2
    >>> snap
    {'model': {'w': 1}, 'lrs': [0.1, 0.2]}
    """
    kept = _KEPT
    if type(node) is tuple and kept.issuperset(map(type, node)):
        return node  # the common tuple: scalars (Adam's betas)
    if isinstance(node, dict):
        if kept.issuperset(map(type, node.values())):  # nothing to copy below it
            return dict(node)
        return {k: v if type(v) in kept else copy_containers(v) for k, v in node.items()}
    if isinstance(node, list):
        if kept.issuperset(map(type, node)):
            return list(node)
        return [v if type(v) in kept else copy_containers(v) for v in node]
    if isinstance(node, tuple) and any(isinstance(v, (dict, list, tuple)) for v in node):
        items = [copy_containers(v) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    if isinstance(node, torch.Tensor):
        kept.add(type(node))
    return node


def json_roundtrip(value: Any) -> Any:
    """``value`` as JSON reads it back: a snapshot that later changes to ``value`` do not
    reach (tuples become lists). Plain scalars are immutable and come back equal: returned as
    they are, so that a save does not run the encoder for every hyperparameter."""
    if type(value) in _SCALARS:
        return value
    return json.loads(json.dumps(value))
