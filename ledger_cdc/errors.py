"""Every error ledger-cdc raises, under one root, each with the exit code the CLI gives it.

Driver errors (psycopg, psycopg2) are translated once, where they cross into this package
(:func:`translate`), with ``raise ... from e`` so the original stays attached: a connection
or server error is *retryable* (server down, restarting, connection cut, too many clients) or
*permanent* (bad DSN, authentication, missing database, schema, publication, privilege or
``wal_level``: something to fix before trying again). Each message says what went wrong, where,
and what to do about it, and never holds a password.

    LedgerError                     exit 5
    ├── ConfigError                 exit 4  bad option, name, DSN; a permanent server-side cause
    │   ├── PostgresNotFoundError   exit 4  no PostgreSQL server binaries to start a cluster with
    │   ├── SchemaError             exit 4  the ledger schema is missing or older than this code
    │   └── SlotError               exit 3  the slot is missing or unusable
    ├── SlotLostError               exit 3  the slot was invalidated: resync from the table
    ├── RetryableError              exit 4  may succeed if tried again (the consumer retries)
    │   ├── DatabaseUnavailable     exit 4  server down, restarting, connection lost
    │   ├── TransportError          exit 4  the replication connection failed
    │   │   └── SlotBusyError       exit 4  another consumer streams the slot
    │   └── JetStreamError          exit 4  a NATS server did not acknowledge
    ├── NotFoundError               exit 1  no such session (a typo, or nothing written yet)
    │   └── NoSuchSessionError      exit 1
    ├── EmbeddedError               exit 5  a throwaway cluster failed to initialise, start or stop
    ├── MigrationError              exit 4  a migration failed or was changed after being applied
    ├── AppendError                 exit 5  an append was refused; nothing was written
    │   ├── InvalidEventError       exit 5  bad session id, payload of the wrong shape, not JSON
    │   ├── UnknownEventTypeError   exit 5  event type that was never registered
    │   ├── ConcurrentAppendError   exit 5  stale ``expected_position``
    │   └── IdempotencyConflictError   exit 5  same key, different event
    ├── FencedError                 exit 5  another consumer moved the checkpoint
    ├── HistoryArchivedError        exit 1  the history a rebuild needs was archived
    ├── ArchiveRefusedError         exit 5  archiving would lose something (consumer behind, …)
    ├── LeaseLostError              exit 5  the run was taken over since this worker leased it
    ├── RunNotReadyError            exit 5  the run is not ready to lease
    ├── MemoNotLoadedError          exit 5  a rebuilt context asked for a memo it does not hold
    └── DecodeError                 exit 5  bytes that are not a valid pgoutput message
"""

from __future__ import annotations

import re
import urllib.parse
import uuid

from ledger_cdc import lsn as _lsn
from ledger_cdc.lsn import format_lsn


class LedgerError(Exception):
    """Root of every error raised by ledger-cdc."""

    exit_code = 5


class ConfigError(LedgerError):
    """A configuration value, option or name is invalid, or the server refuses for a reason
    that retrying will not cure (authentication, privileges, wal_level, a missing object)."""

    exit_code = 4


DAY = 86_400
"""Seconds: the longest interval, wait or timeout a setting takes (past it a wait overflows the
platform's clock, or a health check never comes)."""


