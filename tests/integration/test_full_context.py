"""A stored projection made whole again, "full context from references", has two readers: Python
(``client.recovery.attach_steps`` then ``load_memo``: the fold's ``attach`` and the memo merge)
and SQL (``ledger_full_context``, which ``ledger_session_context``, the
``agent_session_contexts`` view and ``client.read.projected_contexts`` use). On histories
generated to need every kind of reference (a context window left in its ``context.loaded``
event, long replies and results left in theirs, memo entries without their result), stored by
the real consumer, both give the same whole context, equal to a fold of the session from zero;
the PostgreSQL sink's own reload (``PgSink.load_contexts``) gives it too, without the memo.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg
import pytest
from hypothesis import HealthCheck, event, example, given, settings

from ledger_cdc.client.read import load_events
from ledger_cdc.client.recovery import attach_steps, load_memo
from ledger_cdc.client.steps import run
from ledger_cdc.client.writer import Ledger
from ledger_cdc.fold import (
    SessionContext,
    decode_context,
    encode_context,
    fold,
    references,
)
from ledger_cdc.sink.postgres import PgSink
from tests.integration.test_recovery import RunningConsumer
from tests.support.cdc import wait_caught_up, wait_streaming
from tests.support.harness import Database
from tests.unit.test_stored_references import KNOWN, Event, histories

pytestmark = pytest.mark.server


@pytest.fixture
def consumed(db: Database) -> Iterator[Database]:
    """A database whose consumer streams (snapshots every 3 events of a session)."""
    with RunningConsumer(db.dsn):
        wait_streaming(db.dsn)
        yield db


def _write(ledger: Ledger, sid: uuid.UUID, turns: list[list[Event]]) -> None:
    for turn in turns:
        with ledger.transaction() as tx:
            for etype, payload in turn:
                tx.append(sid, "a", etype, payload)


def _python(conn: psycopg.Connection[Any], stored: str) -> SessionContext:
    """The Python reader: the stored context, what it references attached, its memo merged."""
    ctx = decode_context(stored)
    window, sources = references(ctx)
    if window is not None:
        event("window by reference")
    if sources:
        event("messages by reference")
    ctx = run(conn, attach_steps(ctx))
    return load_memo(conn, ctx)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(histories)
@example(KNOWN)
def test_python_and_sql_make_the_same_whole_context_from_references(
    consumed: Database, drawn: list[list[list[Event]]]
) -> None:
    sids = [uuid.uuid4() for _ in drawn]
    with Ledger(consumed.dsn) as ledger:
        for sid, turns in zip(sids, drawn, strict=True):
            _write(ledger, sid, turns)
    wait_caught_up(consumed.dsn)
    sink = PgSink(consumed.dsn, "unused_slot")
    try:
        with consumed.connect() as conn:
            for sid in sids:
                row = conn.execute(
                    "SELECT context::text, ledger_full_context(session_id, context)::text, "
                    "(SELECT count(*) FROM agent_memo m WHERE m.session_id = s.session_id "
                    " AND NOT (m.entry ? 'result' OR m.entry ? 'content')) "
                    "FROM agent_sessions s WHERE session_id = %s",
                    (sid,),
                ).fetchone()
                assert row is not None
                stored, whole, by_reference = row
                if by_reference:
                    event("memo entries by reference")
                python = _python(conn, stored)
                in_sql = decode_context(whole)
                # every field, those the stored context left out at their default too
                assert set(msgspec.json.decode(whole)) == set(SessionContext.__struct_fields__)
                assert encode_context(python) == encode_context(in_sql)
                assert python == in_sql
                assert python == fold(load_events(conn, sid), session_id=sid)
                assert sink.load_contexts([sid])[sid] == msgspec.structs.replace(
                    python,
                    completed_tools={},
                    completed_models={},
                    memo_position=python.last_position,
                )
    finally:
        sink.close()


def test_sql_gives_back_the_fields_a_stored_context_leaves_at_their_default(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        row = conn.execute(
            "SELECT ledger_full_context(%s, jsonb_build_object('session_id', %s::text))"
            " = %s::jsonb",
            (sid, sid, encode_context(SessionContext(sid)).decode()),
        ).fetchone()
    assert row == (True,)
