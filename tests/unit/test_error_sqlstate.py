"""Driver errors are told apart by SQLSTATE, never by their message (errors.translate): a
server writes its messages in its lc_messages, which may be any language. Every SQLSTATE
psycopg knows is classified and hinted alike whatever its text says; the classifier does not
even read it (is_permanent on an error whose text cannot be read). A failed connection
attempt, which carries no SQLSTATE, is told by libpq's answers to a second try (faked here),
never by its text. tests/integration/test_error_locale.py runs the same paths against a server
that speaks German."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg.errors import FinishedPGconn
from psycopg.pq import ConninfoOption, Ping

import ledger_cdc.errors as errors_module
from ledger_cdc.errors import (
    ConfigError,
    DatabaseUnavailable,
    LedgerError,
    RefusedError,
    SchemaError,
    first_line,
    is_permanent,
    translate,
)
from tests.unit.test_error_hints import report, server_error

# what a classifier reading English would key on, and text in other languages
TEXTS = (
    'password authentication failed for user "ledger"',
    "sorry, too many clients already",
    'permission denied to create temporary tables in database "ledger"',
    "the database system is shutting down",
    "canceling statement due to statement timeout",
    "logical decoding requires wal_level >= logical",
    "server does not support SSL, but SSL was required",
    "Datenbank »ledger« existiert nicht",
    "Passwort-Authentifizierung für Benutzer »ledger« fehlgeschlagen",
    "нет доступа к таблице agent_events",
    "xyzzy",
)
# the routines whose errors get a hint of their own (diag.source_function), and none
ROUTINES = (
    None,
    "InitTempTableNamespace",
    "CheckSlotPermissions",
    "CheckLogicalDecodingRequirements",
    "CheckSlotRequirements",
    "aclcheck_error",
)
SQLSTATES = sorted(
    {
        c.sqlstate
        for c in vars(psycopg.errors).values()
        if isinstance(c, type) and issubclass(c, psycopg.Error) and c.sqlstate
    }
)


def told(e: BaseException, dsn: str | None = None) -> tuple[type[LedgerError], str]:
    """The class translate gives ``e`` and what it adds to the error's own line (the hint)."""
    t = translate(e, dsn=dsn, doing="here")
    head = f"here: {first_line(e)}"
    assert str(t).startswith(head), t
    return type(t), str(t).removeprefix(head)


def _refuse(self: object) -> str:
    raise AssertionError("the classifier read the error's message")


def unreadable(cls: type[psycopg.Error]) -> Any:
    """``cls`` whose instances' text cannot be read: the test fails if anything asks for it."""
    return type(f"Unreadable{cls.__name__}", (cls,), {"__str__": _refuse, "__repr__": _refuse})


def test_sqlstates_psycopg_knows() -> None:
    """(the loops over them below are not vacuous)"""
    assert len(SQLSTATES) > 200 and {"28P01", "3D000", "42501", "57P03"} <= set(SQLSTATES)


def test_every_sqlstate_is_told_by_its_code_whatever_its_text() -> None:
    differ = []
    for state in SQLSTATES:
        for routine in ROUTINES:
            verdicts = {text: told(server_error(state, text, routine)) for text in TEXTS}
            if len(set(verdicts.values())) != 1:
                differ.append((state, routine, verdicts))
    assert not differ, differ[:3]


def test_the_classifier_never_reads_the_text() -> None:
    for state in SQLSTATES:
        for routine in ROUTINES:
            kind, _ = told(server_error(state, "xyzzy", routine))
            e = unreadable(psycopg.errors.lookup(state))(info=report(state, "xyzzy", routine))
            assert is_permanent(e) is issubclass(kind, ConfigError), state
    with pytest.raises(AssertionError, match="read the error's message"):
        translate(e)  # (which shows the text: the guard holds)


