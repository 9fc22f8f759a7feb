"""The ``ledger-cdc`` command line as a child process, started one way by every test: the
interpreter running the tests, ``-m ledger_cdc``, from the repository's root (so the source tree
is what runs). Tests that need the command in this process use ``cdc.run_cli`` instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def cli_argv(*args: str) -> list[str]:
    """The argv of ``ledger-cdc ARGS``."""
    return [sys.executable, "-m", "ledger_cdc", *args]


def run_cli_process(*args: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``ledger-cdc ARGS`` run to its end, its output captured as text; ``kw`` goes to
    ``subprocess.run`` (``env``, ``cwd``, ``check``, …)."""
    kw.setdefault("cwd", ROOT)
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, **kw)


def start_cli(*args: str, **kw: Any) -> subprocess.Popen[Any]:
    """``ledger-cdc ARGS`` started; ``kw`` goes to ``subprocess.Popen`` (pipes, ``env``, …)."""
    kw.setdefault("cwd", ROOT)
    return subprocess.Popen(cli_argv(*args), **kw)
