"""Failover slots (PostgreSQL 17+): every path that creates the slot can make one, an existing
slot can be turned into one, the consumer reports whether its slot is ready to survive a
failover, and a stall of logical decoding by ``synchronized_standby_slots`` is named with its
fix. The promotion itself is tests/faults/test_failover.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.admin.health import failover_state
from ledger_cdc.admin.schema import create_slot, set_failover
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres, find_installations
from ledger_cdc.errors import ConfigError
from tests.support.cdc import InThread, until
from tests.support.harness import Database
from tests.support.schema import init_db

pytestmark = pytest.mark.server


def _failover(conn: psycopg.Connection[object], slot: str) -> bool:
    row = conn.execute(
        "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def _slot_name(db: Database, what: str) -> str:
    return f"{what}_{db.name}".lower()


def test_every_path_that_creates_the_slot_can_make_a_failover_slot(empty_db: Database) -> None:
    if empty_db.server.major < 17:
        with pytest.raises(ConfigError, match="PostgreSQL 17 or later"):
            init_db(empty_db.dsn, slot=_slot_name(empty_db, "i"), failover=True)
        with empty_db.connect() as conn:  # refused before anything changed
            assert conn.execute("SELECT to_regclass('agent_events')").fetchone() == (None,)
        return
    a, b, c = (_slot_name(empty_db, k) for k in ("i", "s", "c"))
    init_db(empty_db.dsn, slot=a, failover=True)
    with empty_db.connect() as conn:
        assert _failover(conn, a)
        assert create_slot(conn, b, failover=True)
        assert _failover(conn, b)
    sid = uuid.uuid4()
    with Ledger(empty_db.dsn) as ledger:
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
    with InThread(empty_db.dsn, slot=c, failover=True, precreate_slot=False) as consumer:
        until(lambda: consumer.metrics.events == 1, 60)
    with empty_db.connect() as conn:
        assert _failover(conn, c)
        for name in (a, b, c):
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def test_an_existing_slot_is_turned_into_a_failover_slot(db: Database) -> None:
    name = _slot_name(db, "x")
    with db.connect() as conn:
        create_slot(conn, name)
    try:
        if db.server.major < 17:
            with pytest.raises(ConfigError, match="PostgreSQL 17 or later"):
                set_failover(db.dsn, name)
            return
        assert set_failover(db.dsn, name) is True
        assert set_failover(db.dsn, name) is False  # already
        with db.connect() as conn:
            assert _failover(conn, name)
            ready, stall = failover_state(conn, name)  # no standby named: not ready
            assert (ready, stall) == (False, None)
        assert set_failover(db.dsn, name, on=False) is True
        with db.connect() as conn:
            assert not _failover(conn, name)
        with pytest.raises(ConfigError, match="does not exist"):
            set_failover(db.dsn, name + "_none")
    finally:
        with db.connect() as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


@pytest.fixture
def pg18() -> Iterator[EmbeddedPostgres]:
    """A cluster of its own: synchronized_standby_slots is the whole server's."""
    installs = [i for i in find_installations() if i.major >= 17]
    if not installs:
        pytest.skip("no PostgreSQL 17+ here")
    with EmbeddedPostgres(installs[0]) as pg:
        yield pg


def test_a_stall_by_synchronized_standby_slots_is_named_with_its_fix(
    pg18: EmbeddedPostgres,
) -> None:
    dsn = pg18.dsn()
    init_db(dsn, slot="agent_slot", failover=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_physical_replication_slot('standby_1')")
        conn.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby_1, gone_standby'")
        conn.execute("SELECT pg_reload_conf()")
        until(
            lambda: (
                "gone_standby" in str(conn.execute("SHOW synchronized_standby_slots").fetchone())
            ),
            30,
        )
        ready, stall = failover_state(conn, "agent_slot")
        assert not ready and stall is not None
        assert "gone_standby" in stall and "ALTER SYSTEM RESET synchronized_standby_slots" in stall
        conn.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby_1'")
        conn.execute("SELECT pg_reload_conf()")
        until(
            lambda: "gone" not in str(conn.execute("SHOW synchronized_standby_slots").fetchone()),
            30,
        )
        ready, stall = failover_state(conn, "agent_slot")  # named, but no standby connected
        assert not ready and stall is not None and "not connected" in stall


def test_the_command_line_makes_and_turns_failover_slots(empty_db: Database) -> None:
    from tests.support.cdc import assert_clean_exit, run_cli

    name = _slot_name(empty_db, "cli")
    r = run_cli("init", "--dsn", empty_db.dsn, "--create-slot", "--slot", name, "--failover")
    if empty_db.server.major < 17:
        assert_clean_exit(r, 4)
        assert "PostgreSQL 17 or later" in r.output
        return
    assert_clean_exit(r)
    try:
        with empty_db.connect() as conn:
            assert _failover(conn, name)
        r = run_cli("slot", "failover", name, "--off", "--dsn", empty_db.dsn)
        assert_clean_exit(r)
        assert "now an ordinary slot" in r.output
        r = run_cli("slot", "failover", name, "--dsn", empty_db.dsn)
        assert_clean_exit(r)
        assert "now a failover slot" in r.output
        with empty_db.connect() as conn:
            assert _failover(conn, name)
    finally:
        with empty_db.connect() as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
