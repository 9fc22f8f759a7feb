"""Fan-out on NATS JetStream: every committed ledger event and every projection change.

``consume --sink nats://host:4222[,nats://other:4222]`` adds this publisher to the PostgreSQL
projections. For each batch, in commit order, it publishes each event to
``ledger.events.<session_id>`` and each changed projection to ``ledger.sessions.<session_id>``,
waits until JetStream has acknowledged every message, and only then lets the sink commit the
batch's checkpoint. Each message carries ``Nats-Msg-Id`` derived from the slot and the event
(``<slot>:ev:<session>:<position>``, ``<slot>:ctx:<session>:<position>``), so the batch a crashed
consumer published but did not checkpoint is re-published after the restart and dropped by the
server as a duplicate.

Guarantee: a subscriber (a durable consumer with explicit acks) receives every event exactly
once and, per session, in position order, however long the consumer was down. Two mechanisms:
within the stream's duplicate window (``duplicate_window``, 2 minutes by default) the server drops
a message whose ``Nats-Msg-Id`` it has seen; beyond it, the publisher itself skips what the
stream already holds: the first time a connection publishes to a session's subject, it reads the
subject's last message (one request, answered by the stream) and publishes only the positions
after it. The one exception: a consumer frozen mid-publish for longer than the window (SIGSTOP, a
paused VM) that resumes after another consumer took the slot over can publish its batch again
before its PostgreSQL commit is refused (fencing); its messages carry session and position, so a
subscriber can drop them. No order is promised across sessions beyond commit order within a
batch.

A batch of at least ``FAST_MIN`` messages is one fast-ingest batch (JetStream batch
publishing, ADR-50, nats-server 2.14+, a stream with ``allow_batched``): the server acknowledges
every few hundred messages, stores the batch in order up to its first gap ("fail" mode) and
counts what it took in its final acknowledgement, which the publisher checks. Smaller batches,
and streams or servers without batching, are acknowledged message by message.

nats-py is asynchronous; the publisher runs its own event loop on a thread, and the sink thread
waits on it. Its parts: the wire format (:mod:`ledger_cdc.natswire`), the settings
(:mod:`.jetstream_settings`), the connection (:mod:`.jetstream_link`), the stream and what it
holds (:mod:`.jetstream_stream`), acknowledgements message by message (:mod:`.jetstream_acks`)
and fast-ingest batches (:mod:`.jetstream_fast`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from ledger_cdc.errors import ConfigError, JetStreamError, LedgerError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.natswire import HeaderBlock, Message, WireEvent, messages
from ledger_cdc.sink.jetstream_acks import Acks
from ledger_cdc.sink.jetstream_fast import FAST_MIN, FastIngest
from ledger_cdc.sink.jetstream_link import Link, require_nats, subscribe_raw
from ledger_cdc.sink.jetstream_settings import JetStreamSettings
from ledger_cdc.sink.jetstream_stream import StreamHeads, batching, ensure_stream, high_water

__all__ = [
    "STOP_GRACE",
    "JetStreamError",
    "JetStreamPublisher",
    "JetStreamSettings",
    "Publishing",
    "WireEvent",
    "require_nats",
    "subscribe_raw",
]

log = logging.getLogger(__name__)

# once the process is asked to stop, a publish (or a connect) still unanswered this many
# seconds later is given up, whatever ack_timeout says: its batch was not checkpointed, and is
# published again when the consumer next starts
STOP_GRACE = 5.0

_Events = Sequence[tuple[LedgerEvent | Rejected, int]]


class JetStreamPublisher:
    """Publishes batches to one JetStream stream; :meth:`publish` blocks until all are acked."""

    def __init__(self, settings: JetStreamSettings, slot: str) -> None:
        require_nats("the JetStream sink")
        self.settings = settings
        self.slot = slot
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ledger-cdc-nats", daemon=True
        )
        self._thread.start()
        # when stopping() was called (monotonic), by the process or by close(): from then on
        # the end of the connection is ours, not a fault
        self._stop_at: float | None = None
        self._link = Link(settings, slot, stopped=lambda: self._stop_at is not None)
        self._known = StreamHeads()
        self._acks = Acks(settings.ack_timeout, settings.prefix)
        self._fast = FastIngest(self._acks, settings.stream, settings.prefix)
        self.published = 0
        self.skipped = 0  # messages not published: the stream already held their position

    @property
    def heads_read(self) -> int:
        """Subjects whose last message was read (what may be in the stream)."""
        return self._known.read

    @property
    def fast_batches(self) -> int:
        """Batches published as fast-ingest batches."""
        return self._fast.batches

    @property
    def fast_published(self) -> int:
        """Messages published in fast-ingest batches."""
        return self._fast.published

    def stopping(self) -> None:
        """The process is stopping: what is still waited for :data:`STOP_GRACE` seconds from
        now (a batch's acknowledgements, a connection) is given up then, however long
        ``ack_timeout`` is, so a stop never waits on a server that does not answer for longer
        than that; a disconnect from then on is no fault (close() calls it too). Takes no
        lock: safe from any thread, a signal handler's included."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()

    def _run(self, coro: Any, timeout: float) -> Any:
        return self._result(asyncio.run_coroutine_threadsafe(coro, self._loop), timeout, False)

    def _result(
        self, fut: concurrent.futures.Future[Any], timeout: float, stoppable: bool = True
    ) -> Any:
        """``fut``'s result within ``timeout`` (and, when ``stoppable``, within
        :data:`STOP_GRACE` of :meth:`stopping` or of this call, whichever is later: a batch
        the stop itself publishes gets its own grace); else JetStreamError, ``fut`` cancelled
        and the connection marked for a reset."""
        began = time.monotonic()
        deadline = began + timeout
        try:
            while True:
                now = time.monotonic()
                end = deadline
                if stoppable and self._stop_at is not None:
                    end = min(end, max(self._stop_at, began) + STOP_GRACE)
                try:  # (in slices: a stop may come while this waits)
                    return fut.result(max(0.0, min(end - now, 0.25)))
                except (TimeoutError, concurrent.futures.TimeoutError):  # distinct before 3.11
                    if time.monotonic() < end:
                        continue
                if end < deadline:
                    raise JetStreamError(
                        f"stopping: JetStream did not acknowledge within {STOP_GRACE:.0f}s; "
                        "nothing unacknowledged was checkpointed, and it is published again at "
                        "the next start"
                    )
                raise JetStreamError(f"JetStream did not acknowledge within {timeout:.0f}s")
        except JetStreamError:
            fut.cancel()
            self._link.broken = True
            raise
        except BaseException:
            self._link.broken = True
            raise

    async def _reset(self) -> None:
        """After any failure: the connection dropped, and what it knew of the stream."""
        await self._link.reset()
        self._known.forget()

    async def _connect(self) -> None:
        link = self._link
        if link.stale():
            await self._reset()
        if await link.open():
            await self._acks.subscribe(link.nc)
            await self._fast.subscribe(link.nc)
        if link.ready:
            return
        # until the stream exists (a forming cluster may refuse to create it for a while)
        info = await ensure_stream(link.js, self.settings)
        self._fast.on = await batching(link.js, self.settings, info)
        self._known.high = await high_water(link.js, self.settings.stream, self.slot)
        link.ready = True

    def start_connect(self) -> concurrent.futures.Future[None]:
        """Begin :meth:`connect` on the publisher's own thread (the caller does its own work
        meanwhile); pass the result to :meth:`connect` before publishing."""
        return asyncio.run_coroutine_threadsafe(self._connect(), self._loop)

    def connect(
        self, timeout: float = 30, started: concurrent.futures.Future[None] | None = None
    ) -> None:
        """Connect, and make or check the stream (raises JetStreamError if it takes longer
        than ``timeout``: retried by the next publish); ``started``: what
        :meth:`start_connect` began, awaited instead."""
        try:
            self._result(started or self.start_connect(), timeout)
        except LedgerError:  # (a stream it may not change: ConfigError, as it is)
            raise
        except Exception as e:
            raise JetStreamError(
                f"cannot reach JetStream at {', '.join(self.settings.servers)}: {e}"
            ) from e

    async def _publish(self, msgs: list[Message]) -> int:
        """``msgs`` less what the stream holds already, published: how many."""
        await self._connect()
        link, known = self._link, self._known
        # every message carries the highest commit LSN the stream may hold once it is stored:
        # the most of what the stream held when this connection began and of every batch
        # published since. The stream's last message always tells it, whichever batch a restart
        # replays first (a replayed batch may end below what a crashed publisher had stored).
        # Unknown stays unknown (every later reader looks every subject up).
        high = known.high
        block = HeaderBlock(
            None if high is None else max(high, max(m[4] for m in msgs)),
            int(getattr(link.nc, "max_payload", 0) or 1 << 20),
        )
        try:
            await known.learn(link.js, self.settings.stream, msgs, self.settings.ack_timeout)
            todo = [
                block.frame(subject, msg_id, data)
                for subject, data, msg_id, position, _ in msgs
                if not known.holds(subject, position)  # (published before a crash)
            ]
            fast = self._fast
            if not (fast.on and len(todo) >= FAST_MIN and await fast.publish(link, todo)):
                await self._acks.publish_each(link, todo)
        except BaseException:
            await self._reset()
            raise
        known.stored(msgs)
        return len(todo)

    def publish(self, events: _Events, sessions: Sequence[tuple[Any, ...]]) -> None:
        """Publish (event, commit LSN) pairs, then (session, last position, context JSON[,
        commit LSN]) for each changed projection; returns once JetStream holds them all."""
        self.begin(events, sessions).wait()

    def begin(self, events: _Events, sessions: Sequence[tuple[Any, ...]]) -> Publishing:
        """Start publishing what :meth:`publish` takes and return at once: the caller does its
        own work meanwhile (the sink writes the batch's rows) and calls ``wait()`` before its
        commit, or ``cancel()`` when it gives the batch up. The messages are built on the
        publisher's thread too, so the caller's work starts at once; neither sequence may
        change until then."""
        return Publishing(self, events, sessions)

    async def _build_and_publish(
        self, events: _Events, sessions: Sequence[tuple[Any, ...]]
    ) -> tuple[int, int]:
        """Messages published and messages in all (the rest the stream held already)."""
        msgs = messages(self.settings.prefix, self.slot, events, sessions)
        return await self._publish(msgs), len(msgs)

    def close(self) -> None:
        self.stopping()  # (the drain below waits through _run, which the grace does not cut)
        log.info(
            "JetStream: %d messages published (%d in fast-ingest batches), %d already there",
            self.published,
            self.fast_published,
            self.skipped,
        )
        with contextlib.suppress(Exception):  # closing anyway
            self._run(self._link.drain(), 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class Publishing:
    """A batch being published (:meth:`JetStreamPublisher.begin`)."""

    def __init__(
        self, pub: JetStreamPublisher, events: _Events, sessions: Sequence[tuple[Any, ...]]
    ) -> None:
        self._pub = pub
        n = len(events) + len(sessions)
        self._timeout = 2 * pub.settings.ack_timeout + 5 + n / 1000
        self._fut = (
            asyncio.run_coroutine_threadsafe(pub._build_and_publish(events, sessions), pub._loop)
            if n
            else None
        )

    def wait(self) -> None:
        """Returns once JetStream acknowledged every message; raises JetStreamError if not."""
        fut, self._fut = self._fut, None
        if fut is None:
            return
        pub = self._pub
        try:
            sent, total = pub._result(fut, self._timeout)
        except (JetStreamError, ConfigError):
            raise
        except Exception as e:
            raise JetStreamError(f"publish to JetStream failed: {type(e).__name__}: {e}") from e
        pub.published += sent
        pub.skipped += total - sent

    def cancel(self) -> None:
        """Gives the batch up (its connection is dropped; a retry publishes it again)."""
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            # the task is cancelled on the publisher's loop (its connection dropped there);
            # marked broken too, for a task cancelled before it ever ran
            fut.cancel()
            self._pub._link.broken = True
