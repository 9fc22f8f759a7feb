"""The consumer loop: it connects, reads, hands each message to the stages, flushes, settles,
confirms and reconnects. What it decides by rule lives in the stages' own objects:

- :class:`~ledger_cdc.stream.route.LedgerStream`: bytes → committed ledger transactions
  (routing, dead-letter shaping, heartbeats);
- :class:`~ledger_cdc.sink.batch.BatchBuilder`: transactions → the batch one sink transaction
  writes (fold, snapshot policy, run-ready notices, memory budget);
- :class:`~ledger_cdc.consumer.policy.FlushPolicy`: when the batch in hand goes to the sink;
- :class:`~ledger_cdc.sink.worker.SinkWorker`: the sink on a thread of its own (group commit);
- :mod:`~ledger_cdc.consumer.resync`: a bootstrap from the table as of an exported snapshot;
- :mod:`~ledger_cdc.consumer.tasks`: heartbeat, lease watch, partition keeper, slot guard.

The LSN confirmed to the server is the end LSN of the last transaction whose projections are
committed, never more; with nothing in flight, the WAL end of keepalives and heartbeats is
confirmed too, so an idle slot keeps advancing. A lost connection, terminated walsender or
restarted server is retried with :class:`~ledger_cdc.retry.Backoff`, from the stored checkpoint,
dropping whatever was in flight (the server sends it again; transactions at or below the
checkpoint are skipped).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from psycopg import sql

from ledger_cdc.admin.schema import drop_slot, slot_misfit
from ledger_cdc.client.read import load_events
from ledger_cdc.client.recovery import rebuild_context
from ledger_cdc.consumer import divergence
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.policy import CATCH_UP_DELAY, FlushPolicy, Idle, idle_confirm
from ledger_cdc.consumer.resync import History, connected, count_unfolded, preflight
from ledger_cdc.consumer.tasks import (
    VACUUM_TICK,
    Periodic,
    SlotGuard,
    heartbeat,
    lease_watch,
    partition_keeper,
    vacuum,
)
from ledger_cdc.errors import ConfigError, FencedError, LedgerError, RefusedError, RetryableError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import (
    CompletedModel,
    CompletedTool,
    SessionContext,
    default_reducers,
    encode_stored,
)
from ledger_cdc.lsn import format_lsn
from ledger_cdc.retry import Backoff
from ledger_cdc.sink.base import BOOTSTRAPPING, Sink
from ledger_cdc.sink.batch import (
    LOAD_AT_ONCE,
    Batch,
    BatchBuilder,
    SessionCache,
    SnapshotPolicy,
    context_size,
)
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.sink.worker import SinkWorker
from ledger_cdc.stopping import on_stop_signals
from ledger_cdc.stream.assemble import SpilledItems, Transaction
from ledger_cdc.stream.route import Anomaly, Item, LedgerStream
from ledger_cdc.stream.transport import (
    ReplicationStream,
    SlotBusyError,
    SlotError,
    SlotLostError,
    Transport,
)

__all__ = ["Consumer", "ConsumerConfig", "Metrics", "count_unfolded"]

log = logging.getLogger(__name__)

_PG_EPOCH = 946684800.0  # 2000-01-01 in Unix seconds

_HEALTHY_AFTER = 30.0  # seconds of streaming after which a failure starts the backoff over
_READ_MANY = 256  # messages taken from the socket at a time
PROBE_EVERY = 0.05  # seconds between looks at the sink's WAL flush while batches await it


def _memo_rows(conn: Any, ctx: SessionContext) -> list[tuple[uuid.UUID, int, Any]]:
    """The agent_memo rows of every call ``ctx`` (folded with its memo) completed."""
    calls: list[CompletedTool | CompletedModel] = [
        *ctx.completed_tools.values(),
        *ctx.completed_models.values(),
    ]
    seqs = [c.observed_seq if isinstance(c, CompletedTool) else c.responded_seq for c in calls]
    at = dict(
        conn.execute(
            "SELECT seq, position FROM agent_events WHERE session_id = %s AND seq = ANY(%s)",
            (ctx.session_id, seqs),
        ).fetchall()
    )
    return [(ctx.session_id, at[s], c) for s, c in zip(seqs, calls, strict=True) if s in at]


class Consumer:
    """Runs until :meth:`stop` (or SIGINT, SIGTERM, SIGHUP: :meth:`install_signal_handlers`).

    ``sink`` and ``transport`` default to the PostgreSQL projections of ``config.target_dsn``
    (or ``config.dsn``) and the slot's replication stream; given (an in-memory sink, a stream
    of prepared bytes), the loop runs without a server, and without the preflight checks and
    periodic tasks, which talk to one. ``prefetched`` is the slot's stream already begun by
    the caller (:meth:`ReplicationStream.prefetch`: ``ledger-cdc consume`` begins it before
    loading the rest of itself), used if it streams what ``config`` says, closed if not."""

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        on_batch: Callable[[Batch, Metrics], None] | None = None,
        sink: Sink | None = None,
        transport: Transport | None = None,
        prefetched: ReplicationStream | None = None,
    ) -> None:
        config.check()
        self.config = config
        self.metrics = Metrics()
        self.on_batch = on_batch
        self._stop = threading.Event()
        self._stopped_at = 0  # the position confirmed when the consumer stopped
        self._standalone = sink is not None or transport is not None
        if sink is None:
            pg = PgSink(
                config.target_dsn or config.dsn,
                config.slot,
                idle_timeout=config.sink_idle_timeout,
                publication=config.publication,
                # another database than the ledger's cannot read its events: copy them
                by_reference=not config.target_dsn,
                durable_commits=config.sink_commit == "sync",
                folds=config.fold,
            )
            for url in config.sinks:
                from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings

                pg.publishers.append(
                    JetStreamPublisher(JetStreamSettings.from_url(url), config.slot)
                )
            sink = pg
        self.sink: Sink = sink
        if transport is None:
            stream = ReplicationStream(
                config.dsn,
                config.slot,
                config.publication,
                proto_version=config.proto_version,
                streaming=config.streaming,
                status_interval=config.status_interval,
            )
            # begun by the caller (ReplicationStream.prefetch): used if it streams the same
            if prefetched is not None and prefetched.same_as(stream):
                stream, prefetched = prefetched, None
            stream.failover = config.failover
            transport = stream
        if prefetched is not None:
            prefetched.close()
        self.stream: Transport = transport
        self.reducers = config.reducers or default_reducers()
        # of the memory limit: 35 % buffered transactions, 15 % the cache, 15 % the batch in
        # hand; the rest is headroom for what a batch transiently adds (its encoded rows)
        limit = config.memory_limit
        self._budget = max(1, limit * 15 // 100)
        self._cache = SessionCache(limit * 15 // 100)
        self.builder = BatchBuilder(
            load=self._load_contexts,
            cache=self._cache,
            budget=self._budget,
            reducers=self.reducers,
            snapshots=SnapshotPolicy(config.snapshot_every),
            channel=config.notify_channel,
            notify_sessions=config.notify_sessions,
            publish=bool(self.sink.publishers),
            spill_dir=config.spill_dir,
            on_anomaly=self._on_anomaly,
            by_reference=bool(getattr(self.sink, "by_reference", False)),
            folds=config.fold,
            # positions the stream skipped, read from the ledger (not for a stand-in sink or
            # stream: tests', which may have no ledger database behind them)
            fill_gap=None if self._standalone else self._gap_rows,
        )
        self.flush_policy = FlushPolicy(
            config.batch_size,
            self._budget,
            config.max_delay,
            catch_up_delay=0.0 if config.sinks else CATCH_UP_DELAY,
        )
        self._worker = SinkWorker(self.sink)
        self._guard = SlotGuard(config.slot, config.thresholds, self.metrics, config.publication)
        self._backoff = Backoff(
            base=config.reconnect_base, cap=config.reconnect_cap, healthy_after=_HEALTHY_AFTER
        )
        self._standing_by = False
        self._nonce = os.urandom(12).hex()  # marks this process's heartbeats
        self._schema: str | None = None  # the ledger table's schema (None: not looked up)
        self._probed_at = 0.0
        self._sent_at = 0.0  # when the server sent the last run of messages read (Unix time)
        self._reset_stream_state(0)

    # -- control --------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        for pub in self.sink.publishers:  # a publish a server does not answer ends soon, too
            pub.stopping()

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Whether a stop was asked for (:meth:`stop`), waiting up to ``timeout`` seconds."""
        return self._stop.wait(timeout)

    def install_signal_handlers(self) -> None:
        """SIGINT, SIGTERM and SIGHUP stop the consumer after its current batch (the handler
        takes no lock: see :mod:`ledger_cdc.stopping`)."""
        on_stop_signals(self.stop)

    def _reset_stream_state(self, checkpoint: int) -> None:
        self.ledger = LedgerStream(
            skip_upto=checkpoint,
            memory_limit=self.config.memory_limit * 35 // 100,
            spill_dir=self.config.spill_dir,
            schema=self._schema,
            nonce=self._nonce,
            on_heartbeat=self._on_heartbeat,
            on_count=self.metrics.count,
        )
        self.assembler = self.ledger.assembler
        self._pending: list[Transaction[Item]] = []  # taken, not folded yet
        self.builder.drop_ahead()
        self.flush_policy.reset()
        self._idle_lsn: int | None = None  # heartbeat LSN to confirm when nothing is in flight
        self._idle_hb_at: float | None = None
        self._submitted_lsn = checkpoint

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Stream until stopped; reconnects by itself on connection failures."""
        # The session cache is a large, long-lived object graph: the default collector thresholds
        # rescan it again and again while every message allocates. Collect far less often.
        gc.set_threshold(50_000, 50, 1000)
        cfg = self.config
        # publishers (JetStream) connect on their own threads while the checks below run
        publishers = getattr(self.sink, "publishers", []) if not self._standalone else []
        connecting = [(pub, pub.start_connect()) for pub in publishers]
        try:
            if not self._standalone:
                first = True
                while not self._stop.is_set():  # permanent problems stop here, within seconds
                    try:
                        self._schema = preflight(
                            cfg.dsn, cfg.publication, cfg.target_dsn, slot=cfg.slot
                        )
                        break
                    except RefusedError as e:
                        if first:  # (at the start, a fix is likelier than a full server)
                            raise ConfigError(str(e)) from e
                        self._back_off(str(e))
                    except RetryableError as e:
                        self._back_off(str(e))
                    first = False
                self._start_tasks()
                self._connect_publishers(connecting)
            while not self._stop.is_set():
                try:
                    self._attempt()
                except RetryableError as e:  # connection lost, server restarting, NATS …
                    self._back_off(str(e))
        finally:
            self.metrics.set_state("stopped")
            self._worker.wait()
            with contextlib.suppress(Exception):
                self._worker.take()
            self._worker.close()
            self.stream.close()
            self.sink.shutdown()
            self._await_confirmed()

    def _connect_publishers(self, connecting: list[tuple[Any, Any]]) -> None:
        """Each publisher (JetStream) connected, its stream made or checked, before streaming:
        a stream whose settings it may not change stops the consumer now, not at its first
        event, and the first batch does not wait for the connection. One out of reach for now
        is left to its first batch, which tries again."""
        for pub, started in connecting:
            try:
                pub.connect(timeout=5, started=started)
            except RetryableError as e:
                log.warning("%s; the first batch tries again", e)

    def _await_confirmed(self, timeout: float = 5.0) -> None:
        """After a stop: until the server shows the last confirmed position in the slot, so
        that a consumer that exited 0 has confirmed everything it committed. The walsender
        reads the final status message on its own time, and may never read it: a connection
        closed while the server is still streaming is reset, and what the walsender had not
        read is lost with it. So a slot still behind once its walsender is gone (the slot not
        active) is advanced there with ``pg_replication_slot_advance``: the position is that
        of batches committed and on disk. Bounded; best effort (a standby that took the slot
        meanwhile starts from the checkpoint anyway)."""
        lsn = self._stopped_at
        if self._standalone or not lsn:
            return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception), connected(self.config.dsn, "ledger database") as c:
            c.execute("SELECT set_config('statement_timeout', %s, false)", (f"{timeout:.0f}s",))
            while time.monotonic() < deadline:
                row = c.execute(
                    "SELECT confirmed_flush_lsn >= %s::pg_lsn, active FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (format_lsn(lsn), self.config.slot),
                ).fetchone()
                if row is None or row[0]:
                    return
                if not row[1]:
                    c.execute(
                        "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                        (self.config.slot, format_lsn(lsn)),
                    )
                    log.info(
                        "slot %s advanced to %s: its walsender ended before reading the last "
                        "confirmation",
                        self.config.slot,
                        format_lsn(lsn),
                    )
                    return
                time.sleep(0.01)

    def _attempt(self) -> None:
        """Connect and stream until something stops it. Everything but a retryable error is
        handled here; that one is the caller's."""
        try:
            self._connect()
            self._backoff.succeeded()
            if self._standing_by:
                self._standing_by = False
                self.metrics.extra["standby"] = 0.0
                log.warning("slot %s acquired: this consumer is active now", self.config.slot)
            self._stream_loop()
        except SlotLostError as e:
            self._recover()
            self._slot_lost(e)
        except SlotBusyError as e:
            self._stand_by(e)
        except FencedError as e:
            # another consumer moved the checkpoint: we wrote nothing; wait for the slot
            log.warning("%s", e)
            self._recover()
            self._standing_by = True
            self._stop.wait(self.config.standby_poll)

    def _stand_by(self, e: SlotBusyError) -> None:
        """Hot standby: another consumer streams the slot. Try again every ``standby_poll``
        seconds (no backoff): the server frees the slot as soon as the active consumer's
        connection closes, so a dead consumer is replaced within about a second."""
        if not self._standing_by:
            self._standing_by = True
            log.warning("%s; standing by (retrying every %.1fs)", e, self.config.standby_poll)
        self.metrics.extra["standby"] = 1.0
        self.metrics.set_state("standby")
        self._recover()
        self._stop.wait(self.config.standby_poll)

    def _back_off(self, why: str) -> None:
        """After a failure: recover, then wait (capped exponential backoff with jitter)."""
        if self._stop.is_set():  # (stopping anyway: no reconnect to announce)
            log.warning("%s", why)
            self._recover()
            return
        self.metrics.reconnects += 1
        self.metrics.set_state("connecting")
        delay = self._backoff.failed()
        log.warning("%s; reconnecting in %.2fs", why, delay)
        self._recover()
        self._stop.wait(delay)

    def _recover(self) -> None:
        """After a failure: let the sink finish what it has, forget what it had not."""
        self._worker.wait()
        with contextlib.suppress(Exception):
            self._worker.take()
        self.stream.close()
        self.sink.close()
        self._cache.clear()

    def _connect(self) -> None:
        self.metrics.set_state("connecting")
        checkpoint = self.sink.load_checkpoint() or 0
        self._cache.clear()  # the projections may have moved on without us (fencing)
        if (
            self.config.target_dsn
            and self.config.fold
            and not self._standalone
            and self._diverged(checkpoint)
        ):
            return
        if self.sink.epoch == BOOTSTRAPPING:
            log.warning(
                "a bootstrap of slot %s was interrupted; starting it again", self.config.slot
            )
            self._refuse_misfit(None)  # (the slot is dropped and made again)
            self._bootstrap(drop=True)
            return
        self._reset_stream_state(checkpoint)
        try:
            self.stream.start(checkpoint)
        except SlotError as e:
            self._refuse_misfit(e)
            if self.config.create_slot:
                log.info(
                    "slot %s does not exist: creating it and %s the ledger's history",
                    self.config.slot,
                    "folding" if self.config.fold else "publishing",
                )
            elif checkpoint and self.config.on_slot_lost == "resync":
                # streamed before, so the slot was dropped (by hand, a failover to a standby
                # without it, a restore): lost as much as an invalidated one
                self.metrics.count("slot_resyncs_total")
                log.error(
                    "slot %s no longer exists (dropped, or a failover to a server without it); "
                    "creating it and resynchronising from the ledger table (--on-slot-lost "
                    "exit stops instead)",
                    self.config.slot,
                )
            else:
                if checkpoint:
                    log.error("%s; exiting (--on-slot-lost exit)", e)
                raise
            self._bootstrap(drop=False)
            return
        except SlotLostError as e:
            self._slot_lost(e)
            return
        except ConfigError as e:  # (another plugin's slot refuses pgoutput's options)
            self._refuse_misfit(e)
            raise
        self.metrics.confirmed_lsn = self.stream.confirmed
        self.metrics.set_state("streaming")
        early = getattr(self.stream, "adopted", None)
        log.info(
            "streaming slot %s from %s%s",
            self.config.slot,
            format_lsn(checkpoint),
            "" if early is None else f" (begun {early[0]:.2f}s ago, {early[1]:,} bytes read ahead)",
        )

    def _diverged(self, checkpoint: int) -> bool:
        """Projections in another database that may no longer agree with the ledger's server
        (a failover lost what they folded, or the server was restored): the slot is rebuilt
        from the ledger table, which is the truth (:meth:`_bootstrap` discards the sessions
        ahead of it first). True when it was (the stream then runs from the new slot)."""
        cfg = self.config
        assert cfg.target_dsn is not None
        found, me = divergence.check(cfg.dsn, cfg.target_dsn, cfg.slot, checkpoint)
        if found:
            self.metrics.count("divergence_repairs_total")
            for why in found.reasons:
                log.error("the projections do not agree with the ledger's server: %s", why)
            self._refuse_misfit(None)  # (the slot is dropped and made again)
            self._bootstrap(drop=True)
        if me is not None:
            divergence.record(cfg.target_dsn, cfg.slot, me)
        return bool(found)

    def _discard_ahead(self) -> None:
        """Before a bootstrap into another database: the projections the ledger does not hold
        as they folded them are discarded, so that it folds those sessions from their first
        event (a projection ahead of the ledger would otherwise skip, by position, what the
        ledger holds there now)."""
        cfg = self.config
        assert cfg.target_dsn is not None
        with (
            connected(cfg.dsn, "ledger database") as ledger,
            connected(cfg.target_dsn, "projection database") as target,
        ):
            ahead = divergence.projections_ahead(ledger, target)
        for sid, pos, head in ahead[:20]:
            log.error(
                "session %s: its projection is at position %d, the ledger's head at %d with "
                "another history: discarded, folded again from the ledger",
                sid,
                pos,
                head,
            )
        if len(ahead) > 20:
            log.error("… and %d sessions more", len(ahead) - 20)
        if ahead:
            self.metrics.count("sessions_refolded_total", len(ahead))
            divergence.discard(cfg.target_dsn, [sid for sid, _, _ in ahead])

    def _refuse_misfit(self, cause: BaseException | None) -> None:
        """SlotError if the slot is not a pgoutput slot of the ledger's database: somebody
        else's (a standby's physical slot, another tool's), never read, dropped or replaced.
        PostgreSQL 15 says "invalidated" of any slot without a restart LSN, a physical slot
        that never reserved WAL included, and 16+ refuses a physical slot in words of its own:
        the server's error alone does not tell them from the ledger's slot lost."""
        with connected(self.config.dsn, "ledger database (the slot)") as conn:
            misfit = slot_misfit(conn, self.config.slot)
        if misfit is not None:
            raise SlotError(misfit) from cause

    def _slot_lost(self, e: SlotLostError) -> None:
        self._refuse_misfit(e)
        self.metrics.count("slot_resyncs_total")
        if self.config.on_slot_lost == "exit":
            log.error("%s; exiting (--on-slot-lost exit)", e)
            raise e
        log.error("%s; resynchronising from the ledger table", e)
        self._bootstrap(drop=True)

    def _bootstrap(self, *, drop: bool) -> None:
        """Create the slot with an exported snapshot, fold what the projections lack from the
        table as of that snapshot, then stream from the slot's consistent point: no gap (the
        stream has everything committed after the snapshot) and no double (what the snapshot
        holds is not in the stream; what a projection already folded is skipped by position)."""
        cfg = self.config
        self.metrics.set_state("resyncing")
        self.stream.close()  # (a prefetch would hold the slot the drop below ends)
        self.sink.mark_bootstrap()  # a crash from here on makes the next start redo all of it
        if drop:  # (each caller has refused a slot not ours: _refuse_misfit)
            drop_slot(cfg.dsn, cfg.slot, force=True)
        try:
            consistent, snapshot = self.stream.create_slot_exported()
        except ConfigError:
            if not drop:  # nothing was lost: the next start need not take this for a bootstrap
                self.sink.unmark_bootstrap()
            raise
        if cfg.target_dsn and cfg.fold:
            self._discard_ahead()
        positions = self.sink.positions()
        self._reset_stream_state(consistent)
        self._cache.clear()
        with connected(cfg.dsn, "ledger database (bootstrap)", autocommit=False) as src:
            src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            history = History(
                src,
                positions,
                lsn=consistent,
                version=self.reducers.version,
                other_database=bool(cfg.target_dsn),
                progress=cfg.progress,
            )
            txn: Transaction[Item] = Transaction(0, consistent, consistent, 0, [])
            events, dead = self._apply_big(txn, history, epoch=0, grouped=True)
            src.rollback()
        # the snapshot is no longer needed: everything after it comes from the stream
        history.done()
        self._submitted_lsn = consistent
        self.stream.start(consistent, reuse=True)
        self._confirmed(0, events, dead, None, None, rows=events)
        self.metrics.set_state("streaming")
        log.info(
            "slot %s created at %s; %d events %s from the table",
            cfg.slot,
            format_lsn(consistent),
            history.folded,
            "folded" if cfg.fold else "published",
        )

    def _stream_loop(self) -> None:
        stream = self.stream
        worker = self._worker
        feed = self.ledger.feed
        take = self._take
        policy = self.flush_policy
        stopping = self._stop.is_set
        metrics = self.metrics
        lost = self._guard.lost
        read_many = stream.read_many
        # A publisher (JetStream) handles its acknowledgements on a thread of this process: a
        # loop folding ahead while the sink writes would hold the interpreter from it (a
        # fan-out drain is slower so). It then folds ahead only while the sink is idle.
        ahead_while_writing = not self.sink.publishers
        drained = False  # the last read took what the socket had: none ready, most likely
        while True:
            if worker.done:
                self._settle()
            if lost.is_set():
                lost.clear()
                raise SlotLostError(f"slot {self.config.slot} was invalidated (wal_status lost)")
            msgs = [] if drained else read_many(_READ_MANY)
            drained = False
            if msgs:
                drained = len(msgs) < _READ_MANY  # (else the idle pass's wait finds more)
                metrics.server_wal_end = msgs[-1].wal_end
                self._sent_at = msgs[-1].send_time.timestamp()  # by the server's clock
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
                    self._flush(wait=True)  # the batch is full: wait for the sink if it is busy
                elif policy.overdue(worker.busy):
                    self._flush()
                if stopping():
                    self._drain()  # finish the batch in hand, commit, confirm
                    return
                continue
            # nothing ready: hand what we have to the sink (if it is free), confirm an idle
            # position, then wait for the socket or for the sink to finish
            if (self._in_hand() or self._idle_lsn is not None) and not worker.busy:
                self._flush(inline=True)
            metrics.server_wal_end = max(metrics.server_wal_end, stream.wal_end)
            if self.sink.pending and not worker.busy:
                # committed batches not known to be on disk yet: look (no write, no wait) at
                # most every PROBE_EVERY; they are confirmed once they are
                now = time.monotonic()
                if now - self._probed_at >= PROBE_EVERY:
                    self._probed_at = now
                    self.sink.probe()
                    self._confirm_durable()
            to = idle_confirm(
                Idle(
                    sink_busy=worker.busy,
                    submitted=self._submitted_lsn,
                    confirmed=stream.confirmed,
                    unsettled=bool(self.sink.pending),
                    in_flight=bool(self.assembler.in_flight),
                    in_hand=self._in_hand(),
                    wal_end=stream.wal_end,
                )
            )
            if to is not None:
                stream.confirm(to, force=False)
                metrics.confirmed_lsn = stream.confirmed
            if stopping():
                self._drain()
                return
            timeout = policy.wait_timeout()
            if self.sink.pending:
                timeout = min(timeout, PROBE_EVERY)
            stream.wait(timeout, worker.wakeup_fd)

    def _drain(self) -> None:
        self._worker.wait()
        self._settle()
        if self._in_hand() or self._idle_lsn is not None:
            self._flush(wait=True)
            self._worker.wait()
            self._settle()
        self.sink.flush()  # every batch committed on disk: all of it may be confirmed
        self._confirm_durable()
        self.stream.confirm(self.stream.confirmed, force=True)  # the last position, now
        self._stopped_at = self.stream.confirmed

    # -- what the stream stage hands over -------------------------------------------------------

    def _take(self, txns: list[Transaction[Item]]) -> None:
        sent = self._sent_at - _PG_EPOCH
        for t in txns:
            if t.spilled or t.size > self._budget:
                self._big(t)
                continue
            self._pending.append(t)
            self.flush_policy.add(len(t.items), t.size, sent - t.commit_ts / 1e6)

    def _in_hand(self) -> bool:
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

    def _big(self, txn: Transaction[Item]) -> None:
        """A transaction over the batch budget: folded in parts as it is read back, committed
        with its checkpoint, confirmed."""
        items = txn.items
        if isinstance(items, SpilledItems):
            sized: Iterable[tuple[Item, int]] = items.sized()
        else:  # in memory: its share of the budget is known
            share = txn.size // max(1, len(items))
            sized = ((it, share) for it in items)
        # a few changes need no sorting by session: they are one window of loads anyway
        events, dead = self._apply_big(txn, sized, epoch=None, grouped=len(items) <= LOAD_AT_ONCE)
        self._submitted_lsn = max(self._submitted_lsn, txn.end_lsn)
        # (its sessions' rows are written once per chunk that touches them: at most once per
        # event)
        self._confirmed(1, events, dead, txn.commit_ts, time.time(), rows=events)

    def _apply_big(
        self,
        txn: Transaction[Item],
        sized: Iterable[tuple[Item, int]],
        *,
        epoch: int | None,
        grouped: bool,
    ) -> tuple[int, int]:
        """Everything before it committed first, then one big transaction folded in parts and
        written in chunks inside one sink transaction that ends with its checkpoint. Returns
        (events folded, dead letters), once committed."""
        self._drain_pending()
        run, chunks, finish = self.builder.big(
            txn, sized, epoch=epoch, grouped=grouped, write_part=self.sink.write_part
        )
        with self.stream.keepalive_during():
            self.sink.commit_chunked(chunks, finish)
        return run.events, run.dead

    # -- flushing -------------------------------------------------------------------------------

    def _flush(self, *, wait: bool = False, inline: bool = False) -> None:
        """Fold the pending transactions (as many as fit a batch) and hand the batch to the
        sink worker; with ``inline``, a small batch is committed here and now instead
        (:meth:`FlushPolicy.inline`)."""
        worker = self._worker
        if worker.busy:
            if not wait:
                return
            with self.stream.keepalive_during():
                worker.wait()
        self._settle()
        txns, self._pending = self._pending, []
        if txns or self.builder.folded_ahead:
            batch, rest = self.builder.fold(txns)
        else:
            batch, rest = Batch(end_lsn=0), []
        self._pending = rest
        self.flush_policy.reset(sum(len(t.items) for t in rest), sum(t.size for t in rest))
        hb_at = None
        if not rest and self._idle_lsn is not None and not self.assembler.in_flight:
            if self._idle_lsn > batch.end_lsn:
                batch.end_lsn = self._idle_lsn
            hb_at = self._idle_hb_at
            self._idle_lsn = self._idle_hb_at = None
        if batch.end_lsn <= self._submitted_lsn:
            return
        batch.heartbeat_at = hb_at
        self._submitted_lsn = batch.end_lsn
        if inline and self.flush_policy.inline(batch.transactions, batch.stored_size()):
            self.sink.commit(batch)
            batch.committed_at = time.time()
            self._settled(batch)
            return
        batch.freeze()  # (the loop folds on into the same contexts while the sink writes it)
        worker.submit(batch)

    def _drain_pending(self) -> None:
        """Commit everything folded or pending before what comes next, in order."""
        while self._in_hand() or self._worker.busy:
            self._flush(wait=True)
            with self.stream.keepalive_during():
                self._worker.wait()
            self._settle()

    def _settle(self) -> None:
        """If the sink finished a batch: confirm its LSN (raise what it raised)."""
        batch = self._worker.take()
        if batch is not None:
            self._settled(batch)

    def _settled(self, batch: Batch) -> None:
        self._confirmed(
            batch.transactions,
            batch.events,
            len(batch.dead_letters),
            batch.last_commit_ts,
            batch.committed_at,
            rows=len(batch.sessions),
        )
        if self.on_batch is not None:
            self.on_batch(batch, self.metrics)

    def _confirmed(
        self,
        transactions: int,
        events: int,
        dead: int,
        last_commit_ts: int | None,
        committed_at: float | None,
        *,
        rows: int,
    ) -> None:
        """What the sink committed: count it; confirm to the server (within FEEDBACK_EVERY) as
        much of it as is durable (all of it, unless the sink commits without waiting for its
        disk: then what a later look found flushed)."""
        self._confirm_durable()
        m = self.metrics
        m.skipped_transactions = self.assembler.skipped
        m.spills = self.assembler.spills
        m.batches += 1
        m.transactions += transactions
        m.events += events
        m.dead_letters += dead
        m.session_rows += rows
        if last_commit_ts:
            m.last_commit_ts = _PG_EPOCH + last_commit_ts / 1e6
            m.last_applied_at = committed_at

    def _gap_rows(self, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
        """Session ``sid``'s rows at positions ``first``..``last``, from the ledger table (the
        builder folds them where the stream skipped them)."""
        with connected(self.config.dsn, "ledger database (positions the stream skipped)") as c:
            rows = list(load_events(c, sid, after_position=first - 1, upto_position=last))
        self.metrics.count("stream_gap_rows_read_total", len(rows))
        return rows

    def _load_contexts(
        self, session_ids: Iterable[uuid.UUID]
    ) -> dict[uuid.UUID, tuple[SessionContext, int]]:
        """The sink's projections of these sessions; one the sink could not use (see
        PgSink.load_contexts_sized) is rebuilt from the ledger — its latest usable snapshot and
        the tail, as rebuild_context does — and logged, instead of folding on from nothing
        (wrong) or failing the batch for good."""
        found = self.sink.load_contexts_sized(session_ids)
        unusable: dict[uuid.UUID, str] = getattr(self.sink, "unusable", {})
        while unusable:
            sid, why = unusable.popitem()
            try:
                with connected(self.config.dsn, "ledger database (rebuild)") as conn:
                    ctx = rebuild_context(conn, sid, memo=True)
                    memo = _memo_rows(conn, ctx)
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
            self.metrics.count("projections_rebuilt_total")
            found[sid] = (ctx, context_size(ctx, encode_stored(ctx)))
            self.builder.rebuilt[sid] = memo  # written with the next batch of its events
        return found

    def _confirm_durable(self) -> None:
        lsn = self.sink.durable()
        held = self.assembler.oldest_prepared_lsn()
        if held is not None and lsn > held:  # (see there: a prepare held in memory)
            lsn = held
        if lsn > self.stream.confirmed:
            self.stream.confirm(lsn, force=False)
            self.metrics.confirmed_lsn = lsn

    # -- periodic tasks -------------------------------------------------------------------------

    def _start_tasks(self) -> None:
        cfg, stop = self.config, self._stop
        if cfg.heartbeat_interval:
            Periodic(
                "heartbeat", cfg.heartbeat_interval, cfg.dsn, heartbeat(cfg.slot, self._nonce), stop
            ).start()
        if cfg.health_interval:
            Periodic(
                "slot check", cfg.health_interval, cfg.dsn, self._guard, stop, errors=(ValueError,)
            ).start()
        if cfg.lease_watch_interval:
            Periodic(
                "lease watch",
                cfg.lease_watch_interval,
                cfg.target_dsn or cfg.dsn,
                lease_watch(cfg.notify_channel),
                stop,
            ).start()
        if cfg.vacuum_interval:
            Periodic(
                "vacuum",
                VACUUM_TICK,
                cfg.target_dsn or cfg.dsn,
                vacuum(lambda: self.metrics.session_rows, cfg.vacuum_interval),
                stop,
            ).start()
        if cfg.partition_ensure_interval:
            Periodic(
                "partitions",
                cfg.partition_ensure_interval,
                cfg.dsn,
                partition_keeper(cfg.partitions_ahead),
                stop,
                first=0.0,
                retry=min(cfg.partition_ensure_interval, 60.0),
                errors=(LedgerError,),
                level=logging.WARNING,
                failure="could not create the upcoming partitions",
            ).start()
