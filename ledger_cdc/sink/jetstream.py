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

A batch of at least ``_FAST_MIN`` messages is one fast-ingest batch (JetStream batch
publishing, ADR-50, nats-server 2.14+, a stream with ``allow_batched``): the server acknowledges
every few hundred messages, stores the batch in order up to its first gap ("fail" mode) and
counts what it took in its final acknowledgement, which the publisher checks. Smaller batches,
and streams or servers without batching, are acknowledged message by message.

nats-py is asynchronous; the publisher runs its own event loop on a thread, and the sink thread
waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import importlib.util
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import unquote

import msgspec

from ledger_cdc.errors import ConfigError, InvalidEventError, JetStreamError, LedgerError
from ledger_cdc.events import LedgerEvent, Rejected, admit_time, load_payload, unplaced

__all__ = ["JetStreamError", "JetStreamPublisher", "JetStreamSettings", "WireEvent"]


def _flag(value: str) -> bool:
    low = value.strip().lower()
    if low in ("true", "1", "on", "yes"):
        return True
    if low in ("false", "0", "off", "no"):
        return False
    raise ValueError(value)


def _seconds_between(low: float, high: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        v = float(value)
        if not (math.isfinite(v) and low <= v <= high):
            raise ValueError(value)
        return v

    return parse


def _replicas(value: str) -> int:
    v = int(value)
    if not 1 <= v <= 5:  # JetStream's own bounds
        raise ValueError(value)
    return v


def _stream_name(value: str) -> str:
    if (
        not value
        or len(value) > 255
        or not (value.isascii() and value.isprintable())
        or any(c in value for c in " .*>/\\$")
    ):
        raise ValueError(value)
    return value


def _subject_prefix(value: str) -> str:
    tokens = value.split(".")
    if (
        any(not t or any(c in t for c in " *>") for t in tokens)
        or not (value.isascii() and value.isprintable())
        or value.startswith("$")  # $JS, $SYS: the server's own subjects
        or len(value) > 200
    ):
        raise ValueError(value)
    return value


# URL option → (parser, what it must be)
_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "stream": (_stream_name, "a stream name (no spaces, dots, wildcards or slashes)"),
    "prefix": (_subject_prefix, "a subject prefix (dot-separated tokens, no wildcards)"),
    "replicas": (_replicas, "a whole number from 1 to 5"),
    # (the server refuses a window under 100 ms)
    "duplicate_window": (_seconds_between(0.1, 86_400 * 365), "seconds, from 0.1 to a year"),
    "ack_timeout": (_seconds_between(0.1, 3600), "seconds, from 0.1 to 3600"),
    "batched": (_flag, "true or false"),
}


@dataclass(frozen=True)
class JetStreamSettings:
    servers: list[str]
    stream: str = "LEDGER"
    prefix: str = "ledger"
    replicas: int = 1
    duplicate_window: float = 120.0
    ack_timeout: float = 10.0
    # fast-ingest batches for batches of _FAST_MIN messages or more (the stream is given
    # allow_batched); false: every message acknowledged on its own, the stream left as it is
    batched: bool = True
    # the options the URL gave: only those are imposed on a stream that exists (one made by
    # an operator with 3 replicas is not cut back to the default 1 by a URL that says nothing)
    given: frozenset[str] = frozenset()

    @classmethod
    def from_url(cls, url: str, option: str = "--sink") -> JetStreamSettings:
        """``nats://h1:4222[,nats://h2:4222…][?stream=LEDGER&replicas=3&duplicate_window=120]``"""
        base, _, query = url.partition("?")
        servers = [u.strip() for u in base.split(",") if u.strip()]
        bad = [s for s in servers if not s.startswith(("nats://", "tls://"))]
        if not servers or bad:
            raise ConfigError(f"{option} {url!r}: expected nats://host:port[,nats://host:port…]")
        kw: dict[str, Any] = {}
        pairs = (item.partition("=") for item in query.split("&") if item)
        for key, value in ((unquote(k), unquote(v)) for k, _, v in pairs):  # "+" stays "+"
            if key in kw:
                raise ConfigError(f"{option} {url!r}: {key} given twice")
            if key not in _OPTIONS:
                raise ConfigError(
                    f"{option} {url!r}: unknown option {key!r} (use {', '.join(_OPTIONS)})"
                )
            parse, what = _OPTIONS[key]
            try:
                kw[key] = parse(value)
            except ValueError:
                raise ConfigError(f"{option} {url!r}: {key}={value!r} is not {what}") from None
        return cls(servers, **kw, given=frozenset(kw))


