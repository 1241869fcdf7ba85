"""Commands that other packages (or anyshard's own reference trainer, ``demo``) add to the CLI:
an entry point ``NAME = "module:main"`` in the group `COMMANDS_GROUP`, where ``main(argv) -> int``
parses its own options."""

from __future__ import annotations

import functools

COMMANDS_GROUP = "anyshard.commands"


@functools.cache  # the installed entry points: read once per process
def plugin_commands() -> dict[str, object]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


@functools.cache
def summary(module: str) -> str:
    """The first line of ``module``'s docstring, read without importing it."""
    import ast
    import importlib.util

    try:
        origin = importlib.util.find_spec(module).origin
        with open(origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, AttributeError, OSError, SyntaxError, ValueError):
        doc = ""
    return doc.strip().splitlines()[0].split(": ", 1)[-1].rstrip(".") if doc.strip() else module
