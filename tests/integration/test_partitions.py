"""A partitioned ledger on real servers: guards and uniqueness across partitions, the consumer
across a partition boundary, and archive under load — refused while the consumer is behind,
then nothing lost, rebuild_context unchanged, manifest checksums verified."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin import partitions
from ledger_cdc.admin.archive import ArchiveRefusedError, archive, check_archive
from ledger_cdc.admin.importer import ImportedEvent, import_events
from ledger_cdc.admin.partitions import ensure, list_partitions
from ledger_cdc.admin.verify import verify
from ledger_cdc.client.recovery import (
    HistoryArchivedError,
    memoised_model,
    memoised_tool,
    rebuild_context,
)
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import ConfigError, IdempotencyConflictError, InvalidEventError
from ledger_cdc.fold import FORMAT_VERSION, encode_context
from tests.support.cdc import (
    ConsumerProcess,
    Writers,
    assert_clean_exit,
    assert_projections_equal_refold,
    run_cli,
    stored_projections,
    until,
    wait_caught_up,
)
from tests.support.cli import run_cli_process
from tests.support.harness import Database
from tests.support.schema import init_db

OLD = dt.timedelta(days=120)


def _old_event(conn: psycopg.Connection[Any], sid: uuid.UUID, i: int, when: dt.datetime) -> None:
    """An event written 'long ago', by the one path that may place created_at: the owner's
    import (writers cannot)."""
    ev = ImportedEvent(
        sid,
        "old",
        "tool.invoked",
        {"call_id": f"old-{i}", "tool": "t", "arguments": {"i": i}},
        when,
        f"old-{i}",
    )
    import_events(conn, [(1, ev)])


def test_partitioned_ledger_keeps_guards_and_per_session_uniqueness(empty_db: Database) -> None:
    res = init_db(empty_db.dsn, partition_by="month")
    assert len(res.partitions_created) == 4
    with empty_db.connect() as conn:
        assert conn.execute("SELECT pubviaroot FROM pg_publication").fetchone() == (True,)
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        ensure(conn, 0, at=now - OLD)
        old_part = list_partitions(conn)[0].name
        sid = uuid.uuid4()
        _old_event(conn, sid, 1, now - OLD)
        # the key was used by the old event (another partition): refused as a conflict
        with Ledger(empty_db.dsn) as ledger, pytest.raises(IdempotencyConflictError):
            ledger.append(
                sid, "a", "tool.invoked", {"call_id": "other", "tool": "t"}, idempotency_key="old-1"
            )
        with Ledger(empty_db.dsn) as ledger:
            r2 = ledger.append(
                sid, "a", "tool.invoked", {"call_id": "n2", "tool": "t"}, idempotency_key="k2"
            )
            assert r2.position == 2
            dup = ledger.append(
                sid, "a", "tool.invoked", {"call_id": "n2", "tool": "t"}, idempotency_key="k2"
            )
            assert dup.duplicate and dup.seq == r2.seq
        # position 2 exists in the current partition: an insert at 2 into the old one is refused
        with pytest.raises(psycopg.errors.UniqueViolation) as e, conn.transaction():
            conn.execute("SET LOCAL ledger.import_times = on")
            conn.execute(
                "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload, created_at) "
                "VALUES (%s, 2, 'a', 'x.y', '{}', %s)",
                (sid, now - OLD),
            )
        assert e.value.diag.constraint_name == "agent_events_session_position"
        for stmt in (
            "UPDATE agent_events SET agent_id = 'b'",
            "DELETE FROM agent_events",
            "TRUNCATE agent_events",
            f"TRUNCATE {old_part}",
            f"DELETE FROM {old_part}",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                conn.execute(stmt)
        rows = conn.execute(
            "SELECT position, tableoid::regclass::text FROM agent_events ORDER BY position"
        ).fetchall()
        assert rows[0] == (1, old_part) and rows[1][1] != old_part
    # the chain links across the partitions (no consumer: projections not judged)
    assert verify(empty_db.dsn, consumer_wait=-1).ok
    assert init_db(empty_db.dsn, partition_by="month").applied == []  # idempotent


@pytest.mark.parametrize(
    ("unit", "when"),
    [
        ("month", "9999-12-15T00:00:00Z"),
        ("week", "9999-12-29T00:00:00Z"),
        ("day", "9999-12-31T12:00:00Z"),
    ],
)
def test_an_event_whose_partition_would_end_after_year_9999_is_refused(
    empty_db: Database, unit: str, when: str
) -> None:
    """Its partition's upper bound is past what a timestamp can be here: refused as an invalid
    event with the reason, not an OverflowError (the importer's traceback)."""
    init_db(empty_db.dsn, partition_by=unit, slot="agent_slot")
    ev = ImportedEvent(
        uuid.uuid4(),
        "a",
        "tool.invoked",
        {"call_id": "c", "tool": "t"},
        dt.datetime.fromisoformat(when.replace("Z", "+00:00")),
    )
    with empty_db.connect() as conn, pytest.raises(InvalidEventError, match="after year 9999"):
        import_events(conn, [(1, ev)])


@pytest.mark.parametrize(
    ("printed", "read"),
    [
        ("2026-11-01 00:00:00+00", dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)),
        (
            "2026-11-01 00:00:00.5+05:30",
            dt.datetime(2026, 10, 31, 18, 30, 0, 500000, tzinfo=dt.timezone.utc),
        ),
        ("10000-01-01 00:00:00+00", dt.datetime.max.replace(tzinfo=dt.timezone.utc)),
        ("0001-12-01 00:00:00+00 BC", dt.datetime.min.replace(tzinfo=dt.timezone.utc)),
    ],
)
def test_partition_bounds_are_read_alike_on_every_python(printed: str, read: dt.datetime) -> None:
    """As PostgreSQL prints them: Python 3.10's fromisoformat reads neither ``+00`` nor a
    fraction of one digit, and no Python reads the year 10000."""
    assert partitions._bounds(f"FOR VALUES FROM ('{printed}') TO ('{printed}')") == (read, read)


