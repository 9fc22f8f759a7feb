"""ledger-cdc: PostgreSQL's write-ahead log as the authoritative state ledger of agent systems.

Public API: the writer (:func:`append`, :class:`Ledger`), recovery (:func:`rebuild_context`,
:func:`retry_tool`, :class:`SessionContext`), the event types and their registry, and the error
tree. Everything else lives in its stage's module (``runs``, ``dispatch``, ``partitions``, …).

The names load on first use (PEP 562): ``import ledger_cdc`` alone loads no driver, so a command
such as ``ledger-cdc consume`` can start streaming while the rest of the package loads.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing

from ledger_cdc._version import __version__

if _typing.TYPE_CHECKING:
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


_LAZY = {
    "AppendError": "ledger_cdc.errors",
    "AppendResult": "ledger_cdc.client.writer",
    "AsyncLedger": "ledger_cdc.client.writer",
    "ConcurrentAppendError": "ledger_cdc.errors",
    "ConfigError": "ledger_cdc.errors",
    "ContextLoaded": "ledger_cdc.events",
    "DecodeError": "ledger_cdc.errors",
    "HandoffEmitted": "ledger_cdc.events",
    "HandoffReceived": "ledger_cdc.events",
    "IdempotencyConflictError": "ledger_cdc.errors",
    "InvalidEventError": "ledger_cdc.errors",
    "Ledger": "ledger_cdc.client.writer",
    "LedgerError": "ledger_cdc.errors",
    "LedgerEvent": "ledger_cdc.events",
    "Message": "ledger_cdc.events",
    "MigrationError": "ledger_cdc.errors",
    "ModelRequested": "ledger_cdc.events",
    "ModelResponded": "ledger_cdc.events",
    "OutboxItem": "ledger_cdc.client.writer",
    "SessionContext": "ledger_cdc.fold",
    "TaskCompleted": "ledger_cdc.events",
    "TaskFailed": "ledger_cdc.events",
    "ToolCall": "ledger_cdc.events",
    "ToolInvoked": "ledger_cdc.events",
    "ToolObserved": "ledger_cdc.events",
    "UnknownEventTypeError": "ledger_cdc.errors",
    "Usage": "ledger_cdc.events",
    "append": "ledger_cdc.client.writer",
    "append_async": "ledger_cdc.client.writer",
    "rebuild_context": "ledger_cdc.client.recovery",
    "rebuild_context_async": "ledger_cdc.client.recovery",
    "register_event_type": "ledger_cdc.events",
    "retry_tool": "ledger_cdc.client.recovery",
    "retry_tool_async": "ledger_cdc.client.recovery",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module), name)
    elif not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}"):
        value = _importlib.import_module(f"{__name__}.{name}")  # a subpackage, as before
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