@pytest.mark.parametrize(
    ("state", "routine", "kind", "hint"),
    [
        ("28P01", None, ConfigError, "check the user and password in the DSN"),
        ("28000", None, ConfigError, "pg_hba.conf"),
        ("3D000", None, ConfigError, "create the database, or fix its name in the DSN"),
        ("42501", "aclcheck_error", ConfigError, "log in as a role with the privileges"),
        ("42501", "InitTempTableNamespace", ConfigError, "GRANT TEMPORARY ON DATABASE"),
        ("42501", "CheckSlotPermissions", ConfigError, "ALTER ROLE … REPLICATION"),
        ("55000", "CheckLogicalDecodingRequirements", ConfigError, "wal_level = logical"),
        ("55000", "CheckSlotRequirements", ConfigError, "max_replication_slots above 0"),
        ("42704", None, ConfigError, ""),  # undefined_object: a publication, a slot
        ("0A000", None, ConfigError, ""),
        ("22023", None, ConfigError, ""),
        ("54000", None, ConfigError, ""),
        ("42P01", None, SchemaError, "search_path"),
        ("42703", None, SchemaError, "ledger-cdc init"),
        ("3F000", None, SchemaError, "ledger-cdc init"),
        ("42883", None, SchemaError, "ledger-cdc init"),
        ("57014", "ProcessInterrupts", DatabaseUnavailable, "options='-c statement_timeout=0'"),
        ("25006", None, DatabaseUnavailable, "takes no writes"),
        ("57P01", None, DatabaseUnavailable, ""),  # admin_shutdown
        ("57P02", None, DatabaseUnavailable, ""),  # crash_shutdown
        ("57P03", None, DatabaseUnavailable, "starting, stopping or recovering"),
        ("53300", None, DatabaseUnavailable, ""),  # too_many_connections
        ("53100", None, DatabaseUnavailable, ""),  # disk_full
        ("08006", None, DatabaseUnavailable, ""),  # connection_failure
        ("08P01", None, DatabaseUnavailable, ""),  # protocol_violation
        ("40001", None, DatabaseUnavailable, ""),  # serialization_failure
        ("40P01", None, DatabaseUnavailable, ""),  # deadlock_detected
        ("55006", None, DatabaseUnavailable, ""),  # object_in_use: the slot is streamed
        ("55P03", None, DatabaseUnavailable, ""),  # lock_not_available
        ("XX000", None, DatabaseUnavailable, ""),
    ],
)
def test_what_each_sqlstate_is(
    state: str, routine: str | None, kind: type[LedgerError], hint: str
) -> None:
    got, added = told(server_error(state, "xyzzy", routine))
    assert got is kind
    assert hint in added
    if not hint:
        assert added == ""


@pytest.mark.parametrize("state", ["0A000", "08P01"])
def test_sql_on_a_replication_connection_names_the_dsn(state: str) -> None:
    """What a walsender answers to SQL: the DSN asked for a replication connection (its
    ``replication`` parameter decides, not the words of the answer)."""
    e = server_error(state, "xyzzy", "exec_replication_command")
    for extra in ("replication=database", "replication=true"):
        kind, added = told(e, dsn=f"host=127.0.0.1 dbname=ledger {extra}")
        assert kind is ConfigError and "without replication=" in added
    assert "without replication=" not in told(e, dsn="host=127.0.0.1 replication=off")[1]


def test_psycopg2_errors_are_told_by_pgcode() -> None:
    class Psycopg2Error(Exception):
        pgcode = "42501"
        diag = type("Diag", (), {"source_function": "InitTempTableNamespace"})()

    kind, added = told(Psycopg2Error("keine Berechtigung"))
    assert kind is ConfigError and "GRANT TEMPORARY" in added


# -- a failed connection attempt, which has no SQLSTATE -------------------------------------------


@dataclass
class FakeLibpq:
    """libpq's answers to the second tries, in order; the connection strings asked."""

    pings: list[Ping] = field(default_factory=list)
    connects: bool = False
    asked: list[dict[str, Any]] = field(default_factory=list)
    database: Any = None  # what another database of the server says of this one (None: refused)

    def ping(self, conninfo: str) -> int:
        self.asked.append(conninfo_to_dict(conninfo))
        return self.pings.pop(0)

    def connect(self, conninfo: str) -> bool:
        self.asked.append(conninfo_to_dict(conninfo))
        return self.connects

    def database_row(self, conninfo: str, name: str) -> Any:
        return self.database


