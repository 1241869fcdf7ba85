"""UCL, the Universal Checkpoint Language.

Mapping expressions (`parse_mapping`) say how one shard derives from its logical tensor; specs
(`parse`) say how every local tensor of a model family maps to the logical tensors under a layout,
and `compile` evaluates a spec for one rank::

    >>> from anyshard import ucl
    >>> spec = ucl.parse('''
    ...     mesh tp;
    ...     param hidden, ffn;
    ...     "mlp.fc1.weight" -> fuse(0, "mlp.gate.weight" [ffn, hidden] : chunk(0, tp),
    ...                                  "mlp.up.weight" [ffn, hidden] : chunk(0, tp));
    ... ''')
    >>> local = ucl.compile(spec, {"tp": 2, "hidden": 4, "ffn": 6}, {"tp": 1})["mlp.fc1.weight"]
    >>> local.shape, [p.logical for p in local.parts]
    ((6, 4), ['mlp.gate.weight', 'mlp.up.weight'])
"""

from __future__ import annotations

from anyshard.errors import UCLError, UCLSemanticError, UCLSyntaxError
from anyshard.ucl.evaluate import Layout, LocalPart, LocalTensor, compile, layout_for
from anyshard.ucl.library import load_spec, parse, shipped_specs
from anyshard.ucl.mapping import Mapping, parse_mapping
from anyshard.ucl.syntax import Spec

__all__ = [
    "Layout",
    "LocalPart",
    "LocalTensor",
    "Mapping",
    "Spec",
    "UCLError",
    "UCLSemanticError",
    "UCLSyntaxError",
    "compile",
    "layout_for",
    "load_spec",
    "parse",
    "parse_mapping",
    "save_local_states",
    "shipped_specs",
]


def save_local_states(path: str, states, *, spec, layout) -> None:
    """Write a checkpoint for a whole layout from one process (see `anyshard.api.save`)."""
    from anyshard.api.save import save_local_states as impl

    impl(path, states, spec=spec, layout=layout)
