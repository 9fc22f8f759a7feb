"""The whole consumer loop without a server: a stream of pgoutput bytes built with the grammar
(tests/support/fakestream.py) into the in-memory sink. Batching, big transactions, snapshots
between transactions, dropped connections, a crash mid-batch and a new consumer on the same
state, and hostile rows and messages: each run ends where a fold from zero ends."""

from __future__ import annotations

import datetime as dt
import random
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_cdc.batching import Batch, frozen
from ledger_cdc.consumer import Consumer, ConsumerConfig
from ledger_cdc.consumer.server import NoLedgerServer
from ledger_cdc.errors import DatabaseUnavailable
from ledger_cdc.events import LedgerEvent, decode_payload, encode_payload
from ledger_cdc.fold import SessionContext, decode_context, encode_stored, fold_one
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from ledger_cdc.stream.route import Anomaly, LedgerStream
from tests.support.fakestream import FakeSlot, Row, Wal, _Crash, logical, running
from tests.support.wait import until

pytestmark = pytest.mark.timeout(120)


def reference(wal: Wal) -> tuple[dict[uuid.UUID, SessionContext], int]:
    """Every session folded from zero over the whole WAL at once, and the dead letters due."""
    stream = LedgerStream(skip_upto=0, memory_limit=1 << 30)
    ctxs: dict[uuid.UUID, SessionContext] = {}
    dead = 0
    stream.feed(wal.relation(), 0)
    for m in wal.messages:
        for txn in stream.feed(m.payload, m.data_start):
            for it in txn.items:
                if isinstance(it, Anomaly):
                    dead += 1
                    continue
                ev = it if type(it) is LedgerEvent else it.rejected  # type: ignore[union-attr]
                ctx = ctxs.setdefault(ev.session_id, SessionContext(ev.session_id))
                dead += fold_one(ctx, ev) is not None  # type: ignore[arg-type]
    return ctxs, dead


def assert_matches(store: MemoryStore, wal: Wal) -> None:
    want, dead = reference(wal)
    assert set(store.sessions) == set(want)
    for sid, ctx in want.items():
        # stored without its window's messages nor its completed calls; whole again once read
        assert store.context(sid) == ctx, sid
        assert store.sessions[sid].data == encode_stored(ctx), sid
    assert len(store.dead_letters) == dead
    assert store.checkpoint == wal.commits[-1]


def config(**kw: object) -> ConsumerConfig:
    kw.setdefault("reconnect_base", 0.001)
    kw.setdefault("reconnect_cap", 0.01)
    kw.setdefault("max_delay", 0.001)
    return ConsumerConfig(dsn="fake", **kw)  # type: ignore[arg-type]


def agent_work(wal: Wal, rng: random.Random, sessions: int, turns: int) -> None:
    """Turns of agents: a tool call and its result, sometimes in one transaction, sometimes
    several sessions in one, sometimes a session's end."""
    sids = [uuid.uuid4() for _ in range(sessions)]
    for t in range(turns):
        rows: list[Row] = []
        for sid in rng.sample(sids, rng.randint(1, min(3, sessions))):
            call = f"c{t}"
            if rng.random() < 0.3:  # a new context window, which projections reference
                window = [{"role": "user", "content": f"turn {t} " * rng.randint(1, 9)}] * (
                    t % 5 + 1
                )
                rows.append(wal.row(sid, "context.loaded", {"messages": window}))
            rows.append(wal.row(sid, "tool.invoked", {"call_id": call, "tool": "search"}))
            if rng.random() < 0.7:
                # a long string result is stored by reference to this event, a number copied
                result = f"result {t} " * rng.randint(1, 60) if rng.random() < 0.5 else t
                rows.append(wal.row(sid, "tool.observed", {"call_id": call, "result": result}))
        wal.transaction(rows)


