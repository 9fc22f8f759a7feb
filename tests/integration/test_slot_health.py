"""Slot health and recovery on real servers: `lag` through warning → critical → lost with its exit
codes (a monitoring plugin's: 3 only when it cannot tell), a stalled consumer whose slot the
server invalidates resyncing by itself, the bootstrap of a ledger with history under concurrent
writers, and slot management."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin.schema import create_publication, create_slot, migrate
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from tests.support.cdc import (
    ROOT,
    ConsumerProcess,
    InThread,
    Writers,
    assert_clean_exit,
    assert_projections_equal_refold,
    assert_verify_exact,
    run_cli,
    until,
    wait_caught_up,
)
from tests.support.cli import run_cli_process
from tests.support.harness import _INSTALLS, _REQUIRED, Database

# one worker runs the module: its small-WAL clusters are module fixtures
pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.xdist_group("slot_health")]

LAG_KEYS = {
    "slot",
    "failover",  # (a failover slot, whether a promoted standby would have it, what stalls it:
    "failover_ready",  # PostgreSQL 17+, null before)
    "failover_standbys",
    "standby_stall",
    "exists",
    "plugin",
    "database",
    "active",
    "active_pid",
    "wal_status",
    "safe_wal_size",
    "restart_lsn",
    "confirmed_flush_lsn",
    "current_wal_lsn",
    "retained_bytes",
    "lag_bytes",
    "lag_seconds",
    "unfolded_events",
    "max_slot_wal_keep_size",
    "keep_size_share",
    "checkpoint_lsn",
    "checkpoint_behind_slot_bytes",
    "checkpoint_age_seconds",
    "heartbeat_age_seconds",
    "inactive_seconds",
    "invalidation_reason",
    "wal_rate_bytes_per_s",
    "ledger_insert_rate",
    "seconds_to_invalidation",
    "status",
    "status_name",
    "reasons",
}


@pytest.fixture(scope="module", params=[15, 18], ids=["pg15", "pg18"])
def small_wal(request: pytest.FixtureRequest) -> Iterator[EmbeddedPostgres]:
    """A cluster of its own with a 48 MB max_slot_wal_keep_size (slots get invalidated here)."""
    inst = _INSTALLS.get(request.param)
    if inst is None:
        if request.param in _REQUIRED:
            pytest.fail(f"PostgreSQL {request.param} required", pytrace=False)
        pytest.skip(f"PostgreSQL {request.param} binaries not found")
    with EmbeddedPostgres(
        inst,
        max_slot_wal_keep_size="48MB",
        logical_decoding_work_mem="64kB",
        settings={
            "max_wal_size": "64MB",
            "min_wal_size": "32MB",
            # a walsender blocked writing to a stopped client only
            # lets the checkpointer invalidate its slot at this timeout
            "wal_sender_timeout": "5s",
        },
    ) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            migrate(conn)
            create_publication(conn)
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'lag_reader'").fetchone():
                conn.execute("CREATE ROLE lag_reader LOGIN REPLICATION IN ROLE ledger_consumer")
        yield pg


def lag(dsn: str, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    p = run_cli_process("lag", "--dsn", dsn, "--json", "--sample-seconds", "0.2", *extra)
    assert p.returncode in (0, 1, 2, 3), p.stderr
    return p.returncode, json.loads(p.stdout)


def emit_wal(dsn: str, megabytes: int) -> None:
    """Write about ``megabytes`` of WAL into a table outside the publication: the slot must keep
    it, but the walsender sends nothing for it (so it never blocks writing to a stopped client,
    which would keep it from releasing the slot when the checkpointer invalidates it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS wal_pad (t text)")
        (start,) = conn.execute("SELECT pg_current_wal_lsn()").fetchone()  # type: ignore[misc]
        while True:
            conn.execute(
                "INSERT INTO wal_pad SELECT repeat('x', 1000) FROM generate_series(1, 500)"
            )
            (done,) = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)::int8", (start,)
            ).fetchone()  # type: ignore[misc]
            if done >= megabytes * 1024 * 1024:
                return


