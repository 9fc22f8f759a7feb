"""Ctrl-C stops a command even when it was started with SIGINT ignored (a shell's background
job, some supervisors): Python keeps an ignored SIGINT as it finds it, and `lag --watch` ran on
after the signal."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.support.cli import start_cli
from tests.support.harness import Database

pytestmark = pytest.mark.server


def test_lag_watch_stops_on_sigint_though_started_with_it_ignored(db: Database) -> None:
    proc = start_cli(
        *("lag", "--dsn", db.dsn, "--watch"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        seen = ""
        while "logical replication slots" not in seen:  # it is watching
            assert time.monotonic() < deadline, seen
            line = proc.stdout.readline()
            assert line, f"lag ended before watching: {seen}"
            seen += line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
