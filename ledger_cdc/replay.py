"""Rebuilding contexts from the ledger table: the same reducers as the consumer, from the log.

``rebuild_context(conn, session_id)`` is what a restarted agent worker calls: the latest usable
snapshot (current format and reducer version) at or below ``upto_seq``, plus the events after it,
folded by :mod:`ledger_cdc.fold`. A snapshot of another format is skipped and the fold starts
from zero. ``fold_all`` refolds every session from zero (what ``verify`` compares against).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg

from .errors import InvalidEventError
from .events import EVENT_TYPES, LedgerEvent, decode_payload
from .fold import FORMAT_VERSION, SessionContext, apply, decode_context, reducer_version

__all__ = ["fold_all", "load_events", "rebuild_context", "row_event"]

_COLUMNS = (
    "seq, session_id, position, agent_id, event_type, payload::text, created_at, idempotency_key"
)
_free = msgspec.json.Decoder()


def row_event(row: tuple[Any, ...]) -> LedgerEvent:
    """A row of ``SELECT {_COLUMNS}`` → LedgerEvent (payload typed as the consumer types it)."""
    seq, sid, pos, agent, etype, payload, created, key = row
    value = decode_payload(etype, payload) if etype in EVENT_TYPES else _free.decode(payload)
    return LedgerEvent(seq, sid, pos, agent, etype, value, created, key)


def load_events(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | None = None,
    *,
    after_position: int = 0,
    upto_seq: int | None = None,
) -> Iterator[LedgerEvent | InvalidEventError]:
    """Events in (session, position) order; an invalid payload is yielded as its error."""
    where = ["position > %s"]
    params: list[Any] = [after_position]
    if session_id is not None:
        where.append("session_id = %s")
        params.append(session_id)
    if upto_seq is not None:
        where.append("seq <= %s")
        params.append(upto_seq)
    query = (
        f"SELECT {_COLUMNS} FROM agent_events WHERE {' AND '.join(where)} "  # noqa: S608 - fixed text
        "ORDER BY session_id, position"
    )
    with conn.cursor() as cur:
        cur.execute(query.encode(), params)
        for row in cur:
            try:
                yield row_event(row)
            except InvalidEventError as e:
                yield e


def fold_all(conn: psycopg.Connection[Any]) -> dict[uuid.UUID, SessionContext]:
    """Every session folded from zero (events with invalid payloads are skipped, as the consumer
    dead-letters them)."""
    out: dict[uuid.UUID, SessionContext] = {}
    for ev in load_events(conn):
        if isinstance(ev, InvalidEventError):
            continue
        ctx = out.get(ev.session_id)
        if ctx is None:
            ctx = out[ev.session_id] = SessionContext(ev.session_id)
        apply(ctx, ev)
    return out


def rebuild_context(
    conn: psycopg.Connection[Any], session_id: uuid.UUID | str, upto_seq: int | None = None
) -> SessionContext:
    """The session's context from its latest usable snapshot plus the tail of the log."""
    sid = session_id if isinstance(session_id, uuid.UUID) else uuid.UUID(str(session_id))
    q = (
        "SELECT upto_position, context::text FROM agent_snapshots WHERE session_id = %s "
        "AND format_version = %s AND reducer_version = %s"
    )
    params: list[Any] = [sid, FORMAT_VERSION, reducer_version()]
    if upto_seq is not None:
        q += " AND upto_seq <= %s"
        params.append(upto_seq)
    row = conn.execute((q + " ORDER BY upto_seq DESC LIMIT 1").encode(), params).fetchone()
    ctx = decode_context(row[1]) if row else SessionContext(sid)
    after = int(row[0]) if row else 0
    for ev in load_events(conn, sid, after_position=after, upto_seq=upto_seq):
        if isinstance(ev, InvalidEventError):
            continue
        apply(ctx, ev)
    return ctx
