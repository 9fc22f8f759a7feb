"""Ctrl-C stops a command even when it was started with SIGINT ignored (a shell's background
job, some supervisors): Python keeps an ignored SIGINT as it finds it, and `lag --watch` ran on
after the signal."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.support.cli import Output, start_cli
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
        Output(proc.stdout).wait_for("logical replication slots")  # it is watching
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
