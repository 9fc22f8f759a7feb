"""The ledger's NATS wire format: how a committed event or a changed projection becomes a
JetStream message (subject, headers, body), and how a reader gets it back.

The publisher (:mod:`ledger_cdc.sink.jetstream`) builds messages with it; ``tail``
(:mod:`ledger_cdc.client.tail`) and the fold workers (:mod:`ledger_cdc.consumer.fold_nats`) read
them with it, so writer and readers cannot drift. Pure: bytes and values in, bytes and values
out; no connection, no I/O library.

- Subjects: ``<prefix>.events.<session>`` (each event) and ``<prefix>.sessions.<session>`` (each
  changed projection).
- ``Nats-Msg-Id``: ``<slot>:ev:<session>:<position>`` and ``<slot>:ctx:<session>:<position>``
  (the server drops a message whose id it has seen within its duplicate window); a row in no
  session's history goes as ``<slot>:ev:<session>:seq<seq>``, at position 0.
- ``Ledger-High-Lsn``: the highest commit LSN the stream holds once the message is stored
  (empty: not known). ``Ledger-Omitted``: the body was larger than the server takes and was
  left out; its size in bytes.
- Body: an event is :class:`WireEvent` as JSON; a projection is its context JSON as the sink
  wrote it (``{}`` when left out).
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from ledger_cdc.errors import InvalidEventError
from ledger_cdc.events import (
    DOC_MAX_DEPTH,
    LedgerEvent,
    Rejected,
    admit_time,
    decode_bounded,
    load_payload,
    unplaced,
)
from ledger_cdc.lsn import format_lsn, parse_lsn

__all__ = [
    "HIGH_LSN",
    "MSG_ID",
    "OMITTED",
    "HeaderBlock",
    "Message",
    "RawWireEvent",
    "WireEvent",
    "WireFormatError",
    "check_storable",
    "commit_lsn",
    "events_subject",
    "events_wildcard",
    "high_lsn",
    "left_out",
    "messages",
    "msg_id_position",
    "omitted_body",
    "published_by",
    "read_event",
    "read_headers",
    "rejected_event",
    "status_of",
    "stream_subjects",
    "subject_byte",
    "wire_event",
]

MSG_ID = "Nats-Msg-Id"
HIGH_LSN = "Ledger-High-Lsn"  # the highest commit LSN the stream holds with this message
OMITTED = "Ledger-Omitted"  # the body was left out: its size in bytes

_Int64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class WireFormatError(ValueError):
    """Bytes that are not what the format says (a header block a reader cannot parse)."""


class WireEvent(msgspec.Struct):
    """The JSON body of a ``<prefix>.events.<session>`` message."""

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


class RawWireEvent(WireEvent):
    """A message body as readers decode it: the payload left as JSON, loaded by its type."""

    payload: msgspec.Raw


# -- subjects and message ids ------------------------------------------------------------------


def events_subject(prefix: str, session: uuid.UUID | str) -> str:
    return f"{prefix}.events.{session}"


def events_wildcard(prefix: str) -> str:
    """Every session's events (a consumer's filter)."""
    return f"{prefix}.events.*"


def stream_subjects(prefix: str) -> list[str]:
    """The subjects the stream must carry."""
    return [events_wildcard(prefix), f"{prefix}.sessions.*"]


_HEX_BYTE = {f"{b:02{x}}".encode(): b for b in range(256) for x in "xX"}


def subject_byte(subject: bytes) -> int | None:
    """The last byte of the session id a subject ends in (its last two hex digits), read
    without decoding the body; None for a subject that does not end in two hex digits."""
    return _HEX_BYTE.get(subject[-2:])


def msg_id_position(msg_id: str) -> int:
    """The position a ``Nats-Msg-Id`` names (0: none, as for a row in no session)."""
    tail = msg_id.rpartition(":")[2]
    return int(tail) if tail.isascii() and tail.isdigit() else 0


def published_by(msg_id: str, slot: str) -> bool:
    """Whether the publisher of ``slot`` gave this ``Nats-Msg-Id``."""
    return msg_id.startswith(f"{slot}:")


def high_lsn(headers: dict[str, str] | None) -> int | None:
    """The ``Ledger-High-Lsn`` of a message's headers; None when absent or not a number."""
    value = (headers or {}).get(HIGH_LSN, "")
    return int(value) if value.isascii() and value.isdigit() else None


# -- building ----------------------------------------------------------------------------------

# (subject, body, message id, position, commit LSN)
Message = tuple[bytes, bytes, bytes, int, int]

_encode = msgspec.json.Encoder().encode
_NO_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)  # a rejected row's, on the wire


def _session_lsn(session: tuple[Any, ...]) -> int:
    return int(session[3]) if len(session) > 3 else 0  # unknown: looked up like an old one


def messages(
    prefix: str,
    slot: str,
    events: Sequence[tuple[LedgerEvent | Rejected, int]],
    sessions: Sequence[tuple[Any, ...]],
) -> list[Message]:
    """Each (event, commit LSN), then each (session, last position, context JSON[, commit
    LSN]), as messages, in that order."""
    # session → (its subject, its message id with a %d for the position)
    names: dict[uuid.UUID, tuple[bytes, bytes]] = {}
    msgs: list[Message] = []
    for ev, lsn in events:
        sid = ev.session_id
        named = names.get(sid)
        if named is None:
            text = str(sid)
            named = names[sid] = (
                events_subject(prefix, text).encode(),
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
            f"{prefix}.sessions.{s[0]}".encode(),
            s[2],
            f"{slot}:ctx:{s[0]}:{s[1]}".encode(),
            s[1],
            _session_lsn(s),
        )
        for s in sessions
    ]
    return msgs


