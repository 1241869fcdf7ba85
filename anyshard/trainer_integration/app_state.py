"""The app state a `Checkpointer` saves and restores: names mapped to objects with
``state_dict()`` and ``load_state_dict()``, to dicts of tensors and JSON values, or to plain JSON
values; their state dicts taken for a save, and what a restore loaded written back."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from anyshard.api.state import is_json_value


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def is_plain(obj: Any) -> bool:
    """A JSON value other than a dict (``5``, ``"x"``, ``[0.1, 0.2]``): saved as one value, and
    restored by writing the stored value into the app state's entry."""
    return not isinstance(obj, dict) and not is_stateful(obj) and is_json_value(obj)


def check_app_state(app_state: Mapping[str, Any]) -> None:
    bad = sorted(
        f"{name!r} ({type(obj).__name__})"
        for name, obj in app_state.items()
        if not (is_stateful(obj) or isinstance(obj, dict) or is_json_value(obj))
    )
    if bad:
        raise TypeError(
            f"app_state values must have state_dict()/load_state_dict(), be dicts, or be JSON "
            f"values (numbers, strings, bools, None, and lists and dicts of them); got "
            f"{', '.join(bad)}; wrap them in a class with those two methods"
        )


def state_dicts(app_state: Mapping[str, Any]) -> dict[str, Any]:
    check_app_state(app_state)
    return {name: obj.state_dict() if is_stateful(obj) else obj for name, obj in app_state.items()}


def check_restorable(app_state: Mapping[str, Any]) -> None:
    """A restore writes plain values into ``app_state``: it must be mutable if it holds any."""
    check_app_state(app_state)
    plain = sorted(n for n, obj in app_state.items() if is_plain(obj))
    if plain and not isinstance(app_state, MutableMapping):
        raise TypeError(
            f"app_state holds the JSON values {plain}, which a restore writes into app_state; "
            f"pass a dict (got a {type(app_state).__name__})"
        )


def write_back(app_state: Mapping[str, Any], state: dict[str, Any]) -> None:
    """Give each entry of ``app_state`` what a restore loaded into ``state`` (its state dicts):
    ``load_state_dict`` for a Stateful, in place for dicts and lists, else a new value."""
    for name, obj in list(app_state.items()):
        loaded = state[name]
        if is_stateful(obj):
            obj.load_state_dict(loaded)
        elif loaded is obj:  # filled in place
            continue
        elif isinstance(obj, dict) and isinstance(loaded, dict):  # loaded as one JSON value
            obj.clear()
            obj.update(loaded)
        elif isinstance(obj, list) and isinstance(loaded, list):
            obj[:] = loaded
        else:
            assert isinstance(app_state, MutableMapping)  # checked before the restore
            app_state[name] = loaded