def test_stalled_consumer_warning_critical_lost_then_resync(
    small_wal: EmbeddedPostgres, tmp_path: Path
) -> None:
    pg = small_wal
    dsn = pg.dsn()
    reader = pg.dsn(user="lag_reader")  # the consumer role: no superuser
    code, out = lag(reader, "--slot", "agent_slot")
    # a missing slot is critical (2): lag's 3 is for what it cannot tell
    assert code == 2 and out[0]["exists"] is False and "does not exist" in out[0]["reasons"][0]
    assert out[0]["status"] == 3 and out[0]["status_name"] == "lost"

    log = tmp_path / "consumer.log"
    proc = ConsumerProcess(
        dsn, "--create-slot", "--health-interval", "0.5", "--snapshot-every", "10", log=log
    ).start()
    try:
        writers = Writers(dsn, n=2, sessions=8, pace=0.01).start()
        time.sleep(1.5)
        writers.stop()
        wait_caught_up(dsn)
        code, out = lag(reader, "--slot", "agent_slot")
        assert code == 0, out
        (h,) = out
        assert set(h) == LAG_KEYS
        assert h["exists"] and h["plugin"] == "pgoutput" and h["wal_status"] == "reserved"
        assert h["max_slot_wal_keep_size"] == 48 * 1024 * 1024 and h["active"] is True
        assert isinstance(h["safe_wal_size"], int) and h["checkpoint_lsn"] is not None
        assert h["wal_rate_bytes_per_s"] is not None and h["ledger_insert_rate"] is not None

        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGSTOP)  # the consumer stalls; its slot holds WAL
        emit_wal(dsn, 26)
        # WAL keeps coming while `lag` samples the rate: the forecast is safe_wal_size / rate
        stop = threading.Event()

        def trickle() -> None:
            with psycopg.connect(dsn, autocommit=True) as c:
                while not stop.wait(0.02):
                    c.execute(
                        "INSERT INTO wal_pad SELECT repeat('x', 1000) FROM generate_series(1, 50)"
                    )

        t = threading.Thread(target=trickle)
        t.start()
        try:
            code, out = lag(reader, "--slot", "agent_slot", "--sample-seconds", "1")
        finally:
            stop.set()
            t.join()
        assert code == 1, out
        h = out[0]
        assert 0.5 <= h["keep_size_share"] < 0.8 and h["wal_rate_bytes_per_s"] > 0
        assert h["seconds_to_invalidation"] == pytest.approx(
            h["safe_wal_size"] / h["wal_rate_bytes_per_s"]
        )
        emit_wal(dsn, 12)
        code, out = lag(reader, "--slot", "agent_slot")
        assert code == 2, out
        assert out[0]["keep_size_share"] >= 0.8

        # while the slot is dying, writers go on: these rows must not be lost
        more = Writers(dsn, n=2, sessions=8, seed=9, pace=0.01).start()
        for _ in range(8):
            emit_wal(dsn, 20)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
            code, out = lag(reader, "--slot", "agent_slot")
            if out[0]["status"] == 3:
                break
        # lost: critical for the exit code (a monitoring plugin's), 3 in --json as in the metric
        assert code == 2 and out[0]["status"] == 3 and out[0]["wal_status"] == "lost", out
        assert any("invalidated" in r for r in out[0]["reasons"])

        os.kill(proc.proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        more.stop()
        wait_caught_up(dsn, 120)
        assert proc.alive()
        code, out = lag(reader, "--slot", "agent_slot")
        assert code == 0 and out[0]["wal_status"] == "reserved", out
    finally:
        if proc.alive():
            if proc.proc is not None:
                os.kill(proc.proc.pid, signal.SIGCONT)
            proc.kill()
    text = log.read_text()
    assert "resynchronising from the ledger table" in text
    assert_projections_equal_refold(dsn)
    assert_verify_exact(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('agent_slot')")
        conn.execute(
            "TRUNCATE agent_sessions, agent_snapshots, ledger_checkpoints, ledger_dead_letters"
        )


def test_on_slot_lost_exit(small_wal: EmbeddedPostgres, tmp_path: Path) -> None:
    dsn = small_wal.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_slot(conn, "exit_slot")
    proc = ConsumerProcess(
        dsn,
        "--slot",
        "exit_slot",
        "--on-slot-lost",
        "exit",
        "--health-interval",
        "0.5",
        log=tmp_path / "c.log",
    ).start()
    try:
        until(lambda: lag(dsn, "--slot", "exit_slot")[1][0]["active"], 30)
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGSTOP)
        for _ in range(10):
            emit_wal(dsn, 20)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
            if lag(dsn, "--slot", "exit_slot")[1][0]["status"] == 3:
                break
        os.kill(proc.proc.pid, signal.SIGCONT)
        assert proc.proc.wait(60) == 3
    finally:
        if proc.alive():
            proc.kill()
    assert "exiting (--on-slot-lost exit)" in (tmp_path / "c.log").read_text()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('exit_slot')")


def test_bootstrap_with_history_under_concurrent_writers(db: Database, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_backlog  # type: ignore[import-not-found]

    write_backlog(db.dsn, 20_000, 200)
    writers = Writers(db.dsn, n=4, sessions=20, pace=0.005).start()
    try:
        with ConsumerProcess(
            db.dsn, "--create-slot", "--snapshot-every", "50", log=tmp_path / "c.log"
        ):
            # the writers go on until the bootstrap has folded the table under them
            until(lambda: "events folded from the table" in (tmp_path / "c.log").read_text(), 180)
            writers.stop()
            wait_caught_up(db.dsn, 180)
    finally:
        writers._stop.set()
    text = (tmp_path / "c.log").read_text()
    assert "bootstrap:" in text and "events folded from the table" in text
    n = assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)
    assert n > 20_000


def test_interrupted_bootstrap_is_redone(db: Database, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_backlog  # type: ignore[import-not-found]

    write_backlog(db.dsn, 20_000, 200)
    proc = ConsumerProcess(db.dsn, "--create-slot", log=tmp_path / "c.log").start()

    def slot_exists() -> bool:
        with db.connect() as c:
            return (
                c.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
                ).fetchone()
                is not None
            )

    until(slot_exists, 30, 0.005)
    proc.kill()  # mid-bootstrap (or just after): the next start must not miss the history
    with ConsumerProcess(db.dsn, "--create-slot", log=tmp_path / "c.log"):
        wait_caught_up(db.dsn, 120)
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)


