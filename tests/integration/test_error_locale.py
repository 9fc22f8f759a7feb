"""Errors are told apart by SQLSTATE, never by their text (errors.translate): against a server
whose lc_messages is German (or another language it has messages for), each error path —
privileges, a missing table, a statement timeout, a read-only transaction, and the refusals of
a connection attempt — gives the class and the hint it gives in English.

The server's messages come with Debian's PostgreSQL packages (the wheel's server has none); the
OS locale it needs is made with localedef where the machine has none (a fresh image has only
C), and the server is pointed at it with LOCPATH. Where neither can be had the module is
skipped: tests/unit/test_error_sqlstate.py proves the classifier never reads the text.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.connect import connect
from ledger_cdc.demo.embedded import EmbeddedPostgres, PgInstall, _free_port
from ledger_cdc.errors import (
    ConfigError,
    DatabaseUnavailable,
    LedgerError,
    RefusedError,
    SchemaError,
    first_line,
    translate,
)
from ledger_cdc.redact import redact
from tests.support.cdc import until
from tests.support.harness import _INSTALLS

# one worker runs the module: it starts a cluster of its own and changes its settings
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("error_locale")]

# (gettext language, OS locale): the first the server has messages for and the OS can have
LANGUAGES = (("de", "de_DE"), ("fr", "fr_FR"), ("es", "es_ES"), ("it", "it_IT"))
PASSWORD = "S3cretPW"


@dataclass
class Localised:
    """A cluster that speaks ``locale`` (its lc_messages), with a role of each kind."""

    pg: EmbeddedPostgres
    locale: str  # e.g. de_DE.UTF-8


def _has_messages(inst: PgInstall, language: str) -> bool:
    pg_config = inst.bindir / "pg_config"
    if not pg_config.exists():
        return False
    out = subprocess.run(
        [str(pg_config), "--localedir"], capture_output=True, text=True, timeout=60
    )
    localedir = Path(out.stdout.strip())
    return out.returncode == 0 and any((localedir / language / "LC_MESSAGES").glob("postgres*.mo"))


def _locale_env(name: str, into: Path) -> dict[str, str] | None:
    """The environment under which the server finds the OS locale ``name``.UTF-8: none needed
    if it is installed, LOCPATH if localedef made it here; None if neither can be had."""
    if shutil.which("locale"):
        have = subprocess.run(["locale", "-a"], capture_output=True, text=True, timeout=60)
        if f"{name}.utf8" in {x.lower().replace("-", "") for x in have.stdout.split()}:
            return {}
    localedef = shutil.which("localedef")
    if localedef is None:
        return None
    target = into / f"{name}.UTF-8"
    subprocess.run(
        [localedef, "-i", name, "-f", "UTF-8", str(target)], capture_output=True, timeout=300
    )
    if not (target / "LC_CTYPE").exists():  # no locale sources (Debian's locales package)
        return None
    for d in [into, *into.rglob("*")]:  # the server runs as an unprivileged user under root
        os.chmod(d, 0o755 if d.is_dir() else 0o644)
    return {"LOCPATH": str(into)}


def _speaks(conn: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Whether the session's messages are translated (a division by zero says so)."""
    try:
        conn.execute("SELECT 1/0")
    except psycopg.errors.DivisionByZero as e:
        return str(e).strip() != "division by zero"
    raise AssertionError("1/0 did not fail")


@pytest.fixture(scope="module")
def localised() -> Iterator[Localised]:
    found = [
        (inst, name)
        for inst in sorted(_INSTALLS.values(), key=lambda i: i.major)
        for language, name in LANGUAGES
        if _has_messages(inst, language)
    ]
    if not found:
        pytest.skip(
            "no PostgreSQL here has translated messages (Debian's postgresql-NN packages do); "
            "tests/unit/test_error_sqlstate.py proves the classifier never reads the text"
        )
    inst, name = found[0]
    with contextlib.ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="ledger-cdc-locale-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        env = _locale_env(name, workdir)
        if env is None:
            pytest.skip(
                f"no {name} locale on this machine, and localedef cannot make one (its "
                "sources come with Debian's locales package); tests/unit/test_error_sqlstate.py "
                "proves the classifier never reads the text"
            )
        locale = f"{name}.UTF-8"
        hba = (
            "host all ledger_pw 127.0.0.1/32 scram-sha-256",
            "host all refused 127.0.0.1/32 reject",
        )
        with pytest.MonkeyPatch.context() as mp:  # the server keeps the environment it starts in
            for key, value in env.items():
                mp.setenv(key, value)
            pg = stack.enter_context(
                EmbeddedPostgres(inst, hba=hba, settings={"lc_messages": locale})
            )
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            if not _speaks(conn):
                pytest.skip(f"PostgreSQL {inst.major} does not speak {locale} here")
            conn.execute(sql.SQL("CREATE ROLE ledger_pw LOGIN PASSWORD {}").format(PASSWORD))
            conn.execute("CREATE ROLE refused LOGIN")
            conn.execute("CREATE ROLE plain LOGIN")
            conn.execute("CREATE TABLE secret (a int)")
            conn.execute("REVOKE TEMPORARY ON DATABASE postgres FROM PUBLIC")
        yield Localised(pg, locale)


def _hint(told: LedgerError, e: BaseException, doing: str, dsn: str | None = None) -> str:
    """What translate added to the error's own line."""
    head = f"{doing}: {redact(first_line(e), dsn)}"
    assert str(told).startswith(head), told
    return str(told).removeprefix(head)


