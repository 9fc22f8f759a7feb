"""The writer API against a real server: positions, concurrency, idempotency, bad input."""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from typing import Any

import msgspec
import psycopg
import pytest

from ledger_cdc import (
    AsyncLedger,
    ConcurrentAppendError,
    ConfigError,
    IdempotencyConflictError,
    InvalidEventError,
    Ledger,
    OutboxItem,
    ToolInvoked,
    UnknownEventTypeError,
    append,
    register_event_type,
)
from ledger_cdc.errors import RetryableError
from tests.support.harness import Database

pytestmark = pytest.mark.server


def _count(db: Database, table: str = "agent_events") -> int:
    with db.connect() as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


def test_positions_are_gapless_per_session(db: Database) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        got = [ledger.append(s, "x", "task.completed", {}).position for s in (a, b, a, a, b)]
        assert got == [1, 1, 2, 3, 2]
        assert ledger.head(a) == 3 and ledger.head(b) == 2 and ledger.head(uuid.uuid4()) == 0


def test_sixteen_writers_with_expected_position_make_a_linear_history(db: Database) -> None:
    sid = uuid.uuid4()
    per_writer = 12
    conflicts: list[ConcurrentAppendError] = []
    wins: list[tuple[int, int]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(16)

    def writer(w: int) -> None:
        with Ledger(db.dsn) as ledger:
            barrier.wait()
            done = 0
            while done < per_writer:
                head = ledger.head(sid)
                try:
                    r = ledger.append(
                        sid,
                        f"w{w}",
                        "task.completed",
                        {"result": [w, done]},
                        expected_position=head,
                    )
                except ConcurrentAppendError as e:
                    with lock:
                        conflicts.append(e)
                    continue
                with lock:
                    wins.append((r.position, head))
                done += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    total = 16 * per_writer
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT position, payload, prev_hash, hash FROM agent_events WHERE session_id = %s "
            "ORDER BY position",
            (sid,),
        ).fetchall()
    assert [r[0] for r in rows] == list(range(1, total + 1))  # no gap, no duplicate
    assert len({tuple(r[1]["result"]) for r in rows}) == total  # every write landed exactly once
    for prev, cur in itertools.pairwise(rows):
        assert cur[2] == prev[3]
    assert all(pos == head + 1 for pos, head in wins)
    assert conflicts, "16 racing writers must produce conflicts"
    for e in conflicts:
        assert e.session_id == sid and e.actual > e.expected


def test_stale_expected_position_raises_and_writes_nothing(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        ledger.append(sid, "a", "task.completed", {})
        ledger.append(sid, "a", "task.completed", {})
        with pytest.raises(ConcurrentAppendError) as info:
            ledger.append(
                sid, "a", "task.completed", {}, expected_position=1, outbox=[OutboxItem("t", {})]
            )
        assert (info.value.expected, info.value.actual) == (1, 2)
        assert "expected position 1" in str(info.value)
    assert _count(db) == 2 and _count(db, "agent_outbox") == 0


def test_writers_without_expected_position_all_land(db: Database) -> None:
    sid = uuid.uuid4()

    def writer(w: int) -> None:
        with Ledger(db.dsn) as ledger:
            for i in range(10):
                ledger.append(sid, f"w{w}", "task.completed", {"result": [w, i]})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    with db.connect() as conn:
        pos = [
            r[0]
            for r in conn.execute(
                "SELECT position FROM agent_events WHERE session_id = %s ORDER BY position", (sid,)
            )
        ]
    assert pos == list(range(1, 81))


def test_idempotent_retry_returns_the_original(db: Database) -> None:
    sid = uuid.uuid4()
    payload = ToolInvoked("c1", "search", {"q": "x"}, idempotency_key="k1")
    with Ledger(db.dsn) as ledger:
        first = ledger.append(
            sid,
            "a",
            "tool.invoked",
            payload,
            idempotency_key="k1",
            outbox=[OutboxItem("tool:search", {"q": "x"})],
        )
        ledger.append(sid, "a", "task.completed", {})
        again = ledger.append(
            sid,
            "a",
            "tool.invoked",
            payload,
            idempotency_key="k1",
            outbox=[OutboxItem("tool:search", {"q": "x"})],
        )
        assert again.duplicate and not first.duplicate
        assert (again.seq, again.position) == (first.seq, first.position)
        # a retry with an expected position that is stale by now is still the original
        late = ledger.append(
            sid, "a", "tool.invoked", payload, idempotency_key="k1", expected_position=0
        )
        assert late.seq == first.seq
        with pytest.raises(IdempotencyConflictError, match="k1"):
            ledger.append(
                sid, "a", "tool.invoked", ToolInvoked("c2", "search"), idempotency_key="k1"
            )
        # the same key in another session is another event
        other = ledger.append(uuid.uuid4(), "a", "tool.invoked", payload, idempotency_key="k1")
        assert not other.duplicate
    assert _count(db) == 3 and _count(db, "agent_outbox") == 1


def test_concurrent_idempotent_retries_write_one_row(db: Database) -> None:
    sid = uuid.uuid4()
    seqs: list[int] = []
    barrier = threading.Barrier(8)

    def retry() -> None:
        with Ledger(db.dsn) as ledger:
            barrier.wait()
            seqs.append(
                ledger.append(sid, "a", "task.completed", {"result": 1}, idempotency_key="same").seq
            )

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seqs) == 8 and len(set(seqs)) == 1
    assert _count(db) == 1