@pytest.fixture
def libpq(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeLibpq]:
    fake = FakeLibpq()
    monkeypatch.setattr(errors_module, "_ping", fake.ping)
    monkeypatch.setattr(errors_module, "_connects", fake.connect)
    monkeypatch.setattr(errors_module, "_database_row", fake.database_row)
    yield fake


def attempt_error(
    text: str,
    *,
    flags: dict[str, bool] | None = None,
    cls: type[psycopg.Error] = psycopg.OperationalError,
    **params: str,
) -> Any:
    """What psycopg raises for a connection attempt that failed: no SQLSTATE, the attempt's
    parameters and libpq's flags (``needs_password``, ``used_password``) in ``pgconn``."""
    options = {
        "host": "127.0.0.1",
        "port": "5432",
        "dbname": "ledger",
        "user": "ledger",
        "password": "S3cretPW",
        "sslmode": "prefer",
        "connect_timeout": "30",
        **params,
    }
    info = [
        ConninfoOption(k.encode(), None, None, v.encode(), b"", b"", 0) for k, v in options.items()
    ]
    pgconn = FinishedPGconn(info=info, **(flags or {}))
    return cls(f"connection failed: {text}", pgconn=pgconn)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pings", "connects", "params", "flags", "kind", "hint"),
    [
        ([Ping.NO_ATTEMPT], False, {}, {}, ConfigError, "fix the DSN"),
        ([Ping.REJECT], False, {}, {}, DatabaseUnavailable, "starting, stopping or recovering"),
        ([Ping.NO_RESPONSE], False, {}, {}, DatabaseUnavailable, ""),
        (
            [Ping.NO_RESPONSE, Ping.OK],
            False,
            {"sslmode": "require"},
            {},
            ConfigError,
            "not over SSL as sslmode=require demands",
        ),
        (
            [Ping.NO_RESPONSE, Ping.NO_RESPONSE],
            False,
            {"sslmode": "require"},
            {},
            DatabaseUnavailable,
            "",
        ),
        ([Ping.OK], True, {}, {}, DatabaseUnavailable, ""),  # it passes on the second try
        ([Ping.OK], False, {}, {"used_password": True}, ConfigError, "user and password"),
        ([Ping.OK], False, {}, {"needs_password": True}, ConfigError, "PGPASSWORD"),
        ([Ping.OK], False, {}, {}, RefusedError, "before any password"),
    ],
    ids=[
        "parameters libpq refuses",
        "server starting or stopping",
        "nothing answers",
        "SSL the server lacks",
        "SSL demanded and nothing answers",
        "passes on a second try",
        "wrong password",
        "no password",
        "role, database or pg_hba.conf",
    ],
)
def test_a_failed_attempt_is_told_by_asking_libpq_again(
    libpq: FakeLibpq,
    pings: list[Ping],
    connects: bool,
    params: dict[str, str],
    flags: dict[str, bool],
    kind: type[LedgerError],
    hint: str,
) -> None:
    verdicts = set()
    for text in TEXTS:
        libpq.pings, libpq.connects, libpq.asked = list(pings), connects, []
        e = attempt_error(text, flags=flags, **params)
        verdicts.add(told(e))
        assert not libpq.pings  # every answer scripted was asked for, and no more
        for asked in libpq.asked:  # the attempt that failed, tried again with a bound
            assert (asked["host"], asked["port"], asked["password"]) == (
                "127.0.0.1",
                "5432",
                "S3cretPW",
            )
            assert int(asked["connect_timeout"]) <= 10
        if len(pings) == 2:
            assert libpq.asked[1]["sslmode"] == "disable"
        if pings == [Ping.OK]:
            assert libpq.asked[1]["target_session_attrs"] == "any"
    assert len(verdicts) == 1, verdicts
    ((got, added),) = verdicts
    assert got is kind and hint in added
    if not hint:
        assert added == ""
    libpq.pings = list(pings)
    e = attempt_error("xyzzy", flags=flags, cls=unreadable(psycopg.OperationalError), **params)
    assert is_permanent(e) is (kind is ConfigError)