def test_a_partition_ending_in_year_10000_is_listed_and_never_archived(
    empty_db: Database, tmp_path: Path
) -> None:
    """``ledger_ensure_partitions`` (open to the consumer's role) makes the partition of 9999's
    last month when asked, ending at 10000-01-01: Python cannot hold that bound, and every
    command that lists partitions failed on it (ValueError: partitions list, archive, import).
    Its bound is now the latest time Python can hold."""
    init_db(empty_db.dsn, partition_by="month", slot="agent_slot")
    with empty_db.connect() as conn:
        conn.execute("SELECT ledger_ensure_partitions(0, '9999-12-15')")
        last = list_partitions(conn)[-1]
        assert (last.name, last.start.year, last.end) == (
            "agent_events_p99991201",
            9999,
            dt.datetime.max.replace(tzinfo=dt.timezone.utc),
        )
    with empty_db.connect() as conn:
        conn.autocommit = True
        assert archive(conn, dt.timedelta(days=1), tmp_path / "a") == []
    assert_clean_exit(run_cli("partitions", "list", "--dsn", empty_db.dsn))


def test_import_names_the_line_whose_partition_would_end_after_year_9999(
    empty_db: Database, tmp_path: Path
) -> None:
    """``ledger-cdc import``: the refusal names the line and what was written (the batches
    before it), and no partition is left made for the refused batch. Before, it named neither,
    so the import could not be taken up from the right line."""
    init_db(empty_db.dsn, partition_by="month", slot="agent_slot")
    sid = uuid.uuid4()
    source = tmp_path / "events.jsonl"
    source.write_text(
        "\n".join(
            json.dumps(
                {
                    "session_id": str(sid),
                    "agent_id": "a",
                    "event_type": "tool.invoked",
                    "payload": {"call_id": f"c{n}", "tool": "t"},
                    "created_at": when,
                }
            )
            for n, when in enumerate(
                ["2026-06-01T00:00:00Z", "2026-07-01T00:00:00Z", "9999-12-15T00:00:00Z"], 1
            )
        )
    )
    r = run_cli("import", str(source), "--batch", "2", "--dsn", empty_db.dsn)
    assert_clean_exit(r, 5)
    assert "line 3 (created_at 9999-12-15" in r.output, r.output
    assert "after year 9999; nothing from line 3 on was written" in r.output, r.output
    with empty_db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM agent_events").fetchone() == (2,)
        assert "agent_events_p99991201" not in {p.name for p in list_partitions(conn)}


def test_partition_by_on_an_unpartitioned_ledger_is_refused(db: Database) -> None:
    with pytest.raises(ConfigError, match="not partitioned"):
        init_db(db.dsn, partition_by="week")


