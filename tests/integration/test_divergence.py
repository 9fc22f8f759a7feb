"""Projections in another database never run ahead of the ledger (invariant 8).

A consumer with ``--target-dsn`` keeps its projections and checkpoint apart from the ledger, so
a failover or a restore of the ledger's server can leave them holding events the ledger no
longer has. Here the "server" is replaced by another ledger database with a shorter, different
history for the same sessions, and the checkpoint says it was taken on another system: the
consumer discards what does not agree, rebuilds from the ledger, and folds what comes after.
The real failover (a promoted standby) is tests/faults/test_failover.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.client.recovery import fold_all
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer.divergence import _parse_history, projections_ahead, server
from tests.support.cdc import InThread, stored_projections, until
from tests.support.harness import Database, Server, _new_database

pytestmark = pytest.mark.server


@pytest.fixture
def target(server: Server) -> Iterator[Database]:
    """The projection database (--target-dsn), with the ledger schema."""
    yield from _new_database(server, server.template)


def _calls(ledger: Ledger, sid: uuid.UUID, n: int, tag: str) -> None:
    for i in range(n):
        ledger.append(sid, "a", "tool.invoked", {"call_id": f"{tag}{i}", "tool": "t"})


def _folded(target: Database, n: int) -> bool:
    with target.connect() as conn:
        row = conn.execute("SELECT coalesce(sum(event_count), 0) FROM agent_sessions").fetchone()
    return row is not None and int(row[0]) == n  # type: ignore[call-overload]


def test_projections_ahead_of_a_replaced_ledger_are_refolded_from_it(
    db: Database, second_db: Database, target: Database
) -> None:
    s1, s2, s3 = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with Ledger(db.dsn) as old:  # the history the projections were folded from
        _calls(old, s1, 5, "old")
        _calls(old, s2, 3, "old")
    with InThread(db.dsn, slot="slot_a", target_dsn=target.dsn, precreate_slot=False):
        until(lambda: _folded(target, 8), 60)
    with Ledger(second_db.dsn) as new:  # the server's history now: shorter, and other events
        _calls(new, s1, 3, "new")
        _calls(new, s3, 2, "new")
    with target.connect() as conn:  # the same checkpoint, as taken on another system
        conn.execute(
            "UPDATE ledger_checkpoints SET slot_name = 'slot_b', server_id = 'another', "
            "timeline = 1 WHERE slot_name = 'slot_a'"
        )
    with (
        InThread(
            second_db.dsn, slot="slot_b", target_dsn=target.dsn, precreate_slot=False
        ) as consumer,
        Ledger(second_db.dsn) as new,
    ):
        until(lambda: _folded(target, 5), 60)
        _calls(new, s1, 1, "after")  # position 4, where the old history had its own
        until(lambda: _folded(target, 6), 60)
        assert consumer.metrics.extra.get("divergence_repairs_total") == 1
        assert consumer.metrics.extra.get("sessions_refolded_total") == 2
    with second_db.connect() as ledger_conn, target.connect() as target_conn:
        expected = fold_all(ledger_conn)
        got = stored_projections(target_conn)
        assert set(got) == {s1, s3} and got == expected
        assert projections_ahead(ledger_conn, target_conn) == []
        (sid, tl) = target_conn.execute(  # type: ignore[misc]
            "SELECT server_id, timeline FROM ledger_checkpoints WHERE slot_name = 'slot_b'"
        ).fetchone()
    me, _ = server(second_db.dsn)
    assert (sid, tl) == (me.system_id, me.timeline)
    # started again on the same server: nothing to repair, and it goes on folding
    with (
        InThread(
            second_db.dsn, slot="slot_b", target_dsn=target.dsn, precreate_slot=False
        ) as consumer,
        Ledger(second_db.dsn) as new,
    ):
        _calls(new, s3, 1, "later")
        until(lambda: _folded(target, 7), 60)
        assert "divergence_repairs_total" not in consumer.metrics.extra


def test_a_projection_whose_last_hash_differs_is_ahead(db: Database, target: Database) -> None:
    """Same position, another event (the history forked below the head): ahead too; a
    projection the ledger holds as folded is not."""
    sid, other = uuid.uuid4(), uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        _calls(ledger, sid, 2, "x")
        _calls(ledger, other, 1, "x")
    with InThread(db.dsn, target_dsn=target.dsn, precreate_slot=False):
        until(lambda: _folded(target, 3), 60)
    with db.connect() as ledger_conn, target.connect() as target_conn:
        assert projections_ahead(ledger_conn, target_conn) == []
        target_conn.execute(
            "UPDATE agent_sessions SET last_hash = '\\x00' WHERE session_id = %s", (sid,)
        )
        assert projections_ahead(ledger_conn, target_conn) == [(sid, 2, 2)]


def test_timeline_history_is_read_as_the_server_writes_it() -> None:
    text = '1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tat restore point "x"\n'
    assert _parse_history(text) == {1: 0x3000158, 2: 0x5000000}


def test_the_server_is_named_by_its_system_and_timeline(db: Database) -> None:
    me, history = server(db.dsn)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        (wal,) = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()  # type: ignore[misc]
    assert me.timeline == int(str(wal)[:8], 16) and me.system_id.isdigit()
    assert history == ({} if me.timeline == 1 else history)
