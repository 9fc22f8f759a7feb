"""The consumer's periodic tasks, all on one mechanism (:class:`Periodic`): each runs in a
daemon thread with a connection of its own, every ``interval`` seconds until the consumer
stops, reconnecting after a failure.

- the **heartbeat** (:func:`heartbeat`): a non-transactional logical message through the slot,
  which gives the end-to-end lag and an idle position to confirm;
- the **lease watch** (:func:`lease_watch`): a NOTIFY for the runs whose lease expired;
- the **partition keeper** (:func:`partition_keeper`): upcoming partitions created ahead;
- the **vacuum** (:func:`vacuum`): the projections' dead row versions returned for reuse;
- the **slot guard** (:class:`SlotGuard`): slot health as gauges, warnings before the keep-size
  bound, the resync signal when the slot is lost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psycopg

from ledger_cdc.admin.health import LOST, RateWatch, Thresholds, check_slots
from ledger_cdc.connect import connect_timeout, open_session
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.resync import publication_problem
from ledger_cdc.names import HEARTBEAT_PREFIX, LEDGER_TABLE

__all__ = ["Periodic", "SlotGuard", "heartbeat", "lease_watch", "partition_keeper", "vacuum"]

log = logging.getLogger(__name__)

Step = Callable[[psycopg.Connection[Any]], bool | None]
"""One run of a task on its connection; returns False when the task has nothing more to do."""


class Periodic:
    """Runs ``step`` every ``interval`` seconds (the first time after ``first`` seconds) until
    ``stop`` is set. A failure (a driver error, or one of ``errors``) closes the connection and
    is logged at ``level``; the next run reconnects, after ``retry`` seconds if given."""

    def __init__(
        self,
        name: str,
        interval: float,
        dsn: str,
        step: Step,
        stop: threading.Event,
        *,
        first: float | None = None,
        retry: float | None = None,
        errors: tuple[type[BaseException], ...] = (),
        level: int = logging.DEBUG,
        failure: str | None = None,
    ) -> None:
        self.name = name
        self.interval = interval
        self.dsn = dsn
        self.step = step
        self.stop = stop
        self.first = interval if first is None else first
        self.retry = retry
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error, *errors)
        self.level = level
        self.failure = failure or f"{name} failed"
        self.thread = threading.Thread(target=self._loop, name=f"ledger-cdc-{name}", daemon=True)

    def start(self) -> Periodic:
        self.thread.start()
        return self

    def _loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        wait = self.first
        try:
            while not self.stop.wait(wait):
                wait = self.interval
                try:
                    if conn is None or conn.closed:
                        # (lift: a VACUUM of a large table, a long interval)
                        conn = open_session(
                            self.dsn, lift=True, autocommit=True, **connect_timeout(self.dsn, 5)
                        )
                    if self.step(conn) is False:
                        return
                except self.errors as e:
                    log.log(self.level, "%s: %s", self.failure, e)
                    if conn is not None:
                        conn.close()
                    conn = None
                    if self.retry is not None:
                        wait = self.retry
        finally:
            if conn is not None:
                conn.close()


def heartbeat(slot: str, nonce: str) -> Step:
    """Emit one heartbeat carrying this consumer's nonce (only those are believed)."""

    def beat(conn: psycopg.Connection[Any]) -> None:
        body = json.dumps({"slot": slot, "nonce": nonce, "ts": time.time()})
        conn.execute("SELECT pg_logical_emit_message(false, %s, %s)", (HEARTBEAT_PREFIX, body))

    return beat


_EXPIRED_LEASES = """
WITH t AS (SELECT now() AS now)
SELECT t.now, (SELECT count(pg_notify(%(ch)s, s.session_id::text)) FROM agent_sessions s
               WHERE s.run_status = 'running' AND s.lease_until <= t.now
                 AND (%(last)s::timestamptz IS NULL OR s.lease_until > %(last)s::timestamptz))
FROM t
"""


def lease_watch(channel: str) -> Step:
    """Tell schedulers when a lease expires: no event marks that moment, so every run notifies
    the runs whose lease ran out since the last look (server clock). The first look also
    notifies the leases that expired while the consumer was down."""
    last: list[Any] = [None]

    def watch(conn: psycopg.Connection[Any]) -> None:
        row = conn.execute(_EXPIRED_LEASES, {"ch": channel, "last": last[0]}).fetchone()
        if row is not None:
            last[0] = row[0]
            if row[1]:
                log.info("%d lease(s) expired: schedulers notified", row[1])

    return watch


def partition_keeper(ahead: int) -> Step:
    """On a partitioned ledger, create the upcoming partitions, so an insert never lacks its
    partition even when no cron job runs ``partitions ensure``; ends on a plain ledger."""

    def keep(conn: psycopg.Connection[Any]) -> bool:
        from ledger_cdc.admin.partitions import ensure, is_partitioned

        if not is_partitioned(conn):
            return False
        made = ensure(conn, ahead)
        if made:
            log.info("partitions created: %s", ", ".join(made))
        return True

    return keep


VACUUM_TICK = 0.5  # seconds between looks of the vacuum task (and the least between VACUUMs)
VACUUM_ROWS = 200  # row versions written that call for a VACUUM before the interval is up


