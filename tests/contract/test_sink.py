"""The sink contract (:class:`ledger_cdc.sink.base.Sink`), proven once against every sink.

:class:`SinkContract` holds every test and is not collected by itself (its name is not a test
class's); each implementation has a subclass that gives it fresh storage, opens sinks on it (each
as another consumer of the same slot would) and reads back what the storage holds where the
protocol has no reader (dead letters, snapshots, memo rows, notifications sent). The in-memory
sink's case needs no server; the PostgreSQL sink's get a fresh database from the harness, so they
are marked ``server``. Batches are folded from agent events by the batching stage
(:class:`BatchBuilder`), as the consumer folds them, with contexts loaded back through the sink
under test.
"""

from __future__ import annotations

import abc
import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import pytest

import ledger_cdc.sink.postgres as pg_sink
from ledger_cdc.batching import (
    Batch,
    BatchBuilder,
    DeadLetter,
    SessionCache,
    SnapshotPolicy,
    SnapshotRow,
    Tail,
    context_size,
)
from ledger_cdc.errors import FencedError
from ledger_cdc.events import LedgerEvent, Rejected, decode_payload, encode_payload
from ledger_cdc.fold import CompletedTool, SessionContext, default_reducers, encode_stored
from ledger_cdc.lsn import parse_lsn
from ledger_cdc.names import RUNS_CHANNEL, SESSIONS_CHANNEL
from ledger_cdc.sink.base import BOOTSTRAPPING, Sink
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.sink.shape import AgentSnapshotRow, snapshot_row
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Anomaly, Item
from tests.support.harness import Database

SLOT = "contract_slot"
AT = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
EVERY = 2  # a session's snapshot is due every this many of its events


class Log:
    """Committed transactions of agent events as the stream hands them over: seq and positions
    numbered as the ledger numbers them, each transaction ending further on in the WAL."""

    def __init__(self) -> None:
        self.seq = 0
        self.lsn = 0x10000
        self.positions: dict[uuid.UUID, int] = {}

    def event(self, sid: uuid.UUID, etype: str, payload: dict[str, Any]) -> LedgerEvent:
        self.seq += 1
        position = self.positions[sid] = self.positions.get(sid, 0) + 1
        value = decode_payload(etype, encode_payload(etype, payload))
        return LedgerEvent(self.seq, sid, position, "agent", etype, value, AT)

    def turn(self, sid: uuid.UUID) -> list[Item]:
        """A tool call and its result: two events, a memo row."""
        call = f"c{self.seq}"
        return [
            self.event(sid, "tool.invoked", {"call_id": call, "tool": "search"}),
            self.event(sid, "tool.observed", {"call_id": call, "result": f"found {call}"}),
        ]

    def txn(self, items: list[Item]) -> Transaction[Item]:
        self.lsn += 0x100
        return Transaction(self.seq, self.lsn - 0x10, self.lsn, 850_000_000_000_000, items)


def builder(sink: Sink, *, budget: int = 1 << 20) -> BatchBuilder:
    """The fold stage over ``sink``, as a consumer starting now has it: nothing cached."""
    return BatchBuilder(
        load=sink.load_contexts_sized,
        cache=SessionCache(1 << 26),
        budget=budget,
        reducers=default_reducers(),
        snapshots=SnapshotPolicy(EVERY),
        publish=bool(sink.publishers),
    )


def dead_key(d: DeadLetter) -> tuple[int, str, int]:
    return (d.lsn, d.kind, -1 if d.seq is None else d.seq)


class Failure(Exception):
    """A failure injected part-way through a commit."""


