"""Retention that loses nothing: an archive has no race, never stalls writers, and keeps what the
live system still needs (heads, idempotency keys, signal ids); rebuilds, verify and bootstraps
understand archived history or refuse it loudly."""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import gzip
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin import archive as archiving
from ledger_cdc.admin.archive import archive, check_archive
from ledger_cdc.admin.importer import ImportedEvent, import_events
from ledger_cdc.admin.partitions import ensure
from ledger_cdc.admin.schema import drop_slot
from ledger_cdc.admin.verify import verify
from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import fork, memoised_tool, rebuild_context, retry_tool
from ledger_cdc.client.runs import lease, signal, submit
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import (
    ArchiveRefusedError,
    ConcurrentAppendError,
    ConfigError,
    HistoryArchivedError,
)
from tests.support.cdc import (
    InThread,
    assert_clean_exit,
    run_cli,
    stored_projections,
    wait_caught_up,
)
from tests.support.harness import Database
from tests.support.schema import init_db
from tests.support.wait import until

pytestmark = pytest.mark.server

OLD = dt.timedelta(days=120)


def _import(
    conn: psycopg.Connection[Any], sid: uuid.UUID, n: int, when: dt.datetime, **p: Any
) -> None:
    ev = ImportedEvent(
        sid,
        "old",
        p.get("event_type", "tool.invoked"),
        p.get("payload", {"call_id": f"old-{n}", "tool": "t", "arguments": {"n": n}}),
        when,
        p.get("key", f"old-{n}"),
    )
    import_events(conn, [(n, ev)])


def _partitioned(db: Database) -> dt.datetime:
    init_db(db.dsn, partition_by="month", slot="agent_slot")
    with db.connect() as conn:
        now: dt.datetime = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        ensure(conn, 0, at=now - OLD)
    return now


def _archived_keys(directory: Path) -> set[str]:
    keys = set()
    for f in directory.glob("*.csv.gz"):
        with gzip.open(f, "rt", newline="") as g:
            keys |= {row["idempotency_key"] for row in csv.DictReader(g)}
    return keys


_WAITS_FOR_A_LOCK = (
    "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock')"
)


def test_an_insert_at_any_step_of_an_archive_is_archived_or_kept(
    empty_db: Database, tmp_path: Path
) -> None:
    """An import into the partition being archived commits at every step: each such event ends
    in the archive file or in the ledger, never in neither."""
    now = _partitioned(empty_db)
    sid = uuid.uuid4()
    late: list[str] = []
    with empty_db.connect() as conn:
        for i in range(1, 4):
            _import(conn, sid, i, now - OLD + dt.timedelta(minutes=i))
    with (
        InThread(empty_db.dsn, create_slot=False),
        empty_db.connect() as conn,
    ):
        wait_caught_up(empty_db.dsn)

        writers: list[threading.Thread] = []
        pids: dict[str, int] = {}

        def late_import(key: str) -> None:
            with empty_db.connect() as own:
                pids[key] = own.info.backend_pid
                try:
                    _import(own, sid, 100, now - OLD + dt.timedelta(hours=1), key=key)
                    late.append(key)
                except (ConfigError, psycopg.Error):
                    pass  # refused (the range is being archived, or gone): nothing committed

        def at_step(partition: str, step: str) -> None:
            # an import at this very step, on a connection of its own; one that must wait for
            # the archive's lock goes on waiting while the archive proceeds
            key = f"late-{step}"
            t = threading.Thread(target=late_import, args=(key,), daemon=True)
            t.start()
            # until it has ended, or waits for a lock the archive holds: either way it has
            # met the archive at this step
            with empty_db.connect() as watch:
                until(
                    lambda: (
                        not t.is_alive()
                        or watch.execute(_WAITS_FOR_A_LOCK, (pids.get(key),)).fetchone() == (True,)
                    ),
                    30,
                )
            writers.append(t)

        archive(conn, dt.timedelta(days=90), tmp_path / "a", on_step=at_step, consumer_wait=30)
        for t in writers:
            t.join(30)
            assert not t.is_alive()
        with empty_db.connect() as check:
            in_ledger = {
                r[0]
                for r in check.execute(
                    "SELECT idempotency_key FROM agent_events WHERE session_id = %s", (sid,)
                )
            }
    archived = _archived_keys(tmp_path / "a")
    assert late, "no late insert was accepted at all"
    for key in late:
        assert key in archived or key in in_ledger, f"{key} committed, then lost"
    assert {f"old-{i}" for i in range(1, 4)} <= archived