def vacuum(written: Callable[[], int], every: float) -> Step:
    """VACUUM the projections: every batch rewrites each touched session's row (and its TOASTed
    context), so dead versions accumulate between autovacuum's visits; vacuumed often, their
    space is reused instead of growing the table. Driven by what was written: after
    VACUUM_ROWS row versions (a busy consumer, whose batches come fast), else ``every``
    seconds if anything was written at all; never when nothing was (an idle consumer costs the
    server nothing). ``written()`` counts the row versions written so far. SKIP_LOCKED: never
    waits."""

    refused: list[str] = []
    listening: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
    last = [written(), time.monotonic()]  # rows written, and when, at the last VACUUM

    def step(conn: psycopg.Connection[Any]) -> bool | None:
        rows, now = written(), time.monotonic()
        since = rows - last[0]
        if since <= 0 or (since < VACUUM_ROWS and now - last[1] < every):
            return None
        if conn not in listening:  # one handler per connection (a reconnect makes a new one)
            conn.add_notice_handler(lambda d: refused.append(d.message_primary or ""))
            listening.add(conn)
        refused.clear()
        conn.execute("VACUUM (SKIP_LOCKED) agent_sessions")
        last[:] = [rows, now]
        if any("skipping" in m for m in refused):  # not the owner (nor pg_maintain, 17+)
            log.info("the projections are left to autovacuum: this role may not VACUUM them")
            return False
        return True

    return step


_WAL_STATUS = ("reserved", "extended", "unreserved", "lost")  # the gauge's 0 to 3


class SlotGuard:
    """Checks the slot: gauges, a warning before the keep-size bound, an error at the critical
    share, and ``lost`` set when the server reports the slot lost (the loop then resyncs).
    And the publication: one changed under a running consumer so that it no longer streams
    the ledger's INSERTs is an error in the log (again each minute while it lasts; the
    ``publication_streams_ledger`` gauge 0) until it does again."""

    def __init__(
        self,
        slot: str,
        thresholds: Thresholds,
        metrics: Metrics,
        publication: str | None = None,
        table: str = LEDGER_TABLE,
        *,
        lost: threading.Event | None = None,
    ) -> None:
        self.slot = slot
        self.thresholds = thresholds
        self.metrics = metrics
        self.publication = publication
        self.table = table
        self._unpublished: str | None = None

        self._unpublished_log = 0.0
        self.lost = lost if lost is not None else threading.Event()
        self._last_status = 0
        self._last_log = 0.0
        self._last_spike = 0.0
        self._rates = RateWatch()

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        (h,) = check_slots(conn, self.slot, thresholds=self.thresholds, sample_seconds=0)
        now = time.monotonic()
        try:
            r = self._rates.sample(conn)
        except psycopg.Error as e:
            log.debug("rate sample failed: %s", e)
            r = None
        if r is not None:
            h.wal_rate_bytes_per_s, h.ledger_insert_rate = r.wal_bytes_per_s, r.inserts_per_s
            if h.safe_wal_size is not None and h.wal_rate_bytes_per_s:
                h.seconds_to_invalidation = h.safe_wal_size / h.wal_rate_bytes_per_s
            if r.spike and now - self._last_spike > 60:
                self._last_spike = now
                log.warning("%s", r.spike)
                self.metrics.count("rate_spikes_total")
        self._gauges(h)
        if h.status != self._last_status or (h.status >= 1 and now - self._last_log > 60):
            self._last_log = now
            if h.status >= 2:
                log.error("slot %s %s: %s", h.slot, h.status_name, "; ".join(h.reasons))
            elif h.status == 1:
                log.warning("slot %s warning: %s", h.slot, "; ".join(h.reasons))
            elif self._last_status:
                log.info("slot %s healthy again", h.slot)
            self._last_status = h.status
        if h.status == LOST and h.exists:
            self.lost.set()
        if self.publication is not None:
            self._check_publication(conn, self.publication, now)

    def _check_publication(self, conn: psycopg.Connection[Any], name: str, now: float) -> None:
        why = publication_problem(conn, name, self.table)
        self.metrics.extra["publication_streams_ledger"] = float(why is None)
        if why is not None and (why != self._unpublished or now - self._unpublished_log > 60):
            self._unpublished_log = now
            log.error("%s", why)
        elif why is None and self._unpublished is not None:
            log.info("publication %s streams the ledger table again", name)
        self._unpublished = why

    def _gauges(self, h: Any) -> None:
        x = self.metrics.extra
        x["slot_status"] = h.status
        # whether a promoted standby would have the slot (17+; a stall by
        # synchronized_standby_slots is among the status's reasons, logged with them)
        if h.failover_ready is None:
            x.pop("slot_failover_ready", None)
        else:
            x["slot_failover_ready"] = float(h.failover_ready)
        if h.wal_status in _WAL_STATUS:
            x["slot_wal_status"] = float(_WAL_STATUS.index(h.wal_status))
        else:
            x.pop("slot_wal_status", None)
        for key, value in (
            ("slot_retained_bytes", h.retained_bytes),
            ("slot_safe_wal_size_bytes", h.safe_wal_size),
            ("slot_keep_size_share", h.keep_size_share),
            ("slot_lag_bytes", h.lag_bytes),
            ("slot_lag_seconds", h.lag_seconds),
            ("slot_unfolded_events", h.unfolded_events),
            ("slot_inactive_seconds", h.inactive_seconds),
            ("slot_seconds_to_invalidation", h.seconds_to_invalidation),
            ("wal_rate_bytes_per_second", h.wal_rate_bytes_per_s),
            ("ledger_inserts_per_second", h.ledger_insert_rate),
            ("max_slot_wal_keep_size_bytes", h.max_slot_wal_keep_size),
        ):
            if value is None:
                x.pop(key, None)
            else:
                x[key] = float(value)
