"""Ledger events and the registry of event types with their payload Structs.

A :class:`LedgerEvent` is one row of ``agent_events``. Its payload is validated against the Struct
registered for its ``event_type`` at append time (and again by the consumer, which dead-letters a
payload that fails). The standard agent steps are registered here; applications add their own with
:func:`register_event_type`. This module knows nothing about PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from typing import Any

import msgspec

from .errors import InvalidEventError, UnknownEventTypeError

__all__ = [
    "EVENT_TYPES",
    "ContextLoaded",
    "HandoffEmitted",
    "HandoffReceived",
    "LedgerEvent",
    "Message",
    "ModelRequested",
    "ModelResponded",
    "RunLeased",
    "RunQueued",
    "RunReleased",
    "RunSuspended",
    "SessionForked",
    "SignalReceived",
    "TaskCompleted",
    "TaskFailed",
    "ToolCall",
    "ToolInvoked",
    "ToolObserved",
    "Usage",
    "decode_payload",
    "encode_payload",
    "event_types",
    "payload_type",
    "refuse_nul",
    "register_event_type",
]

_TYPE_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


class Message(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One chat message of an agent's context window."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None


class Usage(msgspec.Struct, frozen=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0


class ToolCall(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A tool call a model asked for, as part of its response."""

    call_id: str
    tool: str
    arguments: dict[str, Any] = {}


class ContextLoaded(msgspec.Struct, frozen=True):
    """The context window the agent starts (or restarts) from."""

    messages: list[Message]
    task: str | None = None


class ModelRequested(msgspec.Struct, frozen=True):
    """A model call about to be made; ``request_id`` pairs it with its response."""

    request_id: str
    model: str
    prompt_hash: str | None = None
    idempotency_key: str | None = None


class ModelResponded(msgspec.Struct, frozen=True):
    request_id: str
    model: str
    content: str = ""
    usage: Usage = Usage()
    tool_calls: list[ToolCall] = []
    stop_reason: str | None = None


class ToolInvoked(msgspec.Struct, frozen=True):
    """A tool call about to be performed; the idempotency key travels with any retry."""

    call_id: str
    tool: str
    arguments: dict[str, Any] = {}
    idempotency_key: str | None = None


class ToolObserved(msgspec.Struct, frozen=True):
    """The result of a tool call (``error`` set when it failed)."""

    call_id: str
    result: Any = None
    error: str | None = None


class HandoffEmitted(msgspec.Struct, frozen=True):
    handoff_id: str
    to_agent: str
    message: str = ""
    data: dict[str, Any] = {}


class HandoffReceived(msgspec.Struct, frozen=True):
    handoff_id: str
    from_agent: str


class SessionForked(msgspec.Struct, frozen=True):
    """First event of a forked session: the events that follow are copies of the origin's
    events up to ``upto_seq`` (see ``ledger-cdc fork``)."""

    origin_session_id: uuid.UUID
    upto_seq: int
    upto_position: int
    events: int
    reason: str | None = None


class RunQueued(msgspec.Struct, frozen=True):
    """The run is ready for a worker to lease it."""

    reason: str | None = None


class RunLeased(msgspec.Struct, frozen=True):
    """A worker holds the run for ``ttl`` seconds from the event's commit-time ``created_at``
    (the server's clock). Renewal is another ``run.leased`` by the same worker."""

    worker: str
    ttl: float


class RunReleased(msgspec.Struct, frozen=True):
    """The worker gives the run back (it is pending again)."""

    worker: str
    reason: str | None = None


class RunSuspended(msgspec.Struct, frozen=True):
    """The run waits for one of ``wait_for`` (signal names); its lease ends."""

    reason: str
    wait_for: list[str] = []


class SignalReceived(msgspec.Struct, frozen=True):
    """A signal sent to the run from outside (an approval, a webhook)."""

    name: str
    payload: Any = None
    sender: str | None = None


class TaskCompleted(msgspec.Struct, frozen=True):
    result: Any = None


class TaskFailed(msgspec.Struct, frozen=True):
    error: str
    retryable: bool = False


# A free-form payload for event types registered without a Struct.
FreeForm = dict[str, Any]

