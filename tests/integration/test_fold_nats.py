"""The scale-out path: one `consume --publish-only` reads the slot and publishes to JetStream,
`fold --from nats://… --partition K/N` workers build the projections. Real processes (a
nats-server, the relay, the workers), SIGKILLed mid-stream."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import psycopg
import pytest

from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer.fold_nats import FoldConfig, FoldWorker
from ledger_cdc.lsn import parse_lsn
from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings
from tests.support.cdc import (
    ConsumerProcess,
    Writers,
    assert_projections_equal_refold,
    assert_verify_exact,
    published_columns,
    until,
    wait_caught_up,
    write_rows_without_a_session,
)
from tests.support.cli import run_cli_process
from tests.support.harness import Database
from tests.support.natsserver import NatsServer, jetstream_server, publish, wait_jetstream


def fold_process(dsn: str, url: str, partition: str, log: Path) -> ConsumerProcess:
    """``ledger-cdc fold`` as a child process; many small fetches, so that kills land between
    and inside them."""
    args = ("--from", url, "--partition", partition, "--fetch", "50")
    return ConsumerProcess(dsn, *args, log=log, command="fold").start()


def _checkpoints(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            name: parse_lsn(lsn)
            for name, lsn in conn.execute("SELECT slot_name, lsn::text FROM ledger_checkpoints")
        }


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_fold_workers_build_the_full_fold_exactly_once_through_kills(
    db: Database, tmp_path: Path
) -> None:
    srv = NatsServer(tmp_path / "js")
    relay = None
    workers: list[ConsumerProcess] = []
    try:
        wait_jetstream([srv.url])
        args = ("--create-slot", "--publish-only", "--sink", srv.url, "--max-delay-ms", "5")
        relay = ConsumerProcess(db.dsn, *args, log=tmp_path / "relay.log").start()
        writers = Writers(db.dsn, n=3, sessions=24, pace=0.003).start()
        try:
            until(lambda: writers.turns > 20, timeout=60)
            # the relay moves its slot's checkpoint and writes no projection
            until(lambda: _checkpoints(db.dsn).get("agent_slot", 0) > 0, timeout=60)
            with db.connect() as conn:
                assert conn.execute("SELECT count(*) FROM agent_sessions").fetchone() == (0,)
            workers = [
                fold_process(db.dsn, srv.url, f"{k}/2", tmp_path / f"fold{k}.log") for k in range(2)
            ]
            for round_ in range(3):  # SIGKILL a worker mid-stream, then the relay once
                time.sleep(1.0)
                k = round_ % 2
                workers[k].kill()
                workers[k] = fold_process(db.dsn, srv.url, f"{k}/2", tmp_path / f"fold{k}.log")
            relay.kill()
            relay = ConsumerProcess(db.dsn, *args, log=tmp_path / "relay.log").start()
            # a row past the writer's validation (what SQL writers can do): relayed as rejected,
            # quarantined by its partition's worker as the consumer would
            bad = uuid.uuid4()
            with db.connect() as conn:
                conn.execute(
                    "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                    "VALUES (%s, 'raw', 'tool.invoked', '{\"call_id\": 5}'::jsonb)",
                    (bad,),
                )
            time.sleep(1.0)
        finally:
            writers.stop()
        assert not writers.errors
        wait_caught_up(db.dsn, timeout=120)
        events = assert_projections_equal_refold(db.dsn)  # projections, snapshots, memo
        assert events > 100
        assert_verify_exact(db.dsn)  # verify --all passes, and fails on a real edit
        with db.connect() as conn:
            counted = conn.execute("SELECT sum(event_count) FROM agent_sessions").fetchone()
            stored = conn.execute("SELECT count(*) FROM agent_events").fetchone()
            assert counted is not None and stored is not None
            assert counted[0] + 1 == stored[0]  # each event folded once; the bad row quarantined
        with db.connect() as conn:
            dead = conn.execute(
                "SELECT kind FROM ledger_dead_letters WHERE session_id = %s", (bad,)
            ).fetchall()
            assert dead == [("quarantined",)]
        names = set(_checkpoints(db.dsn))
        assert names == {"agent_slot", "nats:LEDGER:0/2", "nats:LEDGER:1/2"}
        for w in workers:
            assert w.terminate() == 0
        log = (tmp_path / "fold0.log").read_text()
        assert "events folded" in log
    finally:
        for w in workers:
            if w.alive():
                w.kill()
        if relay is not None:
            relay.kill()
        srv.kill()


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_relay_and_fold_worker_go_on_after_the_nats_server_is_killed_and_restarted(
    db: Database, tmp_path: Path
) -> None:
    """The NATS server SIGKILLed under load and started again on its store: the relay
    republishes what was not acknowledged, the worker reconnects and reads on from its
    checkpoint; the projections end equal to a fold of the table, each event once."""
    srv = NatsServer(tmp_path / "js")
    procs: list[ConsumerProcess] = []
    try:
        wait_jetstream([srv.url])
        args = ("--create-slot", "--publish-only", "--sink", srv.url, "--max-delay-ms", "5")
        procs.append(ConsumerProcess(db.dsn, *args, log=tmp_path / "relay.log").start())
        procs.append(fold_process(db.dsn, srv.url, "0/1", tmp_path / "fold.log"))
        writers = Writers(db.dsn, n=3, sessions=16, pace=0.003).start()
        try:
            until(lambda: _checkpoints(db.dsn).get("nats:LEDGER:0/1", 0) > 0, timeout=60)
            srv.restart()
            wait_jetstream([srv.url])
            turns = writers.turns
            until(lambda: writers.turns > turns + 30, timeout=60)
        finally:
            writers.stop()
        assert not writers.errors
        wait_caught_up(db.dsn, timeout=180)
        assert_projections_equal_refold(db.dsn)
        assert_verify_exact(db.dsn)
        with db.connect() as conn:
            counted = conn.execute("SELECT sum(event_count) FROM agent_sessions").fetchone()
            stored = conn.execute("SELECT count(*) FROM agent_events").fetchone()
        assert counted is not None and stored is not None and counted[0] == stored[0]
        assert all(p.alive() for p in procs)
    finally:
        for p in procs:
            if p.alive():
                p.kill()
        srv.kill()


def _fold_until(worker: FoldWorker, done: Callable[[], bool], timeout: float = 30) -> None:
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    try:
        until(done, timeout=timeout)
    finally:
        worker.stop()
        t.join(30)
    assert not t.is_alive()


def _event_count(dsn: str, sid: uuid.UUID) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (context->>'event_count')::int FROM agent_sessions WHERE session_id = %s",
            (sid,),
        ).fetchone()
    return 0 if row is None else int(row[0])


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_messages_that_no_ledger_row_could_be_are_skipped_not_retried(
    db: Database, tmp_path: Path
) -> None:
    """Anyone allowed to publish on the subjects can put anything there. A message without
    headers is read like any other; one with a commit LSN out of range, or with a NUL (which
    PostgreSQL's text and jsonb cannot hold) anywhere is no event: skipped with a warning. Each
    used to stop the worker in a loop that retried it for ever; the events after them must be
    folded."""
    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        sid = uuid.uuid4()
        with Ledger(db.dsn) as ledger:
            for i in range(3):
                ledger.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
        with db.connect() as conn:
            events = [
                row_event(r)
                for r in conn.execute(f"SELECT {COLUMNS} FROM agent_events ORDER BY position")
            ]
        pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
        pub.connect()
        pub.publish([(events[0], 0x1000)], [])
        other = uuid.UUID(int=(uuid.uuid4().int & ~0xFF) | sid.bytes[15])  # same partition
        good = {
            "seq": 999999,
            "session_id": str(other),
            "position": 1,
            "agent_id": "x",
            "event_type": "tool.invoked",
            "payload": {"call_id": "q", "tool": "t"},
            "created_at": "2025-01-01T00:00:00Z",
            "commit_lsn": "0/1800",
        }
        forged = [
            ({}, None),  # no headers at all
            ({"commit_lsn": "FFFFFFFFFF/0"}, {"X": "1"}),
            ({"commit_lsn": "-1/0"}, {"X": "1"}),
            ({"agent_id": "a\x00b"}, {"X": "1"}),
            ({"event_type": "tool.invoked\x00"}, {"X": "1"}),
            ({"idempotency_key": "k\x00"}, {"X": "1"}),
            ({"payload": {"call_id": "q\x00", "tool": "t"}}, {"X": "1"}),
        ]
        # nested past what the decoder takes (RecursionError, not a DecodeError): it stopped
        # the worker for good, every restart reading it again; and one nested past what an
        # event could be (DOC_MAX_DEPTH) but not past 3.11's decoder: skipped on every Python
        # alike (3.13's decoder goes to 10,000 levels)
        deep = [
            msgspec.json.encode({**good, "payload": None}).replace(
                b'"payload":null', b'"payload":' + b"[" * depth + b"]" * depth
            )
            for depth in (5000, 600)
        ]
        publish(
            srv.url,
            [(f"ledger.events.{other}", msgspec.json.encode({**good, **c}), h) for c, h in forged]
            + [(f"ledger.events.{other}", d, {"X": "1"}) for d in deep],
        )
        pub.publish([(events[1], 0x2000), (events[2], 0x3000)], [])
        pub.close()
        log = tmp_path / "fold.log"
        handler = logging.FileHandler(log)
        logging.getLogger("ledger_cdc.consumer.fold_nats").addHandler(handler)
        try:
            worker = FoldWorker(FoldConfig(url=srv.url, dsn=db.dsn, reconnect_cap=0.5))
            _fold_until(worker, lambda: _event_count(db.dsn, sid) == 3)
        finally:
            logging.getLogger("ledger_cdc.consumer.fold_nats").removeHandler(handler)
        text = log.read_text()
        assert "reconnecting" not in text, text
        # (- 1 + the two deep)
        assert text.count("is not an event, skipped") == len(forged) + 1, text
        assert _event_count(db.dsn, other) == 1  # the one without headers is well formed
    finally:
        srv.kill()


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_a_payload_left_out_of_the_stream_is_read_from_the_ledger_not_the_target(
    db: Database, second_db: Database, tmp_path: Path
) -> None:
    """`fold --target-dsn`: projections go elsewhere, but a payload too big for the stream is
    read back from the ledger's database (it was read from the target, where it is not, and the
    event quarantined)."""
    srv = NatsServer(tmp_path / "js", config="max_payload: 8192\n")
    try:
        wait_jetstream([srv.url])
        sid = uuid.uuid4()
        with Ledger(db.dsn) as ledger:
            ledger.append(sid, "a", "tool.invoked", {"call_id": "c0", "tool": "t"})
            ledger.append(
                sid, "a", "context.loaded", {"messages": [{"role": "user", "content": "x" * 20000}]}
            )
            ledger.append(sid, "a", "tool.invoked", {"call_id": "c1", "tool": "t"})
        with db.connect() as conn:
            rows = conn.execute(f"SELECT {COLUMNS} FROM agent_events ORDER BY position")
            events = [row_event(r) for r in rows]
        pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
        pub.connect()
        pub.publish([(e, 0x1000 * (i + 1)) for i, e in enumerate(events)], [])
        pub.close()
        config = FoldConfig(url=srv.url, dsn=db.dsn, target_dsn=second_db.dsn, reconnect_cap=0.5)
        _fold_until(FoldWorker(config), lambda: _event_count(second_db.dsn, sid) == 3)
        with second_db.connect() as conn:
            assert conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone() == (0,)
            ctx = conn.execute(
                "SELECT context FROM agent_sessions WHERE session_id = %s", (sid,)
            ).fetchone()
        assert ctx is not None and "x" * 20000 in json.dumps(ctx[0])
    finally:
        srv.kill()


def test_fold_refuses_a_bad_partition_in_one_line(tmp_path: Path) -> None:
    out = run_cli_process(
        *("fold", "--dsn", "postgresql://127.0.0.1:1/none"),
        *("--from", "nats://127.0.0.1:1", "--partition", "4/4"),
    )
    assert out.returncode != 0
    assert "0 <= K < N" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


@pytest.fixture
def srv18(db: Database, tmp_path: Path) -> Iterator[NatsServer]:
    """A JetStream server, for a test of the stream's path (the same on every PostgreSQL: run
    on 18 only)."""
    with jetstream_server(tmp_path / "js") as srv:
        yield srv


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_rows_of_no_session_reach_the_fold_workers_dead_letters_each(
    db: Database, srv18: NatsServer
) -> None:
    """Rows without a session (NOT NULL dropped by hand) share the nil session and a position:
    published as such, all but the first were skipped as already in the stream (and shared a
    message id), so the fold workers dead-lettered one of them. Each is a message of its own,
    by seq, and a dead letter."""
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger, db.connect() as conn:
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c0", "tool": "t"})
        write_rows_without_a_session(conn, 3)
        conn.commit()
        ledger.append(sid, "a", "tool.observed", {"call_id": "c0", "result": 1})
        rows = conn.execute(f"SELECT {COLUMNS} FROM agent_events ORDER BY seq")
        events = [row_event(r) for r in rows]
    assert sum(1 for e in events if getattr(e, "unplaced", False)) == 3
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv18.url), "agent_slot")
    pub.connect()
    pub.publish([(e, 0x1000 * (i + 1)) for i, e in enumerate(events)], [])
    pub.publish([(e, 0x1000 * (i + 1)) for i, e in enumerate(events)], [])  # a replay
    pub.close()
    config = FoldConfig(url=srv18.url, dsn=db.dsn, reconnect_cap=0.5)

    def dead() -> list[tuple[object, ...]]:
        with db.connect() as conn:
            return conn.execute(
                "SELECT session_id, kind FROM ledger_dead_letters ORDER BY seq"
            ).fetchall()

    _fold_until(FoldWorker(config), lambda: _event_count(db.dsn, sid) == 2 and len(dead()) >= 3)
    assert dead() == [(None, "quarantined")] * 3
    with db.connect() as conn:
        sessions = [r[0] for r in conn.execute("SELECT session_id FROM agent_sessions")]
    assert sessions == [sid]


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_positions_the_stream_lacks_are_read_from_the_ledger_by_a_fold_worker(
    db: Database, srv18: NatsServer
) -> None:
    """The relay never had positions 2 and 3 (inserts left out of the publication for a
    while): the fold worker reads them from the ledger table and folds them before position
    4, as the consumer does, instead of a gap dead letter and a projection short of them."""
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger, db.connect() as conn:
        for i in range(4):
            ledger.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
        rows = conn.execute(f"SELECT {COLUMNS} FROM agent_events ORDER BY seq")
        events = [row_event(r) for r in rows]
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv18.url), "agent_slot")
    pub.connect()
    pub.publish([(e, 0x1000 * (i + 1)) for i, e in enumerate(events) if i in (0, 3)], [])
    pub.close()
    worker = FoldWorker(FoldConfig(url=srv18.url, dsn=db.dsn, reconnect_cap=0.5))
    _fold_until(worker, lambda: _event_count(db.dsn, sid) == 4)
    with db.connect() as conn:
        dead = conn.execute("SELECT kind FROM ledger_dead_letters").fetchall()
    assert dead == [], dead
    assert_projections_equal_refold(db.dsn)


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_a_row_the_relay_streamed_without_its_payload_is_published_whole(
    db: Database, srv18: NatsServer, tmp_path: Path
) -> None:
    """The publication's column list narrowed by hand for a while: the relay reads each row
    the stream sent without its payload whole from the ledger table and publishes it so; the
    fold worker folds every event (such rows used to reach it as dead letters)."""
    sid = uuid.uuid4()
    args = ("--create-slot", "--publish-only", "--sink", srv18.url, "--max-delay-ms", "5")
    with ConsumerProcess(db.dsn, *args, log=tmp_path / "relay.log"), Ledger(db.dsn) as ledger:
        with db.connect() as conn:
            until(
                lambda: (
                    conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (1,)
                ),
                60,
            )
            cols = published_columns(conn)
            narrow = ", ".join(c for c in cols if c != "payload")
            ledger.append(sid, "a", "tool.invoked", {"call_id": "1", "tool": "t"})
            conn.execute(f"ALTER PUBLICATION agent_pub SET TABLE agent_events ({narrow})")
            conn.commit()
            ledger.append(sid, "a", "tool.invoked", {"call_id": "2", "tool": "t"})
            conn.execute(f"ALTER PUBLICATION agent_pub SET TABLE agent_events ({', '.join(cols)})")
            conn.commit()
            ledger.append(sid, "a", "tool.invoked", {"call_id": "3", "tool": "t"})
        worker = FoldWorker(FoldConfig(url=srv18.url, dsn=db.dsn, reconnect_cap=0.5))
        _fold_until(worker, lambda: _event_count(db.dsn, sid) == 3, timeout=60)
    with db.connect() as conn:
        dead = conn.execute("SELECT kind FROM ledger_dead_letters").fetchall()
    assert dead == [], dead
    assert_projections_equal_refold(db.dsn)
