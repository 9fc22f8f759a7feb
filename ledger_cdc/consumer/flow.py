"""The transactions in hand, from the stream stage to the sink and back as confirmations: the
consumer loop's streaming part (:class:`Flow`).

Each run of messages read is fed to the stream stage; the committed transactions it hands over
are folded (ahead of their flush while the sink writes the previous batch) and handed to the sink
worker in batches (:class:`~ledger_cdc.consumer.policy.FlushPolicy` says when); a transaction
over the batch budget is folded and written in parts inside one sink transaction. What the sink
committed is counted, and confirmed to the server as far as it is durable; with nothing in
flight, the idle rule (:func:`~ledger_cdc.consumer.policy.idle_confirm`) confirms the WAL end.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Container, Iterable

from ledger_cdc.batching import (
    LOAD_AT_ONCE,
    Batch,
    BatchBuilder,
    SessionCache,
    SnapshotPolicy,
    context_size,
)
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.policy import CATCH_UP_DELAY, FlushPolicy, Idle, idle_confirm
from ledger_cdc.consumer.server import LedgerServer
from ledger_cdc.errors import LedgerError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import Reducers, SessionContext, encode_stored
from ledger_cdc.sink.base import Sink
from ledger_cdc.sink.worker import SinkWorker
from ledger_cdc.stream.assemble import SpilledItems, Transaction
from ledger_cdc.stream.route import Anomaly, Item, LedgerStream
from ledger_cdc.stream.transport import SlotLostError, Transport

__all__ = ["PG_EPOCH", "Flow"]

log = logging.getLogger(__name__)

PG_EPOCH = 946684800.0  # 2000-01-01 in Unix seconds
READ_MANY = 256  # messages taken from the socket at a time
PROBE_EVERY = 0.05  # seconds between looks at the sink's WAL flush while batches await it


class Flow:
    """Everything between the stream and the sink for one consumer; :meth:`reset` at each
    (re)connection drops what was in hand (the server sends it again)."""

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        sink: Sink,
        stream: Transport,
        server: LedgerServer,
        metrics: Metrics,
        reducers: Reducers,
        nonce: str,
        on_batch: Callable[[Batch, Metrics], None] | None,
    ) -> None:
        self.config, self.sink, self.stream, self.server = config, sink, stream, server
        self.metrics, self.on_batch, self._nonce = metrics, on_batch, nonce
        self.schema: str | None = None  # the ledger table's schema (None: not looked up)
        # of the memory limit: 35 % buffered transactions, 15 % the cache, 15 % the batch in
        # hand; the rest is headroom for what a batch transiently adds (its encoded rows)
        limit = config.memory_limit
        self.budget = max(1, limit * 15 // 100)
        self.cache = SessionCache(limit * 15 // 100)
        self.builder = BatchBuilder(
            load=lambda ids: _load_contexts(self, ids),
            cache=self.cache,
            budget=self.budget,
            reducers=reducers,
            snapshots=SnapshotPolicy(config.snapshot_every),
            channel=config.notify_channel,
            notify_sessions=config.notify_sessions,
            publish=bool(sink.publishers),
            spill_dir=config.spill_dir,
            on_anomaly=self._on_anomaly,
            by_reference=sink.by_reference,
            folds=config.fold,
            fill_gap=lambda *at: _gap_rows(self, *at),  # positions the stream skipped, read back
        )
        self.policy = FlushPolicy(
            config.batch_size,
            self.budget,
            config.max_delay,
            catch_up_delay=0.0 if config.sinks else CATCH_UP_DELAY,
        )
        self.worker = SinkWorker(sink)
        self.sent_at = 0.0  # when the server sent the last run of messages read (Unix time)
        self._probed_at = 0.0
        self.reset(0)

    def reset(self, checkpoint: int) -> None:
        """A new stream from ``checkpoint``: nothing in hand, nothing submitted beyond it."""
        self.ledger = LedgerStream(
            skip_upto=checkpoint,
            memory_limit=self.config.memory_limit * 35 // 100,
            spill_dir=self.config.spill_dir,
            schema=self.schema,
            nonce=self._nonce,
            on_heartbeat=self._on_heartbeat,
            on_count=self.metrics.count,
        )
        self.assembler = self.ledger.assembler
        self._pending: list[Transaction[Item]] = []  # taken, not folded yet
        self.builder.drop_ahead()
        self.policy.reset()
        self._idle_lsn: int | None = None  # heartbeat LSN to confirm when nothing is in flight
        self._idle_hb_at: float | None = None
        self.submitted = checkpoint  # the end LSN of the last batch handed to the sink

    def recover(self) -> None:
        """After a failure: let the sink finish what it has, forget what it had not."""
        self.worker.wait()
        with contextlib.suppress(Exception):
            self.worker.take()
        self.cache.clear()

    def close(self) -> None:
        self.recover()
        self.worker.close()

    # -- streaming ------------------------------------------------------------------------------

    def run(self, stop: threading.Event, lost: threading.Event) -> int:
        """Stream until ``stop``; then commit what is in hand and return the position confirmed.
        SlotLostError when ``lost`` is set (the slot check found the slot invalidated)."""
        stream, worker, metrics, policy = self.stream, self.worker, self.metrics, self.policy
        feed, take, read_many, stopping = (
            self.ledger.feed,
            self._take,
            stream.read_many,
            stop.is_set,
        )
        # A publisher (JetStream) handles its acknowledgements on a thread of this process: a
        # loop folding ahead while the sink writes would hold the interpreter from it (a
        # fan-out drain is slower so). It then folds ahead only while the sink is idle.
        ahead_while_writing = not self.sink.publishers
        drained = False  # the last read took what the socket had: none ready, most likely
        while True:
            if worker.done:
                self.collect()
            if lost.is_set():
                lost.clear()
                raise SlotLostError(f"slot {self.config.slot} was invalidated (wal_status lost)")
            msgs = [] if drained else read_many(READ_MANY)
            drained = False
            if msgs:
                drained = len(msgs) < READ_MANY  # (else the idle pass's wait finds more)
                metrics.server_wal_end = msgs[-1].wal_end
                self.sent_at = msgs[-1].send_time.timestamp()  # by the server's clock
                msgs.reverse()  # popped as handled: a large message is not held to the end
                while msgs:
                    msg = msgs.pop()
                    txns = feed(msg.payload, msg.data_start)
                    if txns:
                        take(txns)
                del msg
                if self._pending and (ahead_while_writing or not worker.busy):
                    self._fold_ahead()
                if policy.full:
                    self.flush(wait=True)  # the batch is full: wait for the sink if it is busy
                elif policy.overdue(worker.busy):
                    self.flush()
                if stopping():
                    return self.finish()
                continue
            self._idle()
            if stopping():
                return self.finish()
            timeout = policy.wait_timeout()
            if self.sink.pending:
                timeout = min(timeout, PROBE_EVERY)
            stream.wait(timeout, worker.wakeup_fd)

    def _idle(self) -> None:
        """Nothing ready: hand what we have to the sink (if it is free), learn what became
        durable, confirm an idle position."""
        stream, worker = self.stream, self.worker
        if (self.in_hand() or self._idle_lsn is not None) and not worker.busy:
            self.flush(inline=True)
        self.metrics.server_wal_end = max(self.metrics.server_wal_end, stream.wal_end)
        if self.sink.pending and not worker.busy:
            # committed batches not known to be on disk yet: look (no write, no wait) at most
            # every PROBE_EVERY; they are confirmed once they are
            now = time.monotonic()
            if now - self._probed_at >= PROBE_EVERY:
                self._probed_at = now
                self.sink.probe()
                self.confirm_durable()
        to = idle_confirm(
            Idle(
                sink_busy=worker.busy,
                submitted=self.submitted,
                confirmed=stream.confirmed,
                unsettled=bool(self.sink.pending),
                in_flight=bool(self.assembler.in_flight),
                in_hand=self.in_hand(),
                wal_end=stream.wal_end,
            )
        )
        if to is not None:
            stream.confirm(to, force=False)
            self.metrics.confirmed_lsn = stream.confirmed

    def finish(self) -> int:
        """At a stop: the batch in hand committed, everything durable confirmed, now."""
        self.worker.wait()
        self.collect()
        if self.in_hand() or self._idle_lsn is not None:
            self.flush(wait=True)
            self.worker.wait()
            self.collect()
        self.sink.flush()  # every batch committed on disk: all of it may be confirmed
        self.confirm_durable()
        self.stream.confirm(self.stream.confirmed, force=True)  # the last position, now
        return self.stream.confirmed

    # -- what the stream stage hands over -------------------------------------------------------

    def _take(self, txns: list[Transaction[Item]]) -> None:
        sent = self.sent_at - PG_EPOCH
        for t in txns:
            if t.spilled or t.size > self.budget:
                self._commit_large(t)
                continue
            self._pending.append(t)
            self.policy.add(len(t.items), t.size, sent - t.commit_ts / 1e6)

    def in_hand(self) -> bool:
        """Whether transactions were taken that no batch handed to the sink holds yet: pending,
        or folded ahead into the next batch."""
        return bool(self._pending) or bool(self.builder.folded_ahead)

    def _fold_ahead(self) -> None:
        """Fold what is in hand into the next batch now, ahead of its flush, as far as no load
        is needed (:meth:`BatchBuilder.fold_ahead`): while the sink writes one batch, the loop
        folds the next instead of waiting for the socket, and the sink, once free, is not kept
        waiting for a fold. Committed, confirmed and dropped on failure with the rest in hand."""
        done = self.builder.fold_ahead(self._pending)
        if done:
            del self._pending[:done]

    def _on_heartbeat(self, lsn: int, sent: float) -> None:
        """Our own heartbeat, back through the slot: the end-to-end lag, and an idle position to
        confirm."""
        self.metrics.heartbeat_lag = max(0.0, time.time() - sent)
        if not self.assembler.in_flight:
            self._idle_lsn = lsn
            self._idle_hb_at = sent

    def _on_anomaly(self, anomaly: Anomaly) -> None:
        self.metrics.anomalies += 1

    def _commit_large(self, txn: Transaction[Item]) -> None:
        """A transaction over the batch budget: folded in parts as it is read back, committed
        with its checkpoint, confirmed."""
        # a few changes need no sorting by session: they are one window of loads anyway
        grouped = len(txn.items) <= LOAD_AT_ONCE
        events, dead = self.commit_in_parts(txn, _sized(txn), epoch=None, grouped=grouped)
        self.submitted = max(self.submitted, txn.end_lsn)
        # (its sessions' rows are written once per chunk that touches them: at most once per
        # event)
        self.count_committed(1, events, dead, txn.commit_ts, time.time(), rows=events)

    def commit_in_parts(
        self,
        txn: Transaction[Item],
        sized: Iterable[tuple[Item, int]],
        *,
        epoch: int | None,
        grouped: bool,
        projected: Container[uuid.UUID] | None = None,
    ) -> tuple[int, int]:
        """Everything before it committed first, then one big transaction folded in parts and
        written in chunks inside one sink transaction that ends with its checkpoint. Returns
        (events folded, dead letters), once committed. ``projected``: see BatchBuilder.big."""
        self._commit_in_hand()
        run, chunks, finish = self.builder.big(
            txn,
            sized,
            epoch=epoch,
            grouped=grouped,
            write_part=self.sink.write_part,
            projected=projected,
        )
        with self.stream.keepalive_during():
            self.sink.commit_chunked(chunks, finish)
        return run.events, run.dead

    # -- flushing -------------------------------------------------------------------------------

    def flush(self, *, wait: bool = False, inline: bool = False) -> None:
        """Fold the pending transactions (as many as fit a batch) and hand the batch to the
        sink worker; with ``inline``, a small batch is committed here and now instead
        (:meth:`FlushPolicy.inline`)."""
        worker = self.worker
        if worker.busy:
            if not wait:
                return
            with self.stream.keepalive_during():
                worker.wait()
        self.collect()
        txns, self._pending = self._pending, []
        if txns or self.builder.folded_ahead:
            batch, rest = self.builder.fold(txns)
        else:
            batch, rest = Batch(end_lsn=0), []
        self._pending = rest
        self.policy.reset(sum(len(t.items) for t in rest), sum(t.size for t in rest))
        hb_at = None
        if not rest and self._idle_lsn is not None and not self.assembler.in_flight:
            if self._idle_lsn > batch.end_lsn:
                batch.end_lsn = self._idle_lsn
            hb_at = self._idle_hb_at
            self._idle_lsn = self._idle_hb_at = None
        if batch.end_lsn <= self.submitted:
            return
        batch.heartbeat_at = hb_at
        self.submitted = batch.end_lsn
        if inline and self.policy.inline(batch.transactions, batch.stored_size()):
            self.sink.commit(batch)
            batch.committed_at = time.time()
            self._account(batch)
            return
        batch.freeze()  # (the loop folds on into the same contexts while the sink writes it)
        worker.submit(batch)

    def _commit_in_hand(self) -> None:
        """Commit everything folded or pending before what comes next, in order."""
        while self.in_hand() or self.worker.busy:
            self.flush(wait=True)
            with self.stream.keepalive_during():
                self.worker.wait()
            self.collect()

    def collect(self) -> None:
        """If the sink finished a batch: account it and confirm its LSN (raise what it
        raised)."""
        batch = self.worker.take()
        if batch is not None:
            self._account(batch)

    def _account(self, batch: Batch) -> None:
        self.count_committed(
            batch.transactions,
            batch.events,
            len(batch.dead_letters),
            batch.last_commit_ts,
            batch.committed_at,
            rows=len(batch.sessions),
        )
        if self.on_batch is not None:
            self.on_batch(batch, self.metrics)

    def count_committed(
        self,
        transactions: int,
        events: int,
        dead: int,
        last_commit_ts: int | None,
        committed_at: float | None,
        *,
        rows: int,
    ) -> None:
        """What the sink committed: count it; confirm to the server as much of it as is durable
        (all of it, unless the sink commits without waiting for its disk: then what a later
        look found flushed)."""
        self.confirm_durable()
        m = self.metrics
        m.skipped_transactions = self.assembler.skipped
        m.spills = self.assembler.spills
        m.batches += 1
        m.transactions += transactions
        m.events += events
        m.dead_letters += dead
        m.session_rows += rows
        if last_commit_ts:
            m.last_commit_ts = PG_EPOCH + last_commit_ts / 1e6
            m.last_applied_at = committed_at

    def confirm_durable(self) -> None:
        lsn = self.sink.durable()
        held = self.assembler.oldest_prepared_lsn()
        if held is not None and lsn > held:  # (see there: a prepare held in memory)
            lsn = held
        if lsn > self.stream.confirmed:
            self.stream.confirm(lsn, force=False)
            self.metrics.confirmed_lsn = lsn


def _sized(txn: Transaction[Item]) -> Iterable[tuple[Item, int]]:
    """A large transaction's items, each with its size: read back from its spill file, or in
    memory with its share of the transaction's size."""
    items = txn.items
    if isinstance(items, SpilledItems):
        return items.sized()
    share = txn.size // max(1, len(items))
    return ((it, share) for it in items)


