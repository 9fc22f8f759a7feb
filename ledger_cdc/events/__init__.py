"""Ledger events and the registry of event types with their payload Structs.

A :class:`LedgerEvent` is one row of ``agent_events``. Its payload is validated against the Struct
registered for its ``event_type`` at append time (and again by the consumer, which dead-letters a
payload that fails). The standard agent steps are registered here; applications add their own with
:func:`register_event_type`. This package knows nothing about PostgreSQL. By concern:

- :mod:`~ledger_cdc.events.catalogue`: the standard payload Structs and the registry of types;
- :mod:`~ledger_cdc.events.frameworks`: the payload types of the LangGraph, OpenAI Agents SDK
  and Pydantic AI backends;
- :mod:`~ledger_cdc.events.depth`: how deep JSON nests, and the depth rule readers share;
- :mod:`~ledger_cdc.events.payload`: payloads to and from JSON, the writer's :class:`Limits`;
- :mod:`~ledger_cdc.events.rows`: a row admitted as a :class:`LedgerEvent` or a
  :class:`Rejected`, by the rule every reader applies (:func:`admit_row`).
"""

from ledger_cdc.events.catalogue import (
    EVENT_TYPES,
    PAYLOAD_DECODERS,
    ContextLoaded,
    HandoffEmitted,
    HandoffReceived,
    Message,
    ModelRequested,
    ModelResponded,
    RunLeased,
    RunQueued,
    RunReleased,
    RunSuspended,
    SessionForked,
    SignalReceived,
    TaskCompleted,
    TaskFailed,
    ToolCall,
    ToolInvoked,
    ToolObserved,
    Usage,
    event_types,
    payload_type,
    register_event_type,
)
from ledger_cdc.events.depth import (
    DOC_MAX_DEPTH,
    READ_MAX_DEPTH,
    decode_bounded,
    json_depth,
    too_deep,
)
from ledger_cdc.events.frameworks import (
    Blob,
    CheckpointSaved,
    CheckpointsHidden,
    HarnessRecord,
    ItemPopped,
    ItemsAdded,
    ItemsCleared,
    ThreadDeleted,
    Typed,
    Write,
    WritesPut,
)
from ledger_cdc.events.payload import (
    DEFAULT_LIMITS,
    Limits,
    decode_payload,
    encode_json,
    encode_payload,
    load_payload,
    refuse_nul,
)
from ledger_cdc.events.rows import (
    MAX_TIME,
    MIN_TIME,
    LedgerEvent,
    Rejected,
    admit_row,
    admit_time,
    as_digest,
    unidentified,
    unplaced,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DOC_MAX_DEPTH",
    "EVENT_TYPES",
    "MAX_TIME",
    "MIN_TIME",
    "PAYLOAD_DECODERS",
    "READ_MAX_DEPTH",
    "Blob",
    "CheckpointSaved",
    "CheckpointsHidden",
    "ContextLoaded",
    "HandoffEmitted",
    "HandoffReceived",
    "HarnessRecord",
    "ItemPopped",
    "ItemsAdded",
    "ItemsCleared",
    "LedgerEvent",
    "Limits",
    "Message",
    "ModelRequested",
    "ModelResponded",
    "Rejected",
    "RunLeased",
    "RunQueued",
    "RunReleased",
    "RunSuspended",
    "SessionForked",
    "SignalReceived",
    "TaskCompleted",
    "TaskFailed",
    "ThreadDeleted",
    "ToolCall",
    "ToolInvoked",
    "ToolObserved",
    "Typed",
    "Usage",
    "Write",
    "WritesPut",
    "admit_row",
    "admit_time",
    "as_digest",
    "decode_bounded",
    "decode_payload",
    "encode_json",
    "encode_payload",
    "event_types",
    "json_depth",
    "load_payload",
    "payload_type",
    "refuse_nul",
    "register_event_type",
    "too_deep",
    "unidentified",
    "unplaced",
]
