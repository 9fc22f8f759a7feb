"""``verify`` wherever the projections live: with ``target_dsn`` (``consume --target-dsn``) the
stored objects are read from the projections' database, the ledger from its own; a projection
ahead of the ledger, or behind it with no consumer making progress, is a difference in either
case, and a ledger whose projections are elsewhere never passes without them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin.verify import Difference, VerifyReport, verify
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import SchemaError
from tests.support.cdc import InThread, until, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server

LONG = 300  # characters: past fold.REFERENCE_MIN, stored by reference in the ledger's database


def _history(ledger: Ledger, sid: uuid.UUID) -> None:
    """A window, a model call and a tool call whose strings are long enough to be left in their
    events by a consumer writing into the ledger's database, and a tool call in flight."""
    ledger.append(
        sid, "a", "context.loaded", {"messages": [{"role": "system", "content": "r" * LONG}]}
    )
    ledger.append(sid, "a", "model.requested", {"request_id": "m1", "model": "m"})
    ledger.append(
        sid, "a", "model.responded", {"request_id": "m1", "model": "m", "content": "c" * LONG}
    )
    ledger.append(sid, "a", "tool.invoked", {"call_id": "t1", "tool": "t"})
    ledger.append(sid, "a", "tool.observed", {"call_id": "t1", "result": "x" * LONG})
    ledger.append(sid, "a", "tool.invoked", {"call_id": "t2", "tool": "t"})


def _folded_into(ledger_dsn: str, target_dsn: str, timeout: float = 60.0) -> None:
    """Until every session's projection in ``target_dsn`` is at the ledger's head."""

    def done() -> bool:
        with psycopg.connect(ledger_dsn) as lc, psycopg.connect(target_dsn) as tc:
            heads = dict(
                lc.execute("SELECT session_id, max(position) FROM agent_events GROUP BY 1")
            )
            return heads == dict(tc.execute("SELECT session_id, last_position FROM agent_sessions"))

    until(done, timeout)


def _consumer(db: Database, target: Database | None = None) -> InThread:
    return InThread(
        db.dsn,
        target_dsn=None if target is None else target.dsn,
        precreate_slot=False,
        snapshot_every=2,
    )


def _streamed(conn: psycopg.Connection[Any]) -> bool:
    """Whether a consumer streams agent_slot."""
    row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = 'agent_slot'")
    return bool(row.fetchone() == (True,))


def _only(report: VerifyReport, sid: uuid.UUID) -> list[Difference]:
    return [d for d in report.differences if d.session_id == sid]


@dataclass
class Run:
    db: Database
    target: Database
    sessions: list[uuid.UUID]

    def verify(self, wait: float = 0.0, *, target: bool = True) -> VerifyReport:
        return verify(
            self.db.dsn, target_dsn=self.target.dsn if target else None, consumer_wait=wait
        )


@pytest.fixture
def folded(db: Database, second_db: Database) -> Iterator[Run]:
    """Three sessions folded by a consumer into ``second_db``, which has stopped since."""
    sids = [uuid.uuid4() for _ in range(3)]
    with _consumer(db, second_db), Ledger(db.dsn) as ledger:
        for sid in sids:
            _history(ledger, sid)
        _folded_into(db.dsn, second_db.dsn)
    with db.connect() as conn:  # its walsender gone: no consumer streams the slot now
        until(lambda: not _streamed(conn))
    yield Run(db, second_db, sids)


