"""The catalogue of event types: the standard agent steps' payload Structs, and the registry
that maps each event type to the type its payload must have.

The standard types (agent steps, runs, and the framework backends' types from
:mod:`ledger_cdc.events.frameworks`) are registered here; applications add their own with
:func:`register_event_type`. The registry also keeps, per type, the decoder its payloads are
read with (:data:`PAYLOAD_DECODERS`), dropped when a type is registered again.
"""

from __future__ import annotations

import re
import types
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from ledger_cdc.errors import UnknownEventTypeError
from ledger_cdc.events.frameworks import (
    CheckpointSaved,
    CheckpointsHidden,
    HarnessRecord,
    ItemPopped,
    ItemsAdded,
    ItemsCleared,
    ThreadDeleted,
    WritesPut,
)

__all__ = [
    "EVENT_TYPES",
    "PAYLOAD_DECODERS",
    "ContextLoaded",
    "FreeForm",
    "HandoffEmitted",
    "HandoffReceived",
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
    "event_types",
    "payload_decoder",
    "payload_type",
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
    "langgraph.checkpoint": CheckpointSaved,
    "langgraph.writes": WritesPut,
    "langgraph.thread.deleted": ThreadDeleted,
    "langgraph.checkpoints.hidden": CheckpointsHidden,
    "openai.items.added": ItemsAdded,
    "openai.item.popped": ItemPopped,
    "openai.items.cleared": ItemsCleared,
    "pydantic.run.registered": HarnessRecord,
    "pydantic.step": HarnessRecord,
    "pydantic.snapshot": HarnessRecord,
    "pydantic.tool.effect": HarnessRecord,
}
_BUILTIN = frozenset(EVENT_TYPES)
_decoders: dict[str, msgspec.json.Decoder[Any]] = {}
PAYLOAD_DECODERS: Mapping[str, msgspec.json.Decoder[Any]] = types.MappingProxyType(_decoders)
"""The decoders of the registered event types' payloads that have been read, by type (read-only;
a type appears once a payload of it was read, see :func:`payload_decoder`): for a reader's hot
path, which applies the same depth rule (:func:`ledger_cdc.events.too_deep`) and leaves whatever
does not decode, or whose type is not here, to :func:`ledger_cdc.events.load_payload`, to be
read and quarantined with its reason."""


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


def payload_decoder(event_type: str) -> msgspec.json.Decoder[Any] | None:
    """The decoder of a registered event type's payloads (made on first use and kept in
    :data:`PAYLOAD_DECODERS` until the type is registered again), or None for a type this
    process does not know."""
    dec = _decoders.get(event_type)
    if dec is None:
        typ = EVENT_TYPES.get(event_type)
        if typ is None:
            return None
        dec = _decoders[event_type] = msgspec.json.Decoder(typ)
    return dec
