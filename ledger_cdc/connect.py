"""Connecting to PostgreSQL, the driver's failures translated once, here: a connection that
cannot be made is a :class:`~ledger_cdc.errors.ConfigError` (a permanent cause: bad DSN,
credentials, database) or :class:`~ledger_cdc.errors.DatabaseUnavailable` (it may pass), in one
line and without the password."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ledger_cdc.errors import translate
from ledger_cdc.names import CONNECT_TIMEOUT

__all__ = ["CONNECT_TIMEOUT", "connect", "connect_timeout", "speak_utf8", "speak_utf8_async"]


def connect_timeout(dsn: str, seconds: float | None = None) -> dict[str, Any]:
    """``{"connect_timeout": seconds}`` (``CONNECT_TIMEOUT`` by default) to pass to a connect,
    unless the DSN gives its own, which a keyword would override: a server that accepts but
    never answers must not hang a connection forever, and a DSN's timeout is its user's."""
    try:
        given = "connect_timeout" in conninfo_to_dict(dsn)
    except psycopg.Error:
        given = False  # a DSN that does not parse: the connect says why
    if given:
        return {}
    return {"connect_timeout": max(1, round(CONNECT_TIMEOUT if seconds is None else seconds))}


def speak_utf8(conn: psycopg.Connection[Any]) -> None:
    """The session speaks UTF-8, whatever client_encoding the database or role sets: text a
    narrower encoding cannot hold (an arrow in a LATIN1 session) is then written and read,
    never refused by the server on every retry. A SQL_ASCII database is left as it is (it
    converts nothing: its text is read as bytes and decoded leniently)."""
    if _narrow(conn.info.encoding, conn.info.parameter_status("server_encoding")):
        conn.execute("SET client_encoding TO 'UTF8'")
        if not conn.autocommit:
            conn.commit()


async def speak_utf8_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`speak_utf8` for an async connection."""
    if _narrow(conn.info.encoding, conn.info.parameter_status("server_encoding")):
        await conn.execute("SET client_encoding TO 'UTF8'")
        if not conn.autocommit:
            await conn.commit()


def _narrow(encoding: str, server: str | None) -> bool:
    return encoding != "utf-8" and server != "SQL_ASCII"


def connect(dsn: str, *, doing: str = "cannot connect", **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect`` (``connect_timeout`` :data:`CONNECT_TIMEOUT` unless given, by the
    caller or the DSN; UTF-8, :func:`speak_utf8`), its failure translated (``doing`` says what
    for)."""
    if "connect_timeout" not in kwargs:
        kwargs.update(connect_timeout(dsn))
    try:
        conn = psycopg.connect(dsn, **kwargs)
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing=doing) from e
    try:
        speak_utf8(conn)
    except psycopg.Error as e:
        conn.close()
        raise translate(e, dsn=dsn, doing=doing) from e
    return conn