def test_slot_commands(db: Database) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli_process("slot", *args, "--dsn", db.dsn)

    assert "created" in cli("create", "s1").stdout
    assert "exists" in cli("create", "s1").stdout
    listed = json.loads(cli("list", "--json").stdout)
    assert [s["slot"] for s in listed if s["slot"] == "s1"] == ["s1"] and listed[0][
        "plugin"
    ] == "pgoutput"
    with db.connect() as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('td', 'test_decoding')")
    bad = cli("create", "td")
    assert bad.returncode == 4 and "not a pgoutput logical slot" in bad.stderr
    missing = cli("drop", "nope")
    assert missing.returncode == 3 and "does not exist" in missing.stderr
    with ConsumerProcess(db.dsn, "--slot", "s1"):
        until(lambda: json.loads(cli("list", "--json").stdout)[0]["active"] is True, 30)
        busy = cli("drop", "s1")
        assert busy.returncode == 4 and "is active" in busy.stderr and "--force" in busy.stderr
        assert "dropped" in cli("drop", "s1", "--force").stdout
    assert cli("drop", "td").returncode == 0
    bad_name = cli("create", "Bad-Name")
    assert bad_name.returncode == 4 and "invalid slot name" in bad_name.stderr


def test_rate_watch_reports_rates_and_flags_a_retry_storm(db: Database) -> None:
    from ledger_cdc.admin.health import RateWatch

    watch = RateWatch(factor=5, min_inserts=50)
    with db.connect() as conn:
        assert watch.sample(conn) is None  # a rate needs two samples
        calm = []
        for _ in range(4):
            conn.execute(
                "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                "SELECT gen_random_uuid(), 'a', 'x.y', '{}' FROM generate_series(1, 5)"
            )
            time.sleep(0.1)
            r = watch.sample(conn)
            assert r is not None and r.inserts_per_s > 0 and r.wal_bytes_per_s > 0
            calm.append(r.spike)
        # no storm of inserts; the WAL is the cluster's, and what other databases of it write
        # meanwhile (tests running beside this one) may be a spike of WAL, never of inserts
        assert [s for s in calm if s is not None and "inserts" in s] == []
        conn.execute(
            "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
            "SELECT gen_random_uuid(), 'a', 'x.y', '{}' FROM generate_series(1, 2000)"
        )
        time.sleep(0.1)
        storm = watch.sample(conn)
        assert storm is not None and storm.spike is not None and "retry storm" in storm.spike