def test_archive_under_load_loses_nothing(empty_db: Database, tmp_path: Path) -> None:
    dsn = empty_db.dsn
    init_db(dsn, partition_by="month", slot="agent_slot")
    sessions = [uuid.uuid4() for _ in range(6)]
    with empty_db.connect() as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        ensure(conn, 0, at=now - OLD)
        for n, sid in enumerate(sessions):
            for i in range(1, 6):
                _old_event(conn, sid, n * 10 + i, now - OLD + dt.timedelta(minutes=i))
    with Ledger(dsn) as ledger:  # the same sessions go on in the current partition
        for sid in sessions:
            ledger.append(sid, "a", "tool.observed", {"call_id": "old-1", "result": 1})
    consumer = ConsumerProcess(dsn, "--snapshot-every", "1").start()
    try:
        wait_caught_up(dsn)
        assert assert_projections_equal_refold(dsn) == 36  # streamed across the boundary
        # the consumer is down and an old event arrives late: archive must refuse
        consumer.kill()
        with empty_db.connect() as conn:
            _old_event(conn, sessions[0], 99, now - OLD + dt.timedelta(minutes=30))
            with pytest.raises(ArchiveRefusedError, match="not folded"):
                archive(conn, dt.timedelta(days=90), tmp_path / "refused")
            out = run_cli_process(
                *("partitions", "archive", "--dsn", dsn, "--older-than", "90d"),
                *("--to", str(tmp_path / "refused")),
            )
            assert out.returncode == 5 and "archive refused" in out.stderr
            assert len(list_partitions(conn)) == 5  # nothing dropped
        consumer = ConsumerProcess(dsn, "--snapshot-every", "1").start()
        wait_caught_up(dsn)
        with empty_db.connect() as conn:
            (head,) = conn.execute("SELECT max(seq) FROM agent_events").fetchone()  # type: ignore[misc]
            before = {
                sid: encode_context(rebuild_context(conn, sid, memo=True)) for sid in sessions
            }
        writers = Writers(dsn, n=2, pace=0.005)
        writers.sessions = sessions + [uuid.uuid4() for _ in range(4)]
        writers.start()
        try:
            until(lambda: writers.turns > 10)
            with empty_db.connect() as conn:
                done = archive(conn, dt.timedelta(days=90), tmp_path / "archive")
            until(lambda: writers.turns > 40)
        finally:
            writers.stop()
        assert [a.events for a in done] == [31] and done[0].sessions == 6
        wait_caught_up(dsn)
        with empty_db.connect() as conn:
            assert len(list_partitions(conn)) == 4  # the old partition is gone
            # rebuild as of before the archive: unchanged, from the snapshots
            for sid in sessions:
                assert encode_context(rebuild_context(conn, sid, head, memo=True)) == before[sid]
            # the current state rebuilt from snapshot + tail equals the consumer's projections
            for sid, ctx in stored_projections(conn).items():
                assert rebuild_context(conn, sid, memo=True) == ctx, sid
            # history before the archived bound cannot be rebuilt without a snapshot covering it
            conn.execute(
                "DELETE FROM agent_snapshots WHERE session_id = %s AND upto_position <= 5",
                (sessions[1],),
            )
            (third,) = conn.execute(  # type: ignore[misc]
                "SELECT (manifest->'sessions'->%s->>'last_seq')::int8 FROM ledger_archives",
                (str(sessions[1]),),
            ).fetchone()
            with pytest.raises(HistoryArchivedError, match="archived"):
                rebuild_context(conn, sessions[1], upto_seq=third)
            assert check_archive(conn, tmp_path / "archive") == []
        report = verify(dsn, archive_dir=tmp_path / "archive")
        assert report.ok, report.differences
        assert any("archived" in n for n in report.notes)
        # the manifest checksum catches a damaged export
        data = tmp_path / "archive" / f"{done[0].name}.csv.gz"
        data.write_bytes(data.read_bytes()[:-8] + b"\0" * 8)
        with empty_db.connect() as conn:
            assert any("sha256" in p for p in check_archive(conn, tmp_path / "archive"))
        assert not verify(dsn, archive_dir=tmp_path / "archive").ok
        # a manifest cut short (or edited) is a problem reported, not a JSONDecodeError
        manifest = tmp_path / "archive" / f"{done[0].name}.manifest.json"
        manifest.write_text(manifest.read_text()[:20])
        with empty_db.connect() as conn:
            assert any("is not a manifest" in p for p in check_archive(conn, tmp_path / "archive"))
        assert not verify(dsn, archive_dir=tmp_path / "archive").ok
    finally:
        if consumer.alive():
            consumer.kill()


