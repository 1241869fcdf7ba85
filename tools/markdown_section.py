"""The tools not yet on the harness import these from here; they live in tools/harness.py."""

from harness import replace_section, rerun_command  # noqa: F401
