"""Projection transactions committed without waiting for their WAL flush (``--sink-commit
async``, the default): the sink knows a batch durable only once the server's flush position
passes its commit, the slot is confirmed past it only then — and, idle or stopping, it is."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.batching import Batch
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer import ConsumerConfig, build_consumer
from ledger_cdc.lsn import parse_lsn
from ledger_cdc.sink import postgres
from ledger_cdc.sink.postgres import PgSink
from tests.support.cdc import until, wait_streaming
from tests.support.harness import Database

pytestmark = pytest.mark.server


def _slot_confirmed(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> int:
    row = conn.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    assert row is not None
    return parse_lsn(str(row[0]))


def test_an_asynchronous_commit_is_durable_only_once_a_later_look_finds_it_flushed(
    db: Database,
) -> None:
    sink = PgSink(db.dsn, "s_async", durable_commits=False)
    try:
        assert sink.load_checkpoint() is None
        with db.connect() as conn:
            (sync,) = conn.execute(
                "SELECT setting FROM pg_settings WHERE name = 'synchronous_commit'"
            ).fetchone()  # type: ignore[misc]
            sink.commit(Batch(end_lsn=0x1000))
            # the sink's own session commits without waiting, whatever the server's default
            (mine,) = sink.conn.execute("SHOW synchronous_commit").fetchone()  # type: ignore[misc]
            assert (mine, sync) == ("off", "on")
            # committed and visible, but nothing was read after it: not known durable
            assert sink.durable() < 0x1000 and sink.pending
            # any synchronous commit flushes the WAL before it, ours included
            conn.execute("SELECT pg_current_xact_id()")
        # a look reads the insert position (past the commit) and the flush position; once a
        # look finds the flush past the insert position of an earlier look, the batch is durable
        until(lambda: sink.probe() is None and sink.durable() == 0x1000, timeout=30)
        assert not sink.pending
        sink.commit(Batch(end_lsn=0x2000))
        assert sink.durable() == 0x1000
        sink.flush()  # waits for the flush itself
        assert sink.durable() == 0x2000 and not sink.pending
    finally:
        sink.shutdown()


def test_while_small_batches_come_their_statements_read_the_wal_positions(
    db: Database,
) -> None:
    """At about 40 small batches a second, what is durable is learnt from the batches' own
    statements (one in every OBSERVE_EVERY reads the WAL positions as it writes), not from the
    idle loop's look between batches, a round trip of its own: that look waits until no
    statement has read them for longer than a statement would."""
    sink = PgSink(db.dsn, "s_look", durable_commits=False)
    own_looks = 0  # the loop's looks (PgSink.probe): the only user of the kept cursor here
    all_looks = 0
    cursor, observed = sink._cursor, sink._observed

    def counted_cursor() -> psycopg.Cursor[Any]:
        nonlocal own_looks
        own_looks += 1
        return cursor()

    def counted_observed(row: tuple[Any, ...] | None) -> None:
        nonlocal all_looks
        all_looks += 1
        observed(row)

    try:
        sink.load_checkpoint()
        sink._cursor = counted_cursor  # type: ignore[method-assign]
        sink._observed = counted_observed  # type: ignore[method-assign]
        lsn = 0x1000
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            lsn += 0x100
            sink.commit(Batch(end_lsn=lsn))  # a small batch: one statement
            sink.probe()  # as the stream loop does between batches while some await the disk
            time.sleep(0.025)  # (the pace of the batches, not a wait for anything)
        statement_looks = all_looks - own_looks
        assert statement_looks >= 4, (statement_looks, own_looks)
        assert own_looks <= statement_looks // 2, (statement_looks, own_looks)
    finally:
        sink.shutdown()


def test_a_checkpoint_read_back_is_on_disk_before_it_is_used(db: Database) -> None:
    """A consumer that lost its connection right after an asynchronous commit reads that
    checkpoint back on its next start: it is on disk before streaming starts from it (the
    replication driver confirms keepalive positions past the start point by itself)."""
    first = PgSink(db.dsn, "s_back", durable_commits=False)
    try:
        first.load_checkpoint()
        first.commit(Batch(end_lsn=0x3000))
        with first.conn.cursor() as cur:
            (commit_end,) = cur.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()  # type: ignore[misc]
    finally:
        first.shutdown()
    again = PgSink(db.dsn, "s_back", durable_commits=False)
    try:
        assert again.load_checkpoint() == 0x3000
        assert again.durable() == 0x3000 and not again.pending
        with db.connect() as conn:
            (flushed,) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()  # type: ignore[misc]
        assert parse_lsn(str(flushed)) >= parse_lsn(str(commit_end))
    finally:
        again.shutdown()


def test_the_bootstrap_mark_is_on_disk_before_the_slot_is_dropped(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Marking a bootstrap (before the slot is dropped and rebuilt) must not wait on the WAL
    writer: a crash after the drop would lose the mark, and the next start would not redo the
    bootstrap."""
    sink = PgSink(db.dsn, "s_boot", durable_commits=False)
    marked_upto: list[int] = []
    flush_wal = postgres._flush_wal

    def watched(conn: Any, slot: str) -> None:  # the mark is committed by now: where its WAL
        with db.connect() as c:  # ends, at most
            (ins,) = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()  # type: ignore[misc]
        marked_upto.append(parse_lsn(str(ins)))
        flush_wal(conn, slot)

    monkeypatch.setattr(postgres, "_flush_wal", watched)
    try:
        sink.load_checkpoint()
        marked_upto.clear()
        sink.mark_bootstrap()
        assert marked_upto, "the mark was left to the WAL writer"
        with db.connect() as conn:
            (fl,) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()  # type: ignore[misc]
        assert parse_lsn(str(fl)) >= marked_upto[0]
    finally:
        sink.shutdown()