def test_lag_sees_a_dead_consumer_by_time(db: Database, tmp_path: Path) -> None:
    """A stopped consumer a few events behind (a few kB of WAL) is a warning once the oldest
    event it has not committed is older than --warn-seconds; lag_seconds is never 0 meanwhile,
    and the consumer's metrics say the same."""
    sid = uuid.uuid4()
    log = tmp_path / "consume.log"
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    with Ledger(db.dsn) as ledger:
        with ConsumerProcess(db.dsn, log=log):
            ledger.append(sid, "a", "tool.invoked", {"call_id": "0", "tool": "t"})
            wait_caught_up(db.dsn)
        code, (h,) = lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")
        assert code == 0 and h["lag_seconds"] == 0 and h["unfolded_events"] == 0, h
        for i in range(1, 11):
            ledger.append(sid, "a", "tool.invoked", {"call_id": str(i), "tool": "t"})
        code, (h,) = lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")
        assert h["lag_seconds"] > 0 and h["unfolded_events"] == 10, h
        until(
            lambda: (
                lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")[1][0]["lag_seconds"] >= 2
            ),
            30,
        )
        code, (h,) = lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")
        assert code == 1 and h["lag_bytes"] < 1024 * 1024 and h["lag_seconds"] >= 2, h
        assert any("behind" in r for r in h["reasons"]) and h["active"] is False
        with InThread(db.dsn, health_interval=0.2) as consumer:
            wait_caught_up(db.dsn)
            until(lambda: lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")[0] == 0, 30)
            # the consumer's guard exports the same figures
            until(lambda: consumer.metrics.extra.get("slot_unfolded_events") == 0.0, 30)
            assert consumer.metrics.extra["slot_lag_seconds"] == 0.0
    code, (h,) = lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")
    assert h["lag_seconds"] == 0 and h["unfolded_events"] == 0


def test_lag_sees_a_slot_no_consumer_ever_read(db: Database) -> None:
    """No checkpoint yet (no consumer ever ran): the events the slot holds are as old as the
    oldest of them, and past --warn-seconds that is a warning (before PostgreSQL 17 the server
    does not say since when the slot is inactive either)."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    with Ledger(db.dsn) as ledger:
        for i in range(5):
            ledger.append(uuid.uuid4(), "a", "tool.invoked", {"call_id": str(i), "tool": "t"})
    until(
        lambda: (
            (lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")[1][0]["lag_seconds"] or 0)
            >= 2
        ),
        30,
    )
    code, (h,) = lag(db.dsn, "--slot", "agent_slot", "--warn-seconds", "2")
    assert code == 1 and h["unfolded_events"] == 5, h
    assert any("behind" in r for r in h["reasons"])


START = ("--create-slot", "--log-format", "text")


def _consume_once(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``consume --create-slot`` run to its end (each caller expects it to refuse at start)."""
    return run_cli_process("consume", "--dsn", dsn, *START, *args)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        ("SELECT pg_create_physical_replication_slot(%s)", "is a physical slot"),
        ("SELECT pg_create_physical_replication_slot(%s, true)", "is a physical slot"),
        ("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", "'test_decoding'"),
    ],
    ids=["physical", "physical-reserved", "test_decoding"],
)
def test_consume_refuses_a_slot_that_is_not_a_pgoutput_slot_and_leaves_it(
    db: Database, tmp_path: Path, make: str, says: str
) -> None:
    """A --slot naming somebody else's slot (a standby's physical slot, another tool's
    logical one) stops consume at once with exit 3 and the reason; the slot stays as it was.
    PostgreSQL 15 reports a physical slot that never reserved WAL as "invalidated", the
    signal of a lost slot, which the consumer resynchronises by dropping and re-creating it:
    it dropped a standby's slot and put a logical one in its place."""
    name = f"theirs_{uuid.uuid4().hex[:8]}"
    with db.connect() as conn:
        conn.execute(make, (name,))
        kind = conn.execute(
            "SELECT slot_type, plugin FROM pg_replication_slots WHERE slot_name = %s", (name,)
        ).fetchone()
    try:
        out = _consume_once(db.dsn, "--slot", name)
        assert out.returncode == 3, out.stderr
        assert says in out.stderr and "not a pgoutput logical slot" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "resynchronising" not in out.stderr
        # `lag` names what it is, rather than "does not exist": critical
        code, health = lag(db.dsn, "--slot", name)
        assert code == 2 and says in health[0]["reasons"][0], health
        with db.connect() as conn:
            assert (
                conn.execute(
                    "SELECT slot_type, plugin FROM pg_replication_slots WHERE slot_name = %s",
                    (name,),
                ).fetchone()
                == kind
            )
    finally:
        with db.connect() as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (name,),
            )