_Int64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class WireEvent(msgspec.Struct):
    """The JSON body of a ``ledger.events.<session>`` message."""

    seq: _Int64  # a forged 2**64 would fail every write of it: not an event
    session_id: uuid.UUID
    position: _Int64
    agent_id: str
    event_type: str
    payload: Any
    created_at: dt.datetime  # RFC 3339 on the wire; parsed by msgspec on every Python
    idempotency_key: str | None = None
    commit_lsn: str | None = None
    # > 0: the payload (this many bytes of message) did not fit the server's max_payload and
    # was left out (payload null); the event is in agent_events at (session_id, position)
    omitted: int = 0
    # set: a row no reader can fold (consume --publish-only publishes it so that the fold
    # workers quarantine it): why; payload is null and created_at is not the row's
    rejected: str | None = None


def wire_event(w: WireEvent, payload: bytes) -> LedgerEvent | Rejected:
    """The event a ``ledger.events.*`` message carries (``payload``: its payload as JSON), by
    the rule every reader shares: Rejected when it was published as such, or its payload or
    time does not fit. A message whose payload was left out (``omitted``) is the caller's to
    read from agent_events."""

    def rejected(why: str) -> Rejected:
        return Rejected(
            w.seq,
            w.session_id,
            w.position,
            w.agent_id,
            w.event_type,
            why,
            None,
            w.idempotency_key,
            # a row whose session or position could not be read goes out as the nil session or
            # position 0: in no session's history, by the rule every reader shares
            unplaced=unplaced(w.session_id if w.session_id.int else None, w.position),
        )

    if w.rejected is not None:
        return rejected(w.rejected)
    try:
        created = admit_time(w.created_at)
        loaded = load_payload(w.event_type, payload)
    except InvalidEventError as e:
        return rejected(str(e))
    return LedgerEvent(
        w.seq,
        w.session_id,
        w.position,
        w.agent_id,
        w.event_type,
        loaded,
        created,
        w.idempotency_key,
    )


_encode = msgspec.json.Encoder().encode
_LSN_HEADER = "Ledger-High-Lsn"  # the highest commit LSN the stream holds with this message


def _lsn_of(session: tuple[Any, ...]) -> int:
    return int(session[3]) if len(session) > 3 else 0  # unknown: looked up like an old one


_PING_INTERVAL = 2  # seconds between NATS pings
# once the process is asked to stop, a publish (or a connect) still unanswered this many
# seconds later is given up, whatever ack_timeout says: its batch was not checkpointed, and is
# published again when the consumer next starts
STOP_GRACE = 5.0
# while the server stays out of reach, nats-py reports each failed attempt (two a second): the
# first is logged, then at most one line per this many seconds, counting those not logged
_ERRORS_EVERY = 30.0
_WINDOW = 4000  # publishes awaiting their acknowledgement at once
_CHUNK = 500  # messages written to the connection at a time
# fast-ingest batches (nats-server 2.14+, a stream with allow_batched): the server acknowledges
# every _FAST_FLOW messages at most (it may ask for fewer), and stores the batch in order up to
# its first gap ("fail": a gap ends the batch); at most _FAST_OUTSTANDING acknowledgements are
# awaited at once. A batch smaller than _FAST_MIN is published message by message: a fast batch
# costs one round trip more (the server's first answer is awaited before the rest is sent)
_FAST_FLOW = 500
_FAST_OUTSTANDING = 4
_FAST_MIN = 64
_FAST_DISABLED = 10205  # err_code: batch publish is disabled on the stream
_LSN_HEADER_B = _LSN_HEADER.encode()
_OMITTED = "Ledger-Omitted"  # header: the body was left out, its size in bytes
_OMITTED_HEADER_B = _OMITTED.encode()
log = logging.getLogger(__name__)


