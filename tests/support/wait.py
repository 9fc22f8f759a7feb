"""Waiting on a condition, never on a fixed sleep: one helper for every test."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(
    pred: Callable[[], bool],
    timeout: float = 30.0,
    every: float = 0.05,
    what: str | Callable[[], str] = "condition",
) -> None:
    """Return once ``pred()`` is true; fail the test if it is not within ``timeout`` seconds,
    naming ``what`` was awaited (a callable is asked only then, e.g. for a log's last lines).
    ``pred`` may itself raise, to fail at once (a process it waits on has died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    told = what() if callable(what) else what
    raise AssertionError(f"{told}: not met within {timeout}s")