EVENT_TYPES: dict[str, Any] = {
    "context.loaded": ContextLoaded,
    "model.requested": ModelRequested,
    "model.responded": ModelResponded,
    "tool.invoked": ToolInvoked,
    "tool.observed": ToolObserved,
    "handoff.emitted": HandoffEmitted,
    "handoff.received": HandoffReceived,
    "task.completed": TaskCompleted,
    "task.failed": TaskFailed,
    "session.forked": SessionForked,
    "run.queued": RunQueued,
    "run.leased": RunLeased,
    "run.released": RunReleased,
    "run.suspended": RunSuspended,
    "signal.received": SignalReceived,
}
_BUILTIN = frozenset(EVENT_TYPES)
_decoders: dict[str, msgspec.json.Decoder[Any]] = {}
_encoder = msgspec.json.Encoder()
# A NUL character, as JSON writes it: an escape preceded by an even number of backslashes.
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def register_event_type(name: str, payload: Any = FreeForm, *, replace: bool = False) -> None:
    """Register an event type and the type its payload must have (a msgspec Struct, or a dict
    type for a free-form JSON object). Registering the same pair again is a no-op."""
    if not _TYPE_RE.match(name):
        raise ValueError(
            f"invalid event type {name!r}: use dotted lower-case words, e.g. 'review.approved'"
        )
    current = EVENT_TYPES.get(name)
    if current is not None and current is not payload and not replace:
        if name in _BUILTIN:
            raise ValueError(f"{name!r} is a standard event type and cannot be redefined")
        raise ValueError(f"{name!r} is already registered with {current!r}; pass replace=True")
    EVENT_TYPES[name] = payload
    _decoders.pop(name, None)


def event_types() -> dict[str, Any]:
    return dict(EVENT_TYPES)


def payload_type(event_type: str) -> Any:
    try:
        return EVENT_TYPES[event_type]
    except KeyError:
        raise UnknownEventTypeError(event_type) from None


def encode_payload(event_type: str, payload: Any) -> bytes:
    """Validate ``payload`` against its event type and return its JSON bytes.

    Accepts an instance of the registered Struct or a plain mapping that converts to it.
    """
    typ = payload_type(event_type)
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct) and isinstance(payload, typ):
        value = payload
    else:
        try:
            value = msgspec.convert(payload, typ, from_attributes=False)
        except msgspec.ValidationError as e:
            raise InvalidEventError(f"{event_type} payload does not match {_name(typ)}: {e}") from e
        except TypeError as e:
            raise InvalidEventError(f"{event_type} payload is not JSON-serialisable: {e}") from e
    try:
        data = _encoder.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError) as e:
        raise InvalidEventError(f"{event_type} payload is not JSON-serialisable: {e}") from e
    if not data.startswith(b"{"):
        raise InvalidEventError(f"{event_type} payload must be a JSON object, got {data[:40]!r}")
    return refuse_nul(data, f"{event_type} payload")


def refuse_nul(data: bytes, what: str) -> bytes:
    """``data`` (JSON) unchanged, or InvalidEventError if it holds a NUL character."""
    if b"\\u0000" in data and _NUL.search(data):
        raise InvalidEventError(
            f"{what} contains a NUL character (\\u0000), which PostgreSQL's jsonb cannot store: "
            "remove it or encode the value (base64, hex) first"
        )
    return data


def decode_payload(event_type: str, data: bytes | str) -> Any:
    """JSON bytes → the registered payload type; raises InvalidEventError when it does not fit."""
    dec = _decoders.get(event_type)
    if dec is None:
        dec = msgspec.json.Decoder(payload_type(event_type))
        _decoders[event_type] = dec
    try:
        return dec.decode(data)
    except msgspec.DecodeError as e:
        raise InvalidEventError(f"{event_type} payload is invalid: {e}") from e


def _name(typ: Any) -> str:
    return getattr(typ, "__name__", repr(typ))


class LedgerEvent(msgspec.Struct, frozen=True, gc=False):
    """One committed row of ``agent_events``, with its payload decoded to its registered type
    (or left as a dict for event types this process does not know)."""

    seq: int
    session_id: uuid.UUID
    position: int
    agent_id: str
    event_type: str
    payload: Any
    created_at: dt.datetime
    idempotency_key: str | None = None
    hash: bytes | None = None
    prev_hash: bytes | None = None