def test_verify_reads_an_exact_target_by_value_and_passes(
    db: Database, second_db: Database
) -> None:
    """Projections, snapshots and memo in another database (everything copied there) equal a
    refold of the ledger; with a consumer running, a projection deleted there is judged by its
    slot on the ledger's server, joined with its checkpoint in the projections' database."""
    a, b = uuid.uuid4(), uuid.uuid4()
    run = Run(db, second_db, [a, b])
    with _consumer(db, second_db), Ledger(db.dsn) as ledger:
        for sid in (a, b):
            _history(ledger, sid)
        _folded_into(db.dsn, second_db.dsn)
        with second_db.connect() as tc:
            # what the ledger's database would leave in the events is copied here
            row = tc.execute(
                "SELECT bool_and(CASE kind WHEN 'tool' THEN entry ? 'result' "
                "ELSE entry ? 'content' END), count(*) FROM agent_memo"
            ).fetchone()
            assert row == (True, 4)
            assert tc.execute(
                "SELECT count(*) FROM agent_sessions WHERE context #>> '{window,omitted}' = 'true'"
            ).fetchone() == (0,)
        report = run.verify(30.0)
        assert report.ok, report.differences
        assert (report.sessions, report.events, report.projections) == (2, 12, 2)
        assert report.memo == 4 and report.snapshots >= 2
        with db.connect() as lc:  # nothing of it in the ledger's database
            assert lc.execute("SELECT count(*) FROM agent_sessions").fetchone() == (0,)
        with second_db.connect() as tc:
            tc.execute("DELETE FROM agent_sessions WHERE session_id = %s", (a,))
        report = run.verify(60.0)
    (found,) = report.differences
    assert (found.session_id, found.kind, found.expected, found.actual) == (
        a,
        "projection",
        6,
        None,
    )
    assert "deleted or put back by hand" in found.detail


def test_verify_target_names_an_edited_projection_and_memo(folded: Run) -> None:
    a, b, c = folded.sessions
    with folded.target.connect() as tc:
        tc.execute(
            "UPDATE agent_sessions SET context = jsonb_set(context, '{event_count}', '99') "
            "WHERE session_id = %s",
            (a,),
        )
        tc.execute(
            "UPDATE agent_memo SET entry = jsonb_set(entry, '{result}', '\"edited\"') "
            "WHERE session_id = %s AND call_id = 't1'",
            (b,),
        )
        # left in the completing event, as in the ledger's database: nothing here reads it back
        tc.execute(
            "UPDATE agent_memo SET entry = entry - 'content' WHERE session_id = %s AND kind = "
            "'model'",
            (c,),
        )
    report = folded.verify()
    assert not report.ok
    assert [(d.kind, d.field, d.expected, d.actual) for d in _only(report, a)] == [
        ("projection", "event_count", 6, 99)
    ]
    assert [(d.kind, d.field, d.actual) for d in _only(report, b)] == [
        ("memo", "completed_tools.t1.result", "edited")
    ]
    (memo_c,) = _only(report, c)
    assert memo_c.kind == "memo" and "not the ledger's" in memo_c.detail, memo_c


def test_verify_target_names_a_context_that_references_the_ledger(folded: Run) -> None:
    """A stored context that leaves its window in the ledger's event, in a database whose SQL
    cannot follow the reference: a difference, not a pass or a crash."""
    a = folded.sessions[0]
    with folded.target.connect() as tc:
        tc.execute(
            "UPDATE agent_sessions SET context = jsonb_set(jsonb_set(context, "
            "'{window,omitted}', 'true'), '{messages}', '[]') WHERE session_id = %s",
            (a,),
        )
    (found,) = folded.verify().differences
    assert (found.session_id, found.kind, found.field) == (a, "projection", "window")
    assert "not the ledger's" in found.detail


