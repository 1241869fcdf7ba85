"""The README's "Layout of the code" matches the tree: every path it names exists, and every
room of the house (each package of anyshard/, each folder of the trainer side, each tool) is named.

The block is read as it is written: a line that starts at the left margin names a path from the
repository's root (its first word); an indented line that starts with a word ending in ``/`` or
``.py`` names a path under the last top-level folder; file names in the descriptions
(``checkpointer.py``, ``heal.py``) are looked up under the folder that the line, or the line its
description continues, names.

Run: python -m pytest tests/unit/test_readme_layout.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_NAME = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w-]+)*(?:\.py\b|\.sh\b|/(?=[\s),:;]|$)))")


def _block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout of the code", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def _named() -> tuple[set[Path], list[str]]:
    """The paths the block names, and those of them that do not exist."""
    named: set[Path] = set()
    missing: list[str] = []
    top = ROOT
    for line in _block():
        if not line.strip():
            continue
        first = line.split()[0].rstrip(",")
        if not line.startswith(" "):
            for word in first.split(","):
                path = ROOT / word
                named.add(path)
                if not path.exists():
                    missing.append(f"{word} (line: {line.strip()[:60]})")
            top = ROOT / first if (ROOT / first).is_dir() else ROOT
            base = top
        elif first.endswith(("/", ".py")) and (top / first).exists():
            base = top / first if first.endswith("/") else top
            named.add(top / first)
        for name in FILE_NAME.findall(line):
            candidates = [base / name, top / name, ROOT / name]
            found = next((c for c in candidates if c.exists()), None)
            if found is None:
                missing.append(f"{name} (under {base.relative_to(ROOT)}/)")
            else:
                named.add(found)
    return named, missing


def _rooms() -> list[Path]:
    """What a newcomer must find in the layout: each package and top-level module of anyshard/,
    each folder and top-level module of the trainer side, each tool and each folder of tools/."""
    pkg = ROOT / "anyshard"
    rooms = [p for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    rooms += [pkg / "cli"] if (pkg / "cli").is_dir() else []
    side = pkg / "trainer_integration"
    rooms += [p for p in side.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    rooms += [p for p in side.glob("*.py") if p.name != "__init__.py"]
    gpt = side / "gpt"
    rooms += [p for p in gpt.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    tools = ROOT / "tools"
    rooms += [
        p for p in tools.iterdir() if p.suffix in (".py", ".sh") or (p / "__init__.py").exists()
    ]
    return sorted(set(rooms))


def test_every_path_the_layout_names_exists():
    _, missing = _named()
    assert not missing, "README's layout names paths that are not in the tree:\n" + "\n".join(
        missing
    )


def test_every_room_of_the_house_is_named_in_the_layout():
    named, _ = _named()
    unnamed = [str(room.relative_to(ROOT)) for room in _rooms() if room not in named]
    assert not unnamed, (
        "README's layout leaves out (add a line or a name in a description):\n" + "\n".join(unnamed)
    )