_MSG_ID_B = MSG_ID.encode()
_HIGH_LSN_B = HIGH_LSN.encode()
_OMITTED_B = OMITTED.encode()


class HeaderBlock:
    """The headers of one batch's messages: each its ``Nats-Msg-Id``, all the batch's
    ``Ledger-High-Lsn`` (``high``; None: not known). A body that would take the message past
    ``max_payload`` is replaced by :func:`omitted_body`, marked ``Ledger-Omitted``."""

    def __init__(self, high: int | None, max_payload: int) -> None:
        mark = b"" if high is None else str(high).encode()  # (digits: no % in it)
        self._head = b"NATS/1.0\r\n%b: %%b\r\n%b: %b\r\n" % (_MSG_ID_B, _HIGH_LSN_B, mark)
        self._plain = self._head + b"\r\n"
        self._limit = max_payload - (len(self._plain) - 2)  # (what "%b" in it leaves)

    def frame(self, subject: bytes, msg_id: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        """(subject, headers, body) of one message."""
        if len(msg_id) + len(body) <= self._limit:
            return subject, self._plain % msg_id, body
        hdr = self._head % msg_id + b"%b: %d\r\n\r\n" % (_OMITTED_B, len(body))
        return subject, hdr, omitted_body(subject, body)


def omitted_body(subject: bytes, data: bytes) -> bytes:
    """What is published instead of a message larger than the server accepts (its header
    ``Ledger-Omitted`` gives the size): an event without its payload, or an empty projection
    (read it from ``agent_session_contexts``). One oversized event never stops the fan-out."""
    if b".events." not in subject:
        return b"{}"
    try:
        w = _read.decode(data)
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


# -- reading -----------------------------------------------------------------------------------

_read = msgspec.json.Decoder(RawWireEvent)


def read_event(data: bytes) -> RawWireEvent:
    """A ``<prefix>.events.*`` body; msgspec.DecodeError for anything else (not JSON, not an
    event's fields and types, nested deeper than an event around a payload can be)."""
    return decode_bounded(_read.decode, data, DOC_MAX_DEPTH)


def commit_lsn(w: WireEvent) -> int:
    """The event's commit LSN (0: none given); ValueError for text that is no LSN."""
    return parse_lsn(w.commit_lsn) if w.commit_lsn else 0


def left_out(w: WireEvent) -> bool:
    """Whether the event's payload was left out of the stream: the reader reads the row from
    agent_events at (session_id, position)."""
    return bool(w.omitted) and w.rejected is None


def rejected_event(w: WireEvent, why: str) -> Rejected:
    """The message's event as Rejected, for ``why``. A row whose session or position could not
    be read goes out as the nil session or position 0: in no session's history, by the rule
    every reader shares."""
    return Rejected(
        w.seq,
        w.session_id,
        w.position,
        w.agent_id,
        w.event_type,
        why,
        None,
        w.idempotency_key,
        unplaced=unplaced(w.session_id if w.session_id.int else None, w.position),
    )


def wire_event(w: WireEvent, payload: bytes) -> LedgerEvent | Rejected:
    """The event a ``<prefix>.events.*`` message carries (``payload``: its payload as JSON), by
    the rule every reader shares: Rejected when it was published as such, or its payload or
    time does not fit. A message whose payload was left out (:func:`left_out`) is the caller's
    to read from agent_events."""
    if w.rejected is not None:
        return rejected_event(w, w.rejected)
    try:
        created = admit_time(w.created_at)
        loaded = load_payload(w.event_type, payload)
    except InvalidEventError as e:
        return rejected_event(w, str(e))
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


# an escaped NUL (\u0000 after an even run of backslashes, or none) in JSON text
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def check_storable(w: WireEvent, payload: bytes) -> None:
    """PostgreSQL's text and jsonb hold no NUL character, so a message carrying one was never a
    ledger row (anyone who may publish on the subjects can forge one), and folding it would fail
    every write of its batch, for ever: ValueError."""
    for name in ("agent_id", "event_type", "idempotency_key", "rejected"):
        value = getattr(w, name)
        if value is not None and "\x00" in value:
            raise ValueError(f"its {name} holds a NUL character, which no ledger row can")
    if b"\\u0000" in payload and _NUL_ESCAPE.search(payload):
        raise ValueError("its payload holds a NUL character (\\u0000), which no ledger row can")


def status_of(headers: bytes) -> bytes:
    """The status code of a raw header block (``NATS/1.0 503 …``: ``b"503"``); empty for a
    message's own headers."""
    return headers[9:12] if headers[8:9] == b" " else b""


def read_headers(block: bytes) -> dict[str, str]:
    """A raw header block (``NATS/1.0[ status]\\r\\nName: value\\r\\n…\\r\\n``) as a dict;
    WireFormatError for bytes that are not one."""
    if not block.startswith(b"NATS/1.0"):
        raise WireFormatError(f"not a NATS header block: {block[:40]!r}")
    try:
        text = block.decode()
    except UnicodeDecodeError:
        raise WireFormatError(f"a NATS header block that is not UTF-8: {block[:40]!r}") from None
    headers: dict[str, str] = {}
    for line in text.split("\r\n")[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise WireFormatError(f"a NATS header line without a name: {line[:40]!r}")
        headers[name.strip()] = value.strip()
    return headers
