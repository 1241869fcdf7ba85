"""`anyshard ARGS` run in the test's process through the console script's function
(`anyshard.cli.main`), returning what a subprocess returns: the exit code, stdout and stderr.
It spares each call a new interpreter's start-up (about 3 s of importing torch on 2 cores); a few
tests per command family still run the installed console script in a subprocess."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from unittest import mock

from anyshard.cli import main


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    patched = mock.patch.dict(os.environ, env or {})
    with patched, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help (0), a usage error (2)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["anyshard", *args], code, out.getvalue(), err.getvalue())