def test_a_port_libpq_would_refuse_is_said_without_asking(libpq: FakeLibpq) -> None:
    for port in ("99999", "0", "abc", "5432,x"):
        kind, added = told(attempt_error("xyzzy", port=port))
        assert kind is ConfigError and "fix the port in the DSN" in added
    kind, added = told(attempt_error("xyzzy", keepalives_idle="soon"))
    assert kind is ConfigError and "keepalives_idle" in added
    # psycopg's own host lookup fails first on such a DSN: no attempt, the DSN read instead
    lookup = psycopg.OperationalError("failed to resolve host 'x': Servname not supported")
    kind, added = told(lookup, dsn="host=x port=notaport")
    assert kind is ConfigError and "fix the port in the DSN" in added
    assert libpq.asked == []


def test_parameters_libpq_took_none_of_are_said_without_asking(libpq: FakeLibpq) -> None:
    """libpq refused them before taking any (a service the service file lacks): the attempt
    holds no value to try again with, and the server of the defaults is not the one meant."""
    unset = [ConninfoOption(b"host", None, None, None, b"", b"", 0)]
    e = psycopg.OperationalError("connection is bad: xyzzy", pgconn=FinishedPGconn(info=unset))  # type: ignore[arg-type]
    kind, added = told(e, dsn="service=nowhere")
    assert kind is ConfigError and "fix the DSN" in added
    assert libpq.asked == []


def test_a_failure_that_is_no_connection_attempt_is_retried_without_asking(
    libpq: FakeLibpq,
) -> None:
    """No SQLSTATE and no attempt (psycopg sets ``pgconn`` only on an attempt's failure): a
    connection lost mid-session, psycopg's own timeout or host lookup. Retried."""
    for e in (
        psycopg.OperationalError("server closed the connection unexpectedly"),
        psycopg.errors.ConnectionTimeout("connection timeout expired"),
        psycopg.OperationalError("failed to resolve host 'db.example': Name or service not known"),
    ):
        assert told(e, dsn="host=127.0.0.1 dbname=ledger") == (DatabaseUnavailable, "")
    assert libpq.asked == []


def test_a_dsn_that_does_not_parse_is_permanent(libpq: FakeLibpq) -> None:
    for dsn in ("not a dsn", "postgresql://u@[127.0.0.1:5432/db", "host=x bogus_param=1"):
        with pytest.raises(psycopg.ProgrammingError) as caught:
            conninfo_to_dict(dsn)
        kind, added = told(caught.value, dsn=dsn)
        assert kind is ConfigError and "fix the DSN" in added
        assert is_permanent(unreadable(psycopg.ProgrammingError)(*caught.value.args))
    assert libpq.asked == []


@pytest.mark.parametrize(
    ("row", "kind", "hint"),
    [
        ("missing", ConfigError, "does not exist"),
        ((False, -1, 0), DatabaseUnavailable, "takes no connections for now"),
        ((True, 2, 2), DatabaseUnavailable, "at its connection limit"),
        ((True, -1, 3), ConfigError, "may not connect to database"),
    ],
    ids=["no such database", "ALLOW_CONNECTIONS false", "its limit reached", "CONNECT refused"],
)
def test_a_refusal_of_this_database_alone_is_told_by_the_catalog(
    libpq: FakeLibpq, row: Any, kind: type[LedgerError], hint: str
) -> None:
    """The same user gets into another database of the server: the catalog there says why
    this one refused (structured answers, whatever language the server speaks)."""
    for text in TEXTS:
        libpq.pings, libpq.connects, libpq.database = [Ping.OK], False, row
        got = translate(attempt_error(text))
        assert type(got) is kind and hint in str(got), got
