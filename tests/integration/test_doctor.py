"""`ledger-cdc doctor` on real servers: a deployment set up as the docs say passes with exit 0;
each misconfiguration gives its own finding, one line with its fix, and the exit code of the
worst (1 warning, 2 failure); 3 when it cannot tell. What is per database or per role is made in
the harness's shared servers; what is per server (settings), in a cluster of the module's own."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.admin.schema import create_publication, create_slot, migrate
from ledger_cdc.demo.embedded import EmbeddedPostgres
from tests.support.cdc import assert_clean_exit, run_cli
from tests.support.harness import _INSTALLS, _REQUIRED, Database

pytestmark = [pytest.mark.server, pytest.mark.xdist_group("doctor")]

_roles = itertools.count()


@contextmanager
def login_role(db: Database, attributes: str, *, consumer: bool = True) -> Iterator[str]:
    """A login role of this test's own (roles are the cluster's: a name no other test uses),
    dropped at the end."""
    name = f"doc_{os.getpid()}_{next(_roles)}"
    with db.connect() as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN {}{}").format(
                sql.Identifier(name),
                sql.SQL(attributes),
                sql.SQL(" IN ROLE ledger_consumer" if consumer else ""),
            )
        )
    try:
        yield name
    finally:
        with db.connect() as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def doctor(dsn: str, *args: str) -> tuple[int, list[dict[str, str]]]:
    r = run_cli("doctor", "--dsn", dsn, "--json", *args)
    assert_clean_exit(r, 0, 1, 2)
    out = json.loads(r.stdout)
    assert out["status"] == r.exit_code, out
    return r.exit_code, out["findings"]


def by_check(findings: list[dict[str, str]], check: str) -> list[dict[str, str]]:
    return [f for f in findings if f["check"] == check]


def let_vacuum(conn: psycopg.Connection[Any]) -> None:
    """What doctor's VACUUM finding asks for: ledger_consumer may VACUUM the projections."""
    if conn.info.server_version >= 170000:
        conn.execute("GRANT MAINTAIN ON agent_sessions TO ledger_consumer")
    else:
        conn.execute("ALTER TABLE agent_sessions OWNER TO ledger_consumer")


def test_a_deployment_as_documented_passes(db: Database) -> None:
    with login_role(db, "REPLICATION") as role, db.connect() as conn:
        let_vacuum(conn)
        create_slot(conn, "agent_slot")
        consumer = db.dsn_as(role)
        code, findings = doctor(db.dsn, "--consumer-dsn", consumer)
        assert code == 0, [f for f in findings if f["level"] != "ok"]
        checks = {f["check"] for f in findings}
        assert {
            "wal_level",
            "max_wal_senders",
            "max_replication_slots",
            "max_slot_wal_keep_size",
            "wal_sender_timeout",
            "role",
            "REPLICATION",
            "VACUUM",
            "replication connection",
            "schema",
            "publication",
            "slot",
        } <= checks, checks
        if db.server.major >= 18:
            assert "idle_replication_slot_timeout" in checks
        if db.server.major >= 17:
            assert "failover" in checks
        (keep,) = by_check(findings, "max_slot_wal_keep_size")
        assert "bounded at 1.0 GB" in keep["what"] and "cannot be read over SQL" in keep["what"]
        # the ok it gives VACUUM is the server's: the role vacuums the projections unrefused
        notices: list[str] = []
        with psycopg.connect(consumer, autocommit=True) as own:
            own.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            own.execute("VACUUM (SKIP_LOCKED) agent_sessions")
        assert not any("skipping" in n for n in notices), notices
        # as text: one line a finding, then the count
        r = run_cli("doctor", "--dsn", db.dsn, "--consumer-dsn", consumer)
        assert_clean_exit(r, 0)
        lines = r.stdout.splitlines()
        assert len(lines) == len(findings) + 1 and all(ln.startswith("ok ") for ln in lines[:-1])
        assert lines[-1] == f"{len(findings)} ok, 0 warning(s), 0 failure(s)"


