"""The package keeps one straight order of layers, and no module imports itself round a circle.

geometry < ucl < format < reshard < api < loaders, trainer_integration < cli: the import-linter
contract in pyproject.toml says it, with a second one that keeps the planning room free of the
trainer and of torch; `lint-imports` checks both (docs/design.md, "The layers").

Run: python -m pytest tests/unit/test_layers.py -q
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_layers_contract_is_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    proc = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout


def test_no_module_of_anyshard_imports_itself_round_a_circle():
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph("anyshard", cache_dir=None)
    circles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            path = graph.find_shortest_chain(importer=imported, imported=module)
            if path is not None:
                circles.append(" -> ".join((module, *path)))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles))[:20])
