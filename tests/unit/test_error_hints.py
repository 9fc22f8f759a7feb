"""The hint a permanent driver error is given names its cause, not a word it shares with
another (errors.translate)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.pq import DiagnosticField

from ledger_cdc.errors import ConfigError, translate


def report(sqlstate: str, message: str, routine: str | None = None) -> dict[int, bytes | None]:
    """A server's error report as psycopg keeps it: among its fields the routine that raised
    it (a C function name, which no locale translates)."""
    return {
        DiagnosticField.SEVERITY_NONLOCALIZED: b"ERROR",
        DiagnosticField.SQLSTATE: sqlstate.encode(),
        DiagnosticField.MESSAGE_PRIMARY: message.encode(),
        DiagnosticField.SOURCE_FUNCTION: routine.encode() if routine else None,
    }


def server_error(sqlstate: str, message: str, routine: str | None = None) -> psycopg.Error:
    """The error psycopg raises for a server's report: its class by SQLSTATE."""
    return psycopg.errors.lookup(sqlstate)(message, info=report(sqlstate, message, routine))


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (
            server_error(
                "42501",
                'permission denied to create temporary tables in database "ledger"',
                "InitTempTableNamespace",
            ),
            "GRANT TEMPORARY ON DATABASE",
        ),
        (
            server_error("42501", 'permission denied for database "ledger"', "aclcheck_error"),
            "log in as a role with the privileges",
        ),
        (
            server_error("3D000", 'database "ledgr" does not exist'),
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