def test_a_consumer_role_without_replication_fails_twice(db: Database) -> None:
    """The attribute is missing, and the replication connection is refused for it."""
    with login_role(db, "") as role, db.connect() as conn:
        let_vacuum(conn)
        code, findings = doctor(db.dsn, "--consumer-dsn", db.dsn_as(role))
    assert code == 2
    (attr,) = by_check(findings, "REPLICATION")
    assert attr["level"] == "fail" and attr["fix"] == f"ALTER ROLE {role} REPLICATION"
    (rep,) = by_check(findings, "replication connection")
    # (PostgreSQL 15: "… to start walsender"; 18: "… to start WAL sender")
    assert rep["level"] == "fail" and re.search("wal ?sender", rep["what"], re.I), rep
    # the rest of the deployment is fine: these are the only failures
    assert {f["check"] for f in findings if f["level"] == "fail"} == {
        "REPLICATION",
        "replication connection",
    }


def test_a_role_outside_ledger_consumer_and_a_superuser(db: Database) -> None:
    with login_role(db, "REPLICATION", consumer=False) as role:
        code, findings = doctor(db.dsn, "--consumer-dsn", db.dsn_as(role))
    assert code == 2
    (f,) = by_check(findings, "role")
    assert f["level"] == "fail" and f["fix"] == f"GRANT ledger_consumer TO {role}", f
    # the harness's DSN logs in as a superuser: it works, and is a warning
    code, findings = doctor(db.dsn)
    (f,) = by_check(findings, "role")
    assert (
        f["level"] == "warn" and "superuser" in f["what"] and "IN ROLE ledger_consumer" in f["fix"]
    )


@pytest.mark.parametrize(
    ("make", "check", "says"),
    [
        ("DROP PUBLICATION agent_pub", "publication", "'agent_pub' does not exist"),
        (
            "ALTER PUBLICATION agent_pub SET (publish = 'update, delete')",
            "publication",
            "does not publish INSERTs",
        ),
        (
            "ALTER PUBLICATION agent_pub DROP TABLE agent_events",
            "publication",
            "does not publish the ledger table",
        ),
        (
            "INSERT INTO ledger_checkpoints (slot_name, lsn) VALUES ('agent_slot', '0/0')",
            "slot",
            "the slot was dropped",
        ),
        ("DELETE FROM ledger_migrations WHERE version = 19", "schema", "lacks migration(s) 0019"),
    ],
    ids=["no-publication", "no-inserts", "table-dropped", "slot-dropped", "migration-missing"],
)
def test_a_ledger_misconfigured_in_its_database(
    db: Database, make: str, check: str, says: str
) -> None:
    with db.connect() as conn:
        conn.execute(make.encode())
    code, findings = doctor(db.dsn)
    assert code == 2
    (f,) = by_check(findings, check)
    assert f["level"] == "fail" and says in f["what"], f


def test_a_slot_of_another_kind_or_database(db: Database, second_db: Database) -> None:
    with db.connect() as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('doc_td', 'test_decoding')")
        create_slot(conn, "agent_slot")
    code, findings = doctor(db.dsn, "--slot", "doc_td")
    (f,) = by_check(findings, "slot")
    assert code == 2 and f["level"] == "fail" and "'test_decoding'" in f["what"], f
    code, findings = doctor(second_db.dsn)
    (f,) = by_check(findings, "slot")
    assert code == 2 and f"belongs to database '{db.name}'" in f["what"], f


def test_no_ledger_at_all(empty_db: Database) -> None:
    code, findings = doctor(empty_db.dsn)
    assert code == 2
    (schema,) = by_check(findings, "schema")
    assert "no ledger schema" in schema["what"] and "ledger-cdc init" in schema["what"]
    (pub,) = by_check(findings, "publication")
    assert pub["level"] == "fail" and "ledger-cdc init" in pub["fix"]


