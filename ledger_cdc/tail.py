"""Following one session live: from JetStream when it is configured, else from PostgreSQL.

Both read what the consumer has committed, in position order, and never poll the ledger in a
loop: the JetStream follower is an ordered consumer on ``ledger.events.<session>``; the
PostgreSQL follower LISTENs on ``ledger_sessions`` (the consumer NOTIFYs ``<session>:<position>``
in each batch's transaction) and reads the new events by (session, position), with a re-check
every few seconds so a missed notification only delays a line.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import psycopg

from .events import LedgerEvent, Rejected
from .replay import _COLUMNS, row_event
from .sink import SESSIONS_CHANNEL

__all__ = ["follow_jetstream", "follow_postgres"]

_AFTER = (
    f"SELECT {_COLUMNS} FROM agent_events WHERE session_id = %s AND position > %s "  # noqa: S608
    "AND position <= coalesce((SELECT last_position FROM agent_sessions WHERE session_id = %s), 0) "
    "ORDER BY position"
)


async def follow_postgres(
    dsn: str, session_id: uuid.UUID, *, after: int = 0, recheck: float = 3.0
) -> AsyncIterator[LedgerEvent | Rejected]:
    """Events of the session after position ``after``, as the consumer folds them (a row the
    consumer quarantined comes as :class:`~ledger_cdc.events.Rejected`)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f"LISTEN {SESSIONS_CHANNEL}")
        last = after
        prefix = f"{session_id}:"
        while True:
            cur = await conn.execute(_AFTER.encode(), (session_id, last, session_id))
            for row in await cur.fetchall():
                ev = row_event(row)
                last = ev.position
                yield ev
            async for n in conn.notifies(timeout=recheck):
                if n.payload.startswith(prefix):
                    break


async def follow_jetstream(
    servers: list[str], session_id: uuid.UUID, *, after: int = 0, prefix: str = "ledger"
) -> AsyncIterator[LedgerEvent]:
    """Events of the session from the JetStream stream (all of them, then live)."""
    import datetime as dt

    import nats

    from .events import EVENT_TYPES, decode_payload
    from .jetstream import WireEvent

    nc = await nats.connect(servers=servers, connect_timeout=5)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(f"{prefix}.events.{session_id}", ordered_consumer=True)
        dec = msgspec.json.Decoder(WireEvent)
        while True:
            try:
                msg = await sub.next_msg(timeout=3600)
            except asyncio.TimeoutError:
                continue
            w = dec.decode(msg.data)
            if w.position <= after:
                continue
            after = w.position
            raw = msgspec.json.encode(w.payload)
            payload = (
                decode_payload(w.event_type, raw) if w.event_type in EVENT_TYPES else w.payload
            )
            created = dt.datetime.fromisoformat(str(w.created_at))
            yield LedgerEvent(
                w.seq,
                w.session_id,
                w.position,
                w.agent_id,
                w.event_type,
                payload,
                created,
                w.idempotency_key,
            )
    finally:
        await nc.close()
