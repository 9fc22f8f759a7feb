"""The JetStream publisher's NATS connection: made on demand, dropped after any failure, its
errors logged one line at a time; frames written straight to its socket.

Also the two pieces of nats-py plumbing the fold workers share: :func:`require_nats` and
:func:`subscribe_raw`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

from ledger_cdc.errors import ConfigError, JetStreamError
from ledger_cdc.sink.jetstream_settings import JetStreamSettings

__all__ = ["Link", "RawHandler", "first_line", "require_nats", "subscribe_raw"]

log = logging.getLogger(__name__)

_PING_INTERVAL = 2  # seconds between NATS pings
# while the server stays out of reach, nats-py reports each failed attempt (two a second): the
# first is logged, then at most one line per this many seconds, counting those not logged
_ERRORS_EVERY = 30.0

RawHandler = Callable[[bytes, bytes, bytes, bytes], None]  # (subject, reply, data, headers)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def require_nats(what: str) -> None:
    """ConfigError, saying how to install it, when nats-py is missing. Looked up, not imported:
    importing it (a tenth of a second) is left to the thread that connects, which does it while
    the consumer's own checks wait on the server."""
    try:
        found = importlib.util.find_spec("nats") is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken install
        found = False
    if not found:
        raise ConfigError(f"{what} needs nats-py: pip install 'ledger-cdc[nats]'")


async def subscribe_raw(nc: Any, subject: str, handler: RawHandler, pending: int = 65536) -> None:
    """Subscribe ``handler`` to ``subject``: each message is handed over straight from the
    connection's parser, as bytes (nats-py otherwise builds a message object and passes it
    through a queue and a task, which costs more than what most handlers do). Where the client
    lacks that hook, the subscription's callback gives the same bytes. Returns once the
    server knows the subscription."""

    async def cb(msg: Any) -> None:
        status = (msg.headers or {}).get("Status", "")
        headers = f"NATS/1.0 {status}\r\n".encode() if status else b""
        handler(msg.subject.encode(), (msg.reply or "").encode(), msg.data, headers)

    sub = await nc.subscribe(subject, cb=cb, pending_msgs_limit=pending)
    sid = getattr(sub, "_id", None)
    process = getattr(nc, "_process_msg", None)
    if sid is not None and process is not None:

        async def _process_msg(
            msg_sid: int, subj: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            if msg_sid == sid:  # a message published without headers has None
                handler(subj, reply, data, headers or b"")
            else:
                await process(msg_sid, subj, reply, data, headers)

        nc._process_msg = _process_msg
    await nc.flush()


class Link:
    """One NATS connection and its JetStream context, at a time. After any failure both are
    dropped, never reused (:meth:`reset`): a context keeps the slots of the publishes it has not
    seen acknowledged (the acknowledgements of a hung or restarted server never come), and
    reusing it would leak them until no publish can start. ``ready``: the stream was made or
    checked on this connection. ``stopped()``: the end of the connection is ours, not a fault."""

    def __init__(self, settings: JetStreamSettings, slot: str, stopped: Callable[[], bool]):
        self.settings = settings
        self.slot = slot
        self._stopped = stopped
        self.nc: Any = None
        self.js: Any = None
        self.ready = False
        self.broken = False  # a wait on it failed: dropped before its next use
        self._closing: set[asyncio.Future[None]] = set()  # clients whose connect was cut short
        self._quiet_until = 0.0  # connection errors are counted, not logged, until then
        self._errors_held = 0

    def stale(self) -> bool:
        """Whether the connection must be dropped before it is used."""
        return self.broken or (self.nc is not None and not self.nc.is_connected)

    async def reset(self) -> None:
        """The connection and its context dropped; the old connection closed without waiting
        on it."""
        nc, self.nc, self.js = self.nc, None, None
        self.ready = False
        self.broken = False
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2)

    async def open(self) -> bool:
        """Connect unless connected; whether a new connection was made."""
        from nats.aio.client import Client

        if self.nc is not None:
            return False
        # made first and connected after: a connect cancelled midway (its publish timed out
        # against a hung server) leaves a client whose sockets and tasks live on, unless closed
        nc = Client()
        try:
            await nc.connect(
                servers=self.settings.servers,
                connect_timeout=5,
                # a hung server is noticed within about ping_interval × (max_outstanding + 1)
                ping_interval=_PING_INTERVAL,
                max_outstanding_pings=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,  # type: ignore[arg-type]
                allow_reconnect=True,
                name=f"ledger-cdc:{self.slot}",
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
            )
        except BaseException:
            closing = asyncio.ensure_future(nc.close())  # not awaited: this task may be
            self._closing.add(closing)  # cancelled (kept: a task nobody holds may vanish)
            closing.add_done_callback(self._closing.discard)
            raise
        self.nc = nc
        self._errors_over()
        self.js = nc.jetstream(timeout=self.settings.ack_timeout)
        self.ready = False
        return True

    async def write(self, frames: list[bytes]) -> None:
        """Frames straight to the connection's transport, as nats-py's own flusher writes its
        buffer (building each message here costs a fifth of a publish call)."""
        nc = self.nc
        transport = getattr(nc, "_transport", None)
        if nc is None or not nc.is_connected or transport is None:
            raise JetStreamError("NATS connection lost while publishing")
        transport.writelines(frames)
        timeout = self.settings.ack_timeout
        try:  # a hung server stops reading: its socket fills, and no acknowledgement comes
            await asyncio.wait_for(transport.drain(), timeout)
        except asyncio.TimeoutError:
            raise JetStreamError(f"JetStream took no data for {timeout:.0f}s") from None

    async def drain(self) -> None:
        """What is buffered sent, then the connection closed (closed at once if that fails)."""
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except Exception:
                await self.nc.close()

    # nats-py's own handlers print tracebacks on every disconnect: one line each instead, and
    # while a server stays out of reach, one every _ERRORS_EVERY seconds
    async def _on_error(self, e: Exception) -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            self._errors_held += 1
            return
        held, self._errors_held = self._errors_held, 0
        self._quiet_until = now + _ERRORS_EVERY
        more = f" (and {held} more since the last such line)" if held else ""
        log.warning("NATS: %s%s", first_line(e), more)

    def _errors_over(self) -> None:
        """Connected: the next error is news again."""
        self._quiet_until = 0.0
        self._errors_held = 0

    async def _on_disconnected(self) -> None:
        if self._stopped():  # (ours, or of no matter any more)
            log.info("NATS: connection closed")
        else:
            log.warning("NATS: disconnected")

    async def _on_reconnected(self) -> None:
        self._errors_over()
        url = getattr(self.nc, "connected_url", None)
        log.info("NATS: reconnected to %s", getattr(url, "netloc", url))
