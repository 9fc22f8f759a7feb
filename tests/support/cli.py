"""The ``ledger-cdc`` command line as a child process, started one way by every test: the
interpreter running the tests, ``-m ledger_cdc``, from the repository's root (so the source tree
is what runs). Tests that need the command in this process use ``cdc.run_cli`` instead."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tests.support.wait import until

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


class Output:
    """A child's text output, read line by line in a thread from its start: a test waits for a
    line with a deadline (the child has got that far) instead of sleeping."""

    def __init__(self, stream: Iterable[str]) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: Iterable[str]) -> None:
        for line in stream:
            self.lines.append(line)
        self.ended = True

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, part: str, timeout: float = 60) -> None:
        """Until a line holds ``part``; fails with the output so far, at once if it has ended."""
        self._until(lambda: any(part in line for line in list(self.lines)), repr(part), timeout)

    def wait_lines(self, n: int, timeout: float = 60) -> None:
        """Until ``n`` lines have been read."""
        self._until(lambda: len(self.lines) >= n, f"{n} lines", timeout)

    def _until(self, seen: Callable[[], bool], what: str, timeout: float) -> None:
        def met() -> bool:
            ended = self.ended  # (read first: lines read before the end are all in by then)
            if seen():
                return True
            assert not ended, f"the output ended without {what}:\n{self.text[-3000:]}"
            return False

        until(met, timeout, what=lambda: f"{what} in the output:\n{self.text[-3000:]}")

    def close(self, timeout: float = 60) -> str:
        """The whole output, once the child has closed it."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the output was not closed"
        return self.text
