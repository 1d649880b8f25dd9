"""A command's main() run in the test's own process, its output captured:
for the steps of a test whose process start-up is not what it tests (the
exit status, stderr and no-traceback behaviour of a real process are tested
by the commands the tests still start as processes)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path
from typing import Callable


def run_main(main: Callable[[list[str]], int], args: list[str], *, cwd: Path) -> subprocess.CompletedProcess:
    """main(args) from directory cwd, as a CompletedProcess (returncode, stdout, stderr)."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
