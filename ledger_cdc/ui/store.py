"""What the web view reads, and only reads: every query here runs in a read-only transaction
(``default_transaction_read_only``), on the connection of the DSN it was given (a member of
``ledger_reader`` is enough).

Nothing is loaded whole that can be large: the session list and a session's timeline are read a
page at a time by index (``agent_sessions`` by last activity, ``agent_events`` by (session,
position)); a payload past :data:`INLINE_BYTES` is not fetched with its page but read in
chunks of :data:`CHUNK` characters on its own page. A session's state comes from its projection
(one row), its calls' first invocations from ``agent_memo`` by primary key.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psycopg

from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.events import LedgerEvent, Rejected

__all__ = ["CHUNK", "INLINE_BYTES", "PAGE", "SessionRow", "Store", "TimelinePage"]

PAGE = 100
"""Events on a page of the timeline (and sessions on a page of the list)."""
INLINE_BYTES = 64 * 1024
"""A payload up to this size comes with its page; a larger one is read on its own page."""
CHUNK = 64 * 1024
"""Characters of a large payload shown per page."""


@dataclass(frozen=True)
class SessionRow:
    session_id: uuid.UUID
    status: str
    events: int
    last_position: int
    updated_at: dt.datetime | None
    framework: dict[str, Any]  # the agent_framework projection's state ({} if none)
    agents: list[str]
    projected: bool = True  # False: listed from the ledger (no projection yet)


@dataclass
class TimelinePage:
    session: SessionRow | None  # None: no projection (the consumer has not folded it yet)
    head: int  # the last position in the ledger
    events: list[LedgerEvent | Rejected]
    large: dict[int, int]  # position → payload size of those not fetched with the page
    pending_tools: dict[str, Any] = field(default_factory=dict)  # call id → PendingTool (JSON)
    first_invoked: dict[str, int] = field(default_factory=dict)  # call id → its first seq
    snapshots: list[tuple[int, dt.datetime]] = field(default_factory=list)


_SESSIONS = """
SELECT session_id, status, event_count, last_position, updated_at,
       context->'extra'->'agent_framework', context->'agents'
FROM agent_sessions
ORDER BY updated_at DESC, session_id
LIMIT %s OFFSET %s
"""
_LEDGER_SESSIONS = """
SELECT session_id, max(position), max(created_at), array_agg(DISTINCT agent_id)
FROM agent_events GROUP BY session_id ORDER BY 3 DESC, 1 LIMIT %s OFFSET %s
"""
_ONE = """
SELECT session_id, status, event_count, last_position, updated_at,
       context->'extra'->'agent_framework', context->'agents', context->'pending_tools'
