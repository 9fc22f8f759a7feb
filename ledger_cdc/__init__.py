"""ledger-cdc: PostgreSQL's write-ahead log as the authoritative state ledger of agent systems.

Public API: the writer (:func:`append`, :class:`Ledger`), recovery (:func:`rebuild_context`,
:func:`retry_tool`, :class:`SessionContext`), the event types and their registry, and the error
tree. Everything else lives in its stage's module (``runs``, ``dispatch``, ``partitions``, …).
"""

from ledger_cdc import _compat
from ledger_cdc._version import __version__
from ledger_cdc.client.recovery import (
    rebuild_context,
    rebuild_context_async,
    retry_tool,
    retry_tool_async,
)
from ledger_cdc.client.writer import (
    AppendResult,
    AsyncLedger,
    Ledger,
    OutboxItem,
    append,
    append_async,
)
from ledger_cdc.errors import (
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
from ledger_cdc.events import (
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
from ledger_cdc.fold import SessionContext

_compat.install()  # the flat layout's module paths (ledger_cdc.replay, …) stay importable

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