def test_archive_replaces_a_snapshot_of_the_old_format_and_stops_at_the_consumer(
    empty_db: Database, tmp_path: Path
) -> None:
    """A session whose snapshot at its last event predates the memo table (format 1): archive
    takes a current one at the same seq instead of silently keeping the unusable row; and the
    snapshot it takes is at the consumer's position, not past it (its memo must be in
    agent_memo already)."""
    dsn = empty_db.dsn
    init_db(dsn, partition_by="month", slot="agent_slot")
    sid, ahead = uuid.uuid4(), uuid.uuid4()
    with empty_db.connect() as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        ensure(conn, 0, at=now - OLD)
        for s in (sid, ahead):
            for i in range(1, 4):
                _old_event(conn, s, i, now - OLD + dt.timedelta(minutes=i))
    consumer = ConsumerProcess(dsn, "--snapshot-every", "3").start()
    try:
        wait_caught_up(dsn)
    finally:
        consumer.kill()
    with empty_db.connect() as conn:
        # as written before the upgrade: format 1
        conn.execute("UPDATE agent_snapshots SET format_version = 1 WHERE session_id = %s", (sid,))
        # the other session goes on past the consumer (down): the archive snapshots at position 3
        with Ledger(dsn) as ledger:
            ledger.append(ahead, "a", "tool.observed", {"call_id": "old-1", "result": "late"})
        conn.execute("DELETE FROM agent_snapshots WHERE session_id = %s", (ahead,))
        (done,) = archive(conn, dt.timedelta(days=90), tmp_path / "archive")
        assert done.snapshots_taken == 2
        rows = conn.execute(
            "SELECT session_id, format_version, upto_position FROM agent_snapshots "
            "ORDER BY session_id",
        ).fetchall()
        assert sorted(rows) == sorted([(sid, FORMAT_VERSION, 3), (ahead, FORMAT_VERSION, 3)])
        ctx = rebuild_context(conn, sid)  # from the replaced snapshot: the history is gone
        assert ctx.last_position == 3 and ctx.memo_position == 3
        late = rebuild_context(conn, ahead)  # snapshot at 3, then the tail from the log
        assert late.memo_position == 3 and late.completed_tools["old-1"].result == "late"


def test_archive_keeps_what_stored_contexts_and_memo_rows_reference(
    empty_db: Database, tmp_path: Path
) -> None:
    """Projections, snapshots and memo rows leave windows, long messages and call results in
    their events: once those events' partition is archived, agent_kept_events holds them, and
    every reader (the SQL view, rebuild, memo lookups, verify, a restarted consumer) still gets
    whole contexts — the same as before the archive."""
    dsn = empty_db.dsn
    init_db(dsn, partition_by="month", slot="agent_slot")
    kept, moved_on = uuid.uuid4(), uuid.uuid4()
    long_window = [
        {"role": "system", "content": "window " * 200},
        {"role": "user", "content": "summarise the quarter"},
    ]
    with empty_db.connect() as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        ensure(conn, 0, at=now - OLD)
        for sid in (kept, moved_on):
            history = [
                ("context.loaded", {"messages": long_window}),
                ("model.requested", {"request_id": "r1", "model": "m"}),
                ("model.responded", {"request_id": "r1", "model": "m", "content": "reply " * 90}),
                ("tool.invoked", {"call_id": "c1", "tool": "sql"}),
                ("tool.observed", {"call_id": "c1", "result": "row;" * 300}),
            ]
            import_events(
                conn,
                [
                    (i, ImportedEvent(sid, "old", t, p, now - OLD + dt.timedelta(minutes=i), None))
                    for i, (t, p) in enumerate(history, 1)
                ],
            )
    with Ledger(dsn) as ledger:  # one session goes on under its old window, one loads another
        ledger.append(kept, "a", "tool.invoked", {"call_id": "c2", "tool": "sql"})
        ledger.append(moved_on, "a", "context.loaded", {"messages": long_window[:1]})
    consumer = ConsumerProcess(dsn, "--snapshot-every", "1000").start()
    try:
        wait_caught_up(dsn)
        with empty_db.connect() as conn:
            stored = dict(conn.execute("SELECT session_id, context FROM agent_sessions").fetchall())
            # the projection copies neither the window nor the long reply and result
            assert stored[kept]["window"]["omitted"] is True
            assert [m["content"] for m in stored[kept]["messages"]] == ["", ""]
            assert all(len(s) == 4 for s in stored[kept]["sources"])
            entries = [e for (e,) in conn.execute("SELECT entry FROM agent_memo")]
            assert entries and not any("result" in e or "content" in e for e in entries)
            before = stored_projections(conn)
            rebuilt = {s: rebuild_context(conn, s, memo=True) for s in (kept, moved_on)}
            assert assert_projections_equal_refold(dsn) == 12
            (done,) = archive(conn, dt.timedelta(days=90), tmp_path / "archive")
            assert done.events == 10
            kept_rows = conn.execute(
                "SELECT session_id, position, event_type FROM agent_kept_events "
                "ORDER BY session_id, position"
            ).fetchall()
            want = {(kept, 1, "context.loaded")} | {
                (s, p, t)
                for s in (kept, moved_on)
                for p, t in ((3, "model.responded"), (5, "tool.observed"))
            }
            assert set(kept_rows) == want  # moved_on's old window is referenced by nothing
            assert stored_projections(conn) == before
            for sid in (kept, moved_on):
                assert rebuild_context(conn, sid, memo=True) == rebuilt[sid]
            lazy = rebuild_context(conn, kept)  # from the archive's snapshot
            assert memoised_tool(conn, lazy, "c1").result == "row;" * 300  # type: ignore[union-attr]
            assert memoised_model(conn, lazy, "r1").content == "reply " * 90  # type: ignore[union-attr]
            (whole,) = conn.execute(
                "SELECT context FROM agent_session_contexts WHERE session_id = %s", (kept,)
            ).fetchone()  # type: ignore[misc]
            assert whole["messages"][:2] == long_window and whole["completed_tools"]["c1"]
            assert not verify(dsn).differences
        # a consumer that starts cold reads the projection back (its window from the archive's
        # keep) and folds on
        consumer.kill()
        with Ledger(dsn) as ledger:
            ledger.append(kept, "a", "tool.observed", {"call_id": "c2", "result": "new " * 80})
        consumer = ConsumerProcess(dsn, "--snapshot-every", "1000").start()
        wait_caught_up(dsn)
        with empty_db.connect() as conn:
            ctx = stored_projections(conn)[kept]
            assert [m.content for m in ctx.messages] == [
                *(m["content"] for m in long_window),
                "reply " * 90,
                "row;" * 300,
                "new " * 80,
            ]
            assert not verify(dsn).differences
    finally:
        consumer.kill()


