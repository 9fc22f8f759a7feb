"""The PostgreSQL sink writes a small batch in one statement (ledger_apply_batch) and a large
one by COPY into staging tables: the same log consumed through either path leaves the same rows,
and a fenced batch leaves none."""

from __future__ import annotations

import contextlib
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import ledger_cdc.sink.postgres as pg_sink
from ledger_cdc.admin.schema import create_slot
from ledger_cdc.batching import Batch
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer import ConsumerConfig, build_consumer
from ledger_cdc.errors import FencedError
from ledger_cdc.fold import SessionContext, encode_stored
from tests.support.cdc import turn_events, until
from tests.support.harness import Database, _new_database

_STATE = {
    "agent_sessions": "SELECT session_id, status, last_seq, last_position, event_count, "
    "format_version, context, commit_lsn, run_status, lease_worker, lease_until, last_hash "
    "FROM agent_sessions ORDER BY session_id",
    "agent_memo": "SELECT * FROM agent_memo ORDER BY session_id, kind, call_id, completed_position",
    "agent_snapshots": "SELECT session_id, upto_seq, upto_position, format_version, "
    "reducer_version, content_hash, data, upto_hash FROM agent_snapshots ORDER BY 1, 2",
    "ledger_dead_letters": "SELECT seq, session_id, lsn, kind, reason, row_data "
    "FROM ledger_dead_letters ORDER BY lsn, seq",
    "ledger_checkpoints": "SELECT folded_seq FROM ledger_checkpoints",
}


@pytest.fixture
def targets(db: Database) -> Iterator[list[str]]:
    """Two projection databases (the ledger's schema, from the harness's template)."""
    new = contextlib.contextmanager(_new_database)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(new(db.server, db.server.template)).dsn for _ in range(2)]


def _consume(dsn: str, slot: str, target: str, head: int) -> None:
    """A consumer of ``slot`` into ``target`` until it has folded (or refused) seq ``head``."""
    consumer = build_consumer(
        ConsumerConfig(dsn=dsn, slot=slot, target_dsn=target, snapshot_every=5, max_delay=0.001)
    )
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        with psycopg.connect(target, autocommit=True) as conn:
            until(
                lambda: (
                    conn.execute(
                        "SELECT coalesce(max(folded_seq), 0) FROM ledger_checkpoints "
                        "WHERE slot_name = %s",
                        (slot,),
                    ).fetchone()[0]  # type: ignore[index]
                    >= head
                ),
                timeout=120,
            )
    finally:
        consumer.stop()
        thread.join(30)


def _state(dsn: str) -> dict[str, list[Any]]:
    with psycopg.connect(dsn) as conn:
        return {t: conn.execute(q).fetchall() for t, q in _STATE.items()}


def test_one_statement_and_staged_copy_write_the_same_rows(
    db: Database, targets: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with db.connect() as conn:
        create_slot(conn, "via_one")
        create_slot(conn, "via_copy")
    rng = random.Random(7)
    sessions = [uuid.uuid4() for _ in range(6)]
    with Ledger(db.dsn) as ledger:
        for _ in range(60):
            turn_events(ledger, rng.choice(sessions), "w", rng)
    with db.connect() as conn:  # a row the fold refuses: a dead letter on both paths
        conn.execute(
            "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
            "VALUES (%s, 'a', 'tool.observed', '{\"call_id\": 42}')",
            (sessions[0],),
        )
        (head,) = conn.execute("SELECT max(seq) FROM agent_events").fetchone()  # type: ignore[misc]
    applied: list[str] = []
    real_apply = pg_sink.PgSink._apply

    def spy(self: pg_sink.PgSink, batch: Batch) -> None:
        applied.append(self.slot)
        real_apply(self, batch)

    monkeypatch.setattr(pg_sink.PgSink, "_apply", spy)
    _consume(db.dsn, "via_one", targets[0], head)
    monkeypatch.setattr(pg_sink, "_SMALL_ROWS", -1)  # every batch by COPY
    _consume(db.dsn, "via_copy", targets[1], head)
    assert "via_one" in applied and "via_copy" not in applied
    one, copied = _state(targets[0]), _state(targets[1])
    assert one["ledger_dead_letters"] and one["agent_snapshots"] and one["agent_memo"]
    for table in _STATE:
        assert one[table] == copied[table], table


def test_a_fenced_one_statement_batch_writes_nothing(db: Database) -> None:
    sink = pg_sink.PgSink(db.dsn, "fenced_slot")
    sink.load_checkpoint()
    first = Batch(end_lsn=100, session_notices=["x:1"])
    sink.commit(first)  # one statement, checkpoint 0/64
    other = pg_sink.PgSink(db.dsn, "fenced_slot")
    other.load_checkpoint()
    other.commit(Batch(end_lsn=200))  # another consumer moves it on
    sid = uuid.uuid4()
    late = Batch(end_lsn=150)
    late.sessions[sid] = (SessionContext(sid, last_position=1), b"{}", 150, None)
    with pytest.raises(FencedError, match="no longer 0/64"):
        sink.commit(late)
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM agent_sessions").fetchone() == (0,)
        assert conn.execute(
            "SELECT lsn::text FROM ledger_checkpoints WHERE slot_name = 'fenced_slot'"
        ).fetchone() == ("0/C8",)


def test_staged_rows_are_compressed_as_their_tables_are(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a staged context or snapshot over 2 kB is compressed on its way into the staging table and
    # decompressed by the merge: with lz4 where the server has it, as the projection tables
    # (sql/0018_baseline.sql), not with the default pglz
    with db.connect() as conn:
        (lz4,) = conn.execute(  # type: ignore[misc]
            "SELECT attcompression = 'l' FROM pg_attribute "
            "WHERE attrelid = 'agent_sessions'::regclass AND attname = 'context'"
        ).fetchone()
    monkeypatch.setattr(pg_sink, "_SMALL_ROWS", -1)  # by COPY into the staging tables
    sink = pg_sink.PgSink(db.dsn, "staged_slot")
    sink.load_checkpoint()
    sid = uuid.uuid4()
    big = Batch(end_lsn=100)
    ctx = SessionContext(sid, last_position=1, extra={"note": "x" * 5000})
    big.sessions[sid] = (ctx, encode_stored(ctx), 100, None)
    sink.commit(big)
    staged = dict(
        sink.conn.execute(
            "SELECT attname, attcompression FROM pg_attribute WHERE (attrelid, attname) IN "
            "(('pg_temp.stage_sessions'::regclass, 'context'), "
            "('pg_temp.stage_snapshots'::regclass, 'data'), "
            "('pg_temp.stage_memo'::regclass, 'entry'))"
        ).fetchall()
    )
    method = "l" if lz4 else ""
    assert staged == {"context": method, "data": method, "entry": method}
    with db.connect() as conn:
        assert conn.execute(
            "SELECT context->'extra'->>'note' FROM agent_sessions WHERE session_id = %s", (sid,)
        ).fetchone() == ("x" * 5000,)
    sink.shutdown()
