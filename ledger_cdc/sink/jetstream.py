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

nats-py is asynchronous; the publisher runs its own event loop on a thread, and the sink thread
waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ledger_cdc.errors import ConfigError, InvalidEventError, JetStreamError
from ledger_cdc.events import LedgerEvent, Rejected, admit_time, load_payload

__all__ = ["JetStreamError", "JetStreamPublisher", "JetStreamSettings", "WireEvent"]


@dataclass(frozen=True)
class JetStreamSettings:
    servers: list[str]
    stream: str = "LEDGER"
    prefix: str = "ledger"
    replicas: int = 1
    duplicate_window: float = 120.0
    ack_timeout: float = 10.0

    @classmethod
    def from_url(cls, url: str, option: str = "--sink") -> JetStreamSettings:
        """``nats://h1:4222[,nats://h2:4222…][?stream=LEDGER&replicas=3&duplicate_window=120]``"""
        base, _, query = url.partition("?")
        servers = [u.strip() for u in base.split(",") if u.strip()]
        bad = [s for s in servers if not s.startswith(("nats://", "tls://"))]
        if not servers or bad:
            raise ConfigError(f"{option} {url!r}: expected nats://host:port[,nats://host:port…]")
        kw: dict[str, Any] = {}
        types = {
            "stream": str,
            "prefix": str,
            "replicas": int,
            "duplicate_window": float,
            "ack_timeout": float,
        }
        for item in filter(None, query.split("&")):
            key, _, value = item.partition("=")
            if key not in types:
                raise ConfigError(
                    f"{option} {url!r}: unknown option {key!r} (use {', '.join(types)})"
                )
            try:
                kw[key] = types[key](value)
            except ValueError:
                raise ConfigError(
                    f"{option} {url!r}: {key}={value!r} is not a {types[key].__name__}"
                ) from None
        return cls(servers, **kw)


class WireEvent(msgspec.Struct):
    """The JSON body of a ``ledger.events.<session>`` message."""

    seq: int
    session_id: uuid.UUID
    position: int
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
            w.seq, w.session_id, w.position, w.agent_id, w.event_type, why, None, w.idempotency_key
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
_WINDOW = 4000  # publishes awaiting their acknowledgement at once
_CHUNK = 500  # messages written to the connection at a time
_LSN_HEADER_B = _LSN_HEADER.encode()
_OMITTED = "Ledger-Omitted"  # header: the body was left out, its size in bytes
_OMITTED_HEADER_B = _OMITTED.encode()
log = logging.getLogger("ledger_cdc.jetstream")


_wire = msgspec.json.Decoder(WireEvent)
_NO_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)  # a rejected row's, on the wire


def _omitted(subject: str, data: bytes) -> bytes:
    """What is published instead of a message larger than the server accepts (its header
    ``Ledger-Omitted`` gives the size): an event without its payload, or an empty projection
    (read it from ``agent_session_contexts``). One oversized event never stops the fan-out."""
    if ".events." not in subject:
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
            msg_sid: int, subj: bytes, reply: bytes, data: bytes, headers: bytes
        ) -> None:
            if msg_sid == sid:
                handler(subj, reply, data, headers)
            else:
                await process(msg_sid, subj, reply, data, headers)

        nc._process_msg = _process_msg
    await nc.flush()


