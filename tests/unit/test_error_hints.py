"""The hint a permanent driver error is given names its cause, not a word it shares with
another (errors.translate)."""

from __future__ import annotations

import psycopg
import pytest

from ledger_cdc.errors import ConfigError, translate


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (
            psycopg.errors.InsufficientPrivilege(
                'permission denied to create temporary tables in database "ledger"'
            ),
            "GRANT TEMPORARY ON DATABASE",
        ),
        (
            psycopg.errors.InsufficientPrivilege('permission denied for database "ledger"'),
            "log in as a role with the privileges",
        ),
        (
            psycopg.errors.InvalidCatalogName('database "ledgr" does not exist'),
            "create the database, or fix its name",
        ),
    ],
)
def test_the_hint_names_the_cause(error: psycopg.Error, hint: str) -> None:
    e = translate(error, doing="projection database")
    assert isinstance(e, ConfigError)
    assert hint in str(e)