# (what, statements, run as the role `plain`, class, a part of the hint)
SESSION_PATHS = [
    ("permission denied", ["SELECT * FROM secret"], True, ConfigError, "with the privileges"),
    ("no temporary tables", ["CREATE TEMP TABLE t (a int)"], True, ConfigError, "GRANT TEMPORARY"),
    (
        "no REPLICATION",
        ["SELECT pg_create_logical_replication_slot('s', 'pgoutput')"],
        True,
        ConfigError,
        "ALTER ROLE … REPLICATION",
    ),
    ("unknown table", ["SELECT * FROM agent_events"], False, SchemaError, "search_path"),
    (
        "statement timeout",
        ["SET statement_timeout = '20ms'", "SELECT pg_sleep(10)"],
        False,
        DatabaseUnavailable,
        "options='-c statement_timeout=0'",
    ),
    (
        "read-only transaction",
        ["SET default_transaction_read_only = on", "CREATE TABLE w (a int)"],
        False,
        DatabaseUnavailable,
        "takes no writes",
    ),
]


def _session_error(
    pg: EmbeddedPostgres, locale: str, as_plain: bool, statements: list[str]
) -> psycopg.Error:
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("SET lc_messages = {}").format(locale))  # (the superuser may)
        if as_plain:
            conn.execute("SET ROLE plain")
        with pytest.raises(psycopg.Error) as caught:
            for statement in statements:
                conn.execute(statement)  # type: ignore[arg-type]
    return caught.value


@pytest.mark.parametrize(
    ("what", "statements", "as_plain", "kind", "hint"),
    SESSION_PATHS,
    ids=[p[0] for p in SESSION_PATHS],
)
def test_a_session_error_is_told_alike_in_another_language(
    localised: Localised,
    what: str,
    statements: list[str],
    as_plain: bool,
    kind: type[LedgerError],
    hint: str,
) -> None:
    there = _session_error(localised.pg, localised.locale, as_plain, statements)
    english = _session_error(localised.pg, "C", as_plain, statements)
    assert there.sqlstate == english.sqlstate
    assert str(there) != str(english), "the server did not speak another language"
    told, told_en = translate(there, doing=what), translate(english, doing=what)
    assert type(told) is type(told_en) is kind
    assert _hint(told, there, what) == _hint(told_en, english, what)
    assert hint in str(told), told


def _server_speaks(pg: EmbeddedPostgres, locale: str) -> None:
    """The whole server's lc_messages (the one a connection's refusal is written in) set to
    ``locale``, once new sessions have it."""
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER SYSTEM SET lc_messages = {}").format(locale))
        conn.execute("SELECT pg_reload_conf()")

    def taken() -> bool:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            return conn.execute("SHOW lc_messages").fetchone() == (locale,)

    until(taken, timeout=30)


# (what, the DSN of an attempt, whether the refusal is the server's text, class, hint part)
STARTUP_PATHS: list[tuple[str, Callable[[EmbeddedPostgres], str], bool, type[LedgerError], str]] = [
    (
        "wrong password",
        lambda pg: f"{pg.dsn(user='ledger_pw')} password=WrongPW",
        True,
        ConfigError,
        "check the user and password in the DSN",
    ),
    (
        "no password",
        lambda pg: f"{pg.dsn(user='ledger_pw')} passfile=/nonexistent",
        False,  # libpq's own words
        ConfigError,
        "PGPASSWORD",
    ),
    # the same user gets into another database: the catalog there tells why
    ("unknown database", lambda pg: pg.dsn("no_such_db"), True, ConfigError, "does not exist"),
    # refused before any password, everywhere: a fix or a full server, tried again (RefusedError)
    ("unknown role", lambda pg: pg.dsn(user="no_such_role"), True, RefusedError, "role may not"),
    ("pg_hba.conf reject", lambda pg: pg.dsn(user="refused"), True, RefusedError, "pg_hba.conf"),
    (
        "SSL the server lacks",
        lambda pg: f"{pg.dsn()} sslmode=require",
        False,
        ConfigError,
        "not over SSL as sslmode=require demands",
    ),
    (
        "nothing listening",
        lambda pg: f"host=127.0.0.1 port={_free_port()} dbname=postgres",
        False,
        DatabaseUnavailable,
        "",
    ),
]


def _refusal(dsn: str) -> tuple[LedgerError, BaseException]:
    with pytest.raises(LedgerError) as caught:
        connect(dsn, connect_timeout=10).close()
    assert caught.value.__cause__ is not None
    return caught.value, caught.value.__cause__


def test_a_connection_refused_is_told_alike_in_another_language(localised: Localised) -> None:
    pg = localised.pg
    told: dict[str, dict[str, tuple[LedgerError, BaseException]]] = {}
    try:
        for locale in (localised.locale, "C"):
            _server_speaks(pg, locale)
            told[locale] = {what: _refusal(dsn(pg)) for what, dsn, *_ in STARTUP_PATHS}
    finally:
        _server_speaks(pg, localised.locale)
    for what, dsn, server_text, kind, hint in STARTUP_PATHS:
        (there, cause), (english, cause_en) = told[localised.locale][what], told["C"][what]
        if server_text:
            assert str(cause) != str(cause_en), f"{what}: the server did not speak another language"
        assert type(there) is type(english) is kind, (what, there, english)
        dsn_text = dsn(pg)
        added = _hint(there, cause, "cannot connect", dsn_text)
        assert added == _hint(english, cause_en, "cannot connect", dsn_text), what
        assert hint in added, (what, there)
        assert PASSWORD not in str(there) and "WrongPW" not in str(there)