FROM agent_sessions WHERE session_id = %s
"""
# the page's rows; a large payload's text is left out (its size says so)
_PAGE_COLUMNS = COLUMNS.replace(
    "payload::text",
    f"CASE WHEN octet_length(payload::text) <= {INLINE_BYTES} THEN payload::text END",
)
_EVENTS = (
    f"SELECT {_PAGE_COLUMNS}, octet_length(payload::text) FROM agent_events "  # noqa: S608
    "WHERE session_id = %s AND position > %s AND position <= %s ORDER BY position LIMIT %s"
)
_HEAD = "SELECT max(position) FROM agent_events WHERE session_id = %s"
_FIRST_INVOKED = """
SELECT call_id, min((entry->>'invoked_seq')::bigint) FROM agent_memo
WHERE session_id = %s AND kind = 'tool' AND call_id = ANY(%s) GROUP BY call_id
"""
_SNAPSHOTS = """
SELECT upto_position, created_at FROM agent_snapshots WHERE session_id = %s
ORDER BY upto_position DESC LIMIT 50
"""
_CHUNK = (
    "SELECT event_type, length(payload::text), substr(payload::text, %s, %s) "
    "FROM agent_events WHERE session_id = %s AND position = %s"
)
_json = msgspec.json.Decoder()


def _framework(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = _json.decode(value)
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    if isinstance(value, str):
        value = _json.decode(value)
    return value if isinstance(value, list) else []


class Store:
    """The web view's reads, each on a fresh read-only connection of ``dsn``."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        from ledger_cdc.connect import connect

        with connect(self.dsn, autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = on")
            yield conn

    def writable(self) -> bool:
        """Whether the DSN's role could append to the ledger (the view never does; a
        ``ledger_reader`` role is the one to give it)."""
        with self.connection() as conn:
            row = conn.execute(
                "SELECT has_table_privilege(current_user, 'agent_events', 'INSERT')"
            ).fetchone()
        return bool(row and row[0])

    def sessions(self, page: int) -> tuple[list[SessionRow], bool]:
        """A page of sessions, the latest active first, and whether more follow."""
        with self.connection() as conn:
            rows = conn.execute(_SESSIONS, (PAGE + 1, page * PAGE)).fetchall()
            out = [
                SessionRow(r[0], r[1], r[2], r[3], r[4], _framework(r[5]), _list(r[6]))
                for r in rows
            ]
            if not out and page == 0:  # no projections (no consumer yet): what the ledger has
                rows = conn.execute(_LEDGER_SESSIONS, (PAGE + 1, 0)).fetchall()
                out = [
                    SessionRow(r[0], "—", r[1], r[1], r[2], {}, list(r[3]), projected=False)
                    for r in rows
                ]
        return out[:PAGE], len(out) > PAGE

    def timeline(self, sid: uuid.UUID, after: int | None, last: bool = False) -> TimelinePage:
        """A page of a session's events after position ``after`` (``last``: the last page)."""
        with self.connection() as conn:
            one = conn.execute(_ONE, (sid,)).fetchone()
            head_row = conn.execute(_HEAD, (sid,)).fetchone()
            head = int(head_row[0]) if head_row and head_row[0] is not None else 0
            if last:
                after = max(head - PAGE, 0)
            start = after or 0
            # positions are dense: the window is the page (found by index whatever the
            # planner's statistics say); a hole (history archived) falls back to LIMIT
            rows = conn.execute(_EVENTS, (sid, start, min(head, start + PAGE), PAGE)).fetchall()
            if not rows and start < head:
                rows = conn.execute(_EVENTS, (sid, start, head, PAGE)).fetchall()
            session = None
            pending: dict[str, Any] = {}
            if one is not None:
                session = SessionRow(
                    one[0], one[1], one[2], one[3], one[4], _framework(one[5]), _list(one[6])
                )
                p = one[7]
                pending = (_json.decode(p) if isinstance(p, str) else p) or {}
            events: list[LedgerEvent | Rejected] = []
            large: dict[int, int] = {}
            for r in rows:
                *cols, size = r
                if cols[5] is None and size is not None:
                    large[int(cols[2])] = int(size)
                    cols[5] = "{}"  # shown by its size; read on its own page
                events.append(row_event(cols))
            calls = [
                str(e.payload.call_id)
                for e in events
                if type(e) is LedgerEvent
                and e.event_type == "tool.invoked"
                and hasattr(e.payload, "call_id")
            ]
            first = dict(conn.execute(_FIRST_INVOKED, (sid, calls)).fetchall()) if calls else {}
            for call, p in pending.items():
                if isinstance(p, dict) and isinstance(p.get("invoked_seq"), int):
                    first.setdefault(call, p["invoked_seq"])
            snaps = [(int(a), b) for a, b in conn.execute(_SNAPSHOTS, (sid,)).fetchall()]
        return TimelinePage(session, head, events, large, pending, first, snaps)

    def chunk(self, sid: uuid.UUID, position: int, offset: int) -> tuple[str, int, str] | None:
        """(event type, payload length, ``CHUNK`` characters of its JSON from ``offset``)."""
        with self.connection() as conn:
            row = conn.execute(_CHUNK, (offset + 1, CHUNK, sid, position)).fetchone()
        return None if row is None else (row[0], int(row[1]), row[2] or "")

    def event(self, sid: uuid.UUID, position: int) -> LedgerEvent | Rejected | None:
        from ledger_cdc.client.read import load_events

        with self.connection() as conn:
            got = list(load_events(conn, sid, after_position=position - 1, upto_position=position))
        return got[0] if got else None

    def events(self, sid: uuid.UUID) -> Sequence[LedgerEvent | Rejected]:
        """A session's events whole (for a diff)."""
        from ledger_cdc.client.read import load_events

        with self.connection() as conn:
            return list(load_events(conn, sid))

    def resolve(self, text: str) -> Any:
        """A name as the command line takes it (a UUID, thread:ID, …, or a bare name)."""
        from ledger_cdc.client.frameworks import parse_name, resolve

        with self.connection() as conn:
            return resolve(conn, parse_name(text))

    def health(self) -> list[Any]:
        """Every logical slot's health, as ``ledger-cdc lag`` reports it (no rate sample)."""
        from ledger_cdc.admin.health import check_slots

        with self.connection() as conn:
            return check_slots(conn, sample_seconds=0)
