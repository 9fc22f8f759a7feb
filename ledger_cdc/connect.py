"""Connecting to PostgreSQL, the driver's failures translated once, here: a connection that
cannot be made is a :class:`~ledger_cdc.errors.ConfigError` (a permanent cause: bad DSN,
credentials, database) or :class:`~ledger_cdc.errors.DatabaseUnavailable` (it may pass), in one
line and without the password."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ledger_cdc.conninfo import options_with, timeout_option
from ledger_cdc.errors import translate
from ledger_cdc.names import CONNECT_TIMEOUT

__all__ = [
    "CONNECT_TIMEOUT",
    "connect",
    "connect_timeout",
    "lift_timeouts",
    "lift_timeouts_async",
    "merged_options",
    "open_session",
    "open_session_async",
    "session_setup",
    "session_setup_async",
    "unbounded_options",
]


def connect_timeout(dsn: str, seconds: float | None = None) -> dict[str, Any]:
    """:func:`~ledger_cdc.conninfo.timeout_option` of the DSN's parameters, as psycopg parses
    them (a DSN that does not parse: the connect says why)."""
    return timeout_option(_given(dsn), seconds)


def _given(dsn: str) -> dict[str, Any] | None:
    try:
        return conninfo_to_dict(dsn)
    except psycopg.Error:
        return None


# What psycopg reads in text: a timestamptz or date only in the ISO DateStyle, an interval only
# in the postgres IntervalStyle. A database or role may set others (ALTER DATABASE … SET
# DateStyle = 'SQL, DMY'): every time the server sends would then be unreadable.
_STYLES = (("DateStyle", "ISO"), ("IntervalStyle", "postgres"))


def _restyle(conn_info: Any) -> str | None:
    """The statement that sets the styles this session lacks, or None when it has them."""
    sets = []
    for name, want in _STYLES:
        now = conn_info.parameter_status(name)
        if now is not None and now.split(",")[0].strip().lower() != want.lower():
            sets.append(f"set_config('{name}', '{want}', false)")
    return f"SELECT {', '.join(sets)}" if sets else None


def session_setup(conn: psycopg.Connection[Any]) -> None:
    """The session speaks what this package reads, whatever the database or role sets:
    UTF-8 (text a narrower encoding cannot hold, an arrow in a LATIN1 session, is then written
    and read, never refused by the server on every retry; a SQL_ASCII database is left as it
    is: it converts nothing, its text is read as bytes and decoded leniently), and the ISO
    DateStyle and postgres IntervalStyle (psycopg reads times and intervals in no other).
    Costs a statement only when the session lacks them."""
    changed = False
    if _narrow(conn.info.encoding, conn.info.parameter_status("server_encoding")):
        conn.execute("SET client_encoding TO 'UTF8'")
        changed = True
    restyle = _restyle(conn.info)
    if restyle is not None:
        conn.execute(restyle)
        changed = True
    if changed and not conn.autocommit:
        conn.commit()


async def session_setup_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`session_setup` for an async connection."""
    changed = False
    if _narrow(conn.info.encoding, conn.info.parameter_status("server_encoding")):
        await conn.execute("SET client_encoding TO 'UTF8'")
        changed = True
    restyle = _restyle(conn.info)
    if restyle is not None:
        await conn.execute(restyle)
        changed = True
    if changed and not conn.autocommit:
        await conn.commit()


# No statement_timeout, no idle_session_timeout, no transaction_timeout (a server before 14,
# or 17, has none of the last two: then nothing). Cheap: it may run under a timeout it lifts.
_LIFT_TIMEOUTS = (
    "SELECT set_config('statement_timeout', '0', false), CASE WHEN "
    "current_setting('idle_session_timeout', true) IS NOT NULL THEN "
    "set_config('idle_session_timeout', '0', false) END, CASE WHEN "
    "current_setting('transaction_timeout', true) IS NOT NULL THEN "
    "set_config('transaction_timeout', '0', false) END"
)


def lift_timeouts(conn: psycopg.Connection[Any]) -> None:
    """For the consumer's own sessions: no statement_timeout, idle_session_timeout or
    transaction_timeout, whatever the database or role sets for its applications. A batch, a
    bootstrap or a VACUUM is bounded by its size, and a timeout would cancel the same work on
    every retry; the sink's session waits idle between batches as long as the ledger is
    quiet, and a session ended meanwhile fails the next batch and restarts the stream.
    Committed, so that a transaction the caller begins next starts clean (SET TRANSACTION
    SNAPSHOT must come first in it)."""
    conn.execute(_LIFT_TIMEOUTS)
    if not conn.autocommit:
        conn.commit()


async def lift_timeouts_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`lift_timeouts` for an async connection: a LISTEN session (``tail``,
    ``pending_runs``) sits idle between notifications by design."""
    await conn.execute(_LIFT_TIMEOUTS)
    if not conn.autocommit:
        await conn.commit()


def _narrow(encoding: str, server: str | None) -> bool:
    return encoding != "utf-8" and server != "SQL_ASCII"


def merged_options(dsn: str, ours: str) -> str:
    """:func:`~ledger_cdc.conninfo.options_with` of the DSN's parameters, as psycopg parses
    them."""
    return options_with(_given(dsn), ours)


def unbounded_options(dsn: str) -> dict[str, Any]:
    """``{"options": …}`` to pass to a connect of the consumer's own: no statement_timeout from
    the start (a statement of the session's set-up then runs under none either)."""
    return {"options": merged_options(dsn, "-c statement_timeout=0")}


def open_session(dsn: str, *, lift: bool = False, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect`` (``connect_timeout`` :data:`CONNECT_TIMEOUT` unless given, by the
    caller or the DSN), then :func:`session_setup`; ``lift``: :func:`unbounded_options` and
    :func:`lift_timeouts`, for the sessions of the consumer and of the followers that wait
    idle. Raises psycopg's errors (closed again if its set-up fails); :func:`connect`
    translates them."""
    if "connect_timeout" not in kwargs:
        kwargs.update(connect_timeout(dsn))
    if lift:
        kwargs.update(unbounded_options(dsn))
    conn = psycopg.connect(dsn, **kwargs)
    try:
        session_setup(conn)
        if lift:
            lift_timeouts(conn)
    except BaseException:
        conn.close()
        raise
    return conn


async def open_session_async(
    dsn: str, *, lift: bool = False, **kwargs: Any
) -> psycopg.AsyncConnection[Any]:
    """:func:`open_session` for an async connection."""
    if "connect_timeout" not in kwargs:
        kwargs.update(connect_timeout(dsn))
    if lift:
        kwargs.update(unbounded_options(dsn))
    conn = await psycopg.AsyncConnection.connect(dsn, **kwargs)
    try:
        await session_setup_async(conn)
        if lift:
            await lift_timeouts_async(conn)
    except BaseException:
        await conn.close()
        raise
    return conn


def connect(
    dsn: str, *, doing: str = "cannot connect", lift: bool = False, **kwargs: Any
) -> psycopg.Connection[Any]:
    """:func:`open_session`, its failure translated (``doing`` says what for)."""
    try:
        return open_session(dsn, lift=lift, **kwargs)
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing=doing) from e