_KILL_AT = """
import datetime as dt, os, signal, sys
from pathlib import Path
import psycopg
from ledger_cdc.admin.archive import archive
dsn, out, when = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
def step(name, s):
    if s == when:
        os.kill(os.getpid(), signal.SIGKILL)
with psycopg.connect(dsn, autocommit=True) as conn:
    archive(conn, dt.timedelta(days=90), out, on_step=step)
"""
_GUARDS = "SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = to_regclass(%s) ORDER BY tgname"
_KEPT = "SELECT count(*) FROM agent_kept_events WHERE partition_name = %s"


@pytest.mark.parametrize("when", ["detached", "exported"])
def test_an_archive_killed_after_the_detach_is_taken_up_by_the_next(
    empty_db: Database, tmp_path: Path, when: str
) -> None:
    """kill -9 once the partition is detached (its rows out of the ledger, in no archive yet).
    Meanwhile a rebuild needing that history says it is being archived, naming the partition
    (it folded across the gap into an empty context, then said "was archived"), and what the stored contexts and the memo reference there (a
    long tool result) is read from what the archive kept before the detach (they failed on
    the missing event); the next archive run attaches the partition again, with its guards
    as they were, and archives it: every event in the ledger or in an archive."""
    now = _partitioned(empty_db)
    sid = uuid.uuid4()
    result = "r" * 3000  # long: the projection and the memo row leave it in its event
    with empty_db.connect() as conn:
        for i in range(1, 4):
            observed = {
                "event_type": "tool.observed",
                "payload": {"call_id": "old-1", "result": result},
            }
            _import(
                conn, sid, i, now - OLD + dt.timedelta(minutes=i), **(observed if i == 2 else {})
            )
        (first_seq,) = conn.execute(  # type: ignore[misc]
            "SELECT min(seq) FROM agent_events WHERE session_id = %s", (sid,)
        ).fetchone()
        (name,) = conn.execute(  # type: ignore[misc]
            "SELECT tableoid::regclass::text FROM agent_events WHERE session_id = %s LIMIT 1",
            (sid,),
        ).fetchone()
        guards = conn.execute(_GUARDS, (name,)).fetchall()
    with InThread(empty_db.dsn, create_slot=False):
        wait_caught_up(empty_db.dsn)
        killed = subprocess.run(
            [sys.executable, "-c", _KILL_AT, empty_db.dsn, str(tmp_path / "a"), when],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert killed.returncode == -9, killed.stderr  # SIGKILL
        with empty_db.connect() as conn:
            assert conn.execute(
                "SELECT count(*) FROM agent_events WHERE session_id = %s", (sid,)
            ).fetchone() == (0,)
            # what it says: being archived, and what puts it back (not "restore the archive":
            # there is none yet)
            with pytest.raises(HistoryArchivedError, match=f"being archived .*{name} is detached"):
                rebuild_context(conn, sid, upto_seq=first_seq)
            assert projected_contexts(conn, [sid])[sid].last_position == 3
            ctx = rebuild_context(conn, sid)
            memo = memoised_tool(conn, ctx, "old-1")
            assert ctx.last_position == 3 and memo is not None and memo.result == result
            # a run whose bound takes no partition still puts the detached one back (and
            # removes the killed run's files: it never recorded them, nor keeps what it kept)
            assert archive(conn, dt.timedelta(days=100_000), tmp_path / "a") == []
            assert list((tmp_path / "a").glob("*.manifest.json")) == []
            assert conn.execute(_GUARDS, (name,)).fetchall() == guards
            assert conn.execute(_KEPT, (name,)).fetchone() == (0,)
            assert rebuild_context(conn, sid, upto_seq=first_seq).last_position == 1
            done = archive(conn, dt.timedelta(days=90), tmp_path / "a")
            assert [a.name for a in done] == [name] and done[0].events == 3
            assert conn.execute("SELECT count(*) FROM ledger_archiving").fetchone() == (0,)
            assert conn.execute(_KEPT, (name,)).fetchone() == (1,)  # the completion
    assert _archived_keys(tmp_path / "a") == {f"old-{i}" for i in range(1, 4)}
    report = verify(empty_db.dsn, archive_dir=tmp_path / "a")
    assert report.ok, report.differences


def test_a_second_archive_run_never_touches_one_under_way(
    empty_db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two archive runs at once: the second is refused while the first holds the archive lock.
    It took the first's record for a killed run's, removed the files the first was about to
    record (an archive recorded without its files), and attached its partition again."""
    now = _partitioned(empty_db)
    sid = uuid.uuid4()
    with empty_db.connect() as conn:
        for i in range(1, 4):
            _import(conn, sid, i, now - OLD + dt.timedelta(minutes=i))
    monkeypatch.setattr(archiving, "_LOCK_WAIT", 0.5)
    exporting, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def hold(partition: str, step: str) -> None:
        if step == "exported":  # files written, their record not yet committed
            exporting.set()
            go.wait(30)

    def run(which: str, **kw: Any) -> None:
        with empty_db.connect() as conn:
            try:
                outcome[which] = archive(conn, dt.timedelta(days=90), tmp_path / "a", **kw)
            except Exception as e:  # the outcome is what is asserted
                outcome[which] = e

    with InThread(empty_db.dsn, create_slot=False):
        wait_caught_up(empty_db.dsn)
        first = threading.Thread(target=run, args=("first",), kwargs={"on_step": hold})
        first.start()
        assert exporting.wait(30)
        second = threading.Thread(target=run, args=("second",))
        second.start()
        second.join(5)  # refused at once (before, it waited for the first's lock to attach)
        go.set()
        first.join(30)
        second.join(30)
    assert [a.events for a in outcome["first"]] == [3]
    with empty_db.connect() as conn:
        assert check_archive(conn, tmp_path / "a") == []
    assert isinstance(outcome["second"], ArchiveRefusedError), outcome["second"]
    assert "another archive" in str(outcome["second"])
    assert _archived_keys(tmp_path / "a") == {f"old-{i}" for i in range(1, 4)}


def _lose_connection(conn: psycopg.Connection[Any]) -> None:
    """The connection lost the way a network fails: the socket shut, psycopg finds out."""
    socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(psycopg.OperationalError):
        conn.execute("SELECT 1")
    assert conn.closed


def test_an_archive_whose_connection_is_lost_before_its_commit_is_undone_at_once(
    empty_db: Database, tmp_path: Path
) -> None:
    """The archive's server process ends before the final commit: nothing was recorded, so a
    new connection puts the partition back into the ledger and the files are removed at once.
    Before, with its own connection gone, the archive could not tell, and left the rows out of
    the ledger until the next run."""
    now = _partitioned(empty_db)
    sid = uuid.uuid4()
    with empty_db.connect() as conn:
        for i in range(1, 4):
            _import(conn, sid, i, now - OLD + dt.timedelta(minutes=i))
    with InThread(empty_db.dsn, create_slot=False), empty_db.connect() as conn:
        wait_caught_up(empty_db.dsn)
        pid = conn.info.backend_pid

        def terminate(partition: str, step: str) -> None:
            if step == "exported":
                with empty_db.connect() as other:
                    other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))

        with pytest.raises(psycopg.OperationalError):
            archive(conn, dt.timedelta(days=90), tmp_path / "a", on_step=terminate)
    with empty_db.connect() as conn:
        assert conn.execute(
            "SELECT count(*) FROM agent_events WHERE session_id = %s", (sid,)
        ).fetchone() == (3,)
        assert conn.execute("SELECT count(*) FROM ledger_archiving").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM ledger_archives").fetchone() == (0,)
    assert list((tmp_path / "a").iterdir()) == []


def test_an_archive_whose_connection_is_lost_after_its_commit_keeps_its_files(
    empty_db: Database, tmp_path: Path
) -> None:
    """The final commit taken by the server, the answer lost with the connection: the archive
    is recorded, so its files stay (a new connection asks; they were removed, leaving an
    archive without its files), and the next run clears the record of the run."""
    now = _partitioned(empty_db)
    sid = uuid.uuid4()
    with empty_db.connect() as conn:
        for i in range(1, 4):
            _import(conn, sid, i, now - OLD + dt.timedelta(minutes=i))

    class LostAtCommit(psycopg.Connection[Any]):
        def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
            cur = super().execute(query, params, **kw)
            if str(query).startswith("DELETE FROM ledger_archiving "):  # the final statement
                super().execute("COMMIT")
                _lose_connection(self)
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return cur

    with InThread(empty_db.dsn, create_slot=False):
        wait_caught_up(empty_db.dsn)
        with (
            LostAtCommit.connect(empty_db.dsn, autocommit=True) as conn,
            pytest.raises(psycopg.OperationalError),
        ):
            archive(conn, dt.timedelta(days=90), tmp_path / "a")
        with empty_db.connect() as conn:
            assert check_archive(conn, tmp_path / "a") == []
            assert archive(conn, dt.timedelta(days=90), tmp_path / "b") == []
            assert conn.execute("SELECT count(*) FROM ledger_archiving").fetchone() == (0,)
    assert _archived_keys(tmp_path / "a") == {f"old-{i}" for i in range(1, 4)}


def test_an_archive_never_stalls_writers_behind_a_reader(
    empty_db: Database, tmp_path: Path
) -> None:
    """A REPEATABLE READ reader (a running verify) keeps the detach waiting; appends to the
    current partition go on meanwhile at their usual latency."""
    now = _partitioned(empty_db)
    sid, live = uuid.uuid4(), uuid.uuid4()
    with empty_db.connect() as conn:
        _import(conn, sid, 1, now - OLD)
    latencies: list[float] = []
    with InThread(empty_db.dsn, create_slot=False), Ledger(empty_db.dsn) as ledger:
        wait_caught_up(empty_db.dsn)
        reader = psycopg.connect(empty_db.dsn)
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM agent_events")
        done = threading.Event()
        archiver: list[int] = []

        def run_archive() -> None:
            with empty_db.connect() as conn:
                archiver.append(conn.info.backend_pid)
                archive(conn, dt.timedelta(days=90), tmp_path / "a")
            done.set()

        t = threading.Thread(target=run_archive, daemon=True)
        t.start()
        waits_seen = 0

        def appended_while_the_archive_waits() -> bool:
            nonlocal waits_seen
            assert not done.is_set(), "the detach did not wait for the open reader"
            t0 = time.monotonic()
            ledger.append(live, "a", "tool.invoked", {"call_id": f"c{len(latencies)}", "tool": "t"})
            latencies.append(time.monotonic() - t0)
            if archiver and watch.execute(_WAITS_FOR_A_LOCK, archiver).fetchone() == (True,):
                waits_seen += 1
            return waits_seen >= 20

        # appends go on while the archive is seen waiting (on the reader's snapshot), 20 times
        with empty_db.connect() as watch:
            until(appended_while_the_archive_waits, 60, every=0.01)
        assert not done.is_set(), "the detach did not wait for the open reader"
        reader.rollback()
        reader.close()
        t.join(60)
        assert done.is_set()
    assert max(latencies) < 1.0, max(latencies)


def test_archived_sessions_go_on(empty_db: Database, tmp_path: Path) -> None:
    """Whole sessions archived: appends, retries, leases and re-sent keys continue at the right
    position; a fork is refused clearly; rebuilds inside the archive are refused unless a
    snapshot is at exactly that point; verify passes; a bootstrap starts from the archive."""
    now = _partitioned(empty_db)
    a, b = uuid.uuid4(), uuid.uuid4()
    with empty_db.connect() as conn:
        _import(conn, a, 1, now - OLD)  # tool.invoked old-1: in flight when archived
        _import(conn, a, 2, now - OLD, event_type="run.queued", payload={}, key=None)
        _import(
            conn,
            a,
            3,
            now - OLD,
            event_type="signal.received",
            payload={"name": "approve", "sender": "signal"},
            key="signal:sig-1",
        )
        for i in range(1, 5):
            _import(conn, b, 10 + i, now - OLD + dt.timedelta(minutes=i))
    with InThread(empty_db.dsn, create_slot=False, snapshot_every=2):
        wait_caught_up(empty_db.dsn)
        with empty_db.connect() as conn:
            snap_seq = conn.execute(
                "SELECT min(upto_seq) FROM agent_snapshots WHERE session_id = %s", (b,)
            ).fetchone()[0]  # type: ignore[index]
            inside = conn.execute(
                "SELECT seq FROM agent_events WHERE session_id = %s AND position = 3", (b,)
            ).fetchone()[0]  # type: ignore[index]
            (done,) = archive(conn, dt.timedelta(days=90), tmp_path / "a")
            assert done.events == 7
        assert_clean_exit(run_cli("verify", "--all", "--dsn", empty_db.dsn))
        with empty_db.connect() as conn:
            # heads survive: appends at the right position
            with Ledger(empty_db.dsn) as ledger:
                assert ledger.head(a) == 3 and ledger.head(b) == 4
                with pytest.raises(ConcurrentAppendError):
                    ledger.append(
                        b, "x", "tool.invoked", {"call_id": "n", "tool": "t"}, expected_position=0
                    )
                r = ledger.append(
                    b, "x", "tool.invoked", {"call_id": "n", "tool": "t"}, expected_position=4
                )
                assert r.position == 5
                # a key of an archived event: the same event is a duplicate, another a conflict
                dup = ledger.append(
                    b,
                    "old",
                    "tool.invoked",
                    {"call_id": "old-11", "tool": "t", "arguments": {"n": 11}},
                    idempotency_key="old-11",
                )
                assert dup.duplicate and dup.position == 1
            assert signal(conn, a, "approve", signal_id="sig-1").duplicate
            # a rebuilt context resumes: the in-flight call is retried, the run leased
            ctx = rebuild_context(conn, a)
            assert ctx.last_position == 3 and "old-1" in ctx.pending_tools
            retry_tool(conn, ctx, "old-1", "w2")
            assert ctx.last_position == 4
            run = lease(conn, a, "w2", ttl=30)
            assert run.ctx.last_position == 5
            with pytest.raises(HistoryArchivedError, match="fork"):
                fork(conn, b)
            # time travel: inside the archive only at a snapshot's exact point
            assert rebuild_context(conn, b, snap_seq).last_seq == snap_seq
            with pytest.raises(HistoryArchivedError):
                rebuild_context(conn, b, inside)
            submit(conn, b)
        wait_caught_up(empty_db.dsn)
    assert_clean_exit(run_cli("verify", "--all", "--dsn", empty_db.dsn))
    with empty_db.connect() as conn:
        before = stored_projections(conn)
        # the slot is lost and the projections with it: a bootstrap rebuilds them, archived
        # sessions from their archive snapshot
        drop_slot(conn, "agent_slot", force=True)
        conn.execute("TRUNCATE agent_sessions, ledger_checkpoints")
    with InThread(empty_db.dsn, precreate_slot=False):
        wait_caught_up(empty_db.dsn)
    with empty_db.connect() as conn:
        assert stored_projections(conn) == before
    assert verify(empty_db.dsn).ok
    with empty_db.connect() as conn:
        drop_slot(conn, "agent_slot", force=True)


def test_a_bootstrap_into_another_database_refuses_archived_history(
    empty_db: Database, db: Database, tmp_path: Path
) -> None:
    now = _partitioned(empty_db)
    with empty_db.connect() as conn:
        _import(conn, uuid.uuid4(), 1, now - OLD)
    with InThread(empty_db.dsn, create_slot=False):
        wait_caught_up(empty_db.dsn)
        with empty_db.connect() as conn:
            archive(conn, dt.timedelta(days=90), tmp_path / "a")
    with empty_db.connect() as conn:
        drop_slot(conn, "agent_slot", force=True)
    r = run_cli(
        "consume",
        "--dsn",
        empty_db.dsn,
        "--target-dsn",
        db.dsn,
        "--create-slot",
    )
    assert_clean_exit(r, 4)
    assert "archived" in r.output