_wire = msgspec.json.Decoder(WireEvent)
_NO_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)  # a rejected row's, on the wire


def _omitted(subject: bytes, data: bytes) -> bytes:
    """What is published instead of a message larger than the server accepts (its header
    ``Ledger-Omitted`` gives the size): an event without its payload, or an empty projection
    (read it from ``agent_session_contexts``). One oversized event never stops the fan-out."""
    if b".events." not in subject:
        return b"{}"
    try:
        w = _wire.decode(data)
    except msgspec.DecodeError:
        return b"{}"
    return _encode(
        WireEvent(
            w.seq,
            w.session_id,
            w.position,
            w.agent_id[:256],
            w.event_type[:256],
            None,
            w.created_at,
            None,
            w.commit_lsn,
            omitted=len(data),
        )
    )


RawHandler = Callable[[bytes, bytes, bytes, bytes], None]  # (subject, reply, data, headers)


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


def _api_error(err: dict[str, Any]) -> str:
    """A JetStream API error (``{"code", "err_code", "description"}``) in one line."""
    return f"{err.get('description', '?')} (code {err.get('err_code', '?')})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


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
        self._nc: Any = None
        self._js: Any = None
        self._stream_ready = False
        self._broken = False
        self._closing: set[asyncio.Future[None]] = set()  # clients whose connect was cut short
        # when stopping() was called (monotonic), by the process or by close(): from then on
        # the end of the connection is ours, not a fault
        self._stop_at: float | None = None
        self._quiet_until = 0.0  # connection errors are counted, not logged, until then
        self._errors_held = 0
        self.published = 0
        self.skipped = 0  # messages not published: the stream already held their position
        self.heads_read = 0  # subjects whose last message was read (what may be in the stream)
        # subject → the last position the stream holds on it, as read or acknowledged on this
        # connection (forgotten with the connection: another publisher may have written since)
        self._heads: dict[bytes, int] = {}
        # the highest commit LSN the stream may hold, read from its last message when this
        # connection began: a message of a later commit cannot be in the stream, so only the
        # others need their subject's head (None: not known, every subject is looked up)
        self._high: int | None = None
        # acknowledgements of the batch under way: replies to <_reply>.<n>, n from _base on
        self._reply = ""
        self._next = 0
        self._base = 0
        self._acked = 0
        self._ack_error: str | None = None
        self._want = 0  # _progress is set once this many are acknowledged (or on an error)
        self._last_ack = 0.0
        self._progress = asyncio.Event()
        # fast-ingest batches: whether the stream takes them (read when the connection began),
        # the inbox their answers come to, and the batch under way
        self._batched = False
        self._fast_inbox = b""
        self._fast: _FastBatch | None = None
        self.fast_batches = 0  # batches published as fast-ingest batches
        self.fast_published = 0  # messages in them

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
            self._broken = True
            raise
        except BaseException:
            self._broken = True
            raise

    async def _reset(self) -> None:
        """After any failure: the connection and its JetStream context are dropped, never
        reused. A context keeps the slots of the publishes it has not seen acknowledged (the
        acknowledgements of a hung or restarted server never come): reusing it would leak them
        until no publish can start. The old connection is closed without waiting on it."""
        nc, self._nc, self._js = self._nc, None, None
        self._stream_ready = False
        self._heads = {}
        self._high = None
        self._broken = False
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2)

    async def _connect(self) -> None:
        from nats.aio.client import Client
        from nats.js.api import StreamConfig
        from nats.js.errors import NotFoundError

        s = self.settings
        if self._broken or (self._nc is not None and not self._nc.is_connected):
            await self._reset()
        if self._nc is None:
            # made first and connected after: a connect cancelled midway (its publish timed
            # out against a hung server) leaves a client whose sockets and tasks live on,
            # unless it is closed
            nc = Client()
            try:
                await nc.connect(
                    servers=s.servers,
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
            self._nc = nc
            self._errors_over()
            self._js = self._nc.jetstream(timeout=s.ack_timeout)
            self._stream_ready = False
            await self._acks()
        if self._stream_ready:
            return
        # until the stream exists (a forming cluster may refuse to create it for a while)
        subjects = [f"{s.prefix}.events.*", f"{s.prefix}.sessions.*"]
        try:
            info = await self._js.stream_info(s.stream)
        except NotFoundError:
            info = await self._js.add_stream(
                StreamConfig(
                    name=s.stream,
                    subjects=subjects,
                    num_replicas=s.replicas,
                    duplicate_window=s.duplicate_window,
                    allow_batched=s.batched or None,
                )
            )
        else:
            info = await self._reconcile(info, subjects)
        self._batched = await self._batching(info)
        self._high = await self._high_water()
        self._stream_ready = True

    async def _high_water(self) -> int | None:
        """The high LSN the stream's last message carries (0 for an empty stream; None when
        it carries none, or when another slot published it: shards share a stream, and one
        that is behind marks only what it knows, below what this slot may have stored)."""
        from nats.js.errors import NotFoundError

        info = await self._js.stream_info(self.settings.stream)
        last = int(getattr(info.state, "last_seq", 0) or 0)
        if last == 0:
            return 0
        try:
            msg = await self._js.get_msg(self.settings.stream, seq=last)
        except NotFoundError:
            return None
        headers = msg.headers or {}
        if not headers.get("Nats-Msg-Id", "").startswith(f"{self.slot}:"):
            return None
        value = headers.get(_LSN_HEADER, "")
        return int(value) if value.isdigit() else None

    async def _batching(self, info: Any) -> bool:
        """Whether batches go as fast-ingest batches: the URL wants them (``batched``, true by
        default) and the stream takes them. An existing stream that does not is asked to (a
        server before 2.14 knows no such setting: its answer leaves it out, and every batch is
        then published message by message); with ``batched=false`` it is left as it is."""
        if getattr(info.config, "allow_batched", None):
            return self.settings.batched
        if not self.settings.batched:
            return False
        try:
            info = await self._js.update_stream(
                dataclasses.replace(info.config, allow_batched=True)
            )
        except Exception as e:
            log.info(
                "JetStream stream %s does not take batched publishes (%s): every message is "
                "acknowledged on its own",
                self.settings.stream,
                _first_line(e),
            )
            return False
        return bool(getattr(info.config, "allow_batched", None))

    async def _reconcile(self, info: Any, subjects: list[str]) -> Any:
        """An existing stream whose settings differ from what the URL gives (replicas,
        duplicate window: those it names; our subjects, always) is updated to them, or refused
        with what differs. Returns its info."""
        s = self.settings
        config = info.config
        have = {
            "replicas": config.num_replicas,
            "duplicate_window": float(config.duplicate_window or 0),
            "subjects": sorted(config.subjects or []),
        }
        want = {
            "replicas": s.replicas if "replicas" in s.given else have["replicas"],
            "duplicate_window": (
                s.duplicate_window if "duplicate_window" in s.given else have["duplicate_window"]
            ),
            "subjects": sorted(set(have["subjects"]) | set(subjects)),
        }
        differs = {k: (have[k], want[k]) for k in have if have[k] != want[k]}
        if not differs:
            return info
        try:
            info = await self._js.update_stream(
                dataclasses.replace(
                    config,
                    num_replicas=want["replicas"],
                    duplicate_window=want["duplicate_window"],
                    subjects=want["subjects"],
                )
            )
            log.info("JetStream stream %s updated: %s", s.stream, differs)
            return info
        except Exception as e:
            what = ", ".join(f"{k} {have!r} → {want!r}" for k, (have, want) in differs.items())
            raise ConfigError(
                f"JetStream stream {s.stream!r} exists with other settings ({what}) and the "
                f"server refused to update it ({_first_line(e)}): change the URL's options to "
                "match, or update the stream yourself"
            ) from e

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
        log.warning("NATS: %s%s", _first_line(e), more)

    def _errors_over(self) -> None:
        """Connected: the next error is news again."""
        self._quiet_until = 0.0
        self._errors_held = 0

    async def _on_disconnected(self) -> None:
        if self._stop_at is not None:  # (ours, or of no matter any more)
            log.info("NATS: connection closed")
        else:
            log.warning("NATS: disconnected")

    async def _on_reconnected(self) -> None:
        self._errors_over()
        url = getattr(self._nc, "connected_url", None)
        log.info("NATS: reconnected to %s", getattr(url, "netloc", url))

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

    async def _head(self, subject: bytes) -> int:
        """The last position the stream holds on ``subject`` (0: none), from its last
        message's ``Nats-Msg-Id`` (``<slot>:<kind>:<session>:<position>``)."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self._js.get_last_msg(self.settings.stream, subject.decode())
        except NotFoundError:
            return 0
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        tail = msg_id.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0

    async def _learn_heads(self, subjects: list[bytes]) -> None:
        unknown = [s for s in dict.fromkeys(subjects) if s not in self._heads]
        for i in range(0, len(unknown), _WINDOW):
            part = unknown[i : i + _WINDOW]
            heads = await asyncio.wait_for(
                asyncio.gather(*(self._head(s) for s in part)), self.settings.ack_timeout
            )
            self._heads.update(zip(part, heads, strict=True))
            self.heads_read += len(part)

    async def _acks(self) -> None:
        """The connection's one reply subscription: every publish asks for its acknowledgement
        on ``<inbox>.<n>``, counted as it arrives (no future, no message object per publish)."""
        self._reply = self._nc.new_inbox()
        await subscribe_raw(
            self._nc,
            self._reply + ".*",
            lambda subject, reply, data, headers: self._ack(
                subject.rpartition(b".")[2], data, headers
            ),
            pending=4 * _WINDOW + 1000,
        )
        # fast-ingest batches answer on <inbox>.<batch id>.<flow>.fail.<n>.<op>.$FI
        self._fast_inbox = self._nc.new_inbox().encode()
        await subscribe_raw(
            self._nc,
            self._fast_inbox.decode() + ".>",
            lambda subject, reply, data, headers: self._fast_ack(subject, data, headers),
            pending=1000,
        )

    def _fast_ack(self, subject: bytes, data: bytes, headers: bytes) -> None:
        """An answer to a fast-ingest batch: a flow acknowledgement (every message up to its
        ``seq`` is stored), a gap or an error (the batch ends), or the final publish
        acknowledgement (``count`` messages stored, duplicates included)."""
        st = self._fast
        start = len(self._fast_inbox) + 1
        if st is None or subject[start : start + len(st.bid)] != st.bid:
            return  # an answer to an earlier batch
        self._last_ack = time.monotonic()
        self._progress.set()
        if headers and b"503" in headers[:16]:
            st.fail(self._no_stream())
            return
        try:
            answer = msgspec.json.decode(data)
            if not isinstance(answer, dict):
                raise TypeError
            kind = answer.get("type")
            error = answer.get("error")
            if kind == "ack":
                st.started = True
                st.acked = max(st.acked, int(answer["seq"]))
                st.flow = max(1, min(_FAST_FLOW, int(answer["msgs"])))
            elif kind == "gap":
                st.fail(
                    f"JetStream expected message {answer.get('last_seq')} of a batch and got "
                    f"{answer.get('seq')}: the batch ends there"
                )
            elif kind == "err" or isinstance(error, dict):
                err = error if isinstance(error, dict) else {}
                what = _api_error(err)
                if not st.started:  # the start refused: nothing of the batch was stored
                    st.started = True
                    st.refused = what
                    st.disabled = err.get("err_code") == _FAST_DISABLED
                    return
                st.fail(f"JetStream refused a message of a batch: {what}")
            else:
                st.final = int(answer["count"])
                st.started = True
        except (msgspec.DecodeError, TypeError, KeyError, ValueError):
            st.fail(f"JetStream answered a batch with {data[:200]!r}")

    def _no_stream(self) -> str:
        """Why a publish was answered 503 (no responders)."""
        return (
            f"no JetStream stream takes the subjects under {self.settings.prefix!r} "
            "(503 no responders)"
        )

    def _ack(self, n: bytes, data: bytes, headers: bytes) -> None:
        if not n.isdigit() or int(n) < self._base:
            return  # a reply to an earlier (failed) batch
        self._acked += 1
        self._last_ack = time.monotonic()
        if headers and b"503" in headers[:16]:
            self._ack_error = self._ack_error or self._no_stream()
        elif b'"error"' in data[:64]:
            try:
                what = _api_error(msgspec.json.decode(data).get("error", {}))
            except (msgspec.DecodeError, AttributeError):
                what = repr(data[:200])
            self._ack_error = self._ack_error or f"JetStream refused a message: {what}"
        if self._acked >= self._want or self._ack_error is not None:
            self._progress.set()

    async def _await_acks(self, upto: int) -> None:
        """Until ``upto`` of this batch's messages are acknowledged."""
        self._want = upto
        await self._wait(
            lambda: self._acked >= upto or self._ack_error is not None,
            lambda: f"{upto - self._acked} of {upto} messages outstanding",
        )
        if self._ack_error is not None:
            raise JetStreamError(self._ack_error)

    async def _wait(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Until ``done()``; fails when no acknowledgement came for ``ack_timeout`` (a hung,
        killed or restarted server), saying ``what()`` was outstanding."""
        timeout = self.settings.ack_timeout
        began = time.monotonic()
        while not done():
            self._progress.clear()
            left = max(self._last_ack, began) + timeout - time.monotonic()
            if left <= 0:
                raise JetStreamError(
                    f"JetStream did not acknowledge within {timeout:.0f}s ({what()})"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    async def _publish(self, msgs: list[tuple[bytes, bytes, bytes, int, int]]) -> int:
        await self._connect()
        nc = self._nc
        # every message carries the highest commit LSN the stream may hold once it is stored:
        # the most of what the stream held when this connection began and of every batch
        # published since. The stream's last message always tells it, whichever batch a restart
        # replays first (a replayed batch may end below what a crashed publisher had stored).
        # Unknown stays unknown ("": every later reader looks every subject up).
        high = self._high
        batch_max = max(m[4] for m in msgs)
        mark = b"" if high is None else str(max(high, batch_max)).encode()
        limit = int(getattr(nc, "max_payload", 0) or 1 << 20)
        try:
            maybe_there = [m[0] for m in msgs if high is None or m[4] <= high]
            await self._learn_heads(maybe_there)
            heads = self._heads
            todo: list[tuple[bytes, bytes, bytes]] = []  # (subject, headers, body), in order
            head = b"NATS/1.0\r\nNats-Msg-Id: %b\r\n" + _LSN_HEADER_B + b": " + mark + b"\r\n"
            headers = head + b"\r\n"  # (the mark is digits: no % in it)
            limit -= len(headers) - 2  # (what "%b" in it leaves)
            for subject, data, msg_id, position, _lsn in msgs:
                if 0 < position <= heads.get(subject, 0):
                    continue  # already in the stream (published before a crash)
                if len(msg_id) + len(data) <= limit:
                    todo.append((subject, headers % msg_id, data))
                else:
                    hdr = head % msg_id + b"%b: %d\r\n\r\n" % (_OMITTED_HEADER_B, len(data))
                    todo.append((subject, hdr, _omitted(subject, data)))
            if not (self._batched and len(todo) >= _FAST_MIN and await self._publish_fast(todo)):
                await self._publish_each(todo)
        except BaseException:
            await self._reset()
            raise
        for subject, _, _, position, _ in msgs:  # all acknowledged: the stream holds them now
            if position > heads.get(subject, 0):
                heads[subject] = position
        if high is not None:
            self._high = max(high, batch_max)
        return len(todo)

    async def _publish_each(self, todo: list[tuple[bytes, bytes, bytes]]) -> None:
        """Every message asks for its own acknowledgement (on ``<inbox>.<n>``); at most
        ``_WINDOW`` are awaited at once."""
        self._base = self._next
        self._acked = 0
        self._ack_error = None
        reply = self._reply.encode() + b"."
        frames: list[bytes] = []
        sent = 0
        for subject, hdr, data in todo:  # in order: one connection
            frames.append(
                b"HPUB %b %b%d %d %d\r\n%b%b\r\n"
                % (subject, reply, self._next, len(hdr), len(hdr) + len(data), hdr, data)
            )
            self._next += 1
            sent += 1
            if len(frames) >= _CHUNK:
                await self._write(frames)
                frames = []
                await self._await_acks(sent - _WINDOW)  # at most _WINDOW unacknowledged
        if frames:
            await self._write(frames)
        await self._await_acks(sent)

    async def _publish_fast(self, todo: list[tuple[bytes, bytes, bytes]]) -> bool:
        """One fast-ingest batch (ADR-50): the server acknowledges every few hundred messages
        instead of each, stores the batch in order and ends it at the first gap or refusal;
        its final acknowledgement counts what it stored (duplicates it dropped included).
        False when the server refused the batch's start (nothing was stored): batching turned
        off on the stream (then for as long as the connection lasts), too many batches in
        flight, …"""
        st = self._fast = _FastBatch(uuid.uuid4().hex.encode())
        try:
            return await self._fast_batch(todo, st)
        finally:
            if self._fast is st:  # (not a later batch's: a cancelled one ends here at once)
                self._fast = None

    async def _fast_batch(self, todo: list[tuple[bytes, bytes, bytes]], st: _FastBatch) -> bool:
        n = len(todo)  # at least 2 (_FAST_MIN)
        prefix = b"%b.%b.%d.fail." % (self._fast_inbox, st.bid, _FAST_FLOW)
        frame = b"HPUB %b " + prefix.replace(b"%", b"%%") + b"%d.%d.$FI %d %d\r\n%b%b\r\n"

        async def send(first: int, end: int, op: int) -> None:
            """Messages first … end-1, once few enough acknowledgements are outstanding. op 0
            starts the batch, 1 appends to it, 2 stores the last message and commits."""
            st.sent = end - 1
            await self._wait(st.room, lambda: f"{st.sent - st.acked} of {n} messages")
            st.check()
            await self._write(
                [
                    frame % (subject, i, op, len(h), len(h) + len(d), h, d)
                    for i, (subject, h, d) in enumerate(todo[first - 1 : end - 1], first)
                ]
            )

        # the server's first answer: batching is on, and how often it acknowledges
        await send(1, 2, 0)
        await self._wait(lambda: st.started or st.error is not None, lambda: "a batch's start")
        if st.refused is not None:
            if st.disabled:
                log.info(
                    "JetStream stream %s no longer takes batched publishes: every message is "
                    "acknowledged on its own",
                    self.settings.stream,
                )
                self._batched = False
            else:  # (e.g. too many batches in flight on the stream): this one goes without
                log.info("JetStream refused a batch's start (%s): sent one by one", st.refused)
            return False
        st.check()
        i = 2
        while i < n:  # messages 2 … n-1, as many at a time as the server acknowledges at once
            end = min(n, i + st.flow)  # (its flow changes as other batches come and go)
            await send(i, end, 1)
            i = end
        await send(n, n + 1, 2)  # the last alone: it commits the batch
        await self._wait(
            lambda: st.final is not None or st.error is not None,
            lambda: f"the end of a batch of {n} messages, {st.acked} acknowledged",
        )
        st.check()
        if st.final != n:
            raise JetStreamError(f"JetStream stored {st.final} of a batch of {n} messages")
        self.fast_batches += 1
        self.fast_published += n
        return True

    async def _write(self, frames: list[bytes]) -> None:
        """Frames straight to the connection's transport, as nats-py's own flusher writes its
        buffer (building each message here costs a fifth of a publish call)."""
        nc = self._nc
        transport = getattr(nc, "_transport", None)
        if not nc.is_connected or transport is None:
            raise JetStreamError("NATS connection lost while publishing")
        transport.writelines(frames)
        try:  # a hung server stops reading: its socket fills, and no acknowledgement comes
            await asyncio.wait_for(transport.drain(), self.settings.ack_timeout)
        except asyncio.TimeoutError:
            raise JetStreamError(
                f"JetStream took no data for {self.settings.ack_timeout:.0f}s"
            ) from None

    def publish(
        self,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[Any, ...]],
    ) -> None:
        """Publish (event, commit LSN) pairs, then (session, last position, context JSON[,
        commit LSN]) for each changed projection; returns once JetStream holds them all."""
        self.begin(events, sessions).wait()

    def begin(
        self,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[Any, ...]],
    ) -> Publishing:
        """Start publishing what :meth:`publish` takes and return at once: the caller does its
        own work meanwhile (the sink writes the batch's rows) and calls ``wait()`` before its
        commit, or ``cancel()`` when it gives the batch up. The messages are built on the
        publisher's thread too, so the caller's work starts at once; neither sequence may
        change until then."""
        return Publishing(self, events, sessions)

    def _messages(
        self,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[Any, ...]],
    ) -> list[tuple[bytes, bytes, bytes, int, int]]:
        """(subject, body, message id, position, commit LSN) of each event, then of each
        session's projection, in that order."""
        from ledger_cdc.lsn import format_lsn

        p = self.settings.prefix
        slot = self.slot
        # session → (its subject, its message id prefix)
        names: dict[uuid.UUID, tuple[bytes, bytes]] = {}
        msgs: list[tuple[bytes, bytes, bytes, int, int]] = []
        for ev, lsn in events:
            sid = ev.session_id
            named = names.get(sid)
            if named is None:
                text = str(sid)
                named = names[sid] = (
                    f"{p}.events.{text}".encode(),
                    f"{slot}:ev:{text}:%d".encode(),
                )
            good = type(ev) is LedgerEvent
            body = WireEvent(
                ev.seq,
                sid,
                ev.position,
                ev.agent_id,
                ev.event_type,
                ev.payload if good else None,  # type: ignore[union-attr]
                ev.created_at if good else _NO_TIME,  # type: ignore[arg-type]
                ev.idempotency_key,
                format_lsn(lsn) if lsn else None,
                rejected=None if good else ev.reason,  # type: ignore[union-attr]
            )
            if good or not ev.unplaced:  # type: ignore[union-attr]
                msgs.append((named[0], _encode(body), named[1] % ev.position, ev.position, lsn))
            else:  # in no session's history: its own message, by seq (at "position" 0: never
                # taken for one the stream holds already, never a subject's head)
                msg_id = f"{slot}:ev:{sid}:seq{ev.seq}".encode()
                msgs.append((named[0], _encode(body), msg_id, 0, lsn))
        msgs += [
            (
                f"{p}.sessions.{s[0]}".encode(),
                s[2],
                f"{slot}:ctx:{s[0]}:{s[1]}".encode(),
                s[1],
                _lsn_of(s),
            )
            for s in sessions
        ]
        return msgs

    async def _build_and_publish(
        self,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[Any, ...]],
    ) -> tuple[int, int]:
        """Messages published and messages in all (the rest the stream held already)."""
        msgs = self._messages(events, sessions)
        return await self._publish(msgs), len(msgs)

    def close(self) -> None:
        self.stopping()  # (the drain below waits through _run, which the grace does not cut)
        log.info(
            "JetStream: %d messages published (%d in fast-ingest batches), %d already there",
            self.published,
            self.fast_published,
            self.skipped,
        )

        async def drain() -> None:
            if self._nc is not None:
                try:
                    await asyncio.wait_for(self._nc.drain(), 5)
                except Exception:
                    await self._nc.close()

        with contextlib.suppress(Exception):  # closing anyway
            self._run(drain(), 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class _FastBatch:
    """The state of a fast-ingest batch under way (updated by its answers)."""

    def __init__(self, bid: bytes) -> None:
        self.bid = bid
        self.started = False  # the server answered the first message
        self.refused: str | None = None  # … by refusing it: why (nothing was stored)
        self.disabled = False  # … because the stream takes no batches
        self.flow = 1  # the server acknowledges every this many messages
        self.acked = 0  # every message up to this one is stored
        self.final: int | None = None  # messages stored, from the final acknowledgement
        self.error: str | None = None
        self.sent = 0  # messages written (or about to be)

    def room(self) -> bool:
        """Whether what is written leaves few enough acknowledgements outstanding."""
        return self.sent - self.acked <= self.flow * _FAST_OUTSTANDING or self.error is not None

    def fail(self, why: str) -> None:
        self.error = self.error or why

    def check(self) -> None:
        if self.error is not None:
            raise JetStreamError(self.error)


class Publishing:
    """A batch being published (:meth:`JetStreamPublisher.begin`)."""

    def __init__(
        self,
        pub: JetStreamPublisher,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[Any, ...]],
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
            self._pub._broken = True
