"""Errors that say what to fix: every command, every bad input, one line on stderr, the exit code
the README gives, no traceback and never a password.

Permanent causes (a malformed DSN, a bad port, bad credentials, a missing database or schema,
``wal_level`` not logical) end a command within seconds with exit 4 — the consumer included,
which retries only what passes; unknown session ids are exit 1; malformed arguments exit 2.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.admin.schema import migrate
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from tests.support.cdc import assert_clean_exit, run_cli
from tests.support.cli import run_cli_process
from tests.support.harness import _INSTALLS, Database

# one worker runs the module: a cluster with logical decoding off is a module fixture
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("errors")]

SID, SID2 = str(uuid.uuid4()), str(uuid.uuid4())

COMMANDS: list[list[str]] = [
    ["init"],
    ["lag", "--sample-seconds", "0"],
    ["slot", "list"],
    ["slot", "create", "x_slot"],
    ["slot", "drop", "x_slot"],
    ["replay", SID],
    ["inspect", SID],
    ["verify", SID],
    ["verify", "--all"],
    ["diff", SID, SID2],
    ["fork", SID, "--upto-seq", "1"],
    ["dispatch", "--once", "--target", "x=http://127.0.0.1:9/"],
    ["outbox"],
    ["runs"],
    ["signal", SID, "approve"],
    ["partitions", "list"],
    ["partitions", "ensure"],
]
SECRETS = ("S3cretPW", "WrongPW")


def _bad_dsns(db: Database) -> list[tuple[str, str]]:
    port = db.server.pg.port
    url = f"postgresql://postgres@127.0.0.1:{port}/{db.name}"
    return [
        ("not a dsn", "DSN"),
        ("postgresql://u:S3cretPW@[127.0.0.1:5432/db", "DSN"),
        (f"postgresql://u:S3cretPW x@127.0.0.1:{port}/{db.name}", "spaces"),  # quoted by libpq
        (f"{url}?bogus_param=1", "DSN"),
        (f"host=127.0.0.1 port=99999 dbname={db.name}", "port"),
        (f"postgresql://ledger_pw:WrongPW@127.0.0.1:{port}/{db.name}", "password"),
        (f"host=127.0.0.1 port={port} dbname=no_such_db user=postgres", "database"),
        (f"host=127.0.0.1 port={port} dbname={db.name} user=no_such_role", "role"),
    ]


def _one_line(out: str) -> None:
    assert "Traceback" not in out, out
    for secret in SECRETS:
        assert secret not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out


def test_bad_dsns_through_every_command(db: Database) -> None:
    for dsn, hint in _bad_dsns(db):
        for cmd in COMMANDS:
            started = time.monotonic()
            r = run_cli(*cmd, "--dsn", dsn)
            assert_clean_exit(r, 3 if cmd[0] == "lag" else 4)  # (lag: a check's "unknown")
            _one_line(r.output)
            assert hint.lower() in r.output.lower() or "dsn" in r.output.lower(), (cmd, r.output)
            assert time.monotonic() - started < 15, cmd


def _consume(dsn: str, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return run_cli_process("consume", "--dsn", dsn, *extra, timeout=timeout)


def test_the_consumer_stops_at_once_on_a_permanent_cause(db: Database, empty_db: Database) -> None:
    cases = [(dsn, hint) for dsn, hint in _bad_dsns(db)]
    cases.append((empty_db.dsn, "ledger-cdc init"))  # consume before init
    # a replication DSN copied from another tool (the consumer makes its replication connection
    # itself; its ordinary ones cannot run statements in one), and SSL the server does not have:
    # retried for ever before, a warning every few seconds
    for extra in (" replication=database", " replication=true"):
        cases.append((db.dsn + extra, "without replication="))
    cases.append((db.dsn + " sslmode=require", "sslmode"))
    for dsn, hint in cases:
        started = time.monotonic()
        p = _consume(dsn, "--create-slot")
        assert p.returncode == 4, (dsn, p.stderr)
        _one_line(p.stderr)
        assert hint.lower() in p.stderr.lower() or "dsn" in p.stderr.lower(), p.stderr
        assert time.monotonic() - started < 20
    # a missing publication is said as such
    with db.connect() as conn:
        conn.execute("DROP PUBLICATION agent_pub")
    p = _consume(db.dsn)
    assert p.returncode == 4 and "publication 'agent_pub' does not exist" in p.stderr, p.stderr
    # and a missing slot without --create-slot is the slot's exit code
    with db.connect() as conn:
        conn.execute("CREATE PUBLICATION agent_pub FOR TABLE agent_events")
    p = _consume(db.dsn)
    assert p.returncode == 3 and "does not exist" in p.stderr, p.stderr
    _one_line(p.stderr)


def test_unknown_sessions_are_an_error(db: Database) -> None:
    known = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        ledger.append(known, "a", "task.completed", {"result": 1})
    for cmd in (
        ["replay", SID],
        ["inspect", SID],
        ["verify", SID],
        ["verify", str(known), SID],
        ["diff", str(known), SID],
        ["fork", SID, "--upto-seq", "100"],
        ["signal", SID, "approve"],
    ):
        r = run_cli(*cmd, "--dsn", db.dsn)
        assert_clean_exit(r, 1)
        _one_line(r.output)
        assert SID in r.output
    # asked to, signal starts the session
    assert_clean_exit(run_cli("signal", SID, "approve", "--create", "--dsn", db.dsn))
    # a name that is no UUID is looked up as a framework's (thread, session, run): unknown, it
    # is an unknown session
    r = run_cli("replay", "not-a-uuid", "--dsn", db.dsn)
    assert_clean_exit(r, 1)
    _one_line(r.output)
    assert_clean_exit(run_cli("verify", "--all", SID, "--dsn", db.dsn), 2)
    assert_clean_exit(run_cli("lag", "--warn-share", "2", "--dsn", db.dsn), 3)  # (a check)


def test_no_schema_is_said_as_such(empty_db: Database) -> None:
    for cmd in (["replay", SID], ["inspect", SID], ["runs"], ["outbox"], ["verify", "--all"]):
        r = run_cli(*cmd, "--dsn", empty_db.dsn)
        assert_clean_exit(r, 4)
        _one_line(r.output)
        assert "ledger-cdc init" in r.output, r.output


@pytest.fixture(scope="module")
def replica_only() -> Iterator[EmbeddedPostgres]:
    """A cluster with wal_level = replica: logical decoding is off."""
    inst = _INSTALLS.get(15) or next(iter(_INSTALLS.values()), None)
    if inst is None:
        pytest.skip("no PostgreSQL binaries")
    with EmbeddedPostgres(inst, settings={"wal_level": "replica"}) as pg:
        yield pg


def test_wal_level_replica_is_refused_before_anything_changes(
    replica_only: EmbeddedPostgres,
) -> None:
    dsn = replica_only.dsn()
    r = run_cli("init", "--dsn", dsn, "--create-slot")
    assert_clean_exit(r, 4)
    _one_line(r.output)
    assert "wal_level" in r.output and "nothing was changed" in r.output
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('ledger_migrations')").fetchone() == (None,)
        migrate(conn)  # a schema in place: the consumer must still refuse at once
    started = time.monotonic()
    p = _consume(dsn, "--create-slot")
    assert p.returncode == 4 and "wal_level" in p.stderr, p.stderr
    assert time.monotonic() - started < 20
    _one_line(p.stderr)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # no bootstrap marker left behind for a later plain `consume` to act on
        assert conn.execute("SELECT count(*) FROM ledger_checkpoints").fetchone() == (0,)
