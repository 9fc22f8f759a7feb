"""Streaming that begins before the consumer has loaded: ``ledger-cdc consume`` starts the slot's
stream (ReplicationStream.prefetch) and reads ahead while the rest of it loads and checks, then
takes the stream over. What it reads ahead starts where the slot stands, which may be before the
consumer's checkpoint: what the checkpoint covers must still be dropped, never applied again."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import SlotError, TransportError
from ledger_cdc.lsn import format_lsn, parse_lsn
from ledger_cdc.stream.transport import MESSAGE_OVERHEAD, ReplicationStream
from tests.support.cdc import (
    ConsumerProcess,
    assert_verify_exact,
    until,
    wait_caught_up,
)
from tests.support.harness import Database

pytestmark = pytest.mark.server

_TOOL = {"call_id": "c", "tool": "search", "arguments": {"q": "x" * 2000}}


def _slot_active(db: Database, slot: str = "agent_slot") -> bool:
    with db.connect() as conn:
        row = conn.execute(
            "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return bool(row and row[0])


def _wal_lsn(db: Database) -> int:
    with db.connect() as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def test_consume_takes_over_the_stream_it_began_while_loading(db: Database, tmp_path: Path) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    sids = [uuid.uuid4() for _ in range(20)]
    with Ledger(db.dsn) as ledger:
        for i in range(300):  # a backlog, waiting before the consumer starts
            ledger.append(sids[i % 20], "a", "tool.invoked", {**_TOOL, "call_id": f"c{i}"})
    log = tmp_path / "c.log"
    with ConsumerProcess(db.dsn, log=log):
        wait_caught_up(db.dsn)
    text = log.read_text()
    assert "bytes read ahead)" in text, text  # the stream it took over, begun before its checks
    assert_verify_exact(db.dsn)


def test_what_the_checkpoint_covers_is_dropped_though_the_slot_resends_it(
    db: Database, tmp_path: Path
) -> None:
    """The slot stands before the checkpoint (as after a crash between a batch's commit and its
    confirmation): the stream begun early resends those transactions; none is applied again."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    before, after = [uuid.uuid4() for _ in range(5)], [uuid.uuid4() for _ in range(5)]
    with Ledger(db.dsn) as ledger:
        for sid in before:
            ledger.append(sid, "a", "tool.invoked", _TOOL)
        checkpoint = _wal_lsn(db)
        for sid in after:
            ledger.append(sid, "a", "tool.invoked", _TOOL)
    with db.connect() as conn:  # a checkpoint that says the first five are applied already
        conn.execute(
            "INSERT INTO ledger_checkpoints (slot_name, lsn) VALUES ('agent_slot', %s::pg_lsn)",
            (format_lsn(checkpoint),),
        )
    log = tmp_path / "c.log"
    with ConsumerProcess(db.dsn, log=log), db.connect() as conn:
        until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM agent_sessions WHERE session_id = ANY(%s)", (after,)
                ).fetchone()
                == (5,)
            ),
            timeout=60,
        )
    assert "bytes read ahead)" in log.read_text()
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT count(*) FROM agent_sessions WHERE session_id = ANY(%s)", (before,)
        ).fetchone()
    assert rows == (0,), "a transaction the checkpoint covers was applied again"


def test_a_stream_begun_early_is_taken_over_or_let_go(db: Database) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    with Ledger(db.dsn) as ledger:
        ledger.append(uuid.uuid4(), "a", "tool.invoked", _TOOL)
    # let go: closing it frees the slot (no connection left behind)
    early = ReplicationStream(db.dsn, "agent_slot", "agent_pub")
    early.prefetch(1 << 20)
    until(lambda: _slot_active(db), timeout=30)
    early.close()
    until(lambda: not _slot_active(db), timeout=30)
    # taken over: start() streams on it, from what was read ahead
    early = ReplicationStream(db.dsn, "agent_slot", "agent_pub")
    early.prefetch(1 << 20)
    until(lambda: _slot_active(db), timeout=30)
    try:
        early.start(0)
        assert early.adopted is not None
        kinds: list[bytes] = []
        until(
            lambda: bool(kinds.extend(m.payload[:1] for m in early.read_many(64))) or b"C" in kinds
        )
        assert kinds[:3] == [b"B", b"R", b"I"]  # Begin, Relation, Insert: from the slot's start
    finally:
        early.close()
    until(lambda: not _slot_active(db), timeout=30)


def test_a_stream_that_could_not_begin_early_fails_as_a_plain_start(db: Database) -> None:
    early = ReplicationStream(db.dsn, "no_such_slot", "agent_pub")
    early.prefetch(1 << 20)
    with pytest.raises(SlotError, match="does not exist"):
        early.start(0)
    assert early.adopted is None


def test_a_stream_lost_after_it_began_early_is_a_stream_lost(db: Database) -> None:
    """Ended by the server once it was streaming (here its walsender terminated): start() says
    the stream was lost, so the consumer retries it as one (and logs it), not silently."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    early = ReplicationStream(db.dsn, "agent_slot", "agent_pub")
    early.prefetch(1 << 20)
    pre = early._prefetch
    assert pre is not None
    until(lambda: pre._streaming, timeout=30)  # START_REPLICATION has returned: it streams
    with db.connect() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE slot_name = 'agent_slot'"
        )
    until(lambda: pre.lost is not None, timeout=30)
    with pytest.raises(TransportError, match="replication stream lost"):
        early.start(0)
    early.close()


def test_the_read_ahead_counts_what_it_holds(db: Database) -> None:
    """The read-ahead's byte count (what bounds it) is what its messages hold, as they are read
    ahead and taken, whatever the run sizes; it is 0 once the buffer is empty."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    with Ledger(db.dsn) as ledger:
        for _ in range(40):
            ledger.append(uuid.uuid4(), "a", "tool.invoked", _TOOL)
    early = ReplicationStream(db.dsn, "agent_slot", "agent_pub")
    early.prefetch(1 << 20)
    pre = early._prefetch
    assert pre is not None
    try:
        until(lambda: sum(m.payload[:1] == b"C" for m in list(pre.messages)) >= 10)
        early.start(0)

        def counted() -> bool:
            held = sum(len(m.payload) + MESSAGE_OVERHEAD for m in early._ahead.messages)
            assert early._ahead.size == held
            return held > 0

        until(counted)  # read ahead (by the early stream, then by the reads)
        commits = 0
        for n in itertools.cycle((1, 3, 64, 7)):
            commits += sum(m.payload[:1] == b"C" for m in early.read_many(n))
            counted()
            if commits >= 40:
                break
        until(lambda: not early.read_many(64) and not counted())
    finally:
        early.close()
