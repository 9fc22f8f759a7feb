"""An OpenAI Agents SDK ``Session`` on the ledger: a conversation's history as append-only
events of one ledger session.

    from ledger_cdc.integrations.openai_agents import LedgerSession
    session = LedgerSession("user-42", ledger)          # ledger: an AsyncLedger
    result = await Runner.run(agent, "Hello", session=session)

    session = LedgerSession.from_url("user-42", url=dsn)  # from sync code too: opens lazily
    result = Runner.run_sync(agent, "Hello", session=session)
    session.close()                                     # or ``await session.close()``

``add_items`` appends one ``openai.items.added`` event holding all its items (one call's items
stay together and in order, whoever else writes), ``pop_item`` one ``openai.item.popped`` naming
the item it removed, ``clear_session`` one ``openai.items.cleared``: nothing is updated or
deleted, the whole history stays in the log (erase it with partitions). A pop decides on what it
read and appends only if the session has not moved since (the writer's ``expected_position``),
else reads again: two concurrent pops never remove the same item, and an add is never lost to a
pop. A session object keeps the history it folded; a read fetches only the events after it.
The session id is the SDK's string; its ledger session is ``uuid5(OPENAI_NAMESPACE, id)``. An
item the SDK's own sessions keep (they store ``json.dumps`` text) but jsonb would refuse or
change — a NUL character, a lone surrogate, NaN or an infinity, a float of 1e16 or more (jsonb
writes it as an integer) — is stored as that JSON text in base64 under the one key
``ledger.item.base64``, and read back as it was.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import uuid
from collections.abc import Generator
from typing import Any

import msgspec

from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.errors import ConcurrentAppendError, ConfigError
from ledger_cdc.events import (
    READ_MAX_DEPTH,
    ItemPopped,
    ItemsAdded,
    ItemsCleared,
    decode_bounded,
)

try:  # the SDK's base class when it is installed (a Session is a protocol: any class will do)
    from agents.memory.session import SessionABC as _Base
    from agents.memory.session_settings import SessionSettings, coerce_session_settings
except ImportError:  # pragma: no cover - without the SDK
    _Base = object  # type: ignore[assignment,misc]
    SessionSettings = coerce_session_settings = None  # type: ignore[assignment,misc]

__all__ = ["OPENAI_NAMESPACE", "LedgerSession", "conversation_session"]

log = logging.getLogger(__name__)
OPENAI_NAMESPACE = uuid.UUID("0b1c6f0e-3f1a-5d2e-8f44-6f70656e6169")
AGENT = "openai-agents"

_EVENTS = (
    "SELECT position, event_type, payload::text FROM agent_events "
    "WHERE session_id = %s AND position > %s ORDER BY position"
)
_added = msgspec.json.Decoder(ItemsAdded)
_popped = msgspec.json.Decoder(ItemPopped)


# PostgreSQL's jsonb holds no NUL character (a tool's output can), no lone surrogate, no NaN or
# infinity, and writes a float of 1e16 or more as an integer (numeric, no exponent): such an item
# is stored as its JSON text (as the SDK's sessions store it) in base64 under this one key
_WRAPPED = "ledger.item.base64"
_EXPONENT = re.compile(rb"[0-9]e[0-9]")  # how msgspec writes a float of 1e16 or more
_BIG_FLOAT = 1e16  # from here on msgspec writes a float with an exponent


def _float_changes(item: Any) -> bool:
    """Whether a float in ``item`` is one jsonb refuses or reads back as an integer."""
    stack = [item]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v) or abs(v) >= _BIG_FLOAT:
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def _stored(item: Any) -> Any:
    try:
        text = msgspec.json.encode(item)
    except UnicodeEncodeError:  # a lone surrogate
        return _wrapped(item, None)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        return item  # the writer refuses it, saying why
    if (
        b"\\u0000" in text
        or (isinstance(item, dict) and list(item) == [_WRAPPED])  # one like it is wrapped too
        or ((b"null" in text or _EXPONENT.search(text)) and _float_changes(item))
    ):
        return _wrapped(item, text)
    return item


def _wrapped(item: Any, encoded: bytes | None) -> Any:
    """The item as JSON text in base64: ``json.dumps``'s (as the SDK's sessions), else the
    ``encoded`` text msgspec made of a type the standard library does not know."""
    try:
        text = json.dumps(item, ensure_ascii=False).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        if encoded is None:
            return item  # the writer refuses it, saying why
        text = encoded
    return {_WRAPPED: base64.b64encode(text).decode()}


def _loaded(item: Any) -> Any:
    if isinstance(item, dict) and list(item) == [_WRAPPED] and isinstance(item[_WRAPPED], str):
        return json.loads(base64.b64decode(item[_WRAPPED]).decode("utf-8", "surrogatepass"))
    return item


def conversation_session(session_id: str) -> uuid.UUID:
    """The ledger session of an SDK session id."""
    return uuid.uuid5(OPENAI_NAMESPACE, str(session_id))


class _History:
    """A session's items as its events fold — (added at, index) → item, in order; a pop removes
    by key — and the last position folded: each read fetches only the events after it."""

    def __init__(self, sid: uuid.UUID) -> None:
        self.sid = sid
        self.items: dict[tuple[int, int], Any] = {}
        self.head = 0

    def fold(self, rows: list[tuple[Any, ...]]) -> _History:
        for position, event_type, text in rows:
            if position <= self.head:  # two reads of one session object may fetch the same
                continue
            self.head = position
            try:
                if event_type == "openai.items.added":
                    added = decode_bounded(_added.decode, text, READ_MAX_DEPTH).items
                    if _WRAPPED in text:  # rare: only then is each item looked at
                        added = [_loaded(it) for it in added]
                    self.items.update(((position, i), it) for i, it in enumerate(added))
                elif event_type == "openai.item.popped":
                    p = decode_bounded(_popped.decode, text, READ_MAX_DEPTH)
                    self.items.pop((p.added_at, p.index), None)
                elif event_type == "openai.items.cleared":
                    self.items.clear()
            # as every reader: a bad row (one nested deeper than the consumer reads too) is skipped
            except (msgspec.DecodeError, ValueError) as e:
                log.warning(
                    "session %s: a %s event that does not fit, skipped: %s", self.sid, event_type, e
                )
        return self


class LedgerSession(_Base):
    """The SDK's ``Session`` protocol (``get_items``, ``add_items``, ``pop_item``,
    ``clear_session``) on an :class:`~ledger_cdc.AsyncLedger`. ``session_settings`` as the SDK's
    sessions take it (a ``SessionSettings`` or its fields as a dict; its ``limit`` is what
    ``get_items()`` and the Runner read when no limit is given)."""

    session_settings: Any = None

    def __init__(
        self,
        session_id: str,
        ledger: AsyncLedger | str,
        *,
        agent_id: str = AGENT,
        session_settings: Any = None,
    ) -> None:
        self.session_id = session_id
        # given a DSN, the session opens its own AsyncLedger at first use, in the event loop
        # that uses it (the SDK's run_sync runs each call in the thread's one loop)
        self._dsn: str | None = ledger if isinstance(ledger, str) else None
        self._ledger: AsyncLedger | None = None if isinstance(ledger, str) else ledger
        self._opened_in: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None
        self.agent_id = agent_id
        if SessionSettings is not None:  # as the SDK's sessions: a dict is coerced, none default
            self.session_settings = (
                SessionSettings()
                if session_settings is None
                else coerce_session_settings(session_settings)
            )
        else:  # pragma: no cover - without the SDK
            self.session_settings = session_settings
        self.ledger_session = conversation_session(session_id)
        self._folded = _History(self.ledger_session)

    @classmethod
    def from_url(
        cls,
        session_id: str,
        *,
        url: str,
        agent_id: str = AGENT,
        session_settings: Any = None,
    ) -> LedgerSession:
        """A session on a pool of its own, opened at first use (so it can be made in sync
        code, as the SDK's ``SQLiteSession``); :meth:`close` closes it."""
        return cls(session_id, url, agent_id=agent_id, session_settings=session_settings)

    @property
    def ledger(self) -> AsyncLedger:
        """The writer the session uses (given, or opened from its DSN at first use)."""
        if self._ledger is None:
            raise ConfigError(
                f"session {self.session_id!r} has not opened its ledger yet: it opens at its "
                "first operation (or closed it)"
            )
        return self._ledger

    async def _open(self) -> AsyncLedger:
        if self._dsn is None:
            return self.ledger
        loop = asyncio.get_running_loop()
        if self._ledger is not None and self._opened_in is loop:
            return self._ledger
        if self._opening is None or self._opened_in is not loop:
            self._opening = asyncio.Lock()
        async with self._opening:  # one pool, however many coroutines ask at once
            if self._ledger is None or self._opened_in is not loop:
                # a pool of a loop that is gone cannot be closed from this one: let it go
                self._ledger = await AsyncLedger.connect(self._dsn)
                self._opened_in = loop
        return self._ledger

    def close(self) -> _Closed:
        """Close the pool the session opened from a DSN (a given ledger stays open: its owner
        closes it). Call it from sync code, as ``SQLiteSession.close()``, or await it, as the
        SDK's async sessions' ``close()``; the session can be used again after (it reopens)."""
        ledger, loop = (self._ledger, self._opened_in) if self._dsn is not None else (None, None)
        if ledger is None:
            return _Closed(None)
        self._ledger = self._opened_in = None
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is loop:
            return _Closed(running.create_task(ledger.close()))
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(ledger.close())  # sync code, after run_sync
        return _Closed(None)

    async def _history(self) -> _History:
        """The history brought up to date: only the events after what this object folded."""
        ledger = await self._open()
        async with ledger.connection() as conn:
            cur = await conn.execute(_EVENTS, (self.ledger_session, self._folded.head))
            rows = await cur.fetchall()
        return self._folded.fold(rows)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The history in order; with ``limit`` (else ``session_settings.limit``), its latest
        ``limit`` items — none for 0, all for a negative one, as the SDK's own sessions do."""
        if limit is None:
            limit = getattr(self.session_settings, "limit", None)
        values = list((await self._history()).items.values())
        if limit is None or limit < 0:
            return values
        return values[-limit:] if limit > 0 else []

    async def add_items(self, items: list[Any]) -> None:
        if not items:
            return
        ledger = await self._open()
        await ledger.append(
            self.ledger_session,
            self.agent_id,
            "openai.items.added",
            ItemsAdded([_stored(it) for it in items]),
        )

    async def pop_item(self) -> Any | None:
        while True:
            history = await self._history()
            last = next(reversed(history.items.items()), None)
            if last is None:
                return None
            (added_at, index), item = last
            head = history.head
            try:
                await (await self._open()).append(
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
        await (await self._open()).append(
            self.ledger_session, self.agent_id, "openai.items.cleared", ItemsCleared()
        )


class _Closed:
    """What :meth:`LedgerSession.close` returns: done already (sync code), or awaitable for
    the close it started in the running loop."""

    def __init__(self, task: asyncio.Task[None] | None) -> None:
        self._task = task

    def __await__(self) -> Generator[Any, None, None]:
        if self._task is not None:
            yield from self._task.__await__()