def test_verify_target_finds_projections_ahead_of_the_ledger(folded: Run) -> None:
    """What a failover's lost transactions leave in another database: a projection past the
    session's head in the ledger, and one of a session the ledger has no event of."""
    a, b, _ = folded.sessions
    ghost = uuid.uuid4()
    with folded.target.connect() as tc:
        tc.execute(
            "UPDATE agent_sessions SET last_position = last_position + 3 WHERE session_id = %s",
            (a,),
        )
        tc.execute(
            "CREATE TEMP TABLE ghost AS SELECT * FROM agent_sessions WHERE session_id = %s", (b,)
        )
        tc.execute("UPDATE ghost SET session_id = %s", (ghost,))
        tc.execute("INSERT INTO agent_sessions SELECT * FROM ghost")
    report = folded.verify()
    assert not report.ok
    (ahead,) = _only(report, a)
    assert (ahead.kind, ahead.position, ahead.expected, ahead.actual) == ("projection", 9, 6, 9)
    assert "ahead of the ledger" in ahead.detail
    (orphan,) = _only(report, ghost)
    assert orphan.kind == "orphan" and "ahead of the ledger" in orphan.detail


def test_verify_same_database_finds_projections_ahead_of_the_ledger(db: Database) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    with _consumer(db), Ledger(db.dsn) as ledger:
        for sid in (a, b):
            _history(ledger, sid)
        wait_caught_up(db.dsn)
    assert verify(db.dsn, consumer_wait=0).ok
    # a target_dsn that names the ledger's own database reads it as the ledger's (by reference)
    assert verify(db.dsn, target_dsn=db.dsn, consumer_wait=0).ok
    with db.connect() as conn:
        conn.execute(
            "UPDATE agent_sessions SET last_position = last_position + 2 WHERE session_id = %s",
            (a,),
        )
    report = verify(db.dsn, consumer_wait=0)
    (ahead,) = report.differences
    assert (ahead.session_id, ahead.kind, ahead.expected, ahead.actual) == (a, "projection", 6, 8)
    assert "ahead of the ledger" in ahead.detail


def test_verify_target_fails_behind_with_no_consumer_then_passes_once_one_runs(
    folded: Run,
) -> None:
    """An event no consumer has applied: not judged is no pass. Asked not to judge (a negative
    wait), it is a note; with a consumer running again, it vouches and verify passes."""
    a = folded.sessions[0]
    with Ledger(folded.db.dsn) as ledger:
        ledger.append(a, "a", "tool.observed", {"call_id": "t2", "result": 1})
    report = folded.verify()
    assert not report.ok
    (found,) = report.differences
    assert (found.session_id, found.kind, found.position) == (a, "behind", 6)
    assert (found.expected, found.actual) == (7, 6)
    assert "no consumer made progress past the snapshot within 0s" in found.detail
    assert "no consumer was streaming slot agent_slot" in found.detail
    report = folded.verify(-1)
    assert report.ok and any("not judged" in n for n in report.notes), report.notes
    with _consumer(folded.db, folded.target):
        report = folded.verify(60.0)
    assert report.ok, report.differences


def test_verify_without_target_dsn_does_not_pass_when_the_projections_are_elsewhere(
    folded: Run,
) -> None:
    """The ledger's database holds no projection; its slot's checkpoint is in another
    database: every session is a difference, and the detail says to give --target-dsn."""
    report = folded.verify(target=False)
    assert not report.ok and report.projections == 0
    assert sorted(d.session_id for d in report.differences if d.session_id) == sorted(
        folded.sessions
    )
    assert all(d.kind == "behind" for d in report.differences)
    assert "give --target-dsn" in report.differences[0].detail
    assert "agent_slot" in report.differences[0].detail


def test_verify_fails_on_a_ledger_no_consumer_has_folded(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        _history(ledger, sid)
    report = verify(db.dsn, consumer_wait=0)
    (found,) = report.differences
    assert (found.session_id, found.kind, found.position, found.expected) == (
        sid,
        "behind",
        None,
        6,
    )
    assert "no consumer's checkpoint" in found.detail
    assert verify(db.dsn, consumer_wait=-1).ok  # the chain alone, projections not judged


def test_verify_refuses_a_target_without_projection_tables(
    db: Database, empty_db: Database
) -> None:
    with pytest.raises(SchemaError, match="projection database: it has no agent_sessions"):
        verify(db.dsn, target_dsn=empty_db.dsn)
