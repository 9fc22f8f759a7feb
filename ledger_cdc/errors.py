"""Every error ledger-cdc raises, under one root, each with the exit code the CLI gives it.

Driver errors (psycopg, psycopg2) are translated once, where they cross into this package
(:func:`translate`), with ``raise ... from e`` so the original stays attached: a connection
or server error is *retryable* (server down, restarting, connection cut, too many clients) or
*permanent* (bad DSN, authentication, missing database, schema, publication, privilege or
``wal_level``: something to fix before trying again). Which one is told by the error's
SQLSTATE, never by its message, which the server writes in its own language. Each message says
what went wrong, where, and what to do about it, and never holds a password.

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

import sys
import uuid
from typing import Any

from ledger_cdc.lsn import format_lsn
from ledger_cdc.redact import redact


class LedgerError(Exception):
    """Root of every error raised by ledger-cdc."""

    exit_code = 5


class ConfigError(LedgerError):
    """A configuration value, option or name is invalid, or the server refuses for a reason
    that retrying will not cure (authentication, privileges, wal_level, a missing object)."""

    exit_code = 4


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


class RefusedError(DatabaseUnavailable):
    """The server refused the session before any password, with no reason a client can read
    apart from the server's words: it is full (max_connections), or pg_hba.conf does not let
    this user in, or the role does not exist. Tried again by what runs for long (it may pass);
    at a consumer's start it stops it, as a fix is likelier than a full server."""


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
    in ``agent_memo``): look them up with
    ``ledger_cdc.client.recovery.memoised_tool(conn, ctx, …)``."""


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
#
# A server error is told by its SQLSTATE (psycopg 3's ``sqlstate``, psycopg2's ``pgcode``) and,
# where one SQLSTATE has several fixes, by the server routine that raised it
# (``diag.source_function``, a C function name): never by its message, which the server writes
# in its lc_messages, in any language. A failed connection attempt carries no SQLSTATE at all
# (libpq folds the server's reply into its message), so libpq is asked again instead: see
# _startup_verdict.

_PERMANENT_STATES = (
    "28",  # invalid_authorization_specification, invalid_password
    "3D",  # invalid_catalog_name: no such database
    "3F",  # invalid_schema_name
    "42",  # syntax_error_or_access_rule_violation: privileges, undefined objects
    "54",  # program_limit_exceeded
    "55000",  # object_not_in_prerequisite_state: wal_level, max_replication_slots
    "0A000",  # feature_not_supported
    "22023",  # invalid_parameter_value
)
# undefined_table, undefined_column, invalid_schema_name, undefined_function
_SCHEMA_STATES = ("42P01", "42703", "3F000", "42883")
# feature_not_supported, protocol_violation: what a replication connection answers to SQL
_REPLICATION_STATES = ("0A000", "08P01")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_Verdict = tuple[type[LedgerError], str | None]

_DSN_HINT = "fix the DSN: postgresql://user@host:port/database or key=value pairs"
_REFUSED_HINT = "fix the DSN: libpq does not take it as given"
_NO_REPLICATION = (
    "give the DSN without replication=… (ledger-cdc opens a replication connection where it "
    "needs one)"
)
_SCHEMA_HINT = (
    "the ledger schema is missing or older than this version: run `ledger-cdc init --dsn …` "
    "against this database"
)
_SEARCH_PATH_HINT = (
    ", or, if it ran, put the ledger's schema on this role's search_path (SHOW search_path; "
    "ALTER ROLE … SET search_path)"
)
_STATE_HINTS = {
    "28P01": "check the user and password in the DSN",
    "28000": (
        "check the user name in the DSN: the role must exist and may LOGIN, and the server's "
        "pg_hba.conf must let it connect from this host"
    ),
    "3D000": "create the database, or fix its name in the DSN",
    "42501": "log in as a role with the privileges (see the README's roles)",
    "57014": (
        "cancelled by a statement_timeout of the database, the role or the DSN's options, which "
        "options='-c statement_timeout=0' in the DSN lifts for this connection, or by "
        "pg_cancel_backend"
    ),
    "57P03": "the server is starting, stopping or recovering",  # cannot_connect_now
    # retried, it may pass (a failover)
    "25006": (
        "the database takes no writes: a hot standby, or default_transaction_read_only is on; "
        "give the primary's DSN"
    ),
}
# (SQLSTATE, the server routine that raised it): C function names, alike in every language
_ROUTINE_HINTS = {
    ("42501", "InitTempTableNamespace"): (
        "GRANT TEMPORARY ON DATABASE … TO the role (`ledger-cdc init` grants it to ledger_consumer)"
    ),
    ("42501", "CheckSlotPermissions"): "give the role REPLICATION (ALTER ROLE … REPLICATION)",
    ("55000", "CheckLogicalDecodingRequirements"): (
        "set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and restart the server"
    ),
    ("55000", "CheckSlotRequirements"): (
        "set wal_level = logical and max_replication_slots above 0 (ALTER SYSTEM SET …), then "
        "restart the server"
    ),
}
# libpq's whole-number parameters, which it checks only when it connects
_NUMBER_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_SSL_REQUIRED = ("require", "verify-ca", "verify-full")
_PROBE_TIMEOUT = 10  # seconds: at most this for each second try of a failed connection


def is_permanent(e: BaseException, dsn: str | None = None) -> bool:
    """Whether a driver error needs a fix rather than a retry (:func:`translate` says which
    fix)."""
    kind, _ = _classify(e, dsn)
    return issubclass(kind, ConfigError)


def translate(e: BaseException, *, dsn: str | None = None, doing: str = "") -> LedgerError:
    """A driver error as the LedgerError it stands for: permanent → :class:`ConfigError`
    (:class:`SchemaError` for a missing table or column), else :class:`DatabaseUnavailable`.
    One line, with a hint, without the password.

    Told by SQLSTATE, never by the message (see the section's comment); a failed connection
    attempt, which has none, costs one or two more attempts to tell (_startup_verdict)."""
    if isinstance(e, LedgerError):
        return e
    line = redact(first_line(e), dsn)
    where = f"{doing}: " if doing else ""
    kind, hint = _classify(e, dsn)
    if kind is SchemaError:
        return SchemaError(f"{where}{line} — {hint}")
    return kind(f"{where}{line}" + (f" ({hint})" if hint else ""))


def _classify(e: BaseException, dsn: str | None) -> _Verdict:
    state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
    if isinstance(state, str) and state:
        return _by_state(e, state, dsn)
    if any(c.__name__ == "ProgrammingError" for c in type(e).__mro__):
        # both drivers (no SQLSTATE): a DSN that does not parse, or a call the driver refuses
        return ConfigError, _DSN_HINT if dsn is not None and _parse(dsn) is None else None
    pgconn = getattr(e, "pgconn", None)  # psycopg sets it on a connection attempt's failure
    if pgconn is None:
        params = _parse(dsn) if dsn is not None else None
        bad = _bad_number(params) if params is not None else None
        return (ConfigError, bad) if bad is not None else (DatabaseUnavailable, None)
    params = _attempt_params(pgconn)
    if not params:  # libpq refused the parameters before it took any (an unknown service=)
        return ConfigError, _REFUSED_HINT
    bad = _bad_number(params)
    if bad is not None:
        return ConfigError, bad
    return _startup_verdict(pgconn, params)


def _by_state(e: BaseException, state: str, dsn: str | None) -> _Verdict:
    if state in _REPLICATION_STATES and dsn is not None and _asks_replication(dsn):
        return ConfigError, _NO_REPLICATION
    if state in _SCHEMA_STATES:
        return SchemaError, _SCHEMA_HINT + (_SEARCH_PATH_HINT if state == "42P01" else "")
    routine = getattr(getattr(e, "diag", None), "source_function", None)
    hint = _ROUTINE_HINTS.get((state, routine or "")) or _STATE_HINTS.get(state)
    if state.startswith(_PERMANENT_STATES):
        return ConfigError, hint
    return DatabaseUnavailable, hint


def _psycopg() -> Any:
    """psycopg, loaded by whoever made the connection whose error is translated, or None.
    This module loads no driver: the layers below the drivers (pgoutput, fold) raise its
    errors too, and import it without one."""
    return sys.modules.get("psycopg")


def _parse(dsn: str) -> dict[str, str] | None:
    """The DSN's parameters (libpq's parser), or None if it does not parse (with no driver
    loaded, nothing is known of it: no parameters)."""
    pg = _psycopg()
    if pg is None:
        return {}
    try:
        parsed = pg.conninfo.conninfo_to_dict(dsn)
    except pg.Error:
        return None
    return {str(k): str(v) for k, v in parsed.items() if v is not None}


def _asks_replication(dsn: str) -> bool:
    params = _parse(dsn) or {}
    return params.get("replication", "").lower() not in ("", "0", "off", "false", "no")


def _attempt_params(pgconn: Any) -> dict[str, str]:
    """The parameters of the connection attempt that failed, as libpq took them: defaults and
    environment filled in, the one host of a list that was tried last."""
    return {
        o.keyword.decode(): o.val.decode("utf-8", "replace")
        for o in getattr(pgconn, "info", None) or ()
        if o.val is not None
    }


def _bad_number(params: dict[str, str]) -> str | None:
    """The hint for a port or other whole-number parameter that libpq would refuse."""
    ports = params.get("port", "")
    for port in ports.split(","):
        port = port.strip()
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            return "fix the port in the DSN: a number from 1 to 65535"
    for name in _NUMBER_OPTIONS:
        value = params.get(name, "").strip()
        if value and not value.lstrip("-").isdigit():
            return f"fix {name} in the DSN: a whole number"
    return None


def _startup_verdict(pgconn: Any, params: dict[str, str]) -> _Verdict:
    """A failed connection attempt told apart by asking libpq again, as structured answers:
    ``PQping`` (nothing answered; the server answered with some SQLSTATE; it refuses
    connections for now, 57P03; the parameters are invalid) and, if the server answered,
    whether a plain connection is then made, and whether the server had asked for a password.

    These answers cannot tell a refusal that passes from one that does not: a server out of
    connection slots (53300) refuses a new session as one refusing the role, the database or
    the host does, and is taken as permanent too, unless the second try gets in."""
    pg = _psycopg()
    if pg is None:
        return DatabaseUnavailable, None
    pq, make_conninfo = pg.pq, pg.conninfo.make_conninfo
    probe = {**params, "connect_timeout": str(_PROBE_TIMEOUT)}
    timeout = params.get("connect_timeout", "").strip()
    if timeout.isdigit() and 0 < int(timeout) < _PROBE_TIMEOUT:
        probe["connect_timeout"] = timeout
    try:
        ping = _ping(make_conninfo("", **probe))
        if ping == pq.Ping.NO_ATTEMPT:
            return ConfigError, _REFUSED_HINT
        if ping == pq.Ping.REJECT:  # the server answered 57P03
            return DatabaseUnavailable, _STATE_HINTS["57P03"]
        if ping == pq.Ping.NO_RESPONSE:
            mode = params.get("sslmode", "")
            if mode in _SSL_REQUIRED:
                plain = {**probe, "sslmode": "disable"}
                plain.pop("sslnegotiation", None)  # direct SSL needs sslmode=require
                if _ping(make_conninfo("", **plain)) != pq.Ping.NO_RESPONSE:
                    return ConfigError, (
                        f"the server answers, but not over SSL as sslmode={mode} demands: lower "
                        "sslmode in the DSN, turn ssl on in the server, or fix its certificate"
                    )
            return DatabaseUnavailable, None
        # the server answered: refused, or the failure has passed (a session attribute
        # such as target_session_attrs=read-write is the server's state, not a fix to make)
        if _connects(make_conninfo("", **{**probe, "target_session_attrs": "any"})):
            return DatabaseUnavailable, None
        told = _database_verdict(make_conninfo, probe)
        if told is not None:
            return told
    except (pg.Error, UnicodeError):  # parameters libpq took but cannot be written back
        return DatabaseUnavailable, None
    if getattr(pgconn, "needs_password", False):
        return ConfigError, (
            "the server asks this user for a password and none was given: put it in the DSN, "
            "in PGPASSWORD or in ~/.pgpass"
        )
    if getattr(pgconn, "used_password", False):
        return ConfigError, _STATE_HINTS["28P01"] + ", then the database name"
    # refused before any password, wherever this user asks: the server full (53300, which
    # passes), the host or user not in pg_hba.conf, or (trust) a role that does not exist.
    # Tried again, as what passes must not stop a consumer; the server's words say which.
    return RefusedError, (
        "the server refused this user before any password: it may be full (max_connections), "
        "or pg_hba.conf may not let this user connect from this host, or the role may not "
        "exist or may not LOGIN"
    )


_DATABASE = (
    b"SELECT d.datallowconn, d.datconnlimit, (SELECT count(*) FROM pg_stat_activity a "
    b"WHERE a.datname = d.datname) FROM pg_database d WHERE d.datname = $1"
)


def _database_verdict(make_conninfo: Any, probe: dict[str, str]) -> _Verdict | None:
    """When the same user gets into another database of the server, the refusal is this
    database's, and the catalog says which: it does not exist (a fix), it takes no connections
    for now or is at its connection limit (passes), or this user may not connect to it (a
    fix). None when no other database lets the user in either."""
    name = probe.get("dbname") or probe.get("user") or ""
    for other in ("postgres", "template1"):
        if other == name:
            continue
        row = _database_row(make_conninfo("", **{**probe, "dbname": other}), name)
        if row is None:
            continue
        if isinstance(row, str):  # "missing"
            return ConfigError, (
                f"database {name!r} does not exist: create it, or fix its name in the DSN"
            )
        allow, limit, count = row
        if not allow:
            return DatabaseUnavailable, f"database {name!r} takes no connections for now"
        if 0 <= limit <= count:
            return DatabaseUnavailable, f"database {name!r} is at its connection limit"
        return ConfigError, (
            f"this user may not connect to database {name!r}: its CONNECT privilege, or "
            "pg_hba.conf for this database"
        )
    return None


def _database_row(conninfo: str, name: str) -> tuple[bool, int, int] | str | None:
    """From a connection to ``conninfo`` (another database), database ``name``'s
    (datallowconn, datconnlimit, sessions in it), "missing" if there is none, None if that
    connection is refused too."""
    pq = _psycopg().pq
    conn = pq.PGconn.connect(conninfo.encode())
    try:
        if conn.status != pq.ConnStatus.OK:
            return None
        res = conn.exec_params(_DATABASE, [name.encode()])
        if res.status != pq.ExecStatus.TUPLES_OK:
            return None
        if res.ntuples == 0:
            return "missing"
        limit, count = res.get_value(0, 1), res.get_value(0, 2)
        return (
            res.get_value(0, 0) == b"t",
            int(limit) if limit is not None else -1,
            int(count) if count is not None else 0,
        )
    finally:
        conn.finish()


def _ping(conninfo: str) -> int:
    """libpq's ``PQping`` of ``conninfo`` (a :class:`psycopg.pq.Ping`)."""
    return int(_psycopg().pq.PGconn.ping(conninfo.encode()))


