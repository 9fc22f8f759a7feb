"""Every error ledger-cdc raises, under one root.

Driver errors (psycopg, psycopg2) are translated once, where they cross into this package, with
``raise ... from e`` so the original stays attached. Each message says what went wrong, where, and
what to do about it.

    LedgerError
    ├── ConfigError                 bad option, bad name, missing binaries
    │   └── PostgresNotFoundError   no PostgreSQL server binaries to start a cluster with
    ├── EmbeddedError               a throwaway cluster failed to initialise, start or stop
    ├── MigrationError              a schema migration failed or was changed after being applied
    ├── AppendError                 an append was refused; nothing was written
    │   ├── InvalidEventError       bad session id, payload of the wrong shape, not JSON
    │   ├── UnknownEventTypeError   event type that was never registered
    │   ├── ConcurrentAppendError   stale ``expected_position``
    │   └── IdempotencyConflictError   same key, different event
    ├── MemoNotLoadedError          a rebuilt context asked for a memo it does not hold
    └── DecodeError                 bytes that are not a valid pgoutput message
"""

from __future__ import annotations

import uuid


class LedgerError(Exception):
    """Root of every error raised by ledger-cdc."""


class ConfigError(LedgerError):
    """A configuration value, option or name is invalid."""


class PostgresNotFoundError(ConfigError):
    """No PostgreSQL server binaries were found."""


class EmbeddedError(LedgerError):
    """A throwaway PostgreSQL cluster could not be initialised, started or stopped."""


class MigrationError(LedgerError):
    """A schema migration failed, or an applied one no longer matches its file."""


class AppendError(LedgerError):
    """An append was refused; nothing was written."""


class InvalidEventError(AppendError):
    """The event is malformed: bad session id, payload that fails validation, not JSON."""


class UnknownEventTypeError(AppendError):
    """The event type was never registered."""

    def __init__(self, event_type: str) -> None:
        self.event_type = event_type
        super().__init__(
            f"unknown event type {event_type!r}: register it first with "
            "ledger_cdc.register_event_type(name, PayloadStruct) "
            "(or register_event_type(name) for a free-form JSON object payload)"
        )


class ConcurrentAppendError(AppendError):
    """Another writer appended to the session since the position this writer last saw."""

    def __init__(self, session_id: uuid.UUID, expected: int, actual: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"session {session_id}: expected position {expected}, but the session is at "
            f"{actual}; re-read the session and retry"
        )


class IdempotencyConflictError(AppendError):
    """An idempotency key was reused for a different event."""

    def __init__(self, session_id: uuid.UUID, key: str, seq: int) -> None:
        self.session_id = session_id
        self.key = key
        self.seq = seq
        super().__init__(
            f"session {session_id}: idempotency key {key!r} already names event seq {seq} "
            "with a different type or payload; use a new key for a different event"
        )


class MemoNotLoadedError(LedgerError):
    """A context rebuilt from a snapshot does not hold the calls completed before it (they are
    in ``agent_memo``): look them up with ``ledger_cdc.replay.memoised_tool(conn, ctx, …)``."""


class DecodeError(LedgerError):
    """Bytes that are not a valid pgoutput message.

    Carries the message type, the field being read, the byte offset, the LSN of the message
    (``wal_start``) and a short hex excerpt around the offset.
    """

    def __init__(
        self,
        reason: str,
        *,
        message_type: str | None = None,
        field: str | None = None,
        offset: int | None = None,
        lsn: int | None = None,
        data: bytes | None = None,
    ) -> None:
        self.reason = reason
        self.message_type = message_type
        self.field = field
        self.offset = offset
        self.lsn = lsn
        self.excerpt = _excerpt(data, offset) if data is not None else ""
        where = ".".join(p for p in (message_type, field) if p)
        parts = [f"{where}: {reason}" if where else reason]
        ctx = []
        if offset is not None:
            ctx.append(f"offset {offset}")
        if data is not None:
            ctx.append(f"message of {len(data)} bytes")
        if lsn is not None:
            ctx.append(f"at LSN {format_lsn(lsn)}")
        if ctx:
            parts.append("(" + ", ".join(ctx) + ")")
        if self.excerpt:
            parts.append(f"bytes: {self.excerpt}")
        super().__init__(" ".join(parts))


def _excerpt(data: bytes, offset: int | None, width: int = 16) -> str:
    if not data:
        return "<empty>"
    at = 0 if offset is None else max(0, min(offset, len(data)))
    lo = max(0, at - width // 2)
    hi = min(len(data), lo + width)
    head = "…" if lo > 0 else ""
    tail = "…" if hi < len(data) else ""
    return head + data[lo:hi].hex(" ") + tail


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL prints it: ``16B3A40`` → ``0/16B3A40``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """``'0/16B3A40'`` → integer LSN; raises ConfigError on anything else."""
    hi, sep, lo = text.strip().partition("/")
    try:
        if not sep:
            raise ValueError(text)
        return (int(hi, 16) << 32) | int(lo, 16)
    except ValueError:
        raise ConfigError(f"not an LSN: {text!r} (expected the form 0/16B3A40)") from None
