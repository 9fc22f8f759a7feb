"""admit_row: the one rule by which every reader, stream or table, admits a row."""

from __future__ import annotations

import datetime as dt
import uuid

from ledger_cdc.events import LedgerEvent, Rejected, TaskFailed, admit_row

SID = uuid.uuid4()
NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
DIGEST = b"\x01" * 32


def test_a_whole_row_is_an_event_with_its_typed_payload() -> None:
    ev = admit_row(7, SID, 3, "a", "task.failed", b'{"error":"x"}', NOW, "k", DIGEST)
    assert ev == LedgerEvent(7, SID, 3, "a", "task.failed", TaskFailed("x"), NOW, "k", DIGEST)


def test_a_hash_read_as_text_is_its_bytes() -> None:
    ev = admit_row(7, SID, 3, "a", "task.failed", b'{"error":"x"}', NOW, None, "\\x0102")
    assert type(ev) is LedgerEvent and ev.hash == b"\x01\x02"


def test_a_row_without_a_payload_is_rejected_with_the_reason() -> None:
    r = admit_row(7, SID, 3, "a", "task.failed", None, NOW, "k", DIGEST)
    assert type(r) is Rejected and not r.unplaced
    assert r.reason.startswith("event seq 7: payload is NULL")
    assert (r.idempotency_key, r.hash) == ("k", DIGEST)


def test_a_time_readers_cannot_hold_is_kept_as_text_on_the_rejected_row() -> None:
    r = admit_row(7, SID, 3, "a", "task.failed", b"{}", None, None, None, "infinity")
    assert type(r) is Rejected
    assert r.created_at == "infinity" and "created_at infinity" in r.reason


def test_a_payload_that_does_not_fit_its_type_is_rejected() -> None:
    r = admit_row(7, SID, 3, "a", "task.failed", b'{"error":1}', NOW, None, None)
    assert type(r) is Rejected and "task.failed payload is invalid" in r.reason


def test_a_row_of_no_session_is_unplaced() -> None:
    r = admit_row(7, None, 3, "a", "task.failed", b'{"error":"x"}', NOW, None, None)
    assert type(r) is Rejected and r.unplaced and "session_id" in r.reason
