"""Waiting on a condition, never on a fixed sleep: one helper for every test."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(pred: Callable[[], bool], timeout: float = 30.0, every: float = 0.05) -> None:
    """Return once ``pred()`` is true; fail the test if it is not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")