def test_consume_refuses_the_slot_of_another_database(
    db: Database, second_db: Database, tmp_path: Path
) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    out = _consume_once(second_db.dsn)
    assert out.returncode == 3, out.stderr
    assert f"belongs to database '{db.name}', not '{second_db.name}'" in out.stderr, out.stderr
    # lag too: another database's slot is not this ledger's, named or not
    code, health = lag(second_db.dsn, "--slot", "agent_slot")
    assert code == 2 and f"belongs to database '{db.name}'" in health[0]["reasons"][0], health
    r = run_cli("lag", "--dsn", second_db.dsn, "--json", "--sample-seconds", "0")
    assert_clean_exit(r, 2)
    assert json.loads(r.stdout) == [] and "no logical replication slot" in r.stderr, r.output
    code, health = lag(db.dsn)
    assert code == 0 and [h["slot"] for h in health] == ["agent_slot"], health


def test_lag_on_a_database_without_a_ledger_is_unknown(db: Database, empty_db: Database) -> None:
    """Asked about a database that holds no ledger, lag cannot tell (3), in one line; it used
    to report another database's slot as healthy (exit 0)."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    for extra in ((), ("--json",), ("--slot", "agent_slot")):
        r = run_cli("lag", "--dsn", empty_db.dsn, "--sample-seconds", "0", *extra)
        assert_clean_exit(r, 3)
        assert r.stdout == "", r.stdout
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "holds no ledger" in lines[0], r.stderr


@pytest.mark.parametrize(
    ("alter", "says"),
    [
        ("ALTER PUBLICATION agent_pub DROP TABLE agent_events", "does not publish the ledger"),
        (
            "ALTER PUBLICATION agent_pub SET (publish = 'update, delete')",
            "does not publish INSERTs",
        ),
        (
            "ALTER PUBLICATION agent_pub SET TABLE agent_events (seq, session_id, position)",
            "leaves out agent_id, event_type, payload, created_at of 'agent_events'",
        ),
        (  # (the ledger's own has a column list, which PostgreSQL allows only through the root)
            "DROP PUBLICATION agent_pub; CREATE PUBLICATION agent_pub FOR TABLE agent_events",
            "publishes the partitions of 'agent_events'",
        ),
    ],
    ids=["table-dropped", "no-inserts", "columns", "partitions"],
)
def test_a_publication_that_does_not_stream_the_ledger_stops_consume_at_start(
    empty_db: Database, alter: str, says: str
) -> None:
    """The publication exists, but what it streams is not the ledger as the consumer reads it:
    the table taken out of it, INSERTs not published, a column list without columns the fold
    needs, a partitioned ledger published partition by partition (relations the consumer does
    not take for the ledger). It used to stream
    along with nothing to fold, and what was written meanwhile never reached the slot: now
    consume exits 4 at start, with the statement that puts it right."""
    from tests.support.schema import init_db

    init_db(empty_db.dsn, partition_by="month" if "partitions of" in says else None)
    with empty_db.connect() as conn:
        conn.execute(alter)
    out = _consume_once(empty_db.dsn)
    assert out.returncode == 4, out.stderr
    assert says in out.stderr and "ALTER PUBLICATION" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    with empty_db.connect() as conn:  # refused before anything was made
        assert conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)


def test_a_publication_changed_under_a_running_consumer_is_an_error_until_put_right(
    db: Database, tmp_path: Path
) -> None:
    """The ledger table taken out of the publication while the consumer runs: what is written
    meanwhile never reaches the slot. The slot check says so, as an error, within its interval,
    and says when the publication streams the ledger again."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    log = tmp_path / "c.log"
    with ConsumerProcess(db.dsn, "--health-interval", "0.5", log=log):
        until(lambda: "streaming slot agent_slot" in log.read_text(), 60)
        with db.connect() as conn:
            conn.execute("ALTER PUBLICATION agent_pub DROP TABLE agent_events")
        until(lambda: "does not publish the ledger table 'agent_events'" in log.read_text(), 60)
        assert "ERROR publication 'agent_pub' does not publish" in log.read_text()
        with db.connect() as conn:
            conn.execute("ALTER PUBLICATION agent_pub ADD TABLE agent_events")
        until(lambda: "agent_pub streams the ledger table again" in log.read_text(), 60)