@pytest.mark.parametrize(
    ("batch_size", "memory_kb"),
    [(1, 64 * 1024), (7, 64 * 1024), (20_000, 64 * 1024), (20_000, 48)],
    ids=["batch-1", "batch-7", "batch-large", "big-transactions-in-chunks"],
)
def test_the_loop_folds_every_transaction_exactly_once(batch_size: int, memory_kb: int) -> None:
    wal = Wal()
    agent_work(wal, random.Random(batch_size), sessions=12, turns=150)
    # one transaction far over the batch budget (48 kB of memory: a 7 kB batch)
    big = [
        wal.row(uuid.uuid4(), "tool.invoked", {"call_id": f"b{i}", "tool": "t"}) for i in range(300)
    ]
    wal.transaction(big)
    store = MemoryStore()
    slot = FakeSlot(wal)
    c = Consumer(
        config(batch_size=batch_size, memory_limit=memory_kb * 1024, snapshot_every=3),
        sink=MemorySink(store),
        transport=slot.transport(),
        server=NoLedgerServer(),
    )
    with running(c):
        until(lambda: store.checkpoint == wal.commits[-1])
    assert_matches(store, wal)
    assert slot.confirmed >= wal.commits[-1]  # confirmed only what the sink committed
    assert c.metrics.events == sum(p.event_count for p in store.sessions.values())


def test_snapshots_are_cut_between_transactions_and_at_a_session_end() -> None:
    wal = Wal()
    sid = uuid.uuid4()
    ends: set[int] = set()  # positions at which one of the session's transactions ends
    for t in range(40):
        rows = [wal.row(sid, "tool.invoked", {"call_id": f"c{t}", "tool": "x"})]
        rows.append(wal.row(sid, "tool.observed", {"call_id": f"c{t}", "result": 1}))
        wal.transaction(rows)
        ends.add(rows[-1].position)
    last = wal.row(sid, "task.completed", {"result": "ok"})
    wal.transaction([last])
    ends.add(last.position)
    store = MemoryStore()
    c = Consumer(
        config(snapshot_every=3),
        sink=MemorySink(store),
        transport=FakeSlot(wal).transport(),
        server=NoLedgerServer(),
    )
    with running(c):
        until(lambda: store.checkpoint == wal.commits[-1])
    cut = {pos for (s, pos) in store.snapshots if s == sid}
    assert cut and cut <= ends  # never inside a transaction
    assert last.position in cut  # the session ended: its final state is a snapshot
    assert_matches(store, wal)


def test_dropped_connections_resume_from_the_checkpoint_without_a_double() -> None:
    wal = Wal()
    agent_work(wal, random.Random(3), sessions=5, turns=200)
    slot = FakeSlot(wal)
    rng = random.Random(4)
    slot.drops = [rng.randint(0, 60) for _ in range(25)]  # 25 connections end mid-stream
    store = MemoryStore()
    c = Consumer(
        config(batch_size=5),
        sink=MemorySink(store),
        transport=slot.transport(),
        server=NoLedgerServer(),
    )
    with running(c):
        until(lambda: store.checkpoint == wal.commits[-1])
    assert slot.connections > 20 and c.metrics.reconnects > 20
    assert_matches(store, wal)


@pytest.mark.parametrize("crash_at", [1, 2, 4])
@pytest.mark.parametrize("memory_kb", [64 * 1024, 48], ids=["batches", "chunks"])
def test_a_consumer_that_dies_mid_batch_is_replaced_without_loss_or_double(
    crash_at: int, memory_kb: int
) -> None:
    wal = Wal()
    agent_work(wal, random.Random(crash_at), sessions=8, turns=120)
    wal.transaction(
        [
            wal.row(uuid.uuid4(), "tool.invoked", {"call_id": f"b{i}", "tool": "t"})
            for i in range(300)
        ]
    )
    agent_work(wal, random.Random(crash_at + 1), sessions=8, turns=60)
    store = MemoryStore()
    slot = FakeSlot(wal)
    first = MemorySink(store)
    writes = [0]

    def crash(batch: Batch) -> None:
        writes[0] += 1
        if writes[0] == crash_at:
            raise _Crash  # mid-write: nothing of this batch (or chunked transaction) lands

    first.before_commit = crash
    cfg = config(batch_size=4, memory_limit=memory_kb * 1024, snapshot_every=2)
    a = Consumer(cfg, sink=first, transport=slot.transport(), server=NoLedgerServer())
    with running(a) as thread:
        until(lambda: not thread.is_alive())
    assert store.checkpoint != wal.commits[-1]
    b = Consumer(cfg, sink=MemorySink(store), transport=slot.transport(), server=NoLedgerServer())
    with running(b):
        until(lambda: store.checkpoint == wal.commits[-1])
    assert_matches(store, wal)