def test_a_synchronous_sink_is_durable_at_each_commit(db: Database) -> None:
    sink = PgSink(db.dsn, "s_sync", durable_commits=True)
    try:
        sink.load_checkpoint()
        sink.commit(Batch(end_lsn=0x1000))
        (mine,) = sink.conn.execute("SHOW synchronous_commit").fetchone()  # type: ignore[misc]
        assert mine == "on"
        assert sink.durable() == 0x1000 and not sink.pending
    finally:
        sink.shutdown()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_idle_consumer_confirms_everything_it_committed(db: Database, mode: str) -> None:
    """Nothing written after the last event: the slot still reaches its checkpoint (the idle
    loop looks at the flush position), and a stop leaves it confirmed to the last batch."""
    slot = f"agent_slot_{mode}"
    with db.connect() as conn:
        create_slot(conn, slot)
    consumer = build_consumer(
        ConsumerConfig(
            dsn=db.dsn,
            slot=slot,
            sink_commit=mode,
            max_delay=0.001,
            vacuum_interval=0,
            lease_watch_interval=0,
            health_interval=0,
        )
    )
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        wait_streaming(db.dsn, slot)
        sid = uuid.uuid4()
        with Ledger(db.dsn) as ledger, db.connect() as conn:
            for i in range(3):
                ledger.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})

            def checkpoint() -> int:
                row = conn.execute(
                    "SELECT lsn::text, folded_seq FROM ledger_checkpoints WHERE slot_name = %s",
                    (slot,),
                ).fetchone()
                return 0 if row is None or not row[1] else parse_lsn(str(row[0]))

            until(
                lambda: (
                    conn.execute(
                        "SELECT event_count FROM agent_sessions WHERE session_id = %s", (sid,)
                    ).fetchone()
                    == (3,)
                )
            )
            until(lambda: checkpoint() > 0 and _slot_confirmed(conn, slot) >= checkpoint())
    finally:
        consumer.stop()
        thread.join(30)
    assert not thread.is_alive()
    with db.connect() as conn:
        (stored,) = conn.execute(
            "SELECT lsn::text FROM ledger_checkpoints WHERE slot_name = %s", (slot,)
        ).fetchone()  # type: ignore[misc]
        assert _slot_confirmed(conn, slot) >= parse_lsn(str(stored))


def test_statements_deallocated_in_the_sinks_session_are_prepared_anew(db: Database) -> None:
    """A small batch goes as a statement prepared once in the sink's session. Something that
    drops the session's prepared statements (DISCARD ALL, DEALLOCATE ALL; psycopg itself does
    after a ROLLBACK if it prepared anything there) must not make every later batch fail."""
    sink = PgSink(db.dsn, "s_dealloc")
    try:
        assert sink.load_checkpoint() is None
        sink.commit(Batch(end_lsn=0x1000))
        assert sink.load_contexts_sized([uuid.uuid4()]) == {}
        for drop in ("DEALLOCATE ALL", "DISCARD ALL"):
            sink.conn.execute(drop)
            sink.commit(Batch(end_lsn=sink.checkpoint + 0x1000))  # type: ignore[operator]
            assert sink.load_contexts_sized([uuid.uuid4()]) == {}
        with db.connect() as conn:
            row = conn.execute(
                "SELECT lsn::text FROM ledger_checkpoints WHERE slot_name = 's_dealloc'"
            ).fetchone()
        assert row is not None and parse_lsn(str(row[0])) == 0x3000
    finally:
        sink.shutdown()