def test_a_slot_advanced_by_hand_skips_nothing_a_session_writes_on_after(
    db: Database, tmp_path: Path
) -> None:
    """The slot moved past the consumer's checkpoint by hand while it was stopped: the server
    drops the events between. At each session's next event the consumer reads the positions it
    lacks from the table; projections then equal a refold from zero (they used to stay short,
    behind a gap dead letter)."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    a, b = uuid.uuid4(), uuid.uuid4()
    log = tmp_path / "c.log"
    with ConsumerProcess(db.dsn, log=log), Ledger(db.dsn) as ledger:
        ledger.append(a, "w", "tool.invoked", {"call_id": "a1", "tool": "t"})
        wait_caught_up(db.dsn)
    with Ledger(db.dsn) as ledger, db.connect() as conn:
        for i in range(3):
            ledger.append(b, "w", "tool.invoked", {"call_id": f"b{i}", "tool": "t"})
        ledger.append(a, "w", "tool.invoked", {"call_id": "a2", "tool": "t"})
        conn.execute("SELECT pg_replication_slot_advance('agent_slot', pg_current_wal_lsn())")
    with ConsumerProcess(db.dsn, log=log), Ledger(db.dsn) as ledger:
        ledger.append(a, "w", "tool.invoked", {"call_id": "a3", "tool": "t"})
        ledger.append(b, "w", "tool.invoked", {"call_id": "b3", "tool": "t"})
        wait_caught_up(db.dsn)
    with db.connect() as conn:
        dead = conn.execute("SELECT kind FROM ledger_dead_letters").fetchall()
    assert dead == [], dead
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)
