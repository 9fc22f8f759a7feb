"""ledger-cdc: PostgreSQL's write-ahead log as the authoritative state ledger of agent systems.

Public API: the writer (:func:`append`, :class:`Ledger`), recovery (:func:`rebuild_context`,
:func:`retry_tool`, :class:`SessionContext`), the event types and their registry, and the error
tree. Everything else lives in its stage's module (``runs``, ``dispatch``, ``partitions``, …).
"""

from ._version import __version__
from .errors import (
    AppendError,
    ConcurrentAppendError,
    ConfigError,
    DecodeError,
    IdempotencyConflictError,
    InvalidEventError,
    LedgerError,
    MigrationError,
    UnknownEventTypeError,
)
from .events import (
    ContextLoaded,
    HandoffEmitted,
    HandoffReceived,
    LedgerEvent,
    Message,
    ModelRequested,
    ModelResponded,
    TaskCompleted,
    TaskFailed,
    ToolCall,
    ToolInvoked,
    ToolObserved,
    Usage,
    register_event_type,
)
from .fold import SessionContext
from .replay import rebuild_context, rebuild_context_async, retry_tool, retry_tool_async
from .writer import AppendResult, AsyncLedger, Ledger, OutboxItem, append, append_async

__all__ = [
    "AppendError",
    "AppendResult",
    "AsyncLedger",
    "ConcurrentAppendError",
    "ConfigError",
    "ContextLoaded",
    "DecodeError",
    "HandoffEmitted",
    "HandoffReceived",
    "IdempotencyConflictError",
    "InvalidEventError",
    "Ledger",
    "LedgerError",
    "LedgerEvent",
    "Message",
    "MigrationError",
    "ModelRequested",
    "ModelResponded",
    "OutboxItem",
    "SessionContext",
    "TaskCompleted",
    "TaskFailed",
    "ToolCall",
    "ToolInvoked",
    "ToolObserved",
    "UnknownEventTypeError",
    "Usage",
    "__version__",
    "append",
    "append_async",
    "rebuild_context",
    "rebuild_context_async",
    "register_event_type",
    "retry_tool",
    "retry_tool_async",
]
