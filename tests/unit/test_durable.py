"""A sink that commits without waiting for its WAL flush: which batches are durable, and the
consumer loop confirming the slot only past those."""

from __future__ import annotations

import random
import uuid

from ledger_cdc.consumer import Consumer
from ledger_cdc.consumer.server import NoLedgerServer
from ledger_cdc.sink.durable import DurableTracker
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from tests.support.fakestream import FakeSlot, Wal, running
from tests.unit.test_loop import agent_work, assert_matches, config, until


def test_a_batch_is_durable_once_the_flush_passes_a_position_read_after_its_commit() -> None:
    t = DurableTracker()
    t.committed(100)
    t.committed(200)
    assert t.durable == 0 and t.pending
    t.observed(insert_lsn=250, flush_lsn=240)  # read after both commits: bound 250, not flushed
    assert t.durable == 0
    t.committed(300)
    t.observed(insert_lsn=350, flush_lsn=250)  # the first bound is flushed; 300's is not
    assert t.durable == 200 and t.pending
    t.observed(insert_lsn=360, flush_lsn=349)
    assert t.durable == 200
    t.observed(insert_lsn=360, flush_lsn=350)
    assert t.durable == 300 and not t.pending


def test_a_flush_position_read_before_a_commit_proves_nothing_of_it() -> None:
    t = DurableTracker()
    t.observed(insert_lsn=10_000, flush_lsn=10_000)  # nothing committed yet
    t.committed(100)
    assert t.durable == 0  # the position above was read before this commit: no bound from it
    t.flushed()
    assert t.durable == 100 and not t.pending


def test_what_a_lost_connection_leaves_unknown_is_never_taken_for_durable() -> None:
    t = DurableTracker()
    t.committed(100)
    t.observed(insert_lsn=150, flush_lsn=0)
    t.committed(200)
    t.forget()
    t.observed(insert_lsn=1000, flush_lsn=1000)
    assert t.durable == 0 and not t.pending


class _LaggingSink(MemorySink):
    """Commits are visible at once and durable only when the test flushes them (as with
    synchronous_commit = off and a WAL writer that has not run yet)."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.on_disk = 0
        self.flushes = 0

    def durable(self) -> int:
        return min(self.on_disk, self.checkpoint or 0)

    @property
    def pending(self) -> bool:
        return (self.checkpoint or 0) > self.on_disk

    def flush(self) -> None:
        self.flushes += 1
        self.on_disk = self.checkpoint or 0


def test_the_loop_confirms_the_slot_only_past_what_the_sink_has_on_disk() -> None:
    wal = Wal()
    agent_work(wal, random.Random(7), sessions=6, turns=60)
    store = MemoryStore()
    sink = _LaggingSink(store)
    slot = FakeSlot(wal)
    c = Consumer(config(), sink=sink, transport=slot.transport(), server=NoLedgerServer())
    with running(c):
        until(lambda: store.checkpoint == wal.commits[-1])  # all of it visible …
        assert slot.confirmed <= sink.on_disk < wal.commits[-1]  # … none of it confirmed
        half = wal.commits[len(wal.commits) // 2]
        sink.on_disk = half  # the WAL writer got this far
        until(lambda: slot.confirmed >= half)
        assert slot.confirmed == half
        # more work: still held at what is on disk
        wal.transaction([wal.row(uuid.uuid4(), "tool.invoked", {"call_id": "x", "tool": "t"})])
        until(lambda: store.checkpoint == wal.commits[-1])
        assert slot.confirmed == half
    # a stop flushes, then confirms everything
    assert sink.flushes >= 1
    assert slot.confirmed == wal.commits[-1]
    assert_matches(store, wal)
