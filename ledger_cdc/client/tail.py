"""Following one session live: from JetStream when it is configured, else from PostgreSQL.

Both read what the consumer has committed, in position order, and never poll the ledger in a
loop: the JetStream follower is an ordered consumer on ``ledger.events.<session>``; the
PostgreSQL follower LISTENs on ``ledger_sessions`` (the consumer NOTIFYs ``<session>:<position>``
in each batch's transaction) and reads the new events by (session, position), with a re-check
every few seconds so a missed notification only delays a line.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import msgspec
import psycopg

from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.connect import open_session_async
from ledger_cdc.errors import ConfigError, DatabaseUnavailable
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.names import SESSIONS_CHANNEL
from ledger_cdc.natswire import (
    WireEvent,
    events_subject,
    events_wildcard,
    left_out,
    read_event,
    rejected_event,
    wire_event,
)
from ledger_cdc.sink.jetstream import JetStreamSettings

__all__ = ["follow_jetstream", "follow_postgres"]

log = logging.getLogger(__name__)

_AFTER = (
    f"SELECT {COLUMNS} FROM agent_events WHERE session_id = %s AND position > %s "  # noqa: S608
    "AND position <= coalesce((SELECT last_position FROM agent_sessions WHERE session_id = %s), 0) "
    "ORDER BY position LIMIT %s"
)
_PAGE = 1000


async def follow_postgres(
    dsn: str, session_id: uuid.UUID, *, after: int = 0, recheck: float = 3.0
) -> AsyncIterator[LedgerEvent | Rejected]:
    """Events of the session after position ``after``, as the consumer folds them (a row the
    consumer quarantined comes as :class:`~ledger_cdc.events.Rejected`). It takes a DSN, not a
    connection: it opens a session of its own, which listens and waits idle (its timeouts
    lifted) for as long as it is iterated."""
    # (lift: it waits idle for notifications)
    async with await open_session_async(dsn, lift=True, autocommit=True) as conn:
        await conn.execute(f"LISTEN {SESSIONS_CHANNEL}")
        last = after
        prefix = f"{session_id}:"
        while True:
            while True:  # a long history a page at a time, never all at once
                cur = await conn.execute(_AFTER.encode(), (session_id, last, session_id, _PAGE))
                rows = await cur.fetchall()
                for row in rows:
                    ev = row_event(row)
                    last = row[2] if type(row[2]) is int else last
                    yield ev
                if len(rows) < _PAGE:
                    break
            async for n in conn.notifies(timeout=recheck):
                if n.payload.startswith(prefix):
                    break


async def follow_jetstream(
    settings: JetStreamSettings,
    session_id: uuid.UUID,
    *,
    after: int = 0,
    dsn: str | None = None,
) -> AsyncIterator[LedgerEvent | Rejected]:
    """Events of the session from the JetStream stream (all of them, then live), by the URL's
    stream and subject prefix. A payload that does not fit its type comes as Rejected, by the
    rule every reader shares. An event published without its payload (larger than the NATS
    server takes) is read from ``agent_events`` through ``dsn`` (a connection opened for that
    read alone, rare, while the stream is followed for as long as it is iterated); without one
    it comes as Rejected, saying so."""
    import nats
    from nats.js.errors import NotFoundError

    session_id = uuid.UUID(str(session_id))  # a caller's string compares with the wire's UUID

    async def quiet(e: Exception) -> None:  # (nats-py's own handler prints a traceback)
        log.debug("NATS: %s", e)

    try:
        nc = await nats.connect(
            servers=settings.servers,
            connect_timeout=5,
            max_reconnect_attempts=3,
            error_cb=quiet,
        )
    except Exception as e:
        raise DatabaseUnavailable(
            f"cannot reach NATS at {', '.join(settings.servers)}: {type(e).__name__}: {e}"
        ) from e
    try:
        js = nc.jetstream()
        subject = events_subject(settings.prefix, session_id)
        try:
            info = await js.stream_info(settings.stream)
        except NotFoundError as e:
            raise ConfigError(
                f"JetStream stream {settings.stream!r} does not exist at "
                f"{', '.join(settings.servers)} (a consumer creates it: ledger-cdc consume "
                "--sink nats://…; or give ?stream= of the one it uses)"
            ) from e
        carried = list(getattr(info.config, "subjects", None) or [])
        if events_wildcard(settings.prefix) not in carried:  # (would wait for ever, saying nothing)
            raise ConfigError(
                f"JetStream stream {settings.stream!r} does not carry {settings.prefix}.events.* "
                f"(its subjects: {', '.join(carried) or 'none'}): give ?prefix= of the one "
                "its consumer publishes under"
            )
        sub = await js.subscribe(subject, stream=settings.stream, ordered_consumer=True)
        while True:
            try:
                msg = await sub.next_msg(timeout=3600)
            except asyncio.TimeoutError:
                continue
            try:
                w = read_event(msg.data)
            # not what a consumer publishes (or nested deeper than one could be): no event
            except msgspec.DecodeError as e:
                log.warning("skipped a message on %s that is not an event: %s", subject, e)
                continue
            if w.session_id != session_id or w.position <= after:
                continue
            after = w.position
            if left_out(w):
                yield await _omitted_event(dsn, w)
                continue
            yield wire_event(w, bytes(w.payload))
    finally:
        await nc.close()


_ONE = f"SELECT {COLUMNS} FROM agent_events WHERE session_id = %s AND position = %s"  # noqa: S608


async def _omitted_event(dsn: str | None, w: WireEvent) -> LedgerEvent | Rejected:
    why = f"published without its payload ({w.omitted:,} bytes, over the NATS server's max_payload)"
    if dsn is not None:
        try:
            async with await open_session_async(dsn, autocommit=True) as conn:
                cur = await conn.execute(_ONE.encode(), (w.session_id, w.position))
                row = await cur.fetchone()
        except psycopg.Error as e:
            first = str(e).strip().splitlines()[0]
            return rejected_event(w, f"{why}; cannot read it from agent_events: {first}")
        if row is not None:
            return row_event(row)
        why += "; not in agent_events either (archived?)"
    else:
        why += ": give --dsn to read it from agent_events"
    return rejected_event(w, why)
