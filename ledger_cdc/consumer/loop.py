"""The consumer loop: it checks, connects, streams, stops, and recovers from what went wrong
(reconnects, a slot lost or dropped, projections ahead of a promoted server, another consumer
holding the slot). It takes its parts complete (:mod:`~ledger_cdc.consumer.compose` builds the
real ones); what it decides by rule lives in the stages' own objects:

- :class:`~ledger_cdc.consumer.flow.Flow`: the transactions in hand, from the stream to the
  sink, and the confirmations back;
- :class:`~ledger_cdc.consumer.server.LedgerServer`: the ledger database beside the stream
  (checks, periodic tasks, rows read back, the slot's fit, the bootstrap's snapshot);

- :class:`~ledger_cdc.stream.route.LedgerStream`: bytes → committed ledger transactions
  (routing, dead-letter shaping, heartbeats);
- :class:`~ledger_cdc.batching.BatchBuilder`: transactions → the batch one sink transaction
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

import gc
import logging
import os
import threading
from collections.abc import Callable

from ledger_cdc.batching import Batch
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.flow import Flow
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.resync import History, count_unfolded
from ledger_cdc.consumer.server import LedgerServer
from ledger_cdc.errors import ConfigError, FencedError, RefusedError, RetryableError
from ledger_cdc.fold import default_reducers
from ledger_cdc.lsn import format_lsn
from ledger_cdc.retry import Backoff
from ledger_cdc.sink.base import BOOTSTRAPPING, Connecting, Publisher, Sink
from ledger_cdc.stopping import on_stop_signals
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Item
from ledger_cdc.stream.transport import (
    SlotBusyError,
    SlotError,
    SlotLostError,
    Transport,
)

__all__ = ["Consumer", "ConsumerConfig", "Metrics", "count_unfolded"]

log = logging.getLogger(__name__)

_HEALTHY_AFTER = 30.0  # seconds of streaming after which a failure starts the backoff over


class Consumer:
    """Runs until :meth:`stop` (or SIGINT, SIGTERM, SIGHUP: :meth:`install_signal_handlers`).

    It takes its parts complete: the ``sink`` the batches go to, the ``transport`` the slot
    streams through and the ``server`` it checks and reads back from (the ledger database, or
    :class:`~ledger_cdc.consumer.server.NoLedgerServer` for parts that need none).
    :func:`~ledger_cdc.consumer.compose.build_consumer` builds the real ones from a config."""

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        sink: Sink,
        transport: Transport,
        server: LedgerServer,
        on_batch: Callable[[Batch, Metrics], None] | None = None,
    ) -> None:
        config.check()
        self.config = config
        self.metrics = Metrics()
        self.sink, self.stream, self.server = sink, transport, server
        self._stop = threading.Event()
        self._stopped_at = 0  # the position confirmed when the consumer stopped
        self.reducers = config.reducers or default_reducers()
        self._nonce = os.urandom(12).hex()  # marks this process's heartbeats
        self.flow = Flow(
            config,
            sink=sink,
            stream=transport,
            server=server,
            metrics=self.metrics,
            reducers=self.reducers,
            nonce=self._nonce,
            on_batch=on_batch,
        )
        self.builder, self.flush_policy = self.flow.builder, self.flow.policy
        self._backoff = Backoff(
            base=config.reconnect_base, cap=config.reconnect_cap, healthy_after=_HEALTHY_AFTER
        )
        self._standing_by = False

    @property
    def on_batch(self) -> Callable[[Batch, Metrics], None] | None:
        """Called with each batch the sink committed (and the counters), on the loop's thread."""
        return self.flow.on_batch

    @on_batch.setter
    def on_batch(self, fn: Callable[[Batch, Metrics], None] | None) -> None:
        self.flow.on_batch = fn

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

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Stream until stopped; reconnects by itself on connection failures."""
        # The session cache is a large, long-lived object graph: the default collector thresholds
        # rescan it again and again while every message allocates. Collect far less often.
        gc.set_threshold(50_000, 50, 1000)
        # publishers (JetStream) connect on their own threads while the checks below run
        connecting = [(pub, pub.start_connect()) for pub in self.sink.publishers]
        try:
            self._preflight()
            if not self._stop.is_set():
                self.server.start_tasks(self._stop, self.metrics, self._nonce)
                self._connect_publishers(connecting)
            while not self._stop.is_set():
                try:
                    self._attempt()
                except RetryableError as e:  # connection lost, server restarting, NATS …
                    self._back_off(str(e))
        finally:
            self.metrics.set_state("stopped")
            self.flow.close()
            self.stream.close()
            self.sink.shutdown()
            if self._stopped_at:  # everything committed shows confirmed in the slot
                self.server.advance_slot(self._stopped_at, timeout=5.0)

    def _preflight(self) -> None:
        """The server's checks, until they pass: what no retry cures stops the consumer here,
        within seconds; a server that refuses connections at the start is taken for a
        misconfiguration (a fix is likelier than a full server), later for a passing state."""
        first = True
        while not self._stop.is_set():
            try:
                self.flow.schema = self.server.preflight()
                return
            except RefusedError as e:
                if first:
                    raise ConfigError(str(e)) from e
                self._back_off(str(e))
            except RetryableError as e:
                self._back_off(str(e))
            first = False

    def _connect_publishers(self, connecting: list[tuple[Publisher, Connecting]]) -> None:
        """Each publisher (JetStream) connected, its stream made or checked, before streaming:
        a stream whose settings it may not change stops the consumer now, not at its first
        event, and the first batch does not wait for the connection. One out of reach for now
        is left to its first batch, which tries again."""
        for pub, started in connecting:
            try:
                pub.connect(timeout=5, started=started)
            except RetryableError as e:
                log.warning("%s; the first batch tries again", e)

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
            self._stopped_at = self.flow.run(self._stop, self.server.slot_lost)
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
        self.flow.recover()
        self.stream.close()
        self.sink.close()

    def _connect(self) -> None:
        self.metrics.set_state("connecting")
        checkpoint = self.sink.load_checkpoint() or 0
        self.flow.cache.clear()  # the projections may have moved on without us (fencing)
        if self.config.target_dsn and self.config.fold and self._diverged(checkpoint):
            return
        if self.sink.epoch == BOOTSTRAPPING:
            log.warning(
                "a bootstrap of slot %s was interrupted; starting it again", self.config.slot
            )
            self.server.refuse_misfit(None)  # (the slot is dropped and made again)
            self._bootstrap(drop=True)
            return
        self.flow.reset(checkpoint)
        try:
            self.stream.start(checkpoint)
        except SlotError as e:
            self._slot_missing(e, checkpoint)
            self._bootstrap(drop=False)
            return
        except SlotLostError as e:
            self._slot_lost(e)
            return
        except ConfigError as e:  # (another plugin's slot refuses pgoutput's options)
            self.server.refuse_misfit(e)
            raise
        self.metrics.confirmed_lsn = self.stream.confirmed
        self.metrics.set_state("streaming")
        early = self.stream.adopted
        log.info(
            "streaming slot %s from %s%s",
            self.config.slot,
            format_lsn(checkpoint),
            "" if early is None else f" (begun {early[0]:.2f}s ago, {early[1]:,} bytes read ahead)",
        )

    def _slot_missing(self, e: SlotError, checkpoint: int) -> None:
        """The slot does not exist: raise ``e`` unless it is to be made (and the history folded
        from the table)."""
        self.server.refuse_misfit(e)
        cfg = self.config
        if cfg.create_slot:
            log.info(
                "slot %s does not exist: creating it and %s the ledger's history",
                cfg.slot,
                "folding" if cfg.fold else "publishing",
            )
        elif checkpoint and cfg.on_slot_lost == "resync":
            # streamed before, so the slot was dropped (by hand, a failover to a standby
            # without it, a restore): lost as much as an invalidated one
            self.metrics.count("slot_resyncs_total")
            log.error(
                "slot %s no longer exists (dropped, or a failover to a server without it); "
                "creating it and resynchronising from the ledger table (--on-slot-lost "
                "exit stops instead)",
                cfg.slot,
            )
        else:
            if checkpoint:
                log.error("%s; exiting (--on-slot-lost exit)", e)
            raise e

    def _diverged(self, checkpoint: int) -> bool:
        """Projections in another database that may no longer agree with the ledger's server
        (a failover lost what they folded, or the server was restored): the slot is rebuilt
        from the ledger table, which is the truth (:meth:`_bootstrap` discards the sessions
        ahead of it first). True when it was (the stream then runs from the new slot)."""
        reasons = self.server.diverged(checkpoint)
        if reasons:
            self.metrics.count("divergence_repairs_total")
            for why in reasons:
                log.error("the projections do not agree with the ledger's server: %s", why)
            self.server.refuse_misfit(None)  # (the slot is dropped and made again)
            self._bootstrap(drop=True)
        self.server.recorded()
        return bool(reasons)

    def _slot_lost(self, e: SlotLostError) -> None:
        self.server.refuse_misfit(e)
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
        cfg, flow = self.config, self.flow
        self.metrics.set_state("resyncing")
        self.stream.close()  # (a prefetch would hold the slot the drop below ends)
        self.sink.mark_bootstrap()  # a crash from here on makes the next start redo all of it
        if drop:  # (each caller has refused a slot not ours: refuse_misfit)
            self.server.drop_slot()
        try:
            consistent, snapshot = self.stream.create_slot_exported()
        except ConfigError:
            if not drop:  # nothing was lost: the next start need not take this for a bootstrap
                self.sink.unmark_bootstrap()
            raise
        if cfg.target_dsn and cfg.fold:
            # before a bootstrap into another database: a projection ahead of the ledger would
            # skip, by position, what the ledger holds there now
            refolded = self.server.discard_ahead()
            if refolded:
                self.metrics.count("sessions_refolded_total", refolded)
        positions = self.sink.positions()
        flow.reset(consistent)
        flow.cache.clear()
        with self.server.snapshot(snapshot) as src:
            history = History(
                src,
                positions,
                lsn=consistent,
                version=self.reducers.version,
                other_database=bool(cfg.target_dsn),
                progress=cfg.progress,
            )
            txn: Transaction[Item] = Transaction(0, consistent, consistent, 0, [])
            # (positions: the sessions with a projection, and those given an archive base)
            events, dead = flow.commit_in_parts(
                txn, history, epoch=0, grouped=True, projected=positions
            )
        # the snapshot is no longer needed: everything after it comes from the stream
        history.done()
        flow.submitted = consistent
        self.stream.start(consistent, reuse=True)
        flow.count_committed(0, events, dead, None, None, rows=events)
        self.metrics.set_state("streaming")
        log.info(
            "slot %s created at %s; %d events %s from the table",
            cfg.slot,
            format_lsn(consistent),
            history.folded,
            "folded" if cfg.fold else "published",
        )