# -- hostile input: nothing in a row or a message stops the loop ----------------------------------

_DEEP = "[" * 2000 + "]" * 2000
hostile_rows = st.sampled_from(
    [
        ("tool.invoked", '{"call_id": 5, "tool": "x"}', None),  # wrong type
        ("tool.invoked", '{"tool": "x"}', None),  # a required field missing
        ("tool.invoked", "[]", None),
        ("tool.invoked", '{"call_id": "d", "tool": "x", "arguments": ' + _DEEP + "}", None),
        ("run.leased", '{"worker": "w", "ttl": 1e308}', None),
        ("run.leased", '{"worker": "w", "ttl": 1e999}', None),
        ("signal.received", '{"name": "' + "x" * 70_000 + '"}', None),
        ("no.such.type", '{"a": 1}', None),
        ("task.completed", '{"result": {"n": 123456789012345678901234567890}}', None),
        ("tool.invoked", '{"call_id": "t", "tool": "x"}', "infinity"),
        ("tool.invoked", '{"call_id": "t", "tool": "x"}', "20000-01-01 00:00:00+00"),
        ("tool.invoked", '{"call_id": "t", "tool": "x"}', "-infinity"),
        ("tool.invoked", "not json at all", None),
    ]
)
outside = st.sampled_from(
    [
        logical("ledger-cdc.heartbeat", b'{"slot": "agent_slot", "ts": "x"}'),
        logical("ledger-cdc.heartbeat", b"[]"),
        logical("ledger-cdc.heartbeat", b'{"nonce": "forged", "ts": 1e300}'),
        logical("ledger-cdc.heartbeat", b"\xff\xfe"),
        logical("anything", b"\x00" * 10),
        b"z\x00\x00\x00\x01",  # a message kind this decoder does not know
    ]
)
step = st.one_of(
    st.tuples(st.just("good"), st.integers(1, 3)),
    st.tuples(st.just("bad"), hostile_rows),
    st.tuples(st.just("outside"), outside),
    st.tuples(st.just("update"), st.none()),
    st.tuples(st.just("truncate"), st.none()),
)


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(steps=st.lists(step, min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_hostile_rows_and_messages_never_stop_the_loop(
    steps: list[tuple[str, object]], seed: int
) -> None:
    rng = random.Random(seed)
    wal = Wal()
    sids = [uuid.uuid4() for _ in range(3)]
    last: Row | None = None
    n = 0
    for kind, arg in steps:
        sid = rng.choice(sids)
        if kind == "good":
            rows = []
            for _ in range(int(arg)):  # type: ignore[call-overload]
                n += 1
                rows.append(wal.row(sid, "tool.invoked", {"call_id": f"c{n}", "tool": "t"}))
            wal.transaction(rows)
            last = rows[-1]
        elif kind == "bad":
            etype, payload, created = arg  # type: ignore[misc]
            kw = {"created_at": created} if created else {}
            wal.transaction([wal.row(sid, etype, payload, **kw)])
        elif kind == "outside":
            wal.outside(arg)  # type: ignore[arg-type]
        elif kind == "update" and last is not None:
            wal.transaction([], extra=[wal.update(last)])
        elif kind == "truncate":
            wal.transaction([], extra=[wal.truncate()])
    n += 1
    wal.transaction([wal.row(sids[0], "tool.invoked", {"call_id": f"c{n}", "tool": "t"})])
    store = MemoryStore()
    slot = FakeSlot(wal)
    slot.drops = [rng.randint(0, 10)]  # and once, a restart in the middle of it
    cfg = config(batch_size=rng.choice([1, 3, 100]), snapshot_every=2)
    c = Consumer(cfg, sink=MemorySink(store), transport=slot.transport(), server=NoLedgerServer())
    with running(c) as thread:
        until(lambda: store.checkpoint == wal.commits[-1] or not thread.is_alive())
        assert thread.is_alive()
    assert_matches(store, wal)


class _ThreadRecordingSink(MemorySink):
    """Remembers which thread committed each batch."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.threads: list[str] = []

    def commit(self, batch: Batch) -> None:
        self.threads.append(threading.current_thread().name)
        super().commit(batch)


def test_a_trickle_is_committed_by_the_loop_itself_and_a_backlog_by_the_sink_thread() -> None:
    """An idle consumer commits a lone small transaction on its own thread (no hand-over to
    the sink's thread and back); a backlog still goes to the sink's thread, which writes one
    batch while the loop folds the next."""
    wal = Wal()
    sid = uuid.uuid4()
    store = MemoryStore()
    sink = _ThreadRecordingSink(store)
    c = Consumer(config(), sink=sink, transport=FakeSlot(wal).transport(), server=NoLedgerServer())
    with running(c) as loop_thread:
        for t in range(3):  # one at a time, each committed before the next is written
            wal.transaction([wal.row(sid, "tool.invoked", {"call_id": f"c{t}", "tool": "x"})])
            until(lambda: store.checkpoint == wal.commits[-1])
        assert sink.threads == [loop_thread.name] * 3
        for t in range(3, 200):  # a burst, in hand at once
            wal.transaction([wal.row(sid, "tool.invoked", {"call_id": f"c{t}", "tool": "x"})])
        until(lambda: store.checkpoint == wal.commits[-1])
    assert "ledger-cdc-sink" in sink.threads[3:]
    assert_matches(store, wal)


def _held_write(
    wal: Wal, sid: uuid.UUID, consumer: Consumer, more: int, *, fail: bool
) -> tuple[Callable[[Batch], None], list[object]]:
    """A before_commit hook for the first batch the sink's thread writes: while it is held,
    ``more`` transactions of session ``sid`` arrive, and the hook waits until the loop has
    folded some of them into the next batch; it then records what the batch being written
    holds (its context of ``sid``, that context as stored), the position confirmed to the slot
    and the one the sink has committed, and lets the write go on, or fails it."""
    seen: list[object] = []

    def hook(batch: Batch) -> None:
        if seen or threading.current_thread().name != "ledger-cdc-sink":
            return
        for t in range(more):
            wal.transaction([wal.row(sid, "tool.invoked", {"call_id": f"m{t}", "tool": "x"})])
        until(lambda: bool(consumer.builder.folded_ahead), every=0.005)
        ctx, data, _, _ = batch.sessions[sid]
        seen.append(
            (
                consumer.builder.folded_ahead,
                (ctx.last_position, ctx.event_count, len(ctx.pending_tools)),
                decode_context(data),
                consumer.stream.confirmed,
                consumer.sink.durable(),
            )
        )
        if fail:
            raise DatabaseUnavailable("the projections' server went away mid-write")

    return hook, seen


def test_the_loop_folds_the_next_batch_while_the_sink_writes_one() -> None:
    """While the sink's thread writes a batch, the loop folds what arrives into the next one
    instead of waiting; the batch being written keeps the contexts it was sealed with, though
    the loop folds on into the same session; the slot is confirmed no further than what the
    sink committed; everything ends as a fold from zero, each event counted once."""
    wal = Wal()
    sid = uuid.uuid4()
    for t in range(50):  # a backlog: its batch goes to the sink's thread
        wal.transaction([wal.row(sid, "tool.invoked", {"call_id": f"c{t}", "tool": "x"})])
    store = MemoryStore()
    sink = MemorySink(store)
    slot = FakeSlot(wal)
    c = Consumer(config(), sink=sink, transport=slot.transport(), server=NoLedgerServer())
    sink.before_commit, seen = _held_write(wal, sid, c, 30, fail=False)
    with running(c):
        until(lambda: len(wal.commits) == 80 and store.checkpoint == wal.commits[-1])
    assert seen, "no batch was written by the sink's thread"
    ahead, (position, count, pending), stored, confirmed, committed = seen[0]  # type: ignore[misc]
    assert ahead > 0  # folded while the sink was busy
    # what the sink writes is the batch as sealed: its counters and its stored JSON agree,
    # and neither has the transactions folded ahead
    assert (position, count, pending) == (
        stored.last_position,
        stored.event_count,
        len(stored.pending_tools),
    )
    assert position <= 50
    assert confirmed <= committed  # nothing folded ahead (nor in the batch) was confirmed
    assert_matches(store, wal)
    assert c.metrics.events == 80


def test_a_failed_write_drops_what_was_folded_ahead_without_loss_or_double() -> None:
    """The sink fails while the loop has folded the next batch ahead: the consumer reconnects
    from the checkpoint, and what it folded ahead is neither written nor counted twice."""
    wal = Wal()
    sid = uuid.uuid4()
    for t in range(50):
        wal.transaction([wal.row(sid, "tool.invoked", {"call_id": f"c{t}", "tool": "x"})])
    store = MemoryStore()
    sink = MemorySink(store)
    c = Consumer(config(), sink=sink, transport=FakeSlot(wal).transport(), server=NoLedgerServer())
    sink.before_commit, seen = _held_write(wal, sid, c, 30, fail=True)
    with running(c):
        until(lambda: len(wal.commits) == 80 and store.checkpoint == wal.commits[-1])
    assert seen and seen[0][0] > 0  # type: ignore[index]
    assert c.metrics.reconnects >= 1
    assert_matches(store, wal)
    assert c.metrics.events == 80  # the batch folded ahead, then dropped, is not counted


def test_a_frozen_context_is_not_changed_by_folding_on() -> None:
    """What the sink's thread writes while the loop folds on into the same session: every
    list, dict and mutable part a fold changes in place (messages, sources, handoffs, agents,
    pending calls, the run and its inbox, the usage) is the copy's own."""
    sid = uuid.uuid4()
    seq = iter(range(1, 1000))
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def ev(pos: int, etype: str, payload: dict[str, Any], agent: str = "a") -> LedgerEvent:
        value = decode_payload(etype, encode_payload(etype, payload))
        return LedgerEvent(next(seq), sid, pos, agent, etype, value, t0)

    ctx = SessionContext(sid)
    first = [
        ev(1, "run.queued", {}),
        ev(2, "run.leased", {"worker": "w", "ttl": 30}),
        ev(3, "tool.invoked", {"call_id": "c1", "tool": "t"}),
        ev(4, "run.suspended", {"reason": "approval", "wait_for": ["approve"]}),
    ]
    for e in first:
        fold_one(ctx, e)
    sealed = encode_stored(ctx)
    copy = frozen(ctx)
    later = [
        ev(5, "signal.received", {"name": "early"}),  # the run's inbox, appended to
        ev(6, "model.requested", {"request_id": "r1", "model": "m"}),
        ev(
            7,
            "model.responded",
            {"request_id": "r1", "model": "m", "content": "x" * 300, "usage": {"input_tokens": 5}},
        ),
        ev(8, "tool.observed", {"call_id": "c1", "result": "y" * 300}),
        ev(9, "handoff.emitted", {"handoff_id": "h1", "to_agent": "b"}, agent="other"),
        ev(10, "tool.invoked", {"call_id": "c2", "tool": "t"}),
    ]
    for e in later:
        fold_one(ctx, e)
    assert encode_stored(ctx) != sealed
    assert encode_stored(copy) == sealed
    assert copy.run is not None and copy.run.inbox == [] and copy.usage.input_tokens == 0