class Recorder:
    """A publisher that keeps what it is given; each publish's ``wait`` runs ``on_wait`` (a
    look at the storage, or a failure)."""

    def __init__(self) -> None:
        self.begun: list[tuple[list[tuple[Any, int]], list[tuple[Any, ...]]]] = []
        self.on_wait: Callable[[], None] = lambda: None
        self.closed = False

    def start_connect(self) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def connect(self, timeout: float = 30, started: Future[None] | None = None) -> None:
        pass

    def begin(
        self, events: Sequence[tuple[LedgerEvent | Rejected, int]], sessions: Sequence[Any]
    ) -> Recorder:
        self.begun.append((list(events), list(sessions)))
        return self

    def wait(self) -> None:
        self.on_wait()

    def cancel(self) -> None:
        pass

    def stopping(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class SinkContract(abc.ABC):
    """Every rule a sink follows, whatever holds its state. A subclass prepares fresh storage
    for each test (an autouse fixture) and implements the methods below."""

    @abc.abstractmethod
    def sink(self) -> Sink:
        """A sink of the slot on this test's storage, as another consumer would open it (its
        checkpoint not read yet)."""

    @abc.abstractmethod
    def stored_dead_letters(self) -> list[DeadLetter]:
        """The dead letters the storage holds for the slot."""

    @abc.abstractmethod
    def stored_snapshots(self) -> dict[tuple[uuid.UUID, int], AgentSnapshotRow]:
        """The snapshots the storage holds, by (session, position they were cut at)."""

    @abc.abstractmethod
    def stored_memo(self) -> dict[tuple[uuid.UUID, str, str, int], Any]:
        """The memo rows' entries (parsed JSON), by the table's key (session, kind, call,
        position of the completing event)."""

    @abc.abstractmethod
    def notices_until(self, marker: tuple[str, str]) -> list[tuple[str, str]]:
        """The notifications (channel, payload) delivered since the last call, up to and
        including ``marker`` (which a committed batch sent: it proves the rest came first)."""

    # -- helpers ---------------------------------------------------------------------------------

    def opened(self) -> Sink:
        sink = self.sink()
        sink.load_checkpoint()
        return sink

    def state(self) -> dict[str, Any]:
        """What the storage holds, read by a sink of its own: the checkpoint and its epoch,
        each session's position and stored context, the snapshots, memo rows and dead letters."""
        reader = self.opened()
        positions = reader.positions()
        contexts = reader.load_contexts_sized(positions)
        return {
            "checkpoint": (reader.checkpoint, reader.epoch),
            "positions": positions,
            "contexts": {sid: ctx for sid, (ctx, _) in contexts.items()},
            "snapshots": self.stored_snapshots(),
            "memo": self.stored_memo(),
            "dead letters": sorted(self.stored_dead_letters(), key=dead_key),
        }

    def full_batch(self, sink: Sink, log: Log) -> Batch:
        """A batch that writes something of every kind: projections (one with a due snapshot),
        memo rows, a dead letter."""
        one, two = uuid.uuid4(), uuid.uuid4()
        other = log.event(two, "tool.invoked", {"call_id": "x", "tool": "t"})
        deleted = Anomaly("delete", log.lsn, 1, one, {"seq": 1})  # met in the stream: quarantined
        txn = log.txn([*log.turn(one), other, deleted])
        batch, rest = builder(sink).fold([txn])
        assert not rest
        assert batch.sessions and batch.memo and batch.snapshots and batch.dead_letters
        return batch

    def chunked(
        self, sink: Sink, txn: Transaction[Item], budget: int
    ) -> tuple[Iterator[Batch], Callable[[Tail], Batch]]:
        """The parts and the ``finish`` of one transaction folded in chunks (its changes grouped
        by session, each of about 1 kB, a part of about ``budget`` bytes)."""
        items = txn.items
        assert isinstance(items, list)
        _, chunks, finish = builder(sink, budget=budget).big(
            txn, ((it, 1000) for it in items), epoch=None, grouped=True, write_part=sink.write_part
        )
        return chunks, finish

    # -- checkpoints -----------------------------------------------------------------------------

    def test_a_new_slot_has_no_checkpoint_and_no_projections(self) -> None:
        sink = self.sink()
        assert sink.load_checkpoint() is None
        assert (sink.checkpoint, sink.epoch) == (None, None)
        assert sink.positions() == {}
        assert sink.load_contexts_sized([uuid.uuid4()]) == {}

    def test_a_committed_batch_is_the_checkpoint_read_back(self) -> None:
        sink = self.opened()
        batch = self.full_batch(sink, Log())
        sink.commit(batch)
        assert sink.checkpoint == batch.end_lsn
        other = self.sink()
        assert other.load_checkpoint() == batch.end_lsn
        assert other.checkpoint == batch.end_lsn

    def test_the_first_checkpoint_has_epoch_0_and_a_batch_sets_it_or_leaves_it(self) -> None:
        sink = self.opened()
        sink.commit(Batch(end_lsn=0x1000))
        assert self.opened().epoch == 0
        sink.commit(Batch(end_lsn=0x2000, epoch=3))
        assert sink.epoch == 3
        assert self.opened().epoch == 3
        sink.commit(Batch(end_lsn=0x3000))  # no epoch: the stored one stays
        assert (sink.epoch, self.opened().epoch) == (3, 3)

    def test_a_bootstrap_mark_is_read_back_until_unmarked(self) -> None:
        sink = self.opened()
        sink.commit(Batch(end_lsn=0x1000, epoch=2))
        sink.mark_bootstrap()
        assert sink.epoch == BOOTSTRAPPING
        other = self.sink()
        # the slot is rebuilt from the table: the stream starts again from nothing
        assert (other.load_checkpoint(), other.epoch) == (0, BOOTSTRAPPING)
        sink.unmark_bootstrap()
        assert sink.epoch == 0
        assert self.opened().epoch == 0

    def test_unmarking_leaves_an_epoch_that_is_no_bootstrap(self) -> None:
        sink = self.opened()
        sink.commit(Batch(end_lsn=0x1000, epoch=3))
        sink.unmark_bootstrap()
        assert self.opened().epoch == 3

    # -- fencing ---------------------------------------------------------------------------------

    def test_of_two_sinks_that_read_one_checkpoint_the_second_to_commit_is_fenced(self) -> None:
        log = Log()
        first, second = self.opened(), self.opened()
        assert first.checkpoint == second.checkpoint
        first.commit(self.full_batch(first, log))
        before = self.state()
        late = self.full_batch(second, log)
        with pytest.raises(FencedError):
            second.commit(late)
        assert self.state() == before  # nothing of the late batch written
        assert second.checkpoint != late.end_lsn
        # read again, the checkpoint lets it commit
        second.load_checkpoint()
        second.commit(late)
        assert self.opened().checkpoint == late.end_lsn

    def test_a_chunked_commit_is_fenced_as_a_batch_is(self) -> None:
        log = Log()
        first, second = self.opened(), self.opened()
        first.commit(self.full_batch(first, log))
        before = self.state()
        txn = log.txn([it for _ in range(3) for it in log.turn(uuid.uuid4())])
        with pytest.raises(FencedError):
            second.commit_chunked(*self.chunked(second, txn, budget=2500))
        assert self.state() == before

    # -- all or nothing --------------------------------------------------------------------------

    def test_a_chunk_that_fails_leaves_everything_as_it_was(self) -> None:
        log = Log()
        sink = self.opened()
        sink.commit(self.full_batch(sink, log))
        before = self.state()
        txn = log.txn([it for _ in range(4) for it in log.turn(uuid.uuid4())])
        chunks, finish = self.chunked(sink, txn, budget=2500)

        def failing() -> Iterator[Batch]:
            yield next(chunks)  # one part written …
            raise Failure("the second part")  # … and the transaction fails

        with pytest.raises(Failure):
            sink.commit_chunked(failing(), finish)
        assert self.state() == before
        # the same sink commits the next batch (its checkpoint is still the stored one)
        again = self.full_batch(sink, log)
        sink.commit(again)
        assert self.opened().checkpoint == again.end_lsn

    def test_a_finish_that_fails_leaves_everything_as_it_was(self) -> None:
        log = Log()
        sink = self.opened()
        sink.commit(self.full_batch(sink, log))
        before = self.state()
        sids = [uuid.uuid4() for _ in range(4)]
        txn = log.txn([it for sid in sids for it in log.turn(sid)])
        chunks, finish = self.chunked(sink, txn, budget=2500)

        def failing(tail: Tail) -> Batch:
            finish(tail)  # the last part and the due snapshots written …
            assert sink.load_contexts_sized(sids).keys() == set(sids)
            raise Failure("before the checkpoint")  # … and the commit fails

        with pytest.raises(Failure):
            sink.commit_chunked(chunks, failing)
        assert self.state() == before

    # -- commit_chunked --------------------------------------------------------------------------

    def test_chunked_parts_are_visible_to_others_at_once_with_the_checkpoint(self) -> None:
        log = Log()
        sink = self.opened()
        before = self.state()
        sids = [uuid.uuid4() for _ in range(5)]
        txn = log.txn([it for sid in sids for it in log.turn(sid)])
        chunks, finish = self.chunked(sink, txn, budget=2500)
        parts: list[Batch] = []
        seen: dict[str, Any] = {}

        def counted() -> Iterator[Batch]:
            for chunk in chunks:
                parts.append(chunk)
                yield chunk

        def watched(tail: Tail) -> Batch:
            final = finish(tail)
            seen["own"] = sink.load_contexts_sized(sids).keys()  # its own transaction's
            seen["others"] = self.state()
            return final

        sink.commit_chunked(counted(), watched)
        assert len(parts) >= 2  # (the transaction did go in parts)
        assert seen["own"] == set(sids)
        assert seen["others"] == before  # not even the snapshots and memo rows
        after = self.state()
        assert after["checkpoint"] == (txn.end_lsn, 0)
        assert after["positions"] == {sid: 2 for sid in sids}
        assert sink.checkpoint == txn.end_lsn

    def test_a_chunked_commit_stores_the_snapshots_that_came_due(self) -> None:
        log = Log()
        sink = self.opened()
        old, new, ended, on = (uuid.uuid4() for _ in range(4))
        start = [log.event(old, "tool.invoked", {"call_id": "a", "tool": "t"}), *log.turn(on)]
        sink.commit(builder(sink).fold([log.txn(start)])[0])
        assert self.stored_snapshots().keys() == {(on, 2)}
        # due: ``old`` crosses a multiple of EVERY (1 → 3 events), ``new`` reaches one (0 → 2),
        # ``ended`` completes; not due: ``on`` (2 → 3)
        txn = log.txn(
            [
                *log.turn(old),
                *log.turn(new),
                log.event(ended, "task.completed", {"result": "done"}),
                log.event(on, "tool.invoked", {"call_id": "b", "tool": "t"}),
            ]
        )
        sink.commit_chunked(*self.chunked(sink, txn, budget=1500))
        snaps = self.stored_snapshots()
        assert snaps.keys() == {(on, 2), (old, 3), (new, 2), (ended, 1)}
        contexts = self.opened().load_contexts_sized([old, new, ended])
        for sid, (ctx, _) in contexts.items():
            assert snaps[(sid, ctx.last_position)].data == encode_stored(ctx), sid

    # -- snapshots and projections ---------------------------------------------------------------

    def test_due_snapshots_are_stored_as_the_batch_cut_them(self) -> None:
        sink = self.opened()
        batch = self.full_batch(sink, Log())
        sink.commit(batch)
        assert self.stored_snapshots() == {
            (s.session_id, s.upto_position): snapshot_row(s) for s in batch.snapshots
        }

    def test_a_snapshot_at_the_same_point_is_replaced_only_by_another_reducer_version(
        self,
    ) -> None:
        sink = self.opened()
        sid = uuid.uuid4()
        ctx = SessionContext(sid, last_seq=20, last_position=2, event_count=2)

        def snap(version: str, note: str) -> SnapshotRow:
            return SnapshotRow(sid, 20, 2, version, note.encode() * 32, encode_stored(ctx), None)

        sink.commit(Batch(end_lsn=0x1000, snapshots=[snap("v1", "a")]))
        sink.commit(Batch(end_lsn=0x2000, snapshots=[snap("v1", "b")]))  # usable: kept
        assert self.stored_snapshots() == {(sid, 2): snapshot_row(snap("v1", "a"))}
        sink.commit(Batch(end_lsn=0x3000, snapshots=[snap("v2", "c")]))  # replaced
        assert self.stored_snapshots() == {(sid, 2): snapshot_row(snap("v2", "c"))}

    def test_positions_and_contexts_read_back_what_was_committed(self) -> None:
        log = Log()
        sink = self.opened()
        first = self.full_batch(sink, log)
        sink.commit(first)
        second, _ = builder(sink).fold([log.txn(log.turn(next(iter(first.sessions))))])
        sink.commit(second)
        committed = {**first.sessions, **second.sessions}
        reader = self.opened()
        assert reader.positions() == {
            sid: ctx.last_position for sid, (ctx, _, _, _) in committed.items()
        }
        loaded = reader.load_contexts_sized([*committed, uuid.uuid4()])
        assert loaded.keys() == committed.keys()  # a session never committed: none
        for sid, (ctx, data, _, _) in committed.items():
            got, size = loaded[sid]
            assert got == ctx, sid
            # estimated from the stored JSON, however the storage spells it
            assert size >= context_size(ctx, data), sid

    # -- dead letters ----------------------------------------------------------------------------

    def test_dead_letters_are_stored_each_once(self) -> None:
        sink = self.opened()
        sid = uuid.uuid4()
        dead = [
            DeadLetter(7, sid, 0x1000, "quarantined", "payload: expected a str", {"seq": 7}),
            DeadLetter(None, None, 0x1000, "truncate", "TRUNCATE on the append-only ledger"),
        ]
        sink.commit(Batch(end_lsn=0x1000, dead_letters=list(dead)))
        assert sorted(self.stored_dead_letters(), key=dead_key) == sorted(dead, key=dead_key)
        # quarantined again (a replay, a rebuild): the same letter (slot, LSN, kind, seq) is
        # kept once, as first stored
        again = DeadLetter(7, sid, 0x1000, "quarantined", "told otherwise", None)
        more = DeadLetter(8, sid, 0x2000, "quarantined", "another", None)
        sink.commit(Batch(end_lsn=0x2000, dead_letters=[again, more]))
        want = sorted([*dead, more], key=dead_key)
        assert sorted(self.stored_dead_letters(), key=dead_key) == want

    # -- memo rows -------------------------------------------------------------------------------

    def test_a_memo_row_once_stored_is_never_overwritten(self) -> None:
        sink = self.opened()
        batch = self.full_batch(sink, Log())
        sink.commit(batch)
        stored = self.stored_memo()
        assert len(stored) == len(batch.memo)
        sid, position, done = batch.memo[0]
        assert isinstance(done, CompletedTool)
        again = msgspec.structs.replace(done, tool="another", result="another result")
        sink.commit(Batch(end_lsn=batch.end_lsn + 0x100, memo=[(sid, position, again)]))
        assert self.stored_memo() == stored
        assert stored[(sid, "tool", done.call_id, position)]["result"] == done.result

    # -- notifications ---------------------------------------------------------------------------

    def test_notifications_are_sent_when_their_batch_commits_and_never_otherwise(self) -> None:
        sink, other = self.opened(), self.opened()
        ready = uuid.uuid4()
        sink.commit(Batch(end_lsn=0x1000, notify=[ready], session_notices=[f"{ready}:1"]))
        first = (SESSIONS_CHANNEL, f"{ready}:1")
        assert self.notices_until(first) == [(RUNS_CHANNEL, str(ready)), first]
        # fenced, and failed part-way: nothing of theirs is sent
        with pytest.raises(FencedError):
            other.commit(Batch(end_lsn=0x2000, session_notices=["fenced:1"]))
        log = Log()
        chunks, finish = self.chunked(sink, log.txn(log.turn(uuid.uuid4())), budget=1500)

        def failing(tail: Tail) -> Batch:
            finish(tail)  # the touched sessions notified …
            raise Failure("before the checkpoint")  # … in a commit that fails

        with pytest.raises(Failure):
            sink.commit_chunked(chunks, failing)
        sink.commit(Batch(end_lsn=log.lsn + 0x100, session_notices=["marker:1"]))
        assert self.notices_until((SESSIONS_CHANNEL, "marker:1")) == [
            (SESSIONS_CHANNEL, "marker:1")
        ]

    def test_a_chunked_commit_notifies_every_session_it_touched(self) -> None:
        log = Log()
        sink = self.opened()
        sids = [uuid.uuid4() for _ in range(3)]
        queued = uuid.uuid4()  # its run made ready to lease
        txn = log.txn(
            [*(it for sid in sids for it in log.turn(sid)), log.event(queued, "run.queued", {})]
        )
        sink.commit_chunked(*self.chunked(sink, txn, budget=1500))
        sink.commit(Batch(end_lsn=txn.end_lsn + 0x100, session_notices=["marker:1"]))
        got = self.notices_until((SESSIONS_CHANNEL, "marker:1"))
        want = [(SESSIONS_CHANNEL, f"{sid}:2") for sid in sids]
        want += [(SESSIONS_CHANNEL, f"{queued}:1"), (RUNS_CHANNEL, str(queued))]
        assert sorted(got[:-1]) == sorted(want)

    # -- publishers ------------------------------------------------------------------------------

    def test_each_batch_goes_to_every_publisher_before_it_commits(self) -> None:
        sink = self.opened()
        pubs = [Recorder(), Recorder()]
        sink.publishers.extend(pubs)
        batch = self.full_batch(sink, Log())
        assert batch.published
        seen: list[dict[str, Any]] = []
        pubs[0].on_wait = lambda: seen.append(self.state())
        sink.commit(batch)
        assert seen and seen[0]["checkpoint"] == (None, None)  # waited for before the commit
        for pub in pubs:
            ((events, sessions),) = pub.begun
            assert events == batch.published
            assert {s[0] for s in sessions} == set(batch.sessions)
        sink.shutdown()
        assert all(pub.closed for pub in pubs)

    def test_a_publish_that_fails_leaves_everything_as_it_was(self) -> None:
        log = Log()
        sink = self.opened()
        sink.commit(self.full_batch(sink, log))
        before = self.state()
        pub = Recorder()
        sink.publishers.append(pub)

        def refused() -> None:
            raise Failure("the publisher refused the batch")

        pub.on_wait = refused
        with pytest.raises(Failure):
            sink.commit(self.full_batch(sink, log))
        assert pub.begun
        assert self.state() == before

    def test_a_chunked_commit_publishes_each_event_once_before_it_commits(self) -> None:
        log = Log()
        sink = self.opened()
        pub = Recorder()
        sink.publishers.append(pub)
        sids = [uuid.uuid4() for _ in range(4)]
        txn = log.txn([it for sid in sids for it in log.turn(sid)])
        seen: list[Any] = []
        pub.on_wait = lambda: seen.append(self.state()["checkpoint"])
        sink.commit_chunked(*self.chunked(sink, txn, budget=2500))
        published = [ev.seq for events, _ in pub.begun for ev, _ in events]
        items = txn.items
        assert isinstance(items, list)
        assert sorted(published) == sorted(it.seq for it in items if isinstance(it, LedgerEvent))
        assert len(pub.begun) >= 2 and set(seen) == {(None, None)}

    # -- durability ------------------------------------------------------------------------------

    def test_durable_never_passes_the_last_commit_and_a_flush_reaches_it(self) -> None:
        sink = self.opened()
        for end in (0x1000, 0x2000):
            sink.commit(Batch(end_lsn=end))
            sink.probe()
            assert sink.durable() <= end
        sink.flush()
        assert sink.durable() == 0x2000
        assert not sink.pending


class TestMemorySink(SinkContract):
    """The sink in a process's memory: sinks opened on one store share it."""

    @pytest.fixture(autouse=True)
    def _store(self) -> None:
        self.store = MemoryStore()
        self.sent = 0  # notifications read so far

    def sink(self) -> Sink:
        return MemorySink(self.store)

    def stored_dead_letters(self) -> list[DeadLetter]:
        return list(self.store.dead_letters)

    def stored_snapshots(self) -> dict[tuple[uuid.UUID, int], AgentSnapshotRow]:
        return dict(self.store.snapshots)

    def stored_memo(self) -> dict[tuple[uuid.UUID, str, str, int], Any]:
        return {key: json.loads(row.entry) for key, row in self.store.memo.items()}

    def notices_until(self, marker: tuple[str, str]) -> list[tuple[str, str]]:
        sent, self.sent = self.store.notifications[self.sent :], len(self.store.notifications)
        assert marker in sent, (marker, sent)
        return sent[: sent.index(marker) + 1]


class TestPgSink(SinkContract):
    """The sink in PostgreSQL, committing as the consumer does by default (without waiting
    for the WAL flush)."""

    durable_commits = False

    @pytest.fixture(autouse=True)
    def _database(self, db: Database) -> Iterator[None]:
        self.db = db
        self.opened_sinks: list[PgSink] = []
        with db.connect() as listening:
            listening.execute(f"LISTEN {RUNS_CHANNEL}; LISTEN {SESSIONS_CHANNEL}")
            self.listening = listening
            yield
        for sink in self.opened_sinks:
            sink.shutdown()

    def sink(self) -> Sink:
        sink = PgSink(self.db.dsn, SLOT, durable_commits=self.durable_commits)
        self.opened_sinks.append(sink)
        return sink

    def stored_dead_letters(self) -> list[DeadLetter]:
        with self.db.connect() as conn:
            rows: list[tuple[Any, ...]] = conn.execute(
                "SELECT seq, session_id, lsn::text, kind, reason, row_data "
                "FROM ledger_dead_letters WHERE slot_name = %s",
                (SLOT,),
            ).fetchall()
        return [
            DeadLetter(seq, sid, parse_lsn(lsn), kind, reason, row)
            for seq, sid, lsn, kind, reason, row in rows
        ]

    def stored_snapshots(self) -> dict[tuple[uuid.UUID, int], AgentSnapshotRow]:
        with self.db.connect() as conn:
            rows: list[tuple[Any, ...]] = conn.execute(
                "SELECT session_id, upto_seq, upto_position, format_version, reducer_version, "
                "content_hash, data, upto_hash FROM agent_snapshots"
            ).fetchall()
        return {(r[0], r[2]): AgentSnapshotRow(*r) for r in rows}

    def stored_memo(self) -> dict[tuple[uuid.UUID, str, str, int], Any]:
        with self.db.connect() as conn:
            rows: list[tuple[Any, ...]] = conn.execute(
                "SELECT session_id, kind, call_id, completed_position, entry FROM agent_memo"
            ).fetchall()
        return {(sid, kind, call, at): entry for sid, kind, call, at, entry in rows}

    def notices_until(self, marker: tuple[str, str]) -> list[tuple[str, str]]:
        got: list[tuple[str, str]] = []
        for n in self.listening.notifies(timeout=30):
            got.append((n.channel, n.payload))
            if got[-1] == marker:
                return got
        raise AssertionError(f"{marker} not delivered within 30 s: {got}")


class TestPgSinkStaged(TestPgSink):
    """The same, every batch written by COPY into staging tables (the path of batches too
    big for one statement), each commit waiting for its WAL flush (``--sink-commit sync``)."""

    durable_commits = True

    @pytest.fixture(autouse=True)
    def _staged(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pg_sink, "_SMALL_ROWS", -1)
