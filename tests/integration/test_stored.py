"""What the consumer stores on a real server: projections, snapshots and memo rows reference the
ledger's events instead of copying context windows, long messages and call results; every
documented reader gets the whole context back."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.admin.verify import verify
from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import fold_all, memoised_tool, rebuild_context
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer import ConsumerConfig, build_consumer
from ledger_cdc.fold import decode_context, encode_context
from tests.support.cdc import assert_projections_equal_refold, wait_caught_up, wait_streaming
from tests.support.harness import Database


@pytest.fixture
def consumed(db: Database) -> Iterator[Database]:
    consumer = build_consumer(
        ConsumerConfig(dsn=db.dsn, create_slot=True, snapshot_every=4, max_delay=0.005)
    )
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        wait_streaming(db.dsn)
        yield db
    finally:
        consumer.stop()
        thread.join(30)


def _agent(ledger: Ledger, sid: uuid.UUID, turns: int) -> None:
    """Turns of an agent whose context window grows (tens of kB), with long replies and
    results."""
    window = [{"role": "system", "content": "policy. " * 2500}]
    for t in range(turns):
        window.append({"role": "user", "content": f"question {t} " * 200})
        ledger.append(sid, "a", "context.loaded", {"messages": window})
        with ledger.transaction() as tx:
            tx.append(sid, "a", "model.requested", {"request_id": f"r{t}", "model": "m"})
            reply = f"answer {t} " * 300
            tx.append(
                sid, "a", "model.responded", {"request_id": f"r{t}", "model": "m", "content": reply}
            )
            tx.append(sid, "a", "tool.invoked", {"call_id": f"c{t}", "tool": "sql"})
        ledger.append(sid, "a", "tool.observed", {"call_id": f"c{t}", "result": f"row {t};" * 900})
        window += [
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": "row;" * 100, "tool_call_id": f"c{t}"},
        ]


def test_a_projection_stores_what_a_turn_added_not_the_window(consumed: Database) -> None:
    sids = [uuid.uuid4() for _ in range(3)]
    with Ledger(consumed.dsn) as ledger:
        for sid in sids:
            _agent(ledger, sid, turns=6)
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        expected = fold_all(conn)
        for sid in sids:
            whole = len(encode_context(expected[sid]))
            stored, snaps = conn.execute(
                "SELECT octet_length(s.context::text), (SELECT max(octet_length(n.data)) "
                "FROM agent_snapshots n WHERE n.session_id = s.session_id) "
                "FROM agent_sessions s WHERE s.session_id = %s",
                (sid,),
            ).fetchone()  # type: ignore[misc]
            assert whole > 80_000
            # the window (~60 kB), the reply and the result (~10 kB each) stay in their events
            assert stored < 3_000, (stored, whole)
            assert snaps < 3_000, (snaps, whole)
        (memo,) = conn.execute("SELECT max(octet_length(entry::text)) FROM agent_memo").fetchone()  # type: ignore[misc]
        assert memo < 400  # the result is not copied
        # every documented reader gets the whole context
        assert projected_contexts(conn) == expected
        for sid in sids:
            (text,) = conn.execute(
                "SELECT context::text FROM agent_session_contexts WHERE session_id = %s", (sid,)
            ).fetchone()  # type: ignore[misc]
            assert decode_context(text) == expected[sid]
            (one,) = conn.execute("SELECT ledger_session_context(%s)::text", (sid,)).fetchone()  # type: ignore[misc]
            assert decode_context(one) == expected[sid]
            assert rebuild_context(conn, sid, memo=True) == expected[sid]
            lazy = rebuild_context(conn, sid)  # from a snapshot: its memo in agent_memo
            assert lazy.memo_position > 0
            hit = memoised_tool(conn, lazy, "c0")
            assert hit is not None and hit.result == "row 0;" * 900
    assert assert_projections_equal_refold(consumed.dsn) == 3 * 6 * 5
    report = verify(consumed.dsn)
    assert not report.differences and report.projections == 3 and report.memo == 3 * 12


def test_a_reference_that_no_longer_resolves_is_reported_not_guessed(consumed: Database) -> None:
    """A projection pointed at an event that is not its window (tampering, a broken restore):
    verify reports it, the SQL reader refuses it in one line, nothing is filled in wrongly."""
    sid = uuid.uuid4()
    with Ledger(consumed.dsn) as ledger:
        _agent(ledger, sid, turns=2)
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        conn.execute(
            "UPDATE agent_sessions SET context = jsonb_set(context, '{window,position}', '2') "
            "WHERE session_id = %s",
            (sid,),
        )
        with pytest.raises(psycopg.errors.NoDataFound, match="context window loaded at position 2"):
            conn.execute("SELECT ledger_session_context(%s)", (sid,))
    report = verify(consumed.dsn, [sid])
    assert [(d.kind, d.field) for d in report.differences] == [("projection", "window")]
    assert "position 2" in report.differences[0].detail
