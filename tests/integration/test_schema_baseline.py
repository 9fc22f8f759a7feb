"""One baseline: a database initialised by the legacy numbered files (all of them, or only the
first few, with data in it) is brought by ``init`` to the very schema a fresh ``init`` makes —
tables, columns, constraints, indexes, function bodies and settings, triggers, views, grants
and role attributes, compared in the catalog — for an unpartitioned and a partitioned ledger."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger_cdc import Ledger
from ledger_cdc.admin.partitions import ensure
from ledger_cdc.admin.schema import (
    BASELINE,
    applied_migrations,
    load_legacy,
    load_migrations,
    migrate,
)
from tests.support.catalog import schema_catalog
from tests.support.harness import Database, Server, _new_database
from tests.support.schema import init_db

pytestmark = pytest.mark.server


@pytest.fixture
def legacy_db(server: Server) -> Iterator[Database]:
    """A second empty database, for the legacy schema."""
    yield from _new_database(server, None)


_LEGACY_PARTITIONED = Path(__file__).resolve().parents[1] / "data" / "legacy"


def _legacy(db: Database, upto: int, *, partitioned: bool = False) -> None:
    """The schema as the legacy files made it, up to version ``upto`` (and, partitioned, with
    the legacy partitioned files around them, as the legacy init ran them)."""
    with db.connect() as conn:
        if partitioned:
            conn.execute((_LEGACY_PARTITIONED / "partitioned_pre.sql").read_text().encode())
            conn.execute("INSERT INTO ledger_partitioning (unit) VALUES ('day')")
        migrate(conn, [m for m in load_legacy() if m.version <= upto])
        if partitioned:
            conn.execute((_LEGACY_PARTITIONED / "partitioned_post.sql").read_text().encode())
            ensure(conn, 3)
        conn.execute("CREATE PUBLICATION agent_pub FOR TABLE agent_events")


def _differences(a: Database, b: Database) -> dict[str, tuple[list[object], list[object]]]:
    with a.connect() as ca, b.connect() as cb:
        one, two = schema_catalog(ca), schema_catalog(cb)
    return {
        k: ([r for r in one[k] if r not in two[k]], [r for r in two[k] if r not in one[k]])
        for k in one
        if one[k] != two[k]
    }


@pytest.mark.parametrize("upto", [17, 7])
def test_a_legacy_database_is_brought_to_the_fresh_schema(
    empty_db: Database, legacy_db: Database, upto: int
) -> None:
    _legacy(legacy_db, upto)
    sid = uuid.uuid4()
    with Ledger(legacy_db.dsn) as ledger:  # history written under the legacy schema stays
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
    init_db(empty_db.dsn)
    res = init_db(legacy_db.dsn)
    later = [m.version for m in load_migrations() if m.version > BASELINE]
    assert res.applied == [*range(upto + 1, BASELINE), *later]
    assert _differences(empty_db, legacy_db) == {}
    with legacy_db.connect() as conn:
        assert applied_migrations(conn).keys() == {BASELINE, *later}
        assert conn.execute("SELECT count(*) FROM agent_events").fetchone() == (1,)
    with Ledger(legacy_db.dsn) as ledger:
        assert ledger.append(sid, "a", "tool.observed", {"call_id": "c", "result": 1}).position == 2
    assert init_db(legacy_db.dsn).applied == []  # and stays so
    assert _differences(empty_db, legacy_db) == {}


def test_a_legacy_partitioned_database_is_brought_to_the_fresh_schema(
    empty_db: Database, legacy_db: Database
) -> None:
    _legacy(legacy_db, 17, partitioned=True)
    init_db(empty_db.dsn, partition_by="day")
    init_db(legacy_db.dsn, partition_by="day")
    assert _differences(empty_db, legacy_db) == {}
    with legacy_db.connect() as conn:
        (fn,) = conn.execute(  # type: ignore[misc]
            "SELECT tgfoid::regproc::text FROM pg_trigger WHERE tgrelid = 'agent_events'::regclass "
            "AND tgname = 'agent_events_before_insert'"
        ).fetchone()
    assert fn == "ledger_before_insert_partitioned"


def test_init_puts_back_a_function_or_grant_changed_by_hand(empty_db: Database) -> None:
    """The definitions are re-applied by every init: a function replaced or a grant added by
    hand is the file's again after it."""
    init_db(empty_db.dsn)
    with empty_db.connect() as conn:
        before = schema_catalog(conn)
        conn.execute(
            "CREATE OR REPLACE FUNCTION ledger_session_head(p_session uuid) RETURNS bigint "
            "LANGUAGE sql SECURITY DEFINER AS 'SELECT 7::bigint'"
        )
        conn.execute("GRANT SELECT ON agent_sessions TO ledger_writer")
        conn.execute("ALTER ROLE ledger_consumer REPLICATION")
        assert schema_catalog(conn) != before
    init_db(empty_db.dsn)
    with empty_db.connect() as conn:
        assert schema_catalog(conn) == before


def test_the_partition_lock_is_spelled_once() -> None:
    """Python and SQL take the same advisory lock to create partitions, written alike."""
    from ledger_cdc.admin.partitions import PARTITION_LOCK
    from ledger_cdc.admin.schema import load_definitions

    (text,) = [t for name, t in load_definitions() if name == "functions/partitions.sql"]
    assert f"pg_advisory_xact_lock({PARTITION_LOCK})" in text
