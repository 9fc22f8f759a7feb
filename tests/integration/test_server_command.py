"""``ledger-cdc server``: a throwaway PostgreSQL with the ledger initialised, its DSN printed
for a script to read, gone (server and data) after SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.support.cli import Output, start_cli

pytestmark = pytest.mark.server


def test_server_prints_a_dsn_to_an_initialised_ledger_and_cleans_up() -> None:
    proc = start_cli(
        "server",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        assert proc.stdout is not None
        out = Output(proc.stdout)
        out.wait_for("export LEDGER_CDC_DSN=", timeout=120)
        text = out.text
        dsn = re.search(r"^export LEDGER_CDC_DSN='(.+)'$", text, re.M).group(1)  # type: ignore[union-attr]
        datadir = Path(re.search(r"data in\s+(\S+)", text).group(1))  # type: ignore[union-attr]
        assert datadir.is_dir()
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass('agent_events')::text").fetchone() == (
                "agent_events",
            )
            assert conn.execute(
                "SELECT plugin FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
            ).fetchone() == ("pgoutput",)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert not datadir.exists()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=3).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