def _number(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def check_ranges(
    what: str,
    settings: object,
    ranges: dict[str, tuple[float, float]],
    off: tuple[str, ...] = (),
) -> None:
    """Raise ConfigError naming every setting of ``settings`` (an attribute each) that is not a
    number from its least to its most in ``ranges`` (NaN is in no range; a bool is no number),
    or 0 for one in ``off`` (0 turns it off)."""
    bad: list[str] = []
    for name, (low, high) in ranges.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad.append(f"{name}={value!r} is not a number")
        elif not (low <= value <= high or (name in off and value == 0)):
            zero = "0 or " if name in off else ""
            bad.append(f"{name}={value!r} is not {zero}from {_number(low)} to {_number(high)}")
    if bad:
        raise ConfigError(f"{what} out of range: " + "; ".join(bad))


class PostgresNotFoundError(ConfigError):
    """No PostgreSQL server binaries were found."""


class SchemaError(ConfigError):
    """The ledger's schema is missing from the database, or older than this version."""


class SlotError(ConfigError):
    """The slot is missing or not usable (wrong plugin, wrong database)."""

    exit_code = 3


class SlotLostError(LedgerError):
    """The slot was invalidated (WAL it needed was removed): resynchronise from the table."""

    exit_code = 3


class RetryableError(LedgerError):
    """The operation failed for a reason that passes: trying again later may succeed (a
    one-shot command reports it as a connection error)."""

    exit_code = 4


class DatabaseUnavailable(RetryableError):
    """The database cannot be reached right now (down, restarting, the connection was cut)."""


class TransportError(RetryableError):
    """The replication connection failed in a way a reconnect can cure."""


class SlotBusyError(TransportError):
    """Another consumer streams the slot (a hot standby waits for it)."""


class JetStreamError(RetryableError):
    """A publish to NATS JetStream was not acknowledged (retried from the checkpoint)."""


class NotFoundError(LedgerError):
    """What the command was asked about does not exist."""

    exit_code = 1


class NoSuchSessionError(NotFoundError):
    """The session has no events (at or below the requested seq)."""


class HistoryArchivedError(LedgerError):
    """The events a rebuild needs were archived and no snapshot covers them."""

    exit_code = 1


class WindowMissingError(HistoryArchivedError):
    """A stored context (snapshot, projection) references the ``context.loaded`` event that
    holds its context window, and that event is neither in the ledger nor kept by an archive
    (or no longer holds the messages the context referenced)."""


class ArchiveRefusedError(LedgerError):
    """Archiving was refused: it would lose something (the consumer is behind, or the target
    directory already holds this partition's archive)."""


class LeaseLostError(LedgerError):
    """The run was taken over (or released) since this worker leased it: stop working on it."""


class RunNotReadyError(LedgerError):
    """The run is not ready to lease (it is running on a live lease, suspended, or ended)."""


class FencedError(LedgerError):
    """The checkpoint moved under us: another consumer owns the slot now."""


class EmbeddedError(LedgerError):
    """A throwaway PostgreSQL cluster could not be initialised, started or stopped."""


class MigrationError(LedgerError):
    """A schema migration failed, or an applied one no longer matches its file."""

    exit_code = 4


class AppendError(LedgerError):
    """An append was refused; nothing was written."""


class InvalidEventError(AppendError):
    """The event is malformed: bad session id, payload that fails validation, not JSON."""


class UnknownEventTypeError(AppendError):
    """The event type was never registered."""

    def __init__(self, event_type: str) -> None:
        self.event_type = event_type
        name = repr(event_type)
        if len(name) > 200:  # (a careless writer's 10,000 characters are not one error line)
            name = f"{name[:200]}… ({len(event_type):,} characters)"
        super().__init__(
            f"unknown event type {name}: register it first with "
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


# -- driver errors, translated once ---------------------------------------------------------------

# libpq and server messages that no retry will cure (matched lower-case). Connection failures
# carry no SQLSTATE in either driver, so the message is what there is to go on.
_PERMANENT = (
    "password authentication failed",
    "authentication failed",
    "no pg_hba.conf entry",
    "password must be",
    "does not exist",  # role, database, publication, slot, relation, column
    "invalid connection option",
    "invalid integer value",
    "invalid port",
    'missing "=" after',
    "invalid uri",
    "invalid dsn",
    "invalid percent-encoded",
    "unterminated quoted string",
    "invalid sslmode",
    "invalid value for parameter",
    "could not translate host name",
    "failed to resolve host",
    "in uri",
    "connection info string",
    "must be superuser or replication role",
    "must be superuser or have replication",
    "permission denied",
    "logical decoding requires",
    "wal_level",
    "is not a valid",
    "requires a value",
    "definition of service",  # service=… not in the service file
    "service file",
    "bad value for",
    "server does not support ssl",  # sslmode=require against a server without SSL
    "cannot execute sql commands in wal sender",  # replication=true in the DSN
    "not supported in a replication connection",  # replication=database in the DSN
)
_PERMANENT_STATES = ("28", "3D", "3F", "42", "54", "55000", "0A000", "22023")
_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_PASSWORD_URL = re.compile(r"(://[^:/@\s]*:)([^@\s]*)(@)")
_DSN_PASSWORD_URL = re.compile(r"(://[^:/@]*:)([^@]*)(@)")


def redact(text: str, dsn: str | None = None) -> str:
    """``text`` without any password it may hold (of ``dsn``, or written as one)."""
    if dsn:
        secret = _password_of(dsn)
        if secret:
            # as written, and as libpq quotes it decoded (a URL's %20 is a space in its errors)
            for form in {secret, urllib.parse.unquote(secret)}:
                text = text.replace(form, "***")
    text = _PASSWORD_KV.sub(r"\1***", text)
    return _PASSWORD_URL.sub(r"\1***\3", text)


def _password_of(dsn: str) -> str | None:
    # a DSN is one value, not prose: its URL password runs to the '@' (spaces and all, which
    # libpq then refuses, quoting it)
    m = _DSN_PASSWORD_URL.search(dsn)
    if m and m.group(2):
        return m.group(2)
    m = _PASSWORD_KV.search(dsn)
    if m:
        return m.group(2).strip("'")
    return None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_permanent(e: BaseException) -> bool:
    """Whether a driver error needs a fix rather than a retry."""
    state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
    if isinstance(state, str) and state.startswith(_PERMANENT_STATES):
        return True
    if type(e).__name__ == "ProgrammingError":  # both drivers: a DSN that does not parse
        return True
    text = str(e).lower()
    if "database system is" in text or "too many" in text or "terminating connection" in text:
        return False
    return any(p in text for p in _PERMANENT)


_NO_REPLICATION = (
    "give the DSN without replication=… (ledger-cdc opens a replication connection where it "
    "needs one)"
)
_HINTS = (
    ("password authentication failed", "check the user and password in the DSN"),
    ("no pg_hba.conf entry", "allow this host/user in the server's pg_hba.conf"),
    (
        "permission denied to create temporary tables",
        "GRANT TEMPORARY ON DATABASE … TO the role (`ledger-cdc init` grants it to "
        "ledger_consumer)",
    ),
    ("permission denied", "log in as a role with the privileges (see the README's roles)"),
    ('database "', "create the database, or fix its name in the DSN"),
    ('role "', "create the role, or fix the user name in the DSN"),
    ("wal_level", "set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and restart"),
    ("logical decoding requires", "set wal_level = logical and restart the server"),
    ("replication role", "give the role REPLICATION (ALTER ROLE … REPLICATION)"),
    ("must be superuser or have replication", "give the role REPLICATION"),
    ("invalid integer value", "fix the port in the DSN"),
    ("invalid port", "fix the port in the DSN"),
    ("invalid connection option", "fix the DSN: see libpq's connection parameters"),
    ("invalid uri", "fix the DSN: postgresql://user@host:port/database"),
    ("invalid dsn", "fix the DSN: postgresql://user@host:port/database or key=value pairs"),
    ('missing "="', "fix the DSN: postgresql://user@host:port/database or key=value pairs"),
    ("could not translate host name", "fix the host name in the DSN"),
    ("failed to resolve host", "fix the host name in the DSN"),
    ("in uri", "fix the DSN: postgresql://user@host:port/database"),
    ("server does not support ssl", "lower sslmode in the DSN, or turn ssl on in the server"),
    ("replication connection", _NO_REPLICATION),
    ("in wal sender", _NO_REPLICATION),
)


def translate(e: BaseException, *, dsn: str | None = None, doing: str = "") -> LedgerError:
    """A driver error as the LedgerError it stands for: permanent → :class:`ConfigError`
    (:class:`SchemaError` for a missing table or column), else :class:`DatabaseUnavailable`.
    One line, with a hint, without the password."""
    if isinstance(e, LedgerError):
        return e
    line = redact(first_line(e), dsn)
    where = f"{doing}: " if doing else ""
    state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
    if state in ("42P01", "42703", "3F000", "42883"):
        return SchemaError(
            f"{where}{line} — the ledger schema is missing or older than this version: "
            "run `ledger-cdc init --dsn …` against this database"
            + (
                ", or, if it ran, put the ledger's schema on this role's search_path (SHOW "
                "search_path; ALTER ROLE … SET search_path)"
                if state == "42P01"
                else ""
            )
        )
    if is_permanent(e):
        low = line.lower()
        hint = next((h for pat, h in _HINTS if pat in low), None)
        return ConfigError(f"{where}{line}" + (f" ({hint})" if hint else ""))
    if state == "57014" and "statement timeout" in line.lower():
        line += (
            " (a statement_timeout of the database, the role or the DSN's options; lift it "
            "for this connection with options='-c statement_timeout=0' in the DSN)"
        )
    elif state == "25006":  # read_only_sql_transaction: retried, it may pass (a failover)
        line += (
            " (the database takes no writes: a hot standby, or default_transaction_read_only "
            "is on; give the primary's DSN)"
        )
    return DatabaseUnavailable(f"{where}{line}")


def describe(e: BaseException, dsn: str | None = None) -> str:
    """One line for any exception, password removed."""
    return redact(first_line(e), dsn)


__all__ = [
    "DAY",
    "AppendError",
    "ArchiveRefusedError",
    "ConcurrentAppendError",
    "ConfigError",
    "DatabaseUnavailable",
    "DecodeError",
    "EmbeddedError",
    "FencedError",
    "HistoryArchivedError",
    "IdempotencyConflictError",
    "InvalidEventError",
    "JetStreamError",
    "LeaseLostError",
    "LedgerError",
    "MemoNotLoadedError",
    "MigrationError",
    "NoSuchSessionError",
    "NotFoundError",
    "PostgresNotFoundError",
    "RetryableError",
    "RunNotReadyError",
    "SchemaError",
    "SlotBusyError",
    "SlotError",
    "SlotLostError",
    "TransportError",
    "UnknownEventTypeError",
    "WindowMissingError",
    "check_ranges",
    "describe",
    "first_line",
    "format_lsn",
    "is_permanent",
    "parse_lsn",
    "redact",
    "translate",
]


def parse_lsn(text: str) -> int:
    """``'0/16B3A40'`` → integer LSN; a ConfigError (exit code 4) on anything else."""
    try:
        return _lsn.parse_lsn(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None
