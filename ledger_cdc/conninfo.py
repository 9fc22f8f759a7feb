"""The connect timeout and session options this package adds to a connection, never over what
its DSN (or libpq's environment) says itself, from the DSN's parameters as the driver at hand
parsed them. A leaf that loads no driver: the replication stream (psycopg2) begins without
psycopg, which the rest of a consumer loads meanwhile."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ledger_cdc.names import CONNECT_TIMEOUT

__all__ = ["options_with", "timeout_option"]


def timeout_option(given: Mapping[str, Any] | None, seconds: float | None = None) -> dict[str, Any]:
    """``{"connect_timeout": seconds}`` (:data:`CONNECT_TIMEOUT` by default) to pass to a
    connect, unless the DSN's parameters ``given`` hold their own, which a keyword would
    override: a server that accepts but never answers must not hang a connection forever, and
    a DSN's timeout is its user's. ``given`` None: the DSN did not parse (the connect says
    why)."""
    if given is not None and "connect_timeout" in given:
        return {}
    return {"connect_timeout": max(1, round(CONNECT_TIMEOUT if seconds is None else seconds))}


def options_with(given: Mapping[str, Any] | None, ours: str) -> str:
    """Session options for a connection that needs ``ours``: the DSN's own options (``given``:
    its parameters; or PGOPTIONS', when it has none) first, kept, then ``ours``, which win where
    both set a value (the later ``-c`` does). An ``options`` keyword would replace them
    instead."""
    own = None if given is None else given.get("options")
    if own is None:
        own = os.environ.get("PGOPTIONS")
    return f"{own} {ours}" if own and str(own).strip() else ours
