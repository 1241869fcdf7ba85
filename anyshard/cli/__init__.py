"""The ``anyshard`` command: inspect, verify, convert and diff checkpoints, list and clean
checkpoint roots, check and explain UCL specs.

Exit codes: 0 ok, 1 a problem or difference found (verify, diff), 2 bad usage or input (one
line on stderr), 3 an internal error: a bug in anyshard, printed with its traceback to report.
Run: ``anyshard --help``, ``anyshard ls /ckpt``.

The parser is built in `anyshard.cli.parser`, one function per subcommand; the commands run
from `inspecting` (inspect, verify), `converting` (convert, diff), `roots` (ls, gc) and
`ucl_commands`; `plugins` adds the commands other packages install.
"""

from __future__ import annotations

import sys

from anyshard.cli.parser import command_parser
from anyshard.cli.plugins import plugin_commands
from anyshard.cli.values import Usage
from anyshard.errors import AnyshardError

__all__ = ["main"]

INTERNAL_ERROR = 3
_BUILTIN = ("convert", "diff", "gc", "inspect", "ls", "ucl", "verify")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in _BUILTIN:
        plugin = plugin_commands().get(argv[0])
        if plugin is not None:  # its own options, --help included
            return plugin.load()(argv[1:])
    args = command_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. piped into `head`: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (AnyshardError, Usage) as e:
        print(f"anyshard {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception:  # not an input anyshard understood: a bug, shown in full
        import traceback

        traceback.print_exc()
        print(
            f"anyshard {args.command}: internal error (exit code {INTERNAL_ERROR}); the traceback "
            "above is a bug in anyshard: please report it with the command that raised it",
            file=sys.stderr,
        )
        return INTERNAL_ERROR
