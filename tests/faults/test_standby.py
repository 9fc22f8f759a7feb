"""Hot standby: two consumers for one slot. The standby takes over within 5 s of the active
one's SIGKILL; a paused (SIGSTOP) active consumer that resumes after the take-over is fenced and
never overwrites newer projections."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psycopg

from ledger_cdc.lsn import parse_lsn
from tests.support.cdc import (
    ConsumerProcess,
    Writers,
    assert_projections_equal_refold,
    assert_verify_exact,
    until,
    wait_caught_up,
)
from tests.support.harness import Database


def _holder(conn: psycopg.Connection[object]) -> int | None:
    """pid of the consumer process streaming agent_slot (from its application_name)."""
    row = conn.execute(
        "SELECT r.application_name FROM pg_replication_slots s JOIN pg_stat_replication r "
        "ON r.pid = s.active_pid WHERE s.slot_name = 'agent_slot' AND s.database = current_database()"
    ).fetchone()
    if row is None or not str(row[0]).startswith("ledger-cdc:"):
        return None
    return int(str(row[0]).rsplit(":", 1)[1])


def _logs_told(what: str, tmp_path: Path) -> str:
    """``what`` was awaited, with the last lines of each consumer's log (a.log, b.log)."""
    tails = []
    for name in ("a.log", "b.log"):
        path = tmp_path / name
        lines = path.read_text().splitlines()[-15:] if path.exists() else ["(no log)"]
        tails.append(f"--- {name}:\n" + "\n".join(lines))
    return what + "\n" + "\n".join(tails)


class CheckpointWatch(threading.Thread):
    """Samples the checkpoint LSN: it must never move backwards."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.seen: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.done.wait(0.02):
                    row = conn.execute(
                        "SELECT lsn::text FROM ledger_checkpoints WHERE slot_name = 'agent_slot'"
                    ).fetchone()
                    if row:
                        self.seen.append(parse_lsn(row[0]))
        except psycopg.Error:
            pass  # the database went away at teardown

    def monotonic(self) -> bool:
        return all(a <= b for a, b in zip(self.seen, self.seen[1:], strict=False))


def test_standby_takes_over_within_5s_of_a_sigkill(db: Database, tmp_path: Path) -> None:
    a = ConsumerProcess(
        db.dsn, "--create-slot", "--heartbeat-interval", "1", log=tmp_path / "a.log"
    ).start()
    b: ConsumerProcess | None = None
    writers = Writers(db.dsn, n=3, pace=0.01).start()
    try:
        with db.connect() as conn:
            until(lambda: _holder(conn) == a.proc.pid, timeout=60)  # type: ignore[union-attr]
            b = ConsumerProcess(db.dsn, "--heartbeat-interval", "1", log=tmp_path / "b.log").start()
            until(
                lambda: "standing by" in (tmp_path / "b.log").read_text(),
                timeout=30,
                what=lambda: _logs_told("the second consumer standing by", tmp_path),
            )
            time.sleep(1)
            a.kill()
            t0 = time.monotonic()
            until(lambda: _holder(conn) == b.proc.pid, timeout=10)  # type: ignore[union-attr]
            took = time.monotonic() - t0
            assert took < 5, f"take-over took {took:.1f}s"
            (before,) = conn.execute("SELECT lsn::text FROM ledger_checkpoints").fetchone()  # type: ignore[misc]
            until(
                lambda: (
                    conn.execute("SELECT lsn::text FROM ledger_checkpoints").fetchone()[0] != before
                )
            )  # type: ignore[index]
    finally:
        writers.stop()
    wait_caught_up(db.dsn)
    assert assert_projections_equal_refold(db.dsn) > 0
    assert_verify_exact(db.dsn)
    assert "acquired: this consumer is active now" in (tmp_path / "b.log").read_text()
    if b is not None:
        b.kill()


def test_a_paused_consumer_that_resumes_cannot_overwrite_newer_projections(
    db: Database, tmp_path: Path
) -> None:
    with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET wal_sender_timeout = '2s'")
        admin.execute("SELECT pg_reload_conf()")
    watch = CheckpointWatch(db.dsn)
    a = ConsumerProcess(db.dsn, "--create-slot", log=tmp_path / "a.log").start()
    b = None
    writers = Writers(db.dsn, n=3, pace=0.01)
    try:
        with db.connect() as conn:
            until(lambda: _holder(conn) == a.proc.pid, timeout=60)  # type: ignore[union-attr]
            b = ConsumerProcess(db.dsn, log=tmp_path / "b.log").start()
            until(lambda: "standing by" in (tmp_path / "b.log").read_text(), timeout=30)
            watch.start()
            writers.start()
            time.sleep(1)
            assert a.proc is not None
            # alive, silent: its walsender times out (wal_sender_timeout), and a sink transaction
            # it may have left open ends after the sink's idle-in-transaction timeout
            a.proc.send_signal(signal.SIGSTOP)
            until(lambda: _holder(conn) == b.proc.pid, timeout=30)  # type: ignore[union-attr]
            (taken,) = conn.execute("SELECT lsn::text FROM ledger_checkpoints").fetchone()  # type: ignore[misc]
            until(
                lambda: (
                    conn.execute("SELECT lsn::text FROM ledger_checkpoints").fetchone()[0] != taken
                )
            )  # type: ignore[index]
            a.proc.send_signal(signal.SIGCONT)  # it still holds a batch it folded before
            # until it has found its place taken (its batch refused, or the slot busy): the
            # point where it would have overwritten newer projections is behind it
            log_a = tmp_path / "a.log"
            until(lambda: "standing by" in log_a.read_text() or "no longer" in log_a.read_text())
            assert a.alive() and _holder(conn) == b.proc.pid  # type: ignore[union-attr]
    finally:
        if a.proc is not None and a.alive():
            a.proc.send_signal(signal.SIGCONT)
        writers.stop()
        with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET wal_sender_timeout")
            admin.execute("SELECT pg_reload_conf()")
    wait_caught_up(db.dsn)
    watch.done.set()
    watch.join(5)
    assert len(watch.seen) > 10 and watch.monotonic()  # the checkpoint never went back
    assert assert_projections_equal_refold(db.dsn) > 0
    assert_verify_exact(db.dsn)
    log_a = (tmp_path / "a.log").read_text()
    assert "standing by" in log_a or "no longer" in log_a, log_a[-2000:]
    a.kill()
    if b is not None:
        b.kill()
