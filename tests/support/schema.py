"""``init`` on a database given by its DSN, as the tests call it."""

from __future__ import annotations

from typing import Any

from ledger_cdc.admin.schema import InitResult, init
from ledger_cdc.connect import open_session


def init_db(dsn: str, **kwargs: Any) -> InitResult:
    """:func:`ledger_cdc.admin.schema.init` (``kwargs`` passed on) on an autocommit session
    opened on ``dsn`` and closed after."""
    with open_session(dsn, autocommit=True) as conn:
        return init(conn, **kwargs)