def _gap_rows(flow: Flow, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
    """Session ``sid``'s rows at positions ``first``..``last``, from the ledger table (the
    builder folds them where the stream skipped them)."""
    rows = flow.server.gap_rows(sid, first, last)
    flow.metrics.count("stream_gap_rows_read_total", len(rows))
    return rows


def _load_contexts(
    flow: Flow, session_ids: Iterable[uuid.UUID]
) -> dict[uuid.UUID, tuple[SessionContext, int]]:
    """The sink's projections of these sessions; one the sink could not use (see
    PgSink.load_contexts_sized) is rebuilt from the ledger — its latest usable snapshot and
    the tail, as rebuild_context does — and logged, instead of folding on from nothing
    (wrong) or failing the batch for good."""
    found = flow.sink.load_contexts_sized(session_ids)
    unusable = flow.sink.unusable
    while unusable:
        sid, why = unusable.popitem()
        try:
            ctx, memo = flow.server.rebuild(sid)
        except LedgerError as e:
            log.error(
                "projection of session %s is unusable (%s) and cannot be rebuilt from the "
                "ledger (%s): folded on from nothing; `verify` will show it",
                sid,
                why,
                e,
            )
            continue
        log.warning(
            "projection of session %s is unusable (%s): rebuilt from the ledger at position %d",
            sid,
            why,
            ctx.last_position,
        )
        flow.metrics.count("projections_rebuilt_total")
        found[sid] = (ctx, context_size(ctx, encode_stored(ctx)))
        flow.builder.rebuilt[sid] = list(memo)  # written with the next batch of its events
    return found