def _connects(conninfo: str) -> bool:
    """Whether a connection to ``conninfo`` is made now (closed again at once)."""
    pq = _psycopg().pq
    conn = pq.PGconn.connect(conninfo.encode())
    try:
        return bool(conn.status == pq.ConnStatus.OK)
    finally:
        conn.finish()


def describe(e: BaseException, dsn: str | None = None) -> str:
    """One line for any exception, password removed."""
    return redact(first_line(e), dsn)


__all__ = [
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
    "RefusedError",
    "RetryableError",
    "RunNotReadyError",
    "SchemaError",
    "SlotBusyError",
    "SlotError",
    "SlotLostError",
    "TransportError",
    "UnknownEventTypeError",
    "WindowMissingError",
    "describe",
    "first_line",
    "is_permanent",
    "translate",
]


# -- getting a connection -------------------------------------------------------------------------


class PoolExhaustedError(DatabaseUnavailable):
    """No connection came from a writer's pool (``Ledger``, ``AsyncLedger``) within its wait:
    every one of its connections was in use the whole time, or the server refused the new ones
    the pool tried to open (the last refusal is named: a server out of connection slots says
    "too many clients"). Names the pool's size and its wait."""


# -- spilling to disk ----------------------------------------------------------------------------


class SpillError(ConfigError):
    """The directory the consumer spills to (what passes its memory limit: transactions buffered
    to disk, a large transaction sorted by session) cannot take the file: full, missing, not a
    directory, not writable. Names the path and what to do; nothing was confirmed past the
    last committed batch, so the consumer started again goes on from there."""

    def __init__(self, path: str | None, cause: OSError, doing: str) -> None:
        import errno
        import tempfile

        self.path = path
        where = path if path is not None else f"{tempfile.gettempdir()} (the default: TMPDIR)"
        fix = {
            errno.ENOSPC: "free space there, or give the consumer a spill directory on a disk "
            "with room for the largest transaction (--spill-dir, LEDGER_CDC_SPILL_DIR), or "
            "raise --memory-limit-mb",
            errno.EDQUOT: "raise the user's disk quota there, or give the consumer another "
            "spill directory (--spill-dir, LEDGER_CDC_SPILL_DIR)",
            errno.ENOENT: "create it, or give the consumer a spill directory that exists "
            "(--spill-dir, LEDGER_CDC_SPILL_DIR)",
            errno.ENOTDIR: "it is not a directory: give the consumer a directory "
            "(--spill-dir, LEDGER_CDC_SPILL_DIR)",
        }.get(
            cause.errno or 0,
            "let the consumer's user write there, or give it a writable spill directory "
            "(--spill-dir, LEDGER_CDC_SPILL_DIR)",
        )
        super().__init__(f"spill directory {where}: {cause.strerror or cause} ({doing}): {fix}")


__all__ += ["PoolExhaustedError", "SpillError"]