def test_transaction_commits_events_and_outbox_together(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        with pytest.raises(RuntimeError), ledger.transaction() as tx:
            tx.append(sid, "a", "task.completed", {}, outbox=[OutboxItem("http://x", {"a": 1})])
            raise RuntimeError("crash before commit")
        assert _count(db) == 0 and _count(db, "agent_outbox") == 0
        with ledger.transaction() as tx:
            r1 = tx.append(sid, "a", "model.requested", {"request_id": "r", "model": "m"})
            r2 = tx.append(
                sid,
                "a",
                "tool.invoked",
                {"call_id": "c", "tool": "t"},
                outbox=[OutboxItem("http://x", {"a": 1}, "key-1")],
            )
        assert (r1.position, r2.position) == (1, 2) and len(r2.outbox_ids) == 1
    with db.connect() as conn:
        row = conn.execute(
            "SELECT event_seq, target, idempotency_key, dispatched FROM agent_outbox"
        ).fetchone()
    assert row == (r2.seq, "http://x", "key-1", False)


def test_append_joins_the_callers_transaction(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        conn.execute("CREATE TABLE side_effects (note text)")
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO side_effects VALUES ('x')")
            append(conn, sid, "a", "task.completed", {})
            raise RuntimeError("rolled back together")
        assert conn.execute("SELECT count(*) FROM side_effects").fetchone() == (0,)
        with conn.transaction():
            conn.execute("INSERT INTO side_effects VALUES ('y')")
            append(conn, sid, "a", "task.completed", {})
        assert conn.execute("SELECT count(*) FROM side_effects").fetchone() == (1,)
    assert _count(db) == 1


def test_a_conflict_inside_a_callers_transaction_does_not_abort_it(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        append(conn, sid, "a", "task.completed", {})
        with conn.transaction():
            with pytest.raises(ConcurrentAppendError):
                append(conn, sid, "a", "task.completed", {}, expected_position=0)
            append(conn, sid, "a", "task.completed", {}, expected_position=1)
    assert _count(db) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"session_id": "not-a-uuid"}, InvalidEventError, "session_id must be a UUID"),
        ({"session_id": 42}, InvalidEventError, "session_id must be a UUID"),
        ({"agent_id": ""}, InvalidEventError, "agent_id"),
        (
            {"event_type": "no.such.type"},
            UnknownEventTypeError,
            "unknown event type 'no.such.type'",
        ),
        ({"payload": {"call_id": 5, "tool": "t"}}, InvalidEventError, "does not match ToolInvoked"),
        ({"payload": {"tool": "t"}}, InvalidEventError, "call_id"),
        (
            {"payload": {"call_id": "c", "tool": "t", "arguments": {"f": object()}}},
            InvalidEventError,
            "not JSON-serialisable",
        ),
        ({"expected_position": -1}, InvalidEventError, "expected_position"),
        ({"idempotency_key": ""}, InvalidEventError, "idempotency_key"),
        # an outbox target or key that is no string (an AttributeError from deep inside before)
        ({"outbox": [OutboxItem(5, {}, "k")]}, InvalidEventError, "outbox target must be"),  # type: ignore[arg-type]
        ({"outbox": [OutboxItem("t", {}, 5)]}, InvalidEventError, "outbox idempotency_key"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    db: Database, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {
        "session_id": uuid.uuid4(),
        "agent_id": "a",
        "event_type": "tool.invoked",
        "payload": {"call_id": "c", "tool": "t"},
    }
    args.update(kwargs)
    with Ledger(db.dsn) as ledger, pytest.raises(error, match=match):
        ledger.append(**args)
    assert _count(db) == 0


def test_free_form_payload_must_be_json(db: Database) -> None:
    register_event_type("review.note")
    with Ledger(db.dsn) as ledger:
        with pytest.raises(InvalidEventError, match="not JSON-serialisable"):
            ledger.append(uuid.uuid4(), "a", "review.note", {"when": object()})
        with pytest.raises(InvalidEventError):
            ledger.append(uuid.uuid4(), "a", "review.note", [1, 2])
        assert ledger.append(uuid.uuid4(), "a", "review.note", {"ok": True}).position == 1
    assert _count(db) == 1


class Approval(msgspec.Struct, frozen=True):
    approver: str
    approved: bool


def test_custom_event_type_is_validated(db: Database) -> None:
    register_event_type("review.approved", Approval)
    with Ledger(db.dsn) as ledger:
        ledger.append(uuid.uuid4(), "a", "review.approved", Approval("ann", True))
        ledger.append(uuid.uuid4(), "a", "review.approved", {"approver": "bob", "approved": False})
        with pytest.raises(InvalidEventError, match="Approval"):
            ledger.append(
                uuid.uuid4(), "a", "review.approved", {"approver": "bob", "approved": "yes"}
            )
    assert _count(db) == 2


def test_async_ledger(db: Database) -> None:
    sid = uuid.uuid4()

    async def run() -> list[int]:
        ledger = await AsyncLedger.connect(db.dsn)
        try:
            r1 = await ledger.append(sid, "a", "task.completed", {}, expected_position=0)
            async with ledger.transaction() as tx:
                r2 = await tx.append(sid, "a", "task.completed", {}, idempotency_key="k")
                r3 = await tx.append(sid, "a", "task.completed", {}, idempotency_key="k")
            with pytest.raises(ConcurrentAppendError):
                await ledger.append(sid, "a", "task.completed", {}, expected_position=1)
            assert await ledger.head(sid) == 2
            return [r1.position, r2.position, r3.position]
        finally:
            await ledger.close()

    assert asyncio.run(run()) == [1, 2, 2]
    assert _count(db) == 2


def test_writer_connection_errors_are_translated_and_retryable() -> None:
    with pytest.raises(RetryableError, match="Connection refused"):
        Ledger("host=127.0.0.1 port=1 dbname=x connect_timeout=2")


def _check_sessions(db: Database, sessions: list[uuid.UUID], per_session: int) -> None:
    with db.connect() as conn:
        for sid in sessions:
            positions = [
                r[0]
                for r in conn.execute(
                    "SELECT position FROM agent_events WHERE session_id = %s ORDER BY position",
                    (sid,),
                )
            ]
            assert positions == list(range(1, per_session + 1)), (sid, positions)


@pytest.mark.parametrize("shared", ["pool", "one connection"])
def test_one_async_ledger_shared_by_many_tasks(db: Database, shared: str) -> None:
    """Concurrent tasks share one AsyncLedger: each transaction holds a connection of its own
    (pool) or the one connection under a lock; never OutOfOrderTransactionNesting."""
    sessions = [uuid.uuid4() for _ in range(30)]
    common = uuid.uuid4()

    async def turn(ledger: AsyncLedger, sid: uuid.UUID) -> None:
        for i in range(3):
            async with ledger.transaction() as tx:
                await tx.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
                await asyncio.sleep(0)  # let the other tasks in, mid-transaction
                await tx.append(sid, "a", "tool.observed", {"call_id": f"c{i}", "result": i})
            await ledger.append(common, "a", "tool.invoked", {"call_id": f"{sid}-{i}", "tool": "t"})

    async def run() -> None:
        if shared == "pool":
            ledger = await AsyncLedger.connect(db.dsn, pool_size=4)
        else:
            conn = await psycopg.AsyncConnection.connect(db.dsn, autocommit=True)
            ledger = AsyncLedger(conn, own=True)
        async with ledger:
            await asyncio.gather(*(turn(ledger, sid) for sid in sessions))
            assert await ledger.head(common) == 90

    asyncio.run(run())
    _check_sessions(db, sessions, 6)


@pytest.mark.parametrize("shared", ["pool", "one connection"])
def test_one_ledger_shared_by_many_threads(db: Database, shared: str) -> None:
    sessions = [uuid.uuid4() for _ in range(8)]
    errors: list[BaseException] = []
    conn = psycopg.connect(db.dsn, autocommit=True) if shared != "pool" else None
    ledger = Ledger(db.dsn, pool_size=3) if conn is None else Ledger(conn=conn)

    def work(sid: uuid.UUID) -> None:
        try:
            for i in range(5):
                with ledger.transaction() as tx:
                    tx.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
                    tx.append(sid, "a", "tool.observed", {"call_id": f"c{i}", "result": i})
        except BaseException as e:
            errors.append(e)

    with ledger:
        threads = [threading.Thread(target=work, args=(sid,)) for sid in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    if conn is not None:
        conn.close()
    assert not errors, errors[0]
    _check_sessions(db, sessions, 10)


def test_a_wrong_dsn_fails_at_once_in_one_line() -> None:
    with pytest.raises(ConfigError, match="invalid port"):
        Ledger("host=127.0.0.1 port=99999 dbname=x")
