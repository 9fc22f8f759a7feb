"""Connect timeouts: every connection this package makes gives up on a server that accepts but
never answers, after ``CONNECT_TIMEOUT`` seconds or the DSN's own ``connect_timeout``."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import ledger_cdc.conninfo as conninfo
from ledger_cdc.admin.schema import set_failover
from ledger_cdc.client.read import pending_runs
from ledger_cdc.client.tail import _omitted_event
from ledger_cdc.connect import connect, connect_timeout, merged_options
from ledger_cdc.conninfo import options_with, timeout_option
from ledger_cdc.errors import DatabaseUnavailable, LedgerError
from ledger_cdc.events import Rejected
from ledger_cdc.integrations.langgraph import LedgerSaver
from ledger_cdc.names import CONNECT_TIMEOUT
from ledger_cdc.sink.jetstream import WireEvent
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.stream import transport


@pytest.mark.parametrize(
    ("dsn", "want"),
    [
        ("host=127.0.0.1 dbname=ledger", {"connect_timeout": CONNECT_TIMEOUT}),
        ("postgresql://u@127.0.0.1/ledger", {"connect_timeout": CONNECT_TIMEOUT}),
        ("host=127.0.0.1 dbname=ledger connect_timeout=3", {}),
        ("postgresql://u@127.0.0.1/ledger?connect_timeout=3", {}),
        ("host='unterminated", {"connect_timeout": CONNECT_TIMEOUT}),  # the connect says why
    ],
)
def test_a_dsn_s_own_timeout_is_kept(dsn: str, want: dict[str, Any]) -> None:
    assert connect_timeout(dsn) == want
    # the replication connection reads the DSN with psycopg2's parser, to the same effect
    assert timeout_option(transport._given(dsn)) == want


def test_a_caller_s_timeout_is_the_default_it_gives() -> None:
    assert connect_timeout("host=127.0.0.1", 5) == {"connect_timeout": 5}
    assert connect_timeout("host=127.0.0.1 connect_timeout=2", 5) == {}


@pytest.mark.parametrize(
    ("dsn", "env", "want"),
    [
        ("host=127.0.0.1", None, "-c x=1"),
        ("host=127.0.0.1", "-c a=2", "-c a=2 -c x=1"),
        ("host=127.0.0.1 options='-c a=3'", "-c a=2", "-c a=3 -c x=1"),  # the DSN's win
        ("postgresql://u@127.0.0.1/l?options=-c%20a%3D4", None, "-c a=4 -c x=1"),
        ("host='unterminated", "-c a=2", "-c a=2 -c x=1"),  # (the connect says why)
    ],
)
def test_a_dsn_s_own_session_options_come_first(
    dsn: str, env: str | None, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv("PGOPTIONS", raising=False)
    else:
        monkeypatch.setenv("PGOPTIONS", env)
    assert merged_options(dsn, "-c x=1") == want
    assert options_with(transport._given(dsn), "-c x=1") == want  # psycopg2's parser


def test_the_replication_stream_loads_without_psycopg() -> None:
    """`consume` begins its stream (so the server decodes a backlog meanwhile) before it loads
    the rest: the command line and the stream's module must not pull psycopg in, which takes
    longer to load than everything before it."""
    code = (
        "import sys, ledger_cdc.cli, ledger_cdc.stream.transport; "
        "print(sorted(m for m in sys.modules if m == 'psycopg' or m.startswith('psycopg.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel completes the handshake) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def _fails_within(make: Callable[[], object], seconds: float) -> BaseException:
    """``make()`` raises within ``seconds`` (run on a thread: a hang fails the test, not the
    run)."""
    out: list[BaseException] = []

    def run() -> None:
        try:
            make()
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still connecting after {seconds}s"
    assert out, "connected to a server that never answers"
    assert time.monotonic() - started < seconds
    return out[0]


def test_the_sink_gives_up_on_a_server_that_never_answers(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The projections' connection had no timeout: a hung server hung the consumer for good.
    Now it fails as DatabaseUnavailable, which the consumer retries."""
    monkeypatch.setattr(conninfo, "CONNECT_TIMEOUT", 1)
    sink = PgSink(f"host=127.0.0.1 port={silent_port} dbname=x user=x", "agent_slot")
    err = _fails_within(lambda: sink.conn, 8)
    assert isinstance(err, DatabaseUnavailable), err


def test_a_dsn_s_timeout_is_not_overridden(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conninfo, "CONNECT_TIMEOUT", 60)
    dsn = f"host=127.0.0.1 port={silent_port} dbname=x user=x connect_timeout=1"
    err = _fails_within(lambda: connect(dsn), 8)
    assert isinstance(err, LedgerError), err


def test_the_other_connections_give_up_on_a_server_that_never_answers(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection a slot is dropped on (the CLI's and the consumer's: ``drop_slot`` takes
    it), changing a slot's failover (a connection of its own), waiting for runs, reading back an
    event published without its payload and the LangGraph saver's migration: each fails within
    the timeout instead of hanging."""
    monkeypatch.setattr(conninfo, "CONNECT_TIMEOUT", 1)
    dsn = f"host=127.0.0.1 port={silent_port} dbname=x user=x"

    err = _fails_within(lambda: connect(dsn, autocommit=True), 8)
    assert isinstance(err, LedgerError), err
    err = _fails_within(lambda: set_failover(dsn, "agent_slot"), 8)
    assert isinstance(err, LedgerError), err
    err = _fails_within(lambda: asyncio.run(anext(pending_runs(dsn))), 8)
    assert isinstance(err, psycopg.OperationalError), err
    err = _fails_within(lambda: LedgerSaver.from_dsn(dsn).setup(), 8)
    assert isinstance(err, (LedgerError, psycopg.OperationalError)), err

    w = WireEvent(
        1, uuid.uuid4(), 1, "a", "tool.observed", None, dt.datetime.now(dt.timezone.utc), omitted=9
    )
    got: list[object] = []

    def read_back() -> None:
        got.append(asyncio.run(_omitted_event(dsn, w)))
        raise RuntimeError("returned")  # (_fails_within wants a raise: the answer is in got)

    _fails_within(read_back, 8)
    assert isinstance(got[0], Rejected) and "cannot read it from agent_events" in got[0].reason
