"""Reading the ledger table: rows to typed events by the rule every reader shares.

:func:`row_event` turns a row into a :class:`~ledger_cdc.events.LedgerEvent`, or a
:class:`~ledger_cdc.events.Rejected` with the reason (never an exception), the same rule the
stream applies; :func:`load_events` reads in (session, position) order, :func:`fold_all` refolds
every session from zero (what ``verify`` compares against).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.connect import open_session_async
from ledger_cdc.errors import ConfigError
from ledger_cdc.events import LedgerEvent, Rejected, admit_row
from ledger_cdc.fold import SessionContext, decode_context, fold_one
from ledger_cdc.names import RUNS_CHANNEL

__all__ = [
    "COLUMNS",
    "events_query",
    "fold_all",
    "load_events",
    "load_events_sized",
    "projected_contexts",
    "row_event",
]

# created_at outside what every reader can hold (events.MIN_TIME..MAX_TIME) is selected as text
# in the last column instead: loading it as a time would raise in the driver, on any path.
COLUMNS = (
    "seq, session_id, position, agent_id, event_type, payload::text, "
    "CASE WHEN created_at BETWEEN '0001-01-02 00:00+00' AND '9999-12-30 00:00+00' "
    "THEN created_at END, idempotency_key, hash, "
    "CASE WHEN created_at BETWEEN '0001-01-02 00:00+00' AND '9999-12-30 00:00+00' "
    "THEN NULL ELSE created_at::text END"
)
_NCOLS = 10


def row_event(row: Sequence[Any]) -> LedgerEvent | Rejected:
    """A row of ``SELECT {COLUMNS}`` → LedgerEvent (payload typed as the consumer types it), or
    :class:`Rejected` with the reason, by the rule every reader shares. Never raises."""
    seq, sid, pos, agent, etype, payload, created, key, digest, bad_time = row
    if type(payload) is bytes or type(agent) is bytes:  # SQL_ASCII: psycopg leaves text undecoded
        agent, etype, payload, key, bad_time = (
            v.decode("utf-8", "replace") if type(v) is bytes else v
            for v in (agent, etype, payload, key, bad_time)
        )
    return admit_row(seq, sid, pos, agent, etype, payload, created, key, digest, bad_time)


def events_query(
    session_id: uuid.UUID | None,
    after_position: int,
    upto_seq: int | None,
    upto_position: int | None = None,
) -> tuple[bytes, list[Any]]:
    where = ["position > %s"]
    params: list[Any] = [after_position]
    if upto_position is not None:
        where.append("position <= %s")
        params.append(upto_position)
    if session_id is not None:
        where.append("session_id = %s")
        params.append(session_id)
    if upto_seq is not None:
        where.append("seq <= %s")
        params.append(upto_seq)
    query = (
        f"SELECT {COLUMNS} FROM agent_events WHERE {' AND '.join(where)} "  # noqa: S608 - fixed text
        "ORDER BY session_id, position"
    )
    return query.encode(), params


def load_events(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | None = None,
    *,
    after_position: int = 0,
    upto_seq: int | None = None,
    upto_position: int | None = None,
) -> Iterator[LedgerEvent | Rejected]:
    """Events in (session, position) order; a row no reader can fold comes as :class:`Rejected`
    (never an exception), to be quarantined by :func:`ledger_cdc.fold.fold_one`."""
    query, params = events_query(session_id, after_position, upto_seq, upto_position)
    with conn.cursor() as cur:
        cur.execute(query, params)
        for row in cur:
            yield row_event(row)


def load_events_sized(
    conn: psycopg.Connection[Any], *, itersize: int = 2000
) -> Iterator[tuple[LedgerEvent | Rejected, int]]:
    """Every event in (session, position) order with the size of its payload's JSON, read by a
    server-side cursor (in the caller's transaction): the table is never held in memory."""
    query, params = events_query(None, 0, None)
    with conn.cursor(name="ledger_events_all") as cur:
        cur.itersize = itersize
        cur.execute(query, params)
        for row in cur:
            yield row_event(row), len(row[5] or b"") + 200


def fold_all(conn: psycopg.Connection[Any]) -> dict[uuid.UUID, SessionContext]:
    """Every session folded from zero, as the consumer folds them (quarantining the same
    events)."""
    out: dict[uuid.UUID, SessionContext] = {}
    for ev in load_events(conn):
        if type(ev) is Rejected and ev.unplaced:  # a row of no session (a NULL session_id)
            continue
        ctx = out.get(ev.session_id)
        if ctx is None:
            ctx = out[ev.session_id] = SessionContext(ev.session_id)
        fold_one(ctx, ev)
    return out


# -- projections ---------------------------------------------------------------------------------

_PROJECTED = (
    "SELECT session_id, ledger_full_context(session_id, context)::text FROM agent_sessions "
    "{where} ORDER BY session_id"
)


def projected_contexts(
    conn: psycopg.Connection[Any], session_ids: Sequence[uuid.UUID] | None = None
) -> dict[uuid.UUID, SessionContext]:
    """The projections of these sessions (all if None), each context whole: its window's
    messages read from their ``context.loaded`` event and its completed calls from
    ``agent_memo`` (``agent_sessions.context`` stores neither; SQL readers use the
    ``agent_session_contexts`` view or ``ledger_session_context(session_id)``)."""
    where = "" if session_ids is None else "WHERE session_id = ANY(%s)"
    params = () if session_ids is None else (list(session_ids),)
    return {
        sid: decode_context(text)
        for sid, text in conn.execute(_PROJECTED.format(where=where).encode(), params)
    }


# -- runs ready to lease -------------------------------------------------------------------

_CHANNEL_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_channel(channel: str) -> str:
    if not _CHANNEL_RE.match(channel):
        raise ConfigError(
            f"invalid notification channel {channel!r}: use lower-case letters, digits, _"
        )
    return channel


@dataclass(frozen=True)
class ReadyRun:
    session_id: uuid.UUID
    status: str  # pending | stale
    position: int  # the projection's last position when it was found ready
    lease_worker: str | None  # the previous holder of a stale run


_READY = """
SELECT session_id, CASE WHEN run_status = 'pending' THEN 'pending' ELSE 'stale' END,
       last_position, lease_worker
FROM agent_sessions
WHERE run_status = 'pending' OR (run_status = 'running' AND lease_until <= statement_timestamp())
ORDER BY updated_at
LIMIT %s
"""


async def pending_runs(
    dsn: str, *, channel: str = RUNS_CHANNEL, recheck: float = 2.0, limit: int = 1000
) -> AsyncIterator[ReadyRun]:
    """Runs ready to lease, as they become ready: woken by the consumer's notifications, with a
    re-check of the projections every ``recheck`` seconds. A run is yielded again only when its
    projection moved on, or after ``recheck`` seconds if it is still ready (nobody took it).
    It takes a DSN, not a connection: it opens a session of its own, which listens and waits
    idle (its timeouts lifted) for as long as it is iterated."""
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(check_channel(channel)))
    # (lift: it waits idle for notifications)
    async with await open_session_async(dsn, lift=True, autocommit=True) as conn:
        await conn.execute(listen)
        seen: dict[uuid.UUID, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            rows = await (await conn.execute(_READY, (limit,))).fetchall()
            for sid, status, position, worker in rows:
                last = seen.get(sid)
                if last is not None and last[0] == position and now - last[1] < recheck:
                    continue
                seen[sid] = (int(position), now)
                yield ReadyRun(sid, status, int(position), worker)
            if len(seen) > 4 * limit:  # forget runs that are long gone
                seen = {k: v for k, v in seen.items() if now - v[1] < recheck}
            async for _ in conn.notifies(timeout=recheck, stop_after=1):
                pass
            await asyncio.sleep(0)
