"""admin.review: what replay and diff show, gathered by the library (the command line only
renders it)."""

from __future__ import annotations

import json
import uuid

import pytest

from ledger_cdc.admin.review import diff_sessions, replay
from ledger_cdc.client.frameworks import Named
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import NoSuchSessionError
from tests.support.harness import Database


def _run(ledger: Ledger, sid: uuid.UUID, result: object) -> None:
    """One completed call (c1, its result ``result``) and one in flight (c2)."""
    ledger.append(sid, "w", "tool.invoked", {"call_id": "c1", "tool": "t", "idempotency_key": "k1"})
    ledger.append(sid, "w", "tool.observed", {"call_id": "c1", "result": result})
    ledger.append(sid, "w", "tool.invoked", {"call_id": "c2", "tool": "t", "idempotency_key": "k2"})


def test_replay_lists_the_calls_in_flight_and_the_memoised(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        _run(ledger, sid, {"hits": 3})
    with db.connect() as conn:
        found = replay(conn, Named("session", str(sid), sid))
        assert found.context.last_position == 3 and found.named.session_id == sid
        ((flying,), (done,)) = found.in_flight, found.memoised
        assert (flying.kind, flying.id, flying.idempotency_key, flying.seq) == (
            "tool",
            "c2",
            "k2",
            found.context.pending_tools["c2"].invoked_seq,
        )
        assert (done.id, json.loads(done.result or "")) == ("c1", {"hits": 3})
        with pytest.raises(NoSuchSessionError, match="has no events"):
            replay(conn, Named("session", "x", uuid.uuid4()))


def test_diff_sessions_finds_the_first_step_where_two_runs_part(db: Database) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        _run(ledger, a, 1)
        _run(ledger, b, 2)
    with db.connect() as conn:
        found = diff_sessions(conn, Named("session", str(a), a), Named("session", str(b), b))
        same = diff_sessions(conn, Named("session", str(a), a), Named("session", str(a), a))
    assert found.diverged and not same.diverged
    shown = json.loads(found.to_json())
    assert (shown["common_steps"], shown["step"], shown["reason"]) == (
        1,
        2,
        "different tool result",
    )
    assert shown["fields"] == [{"field": "result", "a": 1, "b": 2}]
