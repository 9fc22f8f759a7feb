"""An OpenAI Agents SDK ``Session`` on the ledger: a conversation's history as append-only
events of one ledger session.

    from ledger_cdc.integrations.openai_agents import LedgerSession
    session = LedgerSession("user-42", ledger)          # ledger: an AsyncLedger
    result = await Runner.run(agent, "Hello", session=session)

``add_items`` appends one ``openai.items.added`` event holding all its items (one call's items
stay together and in order, whoever else writes), ``pop_item`` one ``openai.item.popped`` naming
the item it removed, ``clear_session`` one ``openai.items.cleared``: nothing is updated or
deleted, the whole history stays in the log (erase it with partitions). A pop decides on what it
read and appends only if the session has not moved since (the writer's ``expected_position``),
else reads again: two concurrent pops never remove the same item, and an add is never lost to a
pop. The session id is the SDK's string; its ledger session is ``uuid5(OPENAI_NAMESPACE, id)``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import msgspec

from ledger_cdc.client.steps import Step, Steps, run_async
from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.errors import ConcurrentAppendError
from ledger_cdc.events import ItemPopped, ItemsAdded, ItemsCleared

try:  # the SDK's base class when it is installed (a Session is a protocol: any class will do)
    from agents.memory.session import SessionABC as _Base
except ImportError:  # pragma: no cover - without the SDK
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["OPENAI_NAMESPACE", "LedgerSession", "conversation_session"]

log = logging.getLogger(__name__)
OPENAI_NAMESPACE = uuid.UUID("0b1c6f0e-3f1a-5d2e-8f44-6f70656e6169")
AGENT = "openai-agents"

_EVENTS = (
    "SELECT position, event_type, payload::text FROM agent_events "
    "WHERE session_id = %s ORDER BY position"
)
_added = msgspec.json.Decoder(ItemsAdded)
_popped = msgspec.json.Decoder(ItemPopped)


def conversation_session(session_id: str) -> uuid.UUID:
    """The ledger session of an SDK session id."""
    return uuid.uuid5(OPENAI_NAMESPACE, str(session_id))


def _history_steps(sid: uuid.UUID) -> Steps[tuple[list[tuple[int, int, Any]], int]]:
    """The session's items as (added at, index, item), and the session's last position."""
    rows = yield Step(_EVENTS, (sid,))
    items: dict[tuple[int, int], Any] = {}  # (added at, index) → item, in order; pop by key
    head = 0
    for position, event_type, text in rows:
        head = position
        try:
            if event_type == "openai.items.added":
                added = _added.decode(text).items
                items.update(((position, i), it) for i, it in enumerate(added))
            elif event_type == "openai.item.popped":
                p = _popped.decode(text)
                items.pop((p.added_at, p.index), None)
            elif event_type == "openai.items.cleared":
                items.clear()
        except msgspec.DecodeError as e:  # as every reader does: one bad row is skipped
            log.warning("session %s: a %s event that does not fit, skipped: %s", sid, event_type, e)
    return [(at, i, it) for (at, i), it in items.items()], head


class LedgerSession(_Base):
    """The SDK's ``Session`` protocol (``get_items``, ``add_items``, ``pop_item``,
    ``clear_session``) on an :class:`~ledger_cdc.AsyncLedger`."""

    session_settings: Any = None

    def __init__(self, session_id: str, ledger: AsyncLedger, *, agent_id: str = AGENT) -> None:
        self.session_id = session_id
        self.ledger = ledger
        self.agent_id = agent_id
        self.ledger_session = conversation_session(session_id)

    async def _history(self) -> tuple[list[tuple[int, int, Any]], int]:
        async with self.ledger.connection() as conn:
            return await run_async(conn, _history_steps(self.ledger_session))

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The history in order; with ``limit``, its latest ``limit`` items."""
        items, _ = await self._history()
        values = [it for _, _, it in items]
        if limit is not None:
            return values[-limit:] if limit > 0 else []
        return values

    async def add_items(self, items: list[Any]) -> None:
        if not items:
            return
        await self.ledger.append(
            self.ledger_session, self.agent_id, "openai.items.added", ItemsAdded(list(items))
        )

    async def pop_item(self) -> Any | None:
        while True:
            items, head = await self._history()
            if not items:
                return None
            added_at, index, item = items[-1]
            try:
                await self.ledger.append(
                    self.ledger_session,
                    self.agent_id,
                    "openai.item.popped",
                    ItemPopped(added_at, index),
                    expected_position=head,
                )
            except ConcurrentAppendError:
                continue  # the session moved on: decide again on what it holds now
            return item

    async def clear_session(self) -> None:
        await self.ledger.append(
            self.ledger_session, self.agent_id, "openai.items.cleared", ItemsCleared()
        )