def test_partitions_for_a_time_out_of_range_are_refused_not_made_wrong(empty_db: Database) -> None:
    """ledger_ensure_partitions (open to the consumer's role) takes a time: infinity, a year BC
    or past 9999 is refused in one line (SQLSTATE 22008). A year BC made the partition named
    for the same day AD, which was then never made."""
    init_db(empty_db.dsn, partition_by="month")
    with psycopg.connect(empty_db.dsn, autocommit=True) as conn:
        for at, ahead in [
            ("infinity", 0),
            ("-infinity", 0),
            ("0001-01-15 00:00+00 BC", 0),
            ("294000-01-01 00:00+00", 0),
            ("9999-12-15 00:00+00", 1),  # its partition ends in 10000, the next one after
        ]:
            with pytest.raises(psycopg.errors.DatetimeFieldOverflow, match="years 1 to 9999"):
                conn.execute("SELECT ledger_ensure_partitions(%s, %s::timestamptz)", (ahead, at))
        made = conn.execute(
            "SELECT ledger_ensure_partitions(0, '0001-01-15 00:00+00'::timestamptz)"
        ).fetchall()
        assert made == [("agent_events_p00010101",)]
        assert conn.execute(
            "SELECT ledger_ensure_partitions(0, '9999-12-15 00:00+00'::timestamptz)"
        ).fetchall() == [("agent_events_p99991201",)]
        starts = {p.name: p.start for p in partitions.list_partitions(conn)}
        assert starts["agent_events_p00010101"] == dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc)
        with pytest.raises(ConfigError, match="years 1 to 9999"):
            ensure(conn, 1, at=dt.datetime(9999, 12, 2, tzinfo=dt.timezone.utc))
        # the consumer's role may ensure partitions, not make them past the check
        (checked, unchecked) = conn.execute(
            "SELECT has_function_privilege('ledger_consumer', "
            "'ledger_ensure_partitions(integer, timestamptz)', 'EXECUTE'), "
            "has_function_privilege('ledger_consumer', "
            "'ledger_make_partitions(integer, timestamptz)', 'EXECUTE')"
        ).fetchone()  # type: ignore[misc]
        assert (checked, unchecked) == (True, False)
