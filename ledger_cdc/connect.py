"""Connecting to PostgreSQL, the driver's failures translated once, here: a connection that
cannot be made is a :class:`~ledger_cdc.errors.ConfigError` (a permanent cause: bad DSN,
credentials, database) or :class:`~ledger_cdc.errors.DatabaseUnavailable` (it may pass), in one
line and without the password."""

from __future__ import annotations

from typing import Any

import psycopg

from ledger_cdc.errors import translate

__all__ = ["connect"]


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect`` (``connect_timeout`` 10 s unless given), its failure translated."""
    kwargs.setdefault("connect_timeout", 10)
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing="cannot connect") from e