def require_nats(what: str) -> None:
    """ConfigError, saying how to install it, when nats-py is missing."""
    try:
        import nats  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"{what} needs nats-py: pip install 'ledger-cdc[nats]'") from e


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
        self.published = 0
        self.skipped = 0  # messages not published: the stream already held their position
        self.heads_read = 0  # subjects whose last message was read (what may be in the stream)
        # subject → the last position the stream holds on it, as read or acknowledged on this
        # connection (forgotten with the connection: another publisher may have written since)
        self._heads: dict[str, int] = {}
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

    def _run(self, coro: Any, timeout: float) -> Any:
        return self._result(asyncio.run_coroutine_threadsafe(coro, self._loop), timeout)

    def _result(self, fut: concurrent.futures.Future[Any], timeout: float) -> Any:
        try:
            return fut.result(timeout)
        except TimeoutError as e:
            fut.cancel()
            self._broken = True
            raise JetStreamError(f"JetStream did not acknowledge within {timeout:.0f}s") from e
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
        import nats
        from nats.js.api import StreamConfig
        from nats.js.errors import NotFoundError

        s = self.settings
        if self._broken or (self._nc is not None and not self._nc.is_connected):
            await self._reset()
        if self._nc is None:
            self._nc = await nats.connect(
                servers=s.servers,
                connect_timeout=5,
                # a hung server is noticed within about ping_interval × (max_outstanding + 1)
                ping_interval=_PING_INTERVAL,
                max_outstanding_pings=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                allow_reconnect=True,
                name=f"ledger-cdc:{self.slot}",
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
            )
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
            await self._js.add_stream(
                StreamConfig(
                    name=s.stream,
                    subjects=subjects,
                    num_replicas=s.replicas,
                    duplicate_window=s.duplicate_window,
                )
            )
        else:
            await self._reconcile(info.config, subjects)
        self._high = await self._high_water()
        self._stream_ready = True

    async def _high_water(self) -> int | None:
        """The high LSN the stream's last message carries (0 for an empty stream; None when
        it carries none)."""
        from nats.js.errors import NotFoundError

        info = await self._js.stream_info(self.settings.stream)
        last = int(getattr(info.state, "last_seq", 0) or 0)
        if last == 0:
            return 0
        try:
            msg = await self._js.get_msg(self.settings.stream, seq=last)
        except NotFoundError:
            return None
        value = (msg.headers or {}).get(_LSN_HEADER, "")
        return int(value) if value.isdigit() else None

    async def _reconcile(self, config: Any, subjects: list[str]) -> None:
        """An existing stream whose settings differ from the URL's is updated to them (replicas,
        duplicate window, our subjects), or refused with what differs."""
        s = self.settings
        want_subjects = sorted(set(config.subjects or []) | set(subjects))
        differs = {
            k: (have, want)
            for k, have, want in (
                ("replicas", config.num_replicas, s.replicas),
                ("duplicate_window", float(config.duplicate_window or 0), s.duplicate_window),
                ("subjects", sorted(config.subjects or []), want_subjects),
            )
            if have != want
        }
        if not differs:
            return
        try:
            await self._js.update_stream(
                dataclasses.replace(
                    config,
                    num_replicas=s.replicas,
                    duplicate_window=s.duplicate_window,
                    subjects=want_subjects,
                )
            )
            log.info("JetStream stream %s updated: %s", s.stream, differs)
        except Exception as e:
            what = ", ".join(f"{k} {have!r} → {want!r}" for k, (have, want) in differs.items())
            raise ConfigError(
                f"JetStream stream {s.stream!r} exists with other settings ({what}) and the "
                f"server refused to update it ({_first_line(e)}): change the URL's options to "
                "match, or update the stream yourself"
            ) from e

    # nats-py's own handlers print tracebacks on every disconnect: one line each instead
    async def _on_error(self, e: Exception) -> None:
        log.warning("NATS: %s", _first_line(e))

    async def _on_disconnected(self) -> None:
        log.warning("NATS: disconnected")

    async def _on_reconnected(self) -> None:
        url = getattr(self._nc, "connected_url", None)
        log.info("NATS: reconnected to %s", getattr(url, "netloc", url))

    def connect(self) -> None:
        try:
            self._run(self._connect(), 30)
        except JetStreamError:
            raise
        except Exception as e:
            raise JetStreamError(
                f"cannot reach JetStream at {', '.join(self.settings.servers)}: {e}"
            ) from e

    async def _head(self, subject: str) -> int:
        """The last position the stream holds on ``subject`` (0: none), from its last
        message's ``Nats-Msg-Id`` (``<slot>:<kind>:<session>:<position>``)."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self._js.get_last_msg(self.settings.stream, subject)
        except NotFoundError:
            return 0
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        tail = msg_id.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0

    async def _learn_heads(self, subjects: list[str]) -> None:
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

    def _ack(self, n: bytes, data: bytes, headers: bytes) -> None:
        if not n.isdigit() or int(n) < self._base:
            return  # a reply to an earlier (failed) batch
        self._acked += 1
        self._last_ack = time.monotonic()
        if headers and b"503" in headers[:16]:
            self._ack_error = self._ack_error or (
                f"no JetStream stream takes the subjects under {self.settings.prefix!r} "
                "(503 no responders)"
            )
        elif b'"error"' in data[:64]:
            try:
                err = msgspec.json.decode(data).get("error", {})
                what = f"{err.get('description', '?')} (code {err.get('err_code', '?')})"
            except (msgspec.DecodeError, AttributeError):
                what = repr(data[:200])
            self._ack_error = self._ack_error or f"JetStream refused a message: {what}"
        if self._acked >= self._want or self._ack_error is not None:
            self._progress.set()

    async def _await_acks(self, upto: int) -> None:
        """Until ``upto`` of this batch's messages are acknowledged; fails when no
        acknowledgement came for ``ack_timeout`` (a hung, killed or restarted server)."""
        timeout = self.settings.ack_timeout
        began = time.monotonic()
        self._want = upto
        while self._acked < upto and self._ack_error is None:
            self._progress.clear()
            left = max(self._last_ack, began) + timeout - time.monotonic()
            if left <= 0:
                raise JetStreamError(
                    f"JetStream did not acknowledge within {timeout:.0f}s "
                    f"({upto - self._acked} of {upto} messages outstanding)"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        if self._ack_error is not None:
            raise JetStreamError(self._ack_error)

    async def _publish(self, msgs: list[tuple[str, bytes, str, int, int]]) -> int:
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
            self._base = self._next
            self._acked = 0
            self._ack_error = None
            reply = self._reply.encode() + b"."
            frames: list[bytes] = []
            sent = 0
            for subject, data, msg_id, position, _lsn in msgs:  # in order: one connection
                if position <= heads.get(subject, 0):
                    continue  # already in the stream (published before a crash)
                hdr = b"NATS/1.0\r\nNats-Msg-Id: %b\r\n%b: %b\r\n" % (
                    msg_id.encode(),
                    _LSN_HEADER_B,
                    mark,
                )
                if len(hdr) + len(data) + 2 > limit:
                    hdr += b"%b: %d\r\n" % (_OMITTED_HEADER_B, len(data))
                    data = _omitted(subject, data)
                hdr += b"\r\n"
                frames.append(
                    b"HPUB %b %b%d %d %d\r\n%b%b\r\n"
                    % (
                        subject.encode(),
                        reply,
                        self._next,
                        len(hdr),
                        len(hdr) + len(data),
                        hdr,
                        data,
                    )
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
        except BaseException:
            await self._reset()
            raise
        for subject, _, _, position, _ in msgs:  # all acknowledged: the stream holds them now
            if position > heads.get(subject, 0):
                heads[subject] = position
        if high is not None:
            self._high = max(high, batch_max)
        return sent

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
        commit, or ``cancel()`` when it gives the batch up."""
        from ledger_cdc.errors import format_lsn

        p = self.settings.prefix
        slot = self.slot
        names: dict[uuid.UUID, tuple[str, str]] = {}  # session → (its subject, its id prefix)
        msgs: list[tuple[str, bytes, str, int, int]] = []
        for ev, lsn in events:
            sid = ev.session_id
            named = names.get(sid)
            if named is None:
                text = str(sid)
                named = names[sid] = (f"{p}.events.{text}", f"{slot}:ev:{text}:")
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
            msgs.append((named[0], _encode(body), f"{named[1]}{ev.position}", ev.position, lsn))
        msgs += [
            (f"{p}.sessions.{s[0]}", s[2], f"{slot}:ctx:{s[0]}:{s[1]}", s[1], _lsn_of(s))
            for s in sessions
        ]
        return Publishing(self, msgs)

    def close(self) -> None:
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


class Publishing:
    """A batch being published (:meth:`JetStreamPublisher.begin`)."""

    def __init__(self, pub: JetStreamPublisher, msgs: list[tuple[str, bytes, str, int, int]]):
        self._pub = pub
        self._total = len(msgs)
        self._timeout = 2 * pub.settings.ack_timeout + 5 + len(msgs) / 1000
        self._fut = (
            asyncio.run_coroutine_threadsafe(pub._publish(msgs), pub._loop) if msgs else None
        )

    def wait(self) -> None:
        """Returns once JetStream acknowledged every message; raises JetStreamError if not."""
        fut, self._fut = self._fut, None
        if fut is None:
            return
        pub = self._pub
        try:
            sent = pub._result(fut, self._timeout)
        except (JetStreamError, ConfigError):
            raise
        except Exception as e:
            raise JetStreamError(f"publish to JetStream failed: {type(e).__name__}: {e}") from e
        pub.published += sent
        pub.skipped += self._total - sent

    def cancel(self) -> None:
        """Gives the batch up (its connection is dropped; a retry publishes it again)."""
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            # the task is cancelled on the publisher's loop (its connection dropped there);
            # marked broken too, for a task cancelled before it ever ran
            fut.cancel()
            self._pub._broken = True
