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


def test_a_missing_relation_also_names_the_search_path() -> None:
    """A ledger table the session does not find may be missing, or in a schema its search_path
    leaves out: init is one fix, the search_path the other (a second init there would make a
    second ledger)."""
    e = translate(psycopg.errors.UndefinedTable('relation "agent_events" does not exist'))
    assert "ledger-cdc init" in str(e) and "search_path" in str(e)
    older = translate(psycopg.errors.UndefinedColumn('column "hash" does not exist'))
    assert "ledger-cdc init" in str(older) and "search_path" not in str(older)