def test_cannot_tell_is_3() -> None:
    dsn = "host=127.0.0.1 port=1 connect_timeout=2"
    r = run_cli("doctor", "--dsn", dsn)
    assert_clean_exit(r, 3)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    r = run_cli("doctor", "--dsn", dsn, "--json")
    assert_clean_exit(r, 3)
    out = json.loads(r.stdout)
    assert out["status"] == 3 and out["findings"] == [] and "port 1" in out["error"]
    for args in (["--bogus"], ["--slot", "Bad Name"], []):
        r = run_cli("doctor", *args, env={"LEDGER_CDC_DSN": None if not args else dsn})
        assert_clean_exit(r, 3)
    r = run_cli("doctor", "--help")
    codes = " ".join(r.output.split("Exit codes:")[-1].split())
    assert "1 a warning" in codes and "2 a failure" in codes and "3 cannot tell" in codes, codes


# -- settings of the server: a cluster of the module's own -------------------------------------


@pytest.fixture(scope="module", params=[15, 18], ids=["pg15", "pg18"])
def misconfigured(request: pytest.FixtureRequest) -> Iterator[EmbeddedPostgres]:
    """Every server-wide setting wrong at once: logical decoding off, WAL retention unbounded,
    no walsender timeout, every slot taken; on 18 an idle-slot timeout of minutes and
    synchronized_standby_slots naming a slot that does not exist (a promoted standby's)."""
    inst = _INSTALLS.get(request.param)
    if inst is None:
        if request.param in _REQUIRED:
            pytest.fail(f"PostgreSQL {request.param} required", pytrace=False)
        pytest.skip(f"PostgreSQL {request.param} binaries not found")
    settings = {"wal_level": "replica", "wal_sender_timeout": "0", "max_replication_slots": "2"}
    if request.param >= 18:
        settings["idle_replication_slot_timeout"] = "10min"
        settings["synchronized_standby_slots"] = "promoted_away"
    with EmbeddedPostgres(inst, max_slot_wal_keep_size="-1", settings=settings) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            migrate(conn)
            create_publication(conn)
            for name in ("standby_a", "standby_b"):  # (physical: wal_level replica takes them)
                conn.execute("SELECT pg_create_physical_replication_slot(%s)", (name,))
        yield pg


def test_server_settings_each_give_their_finding(misconfigured: EmbeddedPostgres) -> None:
    code, findings = doctor(misconfigured.dsn())
    assert code == 2
    level = {f["check"]: f["level"] for f in findings}
    (wal,) = by_check(findings, "wal_level")
    assert wal["level"] == "fail" and "'replica'" in wal["what"] and "restart" in wal["fix"]
    (slots,) = by_check(findings, "max_replication_slots")
    assert slots["level"] == "fail" and "2 of 2 in use" in slots["what"], slots
    (keep,) = by_check(findings, "max_slot_wal_keep_size")
    assert keep["level"] == "warn" and "unbounded" in keep["what"], keep
    assert "pg_wal holds" in keep["what"]  # (a superuser reads pg_ls_waldir)
    assert level["wal_sender_timeout"] == "warn"
    if misconfigured.major >= 18:
        (idle,) = by_check(findings, "idle_replication_slot_timeout")
        assert idle["level"] == "warn" and "10 min" in idle["what"], idle
        assert "heartbeat does not count" in idle["what"]
        (standby,) = by_check(findings, "synchronized_standby_slots")
        assert standby["level"] == "fail" and "'promoted_away'" in standby["what"], standby
        assert "waits for it for ever" in standby["what"] and "RESET" in standby["fix"]
    else:
        assert "idle_replication_slot_timeout" not in level
        assert "synchronized_standby_slots" not in level
    # as text, each finding is one line, its fix on it
    r = run_cli("doctor", "--dsn", misconfigured.dsn())
    assert_clean_exit(r, 2)
    lines = r.stdout.splitlines()
    assert len(lines) == len(findings) + 1, r.stdout
    assert any(ln.startswith("fail wal_level") and "— fix: ALTER SYSTEM" in ln for ln in lines)
