"""External programs some tests run (docker-compose, promtool): found on PATH, or the test is
skipped, unless the environment variable CI sets for it says the program must be there."""

from __future__ import annotations

import os
import shutil

import pytest


def required_tool(name: str, env: str, install: str) -> str:
    """The path of program ``name``; skips the test when it is absent, or fails it when
    ``env`` is set (``.ci/run`` sets it); ``install`` says how to get it."""
    exe = shutil.which(name)
    if exe is None:
        if os.environ.get(env):
            pytest.fail(f"{name} not installed ({install}), but {env} requires it", pytrace=False)
        pytest.skip(f"{name} not installed")
    return exe
