"""The consumer loop: transport → decode → assemble → fold → sink → confirm.

This module only wires the stages together and decides when to flush:

- a batch is flushed when the stream has nothing more ready, when it holds ``batch_size``
  events, or ``max_delay`` after its first transaction: low latency when idle, large batches
  under load;
- the LSN sent to the server as flushed is the end LSN of the last transaction whose
  projections are committed, never more; with nothing in flight, the WAL end of keepalives and
  heartbeats is confirmed too, so an idle slot keeps advancing;
- on a lost connection, terminated walsender or restarted server it reconnects with capped
  exponential backoff and jitter, from the stored checkpoint, dropping whatever was in flight
  (the server sends it again; transactions at or below the checkpoint are skipped).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import pickle
import random
import signal
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from .errors import (
    ConfigError,
    DecodeError,
    LedgerError,
    RetryableError,
    SchemaError,
    format_lsn,
    translate,
)
from .events import LedgerEvent, Rejected
from .fold import (
    RUN_PENDING,
    SessionContext,
    completion,
    decode_context,
    encode_context,
    encode_snapshot,
    fold_one,
    reducer_version,
)
from .health import LOST, RateWatch, Thresholds, check_slots
from .pgoutput import Decoder, Delete, Insert, LogicalMessage, Relation, Truncate, Update
from .pgoutput.messages import MessageType
from .replay import load_events_sized
from .schema import DEFAULT_PUBLICATION, DEFAULT_SLOT, LEDGER_TABLE, drop_slot, load_migrations
from .sink import BOOTSTRAPPING, Batch, ChunkedTail, DeadLetter, FencedError, PgSink, SnapshotRow
from .stream.assemble import Assembler, SpilledItems, Transaction, estimate
from .stream.rows import LedgerRowDecoder
from .stream.transport import (
    ReplicationStream,
    SlotBusyError,
    SlotError,
    SlotLostError,
)

__all__ = ["Consumer", "ConsumerConfig", "Metrics"]

log = logging.getLogger("ledger_cdc.consumer")

HEARTBEAT_PREFIX = "ledger-cdc.heartbeat"
_KNOWN_KINDS = frozenset(bytes(m.value) for m in MessageType)


def _heartbeat_body(content: bytes) -> tuple[str, float] | None:
    """(nonce, sent-at) of a heartbeat's JSON body, or None for anything else (total)."""
    if len(content) > 512:
        return None
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    nonce, ts = body.get("nonce"), body.get("ts")
    if not isinstance(nonce, str) or isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return None
    if not math.isfinite(ts) or not 0 < ts < 1e11:
        return None
    return nonce, float(ts)


_EXPIRED_LEASES = """
WITH t AS (SELECT now() AS now)
SELECT t.now, (SELECT count(pg_notify(%(ch)s, s.session_id::text)) FROM agent_sessions s
               WHERE s.run_status = 'running' AND s.lease_until <= t.now
                 AND (%(last)s::timestamptz IS NULL OR s.lease_until > %(last)s::timestamptz))
FROM t
"""
_PG_EPOCH = 946684800.0  # 2000-01-01 in Unix seconds
_HEALTHY_AFTER = 30.0  # seconds of streaming after which a failure starts the backoff over


@dataclass
class ConsumerConfig:
    dsn: str
    slot: str = DEFAULT_SLOT
    publication: str = DEFAULT_PUBLICATION
    target_dsn: str | None = None
    create_slot: bool = False
    batch_size: int = 20000
    max_delay: float = 0.05
    snapshot_every: int = 100
    heartbeat_interval: float | None = None
    status_interval: float = 2.0
    proto_version: int = 2
    streaming: bool = True
    # bytes for what grows with the data: buffered transactions, the session cache, the batch
    # in hand and their encoded rows; see Consumer._fold
    memory_limit: int = 512 * 1024 * 1024
    spill_dir: str | None = None
    reconnect_base: float = 0.1
    reconnect_cap: float = 5.0
    table: str = LEDGER_TABLE
    on_slot_lost: str = "resync"  # or "exit"
    health_interval: float = 10.0
    notify_channel: str = "ledger_runs"  # NOTIFY channel for runs ready to lease
    lease_watch_interval: float = 1.0  # seconds between looks for expired leases (0: off)
    partition_ensure_interval: float = 3600.0  # partitioned ledgers: create partitions ahead
    partitions_ahead: int = 3
    standby_poll: float = 0.5  # seconds between tries for a slot another consumer holds
    sink_idle_timeout: float = 10.0  # server ends a sink transaction left idle this long
    sinks: tuple[str, ...] = ()  # extra sinks: nats://host:port[,…] (PostgreSQL is always on)
    notify_sessions: bool = True  # NOTIFY ledger_sessions '<session>:<position>' per change
    thresholds: Thresholds = field(default_factory=Thresholds)
    progress: Callable[[int, int], None] | None = None  # bootstrap progress (done, total)


@dataclass
class Metrics:
    """Counters and gauges of one consumer, also served as Prometheus text."""

    transactions: int = 0
    events: int = 0
    batches: int = 0
    dead_letters: int = 0
    anomalies: int = 0
    skipped_transactions: int = 0
    reconnects: int = 0
    spills: int = 0
    confirmed_lsn: int = 0
    server_wal_end: int = 0
    last_commit_ts: float | None = None  # Unix seconds of the last applied transaction's commit
    last_applied_at: float | None = None
    heartbeat_lag: float | None = None
    started_at: float = field(default_factory=time.time)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def lag_bytes(self) -> int:
        return max(0, self.server_wal_end - self.confirmed_lsn)

    @property
    def lag_seconds(self) -> float | None:
        if self.heartbeat_lag is not None:
            return self.heartbeat_lag
        if self.last_commit_ts is None or self.last_applied_at is None:
            return None
        return max(0.0, self.last_applied_at - self.last_commit_ts)

    def prometheus(self, slot: str) -> str:
        lines = []

        def metric(name: str, kind: str, help_: str, value: float | None) -> None:
            if value is None:
                return
            lines.append(f"# HELP ledger_cdc_{name} {help_}")
            lines.append(f"# TYPE ledger_cdc_{name} {kind}")
            lines.append(f'ledger_cdc_{name}{{slot="{slot}"}} {value}')

        metric("transactions_total", "counter", "Transactions applied.", self.transactions)
        metric("events_total", "counter", "Ledger events folded.", self.events)
        metric("batches_total", "counter", "Sink transactions committed.", self.batches)
        metric(
            "dead_letters_total",
            "counter",
            "Events sent to the dead-letter table.",
            self.dead_letters,
        )
        metric(
            "anomalies_total",
            "counter",
            "UPDATE/DELETE/TRUNCATE seen on the ledger.",
            self.anomalies,
        )
        metric(
            "skipped_transactions_total",
            "counter",
            "Resent transactions skipped (at or below the checkpoint).",
            self.skipped_transactions,
        )
        metric("reconnects_total", "counter", "Replication reconnects.", self.reconnects)
        metric(
            "spills_total", "counter", "Streamed transaction buffers spilled to disk.", self.spills
        )
        metric("confirmed_lsn", "gauge", "Last LSN confirmed to the server.", self.confirmed_lsn)
        metric("lag_bytes", "gauge", "Server WAL end minus the confirmed LSN.", self.lag_bytes)
        metric(
            "lag_seconds",
            "gauge",
            "Commit-to-projection lag (heartbeat when enabled).",
            self.lag_seconds,
        )
        for k, v in sorted(self.extra.items()):
            metric(k, "gauge", k.replace("_", " ") + ".", v)
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Anomaly:
    kind: str
    lsn: int
    seq: int | None
    session_id: uuid.UUID | None
    row: dict[str, Any] | None


class _Held:
    """A ledger row no reader can fold (see :class:`~ledger_cdc.events.Rejected`), with the LSN
    of its insert: quarantined by the fold, recorded as a dead letter."""

    __slots__ = ("lsn", "rejected")

    def __init__(self, lsn: int, rejected: Rejected) -> None:
        self.lsn, self.rejected = lsn, rejected

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Held, (self.lsn, self.rejected))


class _Base:
    """A session's starting point other than empty: its archive snapshot (a bootstrap over
    archived history). Folding it puts the context in place, as the projection to write."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx


Item = LedgerEvent | _Held | _Anomaly | _Base


_LOAD_AT_ONCE = 512  # sessions whose contexts are loaded by one query
_CONTEXT_FACTOR = 3  # a decoded context holds about 3× its JSON in memory (measured)


def _sid_of(it: Item) -> uuid.UUID | None:
    kind = type(it)
    if kind is LedgerEvent:
        return it.session_id  # type: ignore[union-attr]
    if kind is _Held:
        return it.rejected.session_id  # type: ignore[union-attr]
    if kind is _Base:
        return it.ctx.session_id  # type: ignore[union-attr]
    return None


@dataclass
class _Fold:
    """What a batch (or a part of a big transaction) has folded so far."""

    batch: Batch
    # session → (context, commit LSN, hash of its last event as streamed)
    changed: dict[uuid.UUID, tuple[SessionContext, int, bytes | None]] = field(default_factory=dict)
    runs_before: dict[uuid.UUID, tuple[str, int] | None] = field(default_factory=dict)
    max_seq: int = 0
    used: int = 0  # estimated bytes held: the changes folded


_BUCKETS = 64


def _by_session(
    sized: Iterable[tuple[Item, int]], directory: str | None
) -> Iterator[tuple[Item, int]]:
    """The same changes, grouped by session (a session's in their order) through _BUCKETS
    temporary files: a few dozen changes in memory at a time."""
    files: list[Any] = [None] * _BUCKETS
    held: list[list[tuple[Item, int]]] = [[] for _ in range(_BUCKETS)]

    def spill(k: int) -> None:
        if files[k] is None:
            files[k] = tempfile.TemporaryFile(prefix="ledger-cdc-group-", dir=directory)  # noqa: SIM115
        pickle.dump(held[k], files[k], protocol=pickle.HIGHEST_PROTOCOL)
        held[k] = []

    try:
        for pair in sized:
            sid = _sid_of(pair[0])
            k = 0 if sid is None else sid.int % _BUCKETS
            held[k].append(pair)
            if len(held[k]) >= 32:
                spill(k)
        for k in range(_BUCKETS):
            f = files[k]
            if f is not None:
                f.seek(0)
                while True:
                    try:
                        chunk: list[tuple[Item, int]] = pickle.load(f)
                    except EOFError:
                        break
                    yield from chunk
            yield from held[k]
            held[k] = []
    finally:
        for f in files:
            if f is not None:
                f.close()


class _BigRun:
    """The state of one big transaction folded in parts (see Consumer._apply_big)."""

    def __init__(self, txn: Transaction[Item], epoch: int | None) -> None:
        self.txn = txn
        self.epoch = epoch
        self.events = 0
        self.dead = 0
        self.max_seq = 0
        self.last = self.part()

    def part(self) -> _Fold:
        return _Fold(Batch(end_lsn=self.txn.end_lsn))

    def count(self, chunk: Batch) -> None:
        self.events += chunk.events
        self.dead += len(chunk.dead_letters)
        self.max_seq = max(self.max_seq, chunk.max_seq or 0)


class SessionCache:
    """Contexts by session, least recently used first, bounded by their estimated bytes
    (_CONTEXT_FACTOR × their JSON: what the Python objects take, measured)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._ctx: OrderedDict[uuid.UUID, SessionContext] = OrderedDict()
        self._size: dict[uuid.UUID, int] = {}

    def __len__(self) -> int:
        return len(self._ctx)

    def __contains__(self, sid: object) -> bool:
        return sid in self._ctx

    def get(self, sid: uuid.UUID) -> SessionContext | None:
        return self._ctx.get(sid)  # recency is marked once per batch (touch), not per event

    def touch(self, sid: uuid.UUID, size: int) -> None:
        """A session the batch changed: most recently used now, at its new size."""
        if sid in self._ctx:
            self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def put(self, sid: uuid.UUID, ctx: SessionContext, size: int) -> None:
        self._ctx[sid] = ctx
        self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def resize(self, sid: uuid.UUID, size: int) -> None:
        self.bytes += size - self._size.get(sid, 0)
        self._size[sid] = size

    def evict(self) -> None:
        while self.bytes > self.budget and len(self._ctx) > 1:
            sid, _ = self._ctx.popitem(last=False)
            self.bytes -= self._size.pop(sid, 0)

    def clear(self) -> None:
        self._ctx.clear()
        self._size.clear()
        self.bytes = 0


class _SinkWorker:
    """Commits batches on a thread of its own (group commit): while one batch is being written,
    the stream loop goes on reading and folding the next, so batches grow with the sink's
    latency under load and stay single transactions when idle. One batch at a time, in order."""

    def __init__(self, sink: PgSink) -> None:
        self.sink = sink
        self._batch: Batch | None = None
        self._error: BaseException | None = None
        self._finished: Batch | None = None
        self._cond = threading.Condition()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ledger-cdc-sink", daemon=True)
        self._thread.start()

    @property
    def wakeup_fd(self) -> int:
        return self._rfd

    @property
    def busy(self) -> bool:
        return self._batch is not None

    @property
    def done(self) -> bool:
        return self._finished is not None or self._error is not None

    def submit(self, batch: Batch) -> None:
        with self._cond:
            assert self._batch is None
            self._batch = batch
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._batch is None)

    def take(self) -> Batch | None:
        """The batch committed since the last call (re-raising the sink's error, if any)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._rfd, 512)
        with self._cond:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            done, self._finished = self._finished, None
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batch is not None or self._closed)
                if self._closed:
                    return
                batch = self._batch
            assert batch is not None
            try:
                self.sink.commit(batch)
                batch.committed_at = time.time()
                error = None
            except BaseException as e:  # handed to the stream loop
                error = e
            with self._cond:
                if error is None:
                    self._finished = batch
                else:
                    self._error = error
                self._batch = None
                self._cond.notify_all()
            with contextlib.suppress(OSError):
                os.write(self._wfd, b"x")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(60)
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _describe_row(
    rows: LedgerRowDecoder, values: tuple[Any, ...], lsn: int
) -> tuple[int | None, uuid.UUID | None, dict[str, Any] | None]:
    """(seq, session id, JSON-safe row) of a ledger tuple, for a dead letter; what cannot be
    loaded is left out rather than failing the stream."""
    try:
        loaded = rows._loader.as_dict(values, lsn)
    except LedgerError:
        return None, None, None
    seq, sid = loaded.get("seq"), loaded.get("session_id")
    row = {k: _bounded(v) for k, v in loaded.items()}
    return (
        seq if isinstance(seq, int) else None,
        sid if isinstance(sid, uuid.UUID) else None,
        row,
    )


_DEAD_TEXT = 4096


def _bounded(value: Any) -> Any:
    """A value as a dead letter keeps it: JSON-safe, and strings cut at 4 kB (the row itself
    stays in the ledger; the dead letter only has to name it)."""
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    text = value if isinstance(value, str) else str(value)
    if len(text) > _DEAD_TEXT:
        return f"{text[:_DEAD_TEXT]}… ({len(text):,} characters)"
    return text


def _rejected_row(r: Rejected) -> dict[str, Any]:
    return {
        "seq": r.seq,
        "session_id": str(r.session_id),
        "position": r.position,
        "agent_id": _bounded(r.agent_id),
        "event_type": _bounded(r.event_type),
        "idempotency_key": _bounded(r.idempotency_key),
        "created_at": r.created_at,
    }


_PREFLIGHT = """
SELECT current_setting('wal_level'),
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = session_user),
       CASE WHEN to_regclass('ledger_migrations') IS NULL THEN NULL
            ELSE (SELECT array_agg(version) FROM ledger_migrations) END,
       EXISTS (SELECT FROM pg_publication WHERE pubname = %s)
"""


@contextlib.contextmanager
def _connected(
    dsn: str, what: str, *, autocommit: bool = True
) -> Iterator[psycopg.Connection[Any]]:
    """A short-lived connection whose failures leave translated (errors.translate)."""
    try:
        with psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10) as conn:
            yield conn
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing=what) from e


def _check_schema(applied: list[int] | None, where: str) -> None:
    want = {m.version for m in load_migrations()}
    missing = sorted(want - set(applied or ()))
    if applied is None:
        raise SchemaError(f"{where} has no ledger schema: run `ledger-cdc init --dsn …` first")
    if missing:
        raise SchemaError(
            f"{where} lacks migration(s) {', '.join(f'{v:04d}' for v in missing)} of this "
            "version: run `ledger-cdc init --dsn …` (stop the consumer first)"
        )


def count_unfolded(conn: psycopg.Connection[Any], positions: dict[uuid.UUID, int]) -> int:
    """How many ledger rows lie past their session's projection (for the progress bar)."""
    rows = conn.execute(
        "SELECT session_id, count(*), max(position) FROM agent_events GROUP BY 1"
    ).fetchall()
    total = 0
    for sid, n, top in rows:
        done = positions.get(sid, 0)
        total += int(n) if done == 0 else max(0, int(top) - done)
    return total


class Consumer:
    """Runs until :meth:`stop` (or SIGINT/SIGTERM, after :meth:`install_signal_handlers`)."""

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        on_batch: Callable[[Batch, Metrics], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        self.on_batch = on_batch
        self._stop = threading.Event()
        self.sink = PgSink(
            config.target_dsn or config.dsn,
            config.slot,
            idle_timeout=config.sink_idle_timeout,
            publication=config.publication,
        )
        for url in config.sinks:
            from .jetstream import JetStreamPublisher, JetStreamSettings

            self.sink.publishers.append(
                JetStreamPublisher(JetStreamSettings.from_url(url), config.slot)
            )
        self.stream = ReplicationStream(
            config.dsn,
            config.slot,
            config.publication,
            proto_version=config.proto_version,
            streaming=config.streaming,
            status_interval=config.status_interval,
        )
        # of the memory limit: 35 % buffered transactions, 15 % the cache, 15 % the batch in
        # hand; the rest is headroom for what a batch transiently adds (its encoded rows)
        self._cache = SessionCache(config.memory_limit * 15 // 100)
        self._budget_batch = max(1, config.memory_limit * 15 // 100)
        self._loaded_bytes = 0  # contexts loaded since the part in hand began (see _Fold.used)
        self._version = reducer_version()
        self._heartbeat: threading.Thread | None = None
        self._standing_by = False
        self._worker = _SinkWorker(self.sink)
        self._lost = threading.Event()
        self._streaming_since: float | None = None
        self._nonce = os.urandom(12).hex()  # marks this process's heartbeats (see _on_heartbeat)
        self._unknown_seen: set[bytes] = set()
        self._reset_stream_state(0)

    # -- control --------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            log.info("signal %s: finishing the current batch", signum)
            self.stop()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # -- state ----------------------------------------------------------------------------------

    def _reset_stream_state(self, checkpoint: int) -> None:
        self.decoder = Decoder()
        self.assembler: Assembler[Item] = Assembler(
            skip_upto=checkpoint,
            memory_limit=self.config.memory_limit * 35 // 100,
            spill_dir=self.config.spill_dir,
        )
        self._decode = self.decoder.decode
        self._feed = self.assembler.feed
        self._rows: dict[int, LedgerRowDecoder] = {}
        self._ledger_relids: set[int] = set()
        self._pending: list[Transaction[Item]] = []
        self._pending_events = 0
        self._pending_bytes = 0
        self._pending_since: float | None = None
        self._idle_lsn: int | None = None  # heartbeat LSN to checkpoint when nothing is in flight
        self._idle_hb_at: float | None = None
        self._submitted_lsn = checkpoint

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Stream until stopped; reconnects by itself on connection failures."""
        # The session cache is a large, long-lived object graph: the default collector thresholds
        # rescan it again and again while every message allocates. Collect far less often.
        gc.set_threshold(50_000, 50, 1000)
        attempt = 0
        try:
            while not self._stop.is_set():  # permanent problems stop here, within seconds
                try:
                    self._preflight()
                    break
                except RetryableError as e:
                    attempt = self._back_off(attempt, str(e))
            self._start_heartbeat()
            self._start_guard()
            self._start_lease_watch()
            self._start_partition_keeper()
            while not self._stop.is_set():
                self._streaming_since = None
                try:
                    self._attempt()
                except RetryableError as e:  # connection lost, server restarting, NATS …
                    # (also from the handlers of _attempt: a resync meeting a restart). The
                    # backoff starts over only after a while of streaming: a half-recovery (a
                    # leader election, a flapping server) must not re-decode in a tight loop
                    since = self._streaming_since
                    if since is not None and time.monotonic() - since > _HEALTHY_AFTER:
                        attempt = 0
                    attempt = self._back_off(attempt, f"{e}")
        finally:
            self._worker.wait()
            with contextlib.suppress(Exception):
                self._worker.take()
            self._worker.close()
            self.stream.close()
            self.sink.shutdown()

    def _attempt(self) -> None:
        """Connect and stream until something stops it. Everything but a retryable error is
        handled here; that one is the caller's."""
        try:
            self._connect()
            self._streaming_since = time.monotonic()
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

    def _preflight(self) -> None:
        """What no retry cures is said at once, as one ConfigError with its fix: the server's
        wal_level, the role's REPLICATION, the schema's migrations and the publication (and
        the projection database's schema)."""
        cfg = self.config
        with _connected(cfg.dsn, "ledger database") as conn:
            row = conn.execute(_PREFLIGHT, (cfg.publication,)).fetchone()
            assert row is not None
            wal_level, replication, applied, has_pub = row
            if wal_level != "logical":
                raise ConfigError(
                    f"the server's wal_level is {wal_level!r}, not 'logical': logical decoding "
                    "is off (ALTER SYSTEM SET wal_level = logical, then restart the server)"
                )
            if not replication:
                raise ConfigError(
                    "the role in --dsn lacks the REPLICATION attribute needed to stream a slot "
                    "(ALTER ROLE … REPLICATION; attributes are not inherited from "
                    "ledger_consumer)"
                )
            _check_schema(applied, "the ledger database")
            if not has_pub:
                raise ConfigError(
                    f"publication {cfg.publication!r} does not exist in the ledger database: "
                    "run `ledger-cdc init` (with --shards N for shard publications)"
                )
        if cfg.target_dsn:
            with _connected(cfg.target_dsn, "projection database") as conn:
                row = conn.execute(_PREFLIGHT, (cfg.publication,)).fetchone()
                assert row is not None
                _check_schema(row[2], "the projection database (--target-dsn)")

    def _stand_by(self, e: SlotBusyError) -> None:
        """Hot standby: another consumer streams the slot. Try again every ``standby_poll``
        seconds (no backoff): the server frees the slot as soon as the active consumer's
        connection closes, so a dead consumer is replaced within about a second."""
        if not self._standing_by:
            self._standing_by = True
            log.warning("%s; standing by (retrying every %.1fs)", e, self.config.standby_poll)
        self.metrics.extra["standby"] = 1.0
        self._recover()
        self._stop.wait(self.config.standby_poll)

    def _back_off(self, attempt: int, why: str) -> int:
        """Reconnect after a failure: capped exponential backoff with jitter; the next attempt."""
        self.metrics.reconnects += 1
        delay = min(self.config.reconnect_cap, self.config.reconnect_base * 2**attempt)
        delay *= random.uniform(0.5, 1.5)  # jitter: consumers restarted together spread out
        log.warning("%s; reconnecting in %.2fs", why, delay)
        self._recover()
        self._stop.wait(delay)
        return min(attempt + 1, 16)

    def _recover(self) -> None:
        """After a failure: let the sink finish what it has, forget what it had not."""
        self._worker.wait()
        with contextlib.suppress(Exception):
            self._worker.take()
        self.stream.close()
        self.sink.close()
        self._cache.clear()

    def _connect(self) -> None:
        checkpoint = self.sink.load_checkpoint() or 0
        self._cache.clear()  # the projections may have moved on without us (fencing)
        if self.sink.epoch == BOOTSTRAPPING:
            log.warning(
                "a bootstrap of slot %s was interrupted; starting it again", self.config.slot
            )
            self._bootstrap(drop=True)
            return
        self._reset_stream_state(checkpoint)
        try:
            self.stream.start(checkpoint)
        except SlotError:
            if not self.config.create_slot:
                raise
            log.info(
                "slot %s does not exist: creating it and folding the ledger's history",
                self.config.slot,
            )
            self._bootstrap(drop=False)
            return
        except SlotLostError as e:
            self._slot_lost(e)
            return
        self.metrics.confirmed_lsn = self.stream.confirmed
        log.info("streaming slot %s from %s", self.config.slot, format_lsn(checkpoint))

    def _slot_lost(self, e: SlotLostError) -> None:
        self.metrics.extra["slot_resyncs_total"] = (
            self.metrics.extra.get("slot_resyncs_total", 0) + 1
        )
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
        self.sink.mark_bootstrap()  # a crash from here on makes the next start redo all of it
        if drop:
            drop_slot(cfg.dsn, cfg.slot, force=True)
        try:
            consistent, snapshot = self.stream.create_slot_exported()
        except ConfigError:
            if not drop:  # nothing was lost: the next start need not take this for a bootstrap
                self.sink.unmark_bootstrap()
            raise
        positions = self.sink.positions()
        progress = cfg.progress
        self._reset_stream_state(consistent)
        self._cache.clear()
        with _connected(cfg.dsn, "ledger database (bootstrap)", autocommit=False) as src:
            src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            total = count_unfolded(src, positions)
            if progress:
                progress(0, total)
            folded = [0]
            bases = self._archived_bases(src, positions)

            def rows() -> Iterator[tuple[Item, int]]:
                # sessions whose history before the projection's point was archived start from
                # their archive snapshot; then the history, read by a server-side cursor as it
                # is folded, never held whole
                yield from bases
                for ev, size in load_events_sized(src):
                    if ev.position <= positions.get(ev.session_id, 0):
                        continue
                    folded[0] += 1
                    if progress and folded[0] % 5000 == 0:
                        progress(folded[0], total)
                    item = ev if type(ev) is LedgerEvent else _Held(consistent, ev)  # type: ignore[arg-type]
                    yield item, estimate(size)

            txn: Transaction[Item] = Transaction(0, consistent, consistent, 0, [])
            events, dead = self._apply_big(txn, rows(), epoch=0, grouped=True)
            src.rollback()
        # the snapshot is no longer needed: everything after it comes from the stream
        if progress:
            progress(folded[0], folded[0])
        self._submitted_lsn = consistent
        self.stream.start(consistent, reuse=True)
        self._confirmed(consistent, 0, events, dead, None, None)
        log.info(
            "slot %s created at %s; %d events folded from the table",
            cfg.slot,
            format_lsn(consistent),
            folded[0],
        )

    def _archived_bases(
        self, src: psycopg.Connection[Any], positions: dict[uuid.UUID, int]
    ) -> list[tuple[Item, int]]:
        """For each session whose history up to some position was archived and whose projection
        is behind that point: its archive snapshot (with its memo), to fold the rest on. Only in
        the ledger's own database, where the archive keeps its snapshots and memo rows; into
        another (--target-dsn) the bootstrap is refused rather than folded wrong."""
        from .partitions import archived_heads
        from .verify import _archive_base

        out: list[tuple[Item, int]] = []
        version = reducer_version()
        for sid, (upto, _, name) in archived_heads(src).items():
            if positions.get(sid, 0) >= upto:
                continue
            if self.config.target_dsn:
                raise ConfigError(
                    f"session {sid}: its history up to position {upto} was archived ({name}) and "
                    "the projection database lacks it: a bootstrap into another database cannot "
                    "rebuild it (bootstrap into the ledger's own database, which keeps the "
                    "archive snapshots, or restore the archive)"
                )
            base = _archive_base(src, sid, upto, version)
            if base is None:
                raise ConfigError(
                    f"session {sid}: its history up to position {upto} was archived ({name}) "
                    "and no usable snapshot covers it: the bootstrap cannot fold it (restore "
                    "the archive)"
                )
            positions[sid] = base.last_position
            out.append((_Base(base), 0))
        return out

    def _stream_loop(self) -> None:
        stream = self.stream
        worker = self._worker
        on_message = self._on_message
        stopping = self._stop.is_set
        batch_size = self.config.batch_size
        max_delay = self.config.max_delay
        metrics = self.metrics
        lost = self._lost
        read_many = stream.read_many
        while True:
            if worker.done:
                self._settle()
            if lost.is_set():
                lost.clear()
                raise SlotLostError(f"slot {self.config.slot} was invalidated (wal_status lost)")
            msgs = read_many(256)
            if msgs:
                metrics.server_wal_end = msgs[-1].wal_end
                msgs.reverse()  # popped as handled: a large message is not held to the end
                while msgs:
                    msg = msgs.pop()
                    on_message(msg.payload, msg.data_start)
                del msg
                if self._pending_events >= batch_size or self._pending_bytes > self._budget_batch:
                    self._flush(wait=True)  # the batch is full: wait for the sink if it is busy
                elif (
                    self._pending_since is not None
                    and not worker.busy
                    and time.monotonic() - self._pending_since > max_delay
                ):
                    self._flush()
                if stopping():
                    self._drain()  # finish the batch in hand, commit, confirm
                    return
                continue
            # nothing ready: hand what we have to the sink (if it is free), confirm an idle
            # position, then wait for the socket or for the sink to finish
            if (self._pending or self._idle_lsn is not None) and not worker.busy:
                self._flush()
            self.metrics.server_wal_end = max(self.metrics.server_wal_end, stream.wal_end)
            if (
                not worker.busy
                and not self.assembler.in_flight
                and not self._pending
                and stream.wal_end > stream.confirmed
            ):
                stream.confirm(stream.wal_end)
                self.metrics.confirmed_lsn = stream.confirmed
            if self._stop.is_set():
                self._drain()
                return
            timeout = self.config.max_delay if self._pending_since is not None else 0.1
            stream.wait(timeout, worker.wakeup_fd)

    def _drain(self) -> None:
        self._worker.wait()
        self._settle()
        if self._pending or self._idle_lsn is not None:
            self._flush(wait=True)
            self._worker.wait()
            self._settle()

    # -- per message ----------------------------------------------------------------------------

    def _on_message(self, payload: bytes, lsn: int) -> None:
        try:
            msg = self._decode(payload, lsn)
        except DecodeError as e:
            if payload[:1] in _KNOWN_KINDS:
                raise  # the framing of a message we know is broken: nothing after it is sure
            self._unknown_kind(payload, lsn, e)
            return
        kind = type(msg)
        item: Item | None = None
        if kind is Insert:
            rows = self._rows.get(msg.relation_id)  # type: ignore[union-attr]
            if rows is None:
                return
            ev = rows.event(msg.new, lsn)  # type: ignore[union-attr]
            item = ev if type(ev) is LedgerEvent else _Held(lsn, ev)  # type: ignore[arg-type]
        elif kind is Relation:
            assert isinstance(msg, Relation)
            if msg.name == self.config.table:
                self._rows[msg.relation_id] = LedgerRowDecoder(msg)
                self._ledger_relids.add(msg.relation_id)
            else:
                self._rows.pop(msg.relation_id, None)
            return
        elif kind is Update or kind is Delete:
            assert isinstance(msg, (Update, Delete))
            if msg.relation_id in self._ledger_relids:
                item = self._anomaly("update" if kind is Update else "delete", msg, lsn)
        elif kind is Truncate:
            assert isinstance(msg, Truncate)
            if self._ledger_relids.intersection(msg.relation_ids):
                item = _Anomaly("truncate", lsn, None, None, None)
        elif kind is LogicalMessage:
            assert isinstance(msg, LogicalMessage)
            if not msg.transactional and msg.prefix == HEARTBEAT_PREFIX:
                self._on_heartbeat(msg, lsn)
            return
        txns = self._feed(msg, item, len(payload), lsn)
        for t in txns:
            if t.spilled or t.size > self._budget_batch:
                self._big(t)
                continue
            self._pending.append(t)
            self._pending_events += len(t.items)
            self._pending_bytes += t.size
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    def _big(self, txn: Transaction[Item]) -> None:
        """A transaction over the batch budget: folded in parts as it is read back, committed
        with its checkpoint, confirmed."""
        items = txn.items
        sized = items.sized() if isinstance(items, SpilledItems) else ((it, 0) for it in items)
        if not isinstance(items, SpilledItems):  # in memory: its share of the budget is known
            share = txn.size // max(1, len(items))
            sized = ((it, share) for it in items)
        # a few changes need no sorting by session: they are one window of loads anyway
        events, dead = self._apply_big(txn, sized, epoch=None, grouped=len(items) <= _LOAD_AT_ONCE)
        self._submitted_lsn = max(self._submitted_lsn, txn.end_lsn)
        self._confirmed(txn.end_lsn, 1, events, dead, txn.commit_ts, time.time())

    def _unknown_kind(self, payload: bytes, lsn: int, e: DecodeError) -> None:
        """A message kind this decoder does not know (a newer server or protocol): not ours to
        fold, and no reason to stop. Logged once per kind, counted, skipped."""
        kind = payload[:1]
        x = self.metrics.extra
        x["unknown_messages_total"] = x.get("unknown_messages_total", 0.0) + 1
        if kind not in self._unknown_seen:
            self._unknown_seen.add(kind)
            log.warning("skipping a message of a kind this version does not know: %s", e)

    def _anomaly(self, kind: str, msg: Update | Delete, lsn: int) -> _Anomaly:
        rows = self._rows.get(msg.relation_id)
        values = msg.old if msg.old is not None else getattr(msg, "new", None)
        if rows is None or values is None:
            return _Anomaly(kind, lsn, None, None, None)
        return _Anomaly(kind, lsn, *_describe_row(rows, values, lsn))

    def _on_heartbeat(self, msg: LogicalMessage, lsn: int) -> None:
        """Our own heartbeat, back through the slot: the end-to-end lag, and an idle position to
        confirm. Any role can emit a message with this prefix (pg_logical_emit_message is
        PUBLIC), so only a well-formed one carrying this process's nonce is believed; anything
        else is counted and ignored."""
        body = _heartbeat_body(msg.content)
        if body is None or body[0] != self._nonce:
            x = self.metrics.extra
            x["foreign_heartbeats_total"] = x.get("foreign_heartbeats_total", 0.0) + 1
            return
        sent = body[1]
        self.metrics.heartbeat_lag = max(0.0, time.time() - sent)
        if not self.assembler.in_flight:
            self._idle_lsn = lsn
            self._idle_hb_at = sent

    # -- flushing -------------------------------------------------------------------------------

    def _flush(self, *, wait: bool = False) -> None:
        """Fold the pending transactions (as many as fit a batch) and hand the batch to the
        sink worker."""
        worker = self._worker
        if worker.busy:
            if not wait:
                return
            with self.stream.keepalive_during():
                worker.wait()
        self._settle()
        txns, self._pending = self._pending, []
        batch, rest = self._fold(txns) if txns else (Batch(end_lsn=0), [])
        self._pending = rest
        self._pending_events = sum(len(t.items) for t in rest)
        self._pending_bytes = sum(t.size for t in rest)
        self._pending_since = time.monotonic() if rest else None
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
        worker.submit(batch)

    def _settle(self) -> None:
        """If the sink finished a batch: confirm its LSN (raise what it raised)."""
        batch = self._worker.take()
        if batch is None:
            return
        self._confirmed(
            batch.end_lsn,
            batch.transactions,
            batch.events,
            len(batch.dead_letters),
            batch.last_commit_ts,
            batch.committed_at,
        )
        if self.on_batch is not None:
            self.on_batch(batch, self.metrics)

    def _confirmed(
        self,
        end_lsn: int,
        transactions: int,
        events: int,
        dead: int,
        last_commit_ts: int | None,
        committed_at: float | None,
    ) -> None:
        """What the sink committed is durable: confirm it to the server, count it."""
        self.stream.confirm(end_lsn)
        m = self.metrics
        m.confirmed_lsn = end_lsn
        m.skipped_transactions = self.assembler.skipped
        m.spills = self.assembler.spills
        m.batches += 1
        m.transactions += transactions
        m.events += events
        m.dead_letters += dead
        if last_commit_ts:
            m.last_commit_ts = _PG_EPOCH + last_commit_ts / 1e6
            m.last_applied_at = committed_at

    # -- folding ------------------------------------------------------------------------------
    #
    # Memory is bounded by --memory-limit-mb (M): buffered transactions 35 % of M (the assembler
    # spills past it), the session cache 15 % (least recently used contexts evicted, by their
    # estimated size), a batch 15 % (a batch ends at the transaction where it would pass it; a
    # single transaction over it is folded and written in chunks inside one sink transaction),
    # and the rest for what sealing a batch adds for a moment (its rows, encoded).

    def _fold(self, txns: list[Transaction[Item]]) -> tuple[Batch, list[Transaction[Item]]]:
        """Fold committed transactions into one batch, as many as fit its byte budget (at least
        one): the batch, and the transactions left for the next."""
        f = _Fold(Batch(end_lsn=0))
        rest: list[Transaction[Item]] = []
        loaded_upto = 0
        for i, txn in enumerate(txns):
            before: dict[uuid.UUID, tuple[int, str]] = {}
            items = txn.items
            assert isinstance(items, list)
            if i >= loaded_upto:
                loaded_upto = self._load_for(txns, i)
            f.used += self._loaded_bytes
            self._loaded_bytes = 0
            for it in items:
                self._fold_item(f, it, txn, before)
            self._cut_snapshots(f, before)
            f.batch.transactions += 1
            f.batch.end_lsn = txn.end_lsn
            f.batch.commit_times.append(txn.commit_ts)
            f.batch.last_commit_ts = txn.commit_ts
            f.used += txn.size
            if f.used > self._budget_batch and i + 1 < len(txns):
                rest = txns[i + 1 :]
                break
        self._seal(f)
        return f.batch, rest

    def _load_for(self, txns: list[Transaction[Item]], i: int) -> int:
        """Load the contexts that the transactions from ``i`` on need and the cache lacks, up to
        a few hundred sessions in one query; returns the index of the first transaction not
        covered."""
        cache = self._cache
        missing: dict[uuid.UUID, None] = {}
        j = i
        while j < len(txns) and len(missing) < _LOAD_AT_ONCE:
            items = txns[j].items
            assert isinstance(items, list)
            for it in items:
                sid = _sid_of(it)
                if sid is not None and sid not in cache:
                    missing[sid] = None
            j += 1
        self._load(list(missing))
        return j

    def _load(self, missing: list[uuid.UUID]) -> None:
        """Bring these sessions into the cache: their projected context, or a new one for a
        session without a projection (so that a session missing from the cache later was
        evicted, and is read back)."""
        if missing:
            found = self.sink.load_contexts_sized(missing)
            for sid in missing:
                ctx, size = found.get(sid) or (SessionContext(sid), 0)
                self._cache.put(sid, ctx, size)
                self._loaded_bytes += size

    def _fold_item(
        self,
        f: _Fold,
        it: Item,
        txn: Transaction[Item],
        before: dict[uuid.UUID, tuple[int, str]] | None,
    ) -> None:
        """One change into the batch: an event folded (or quarantined) into its session, or an
        anomaly reported. ``before`` collects what each session was at the transaction's start
        (the snapshot rule); None in a chunked transaction, whose chunks record it instead."""
        kind = type(it)
        if kind is _Base:
            assert isinstance(it, _Base)
            base = it.ctx
            self._cache.put(base.session_id, base, 0)
            f.changed[base.session_id] = (base, txn.commit_lsn, None)
            return
        if kind is _Anomaly:
            assert isinstance(it, _Anomaly)
            self.metrics.anomalies += 1
            log.error(
                "ledger %s seen at %s (seq %s): the append-only guard was bypassed; not folded",
                it.kind.upper(),
                format_lsn(it.lsn),
                it.seq,
            )
            f.batch.dead_letters.append(
                DeadLetter(
                    it.seq,
                    it.session_id,
                    it.lsn,
                    it.kind,
                    f"{it.kind.upper()} on the append-only ledger",
                    it.row,
                )
            )
            return
        ev: LedgerEvent | Rejected = it if kind is LedgerEvent else it.rejected  # type: ignore[assignment,union-attr]
        sid = ev.session_id
        ctx = self._cache.get(sid)
        if ctx is None:  # evicted since it was loaded: its projection has what it had
            self._load([sid])
            ctx = self._cache.get(sid)
            assert ctx is not None
        if ev.position <= ctx.last_position:
            return  # already folded (a projection ahead of a lost checkpoint)
        changed = f.changed
        if sid not in changed:
            r = ctx.run
            f.runs_before[sid] = None if r is None else (r.status, r.leases)
            if before is None:  # a chunk records what the session was before the transaction
                f.batch.touched.append(
                    (
                        sid,
                        ctx.event_count,
                        ctx.status,
                        None if r is None else r.status,
                        None if r is None else r.leases,
                    )
                )
        if before is not None and sid not in before:
            before[sid] = (ctx.event_count, ctx.status)
        reason = fold_one(ctx, ev)
        changed[sid] = (ctx, txn.commit_lsn, ev.hash)
        if ev.seq > f.max_seq:
            f.max_seq = ev.seq
        if reason is not None:
            lsn = it.lsn if kind is _Held else txn.commit_lsn  # type: ignore[union-attr]
            row = _rejected_row(ev) if kind is _Held else {"seq": ev.seq}  # type: ignore[arg-type]
            f.batch.dead_letters.append(DeadLetter(ev.seq, sid, lsn, "quarantined", reason, row))
            return
        done = completion(ctx, ev)  # type: ignore[arg-type]
        if done is not None:
            f.batch.memo.append((sid, ev.position, done))
        f.batch.events += 1
        if self.sink.publishers:
            f.batch.published.append((ev, txn.commit_lsn))

    def _cut_snapshots(self, f: _Fold, before: dict[uuid.UUID, tuple[int, str]]) -> None:
        """Snapshots are cut here, between transactions, never inside one."""
        every = self.config.snapshot_every
        for sid, (count_before, status_before) in before.items():
            ctx = f.changed[sid][0]
            due = every > 0 and ctx.event_count // every != count_before // every
            ended = ctx.status != status_before and ctx.status in ("completed", "failed")
            if due or ended:
                f.batch.snapshots.append(self._snapshot(ctx, f.changed[sid][2]))

    def _snapshot(self, ctx: SessionContext, head: bytes | None) -> SnapshotRow:
        data = encode_snapshot(ctx)
        return SnapshotRow(
            ctx.session_id,
            ctx.last_seq,
            ctx.last_position,
            self._version,
            hashlib.sha256(data).digest(),
            data,
            head,
        )

    def _seal(self, f: _Fold, *, notices: bool = True) -> Batch:
        """The batch's projections (each changed context, encoded), runs that became ready,
        change notices; the cache brought back within its budget."""
        batch = f.batch
        for sid, (ctx, commit_lsn, head) in f.changed.items():
            data = encode_context(ctx)
            batch.sessions[sid] = (ctx, data, commit_lsn, head)
            self._cache.touch(sid, _CONTEXT_FACTOR * len(data))
            if not notices:
                continue
            run = ctx.run
            if run is not None and run.status == RUN_PENDING:
                was = f.runs_before.get(sid)
                if was is None or was != (RUN_PENDING, run.leases):
                    batch.notify.append(sid)  # became ready to lease in this batch
        batch.channel = self.config.notify_channel
        if notices and self.config.notify_sessions:
            batch.session_notices = [
                f"{sid}:{c.last_position}" for sid, (c, _, _) in f.changed.items()
            ]
        batch.max_seq = f.max_seq or None
        self._cache.evict()
        return batch

    def _apply_big(
        self,
        txn: Transaction[Item],
        sized: Iterable[tuple[Item, int]],
        *,
        epoch: int | None,
        grouped: bool = False,
    ) -> tuple[int, int]:
        """A transaction too big for one batch (spilled, over the batch budget, or a bootstrap)
        is folded as its changes are read — from the spill file, or the table — and written in
        chunks inside one sink transaction that ends with its checkpoint. Everything before it
        is committed first. Returns (events folded, dead letters), once committed.

        Sessions are independent of one another and a session's changes keep their order, so
        unless they come ``grouped`` by session already (a bootstrap reads them so), the changes
        are first sorted into files by session: each session's context is then loaded once,
        not once per part, however many sessions the transaction touches."""
        self._drain_pending()
        run = _BigRun(txn, epoch)

        def chunks() -> Iterator[Batch]:
            f = run.part()
            ahead: list[tuple[Item, int]] = []
            for pair in sized if grouped else _by_session(sized, self.config.spill_dir):
                ahead.append(pair)
                if len(ahead) >= _LOAD_AT_ONCE:
                    f = yield from self._fold_ahead(run, f, ahead)
                    ahead = []
            run.last = yield from self._fold_ahead(run, f, ahead)

        def finish(tail: ChunkedTail) -> Batch:
            rest = self._seal(run.last, notices=False)
            run.count(rest)
            self.sink.write_part(rest)  # in the projections before the tail reads them
            for rows in tail.due_snapshots(self.config.snapshot_every):
                snaps = [
                    self._snapshot(self._cache.get(sid) or decode_context(text), head)
                    for sid, text, head in rows
                ]
                self.sink.write_part(Batch(end_lsn=txn.end_lsn, snapshots=snaps))
            tail.notify(self.config.notify_channel, self.config.notify_sessions)
            final = Batch(end_lsn=txn.end_lsn, epoch=epoch, max_seq=run.max_seq or None)
            if txn.commit_ts:
                final.last_commit_ts = txn.commit_ts
                final.commit_times = [txn.commit_ts]
            return final

        with self.stream.keepalive_during():
            self.sink.commit_chunked(chunks(), finish)
        return run.events, run.dead

    def _fold_ahead(
        self, run: _BigRun, f: _Fold, ahead: list[tuple[Item, int]]
    ) -> Generator[Batch, None, _Fold]:
        """Fold a run of a big transaction's changes (the contexts they lack loaded in one
        query); each time the part in hand passes the batch budget, hand it over as a chunk and
        go on with a new part. Returns the part in hand."""
        self._load_missing(ahead)
        for i, (it, size) in enumerate(ahead):
            self._fold_item(f, it, run.txn, None)
            f.used += size + self._loaded_bytes  # the changes, and the contexts they pin
            self._loaded_bytes = 0
            if f.used > self._budget_batch:
                chunk = self._seal(f, notices=False)
                run.count(chunk)
                yield chunk
                f = run.part()  # what was written is in the projections (same transaction)
                self._load_missing(ahead[i + 1 :])  # what the seal evicted, read back at once
        return f

    def _load_missing(self, ahead: list[tuple[Item, int]]) -> None:
        cache = self._cache
        wanted = dict.fromkeys(map(_sid_of, (it for it, _ in ahead)))
        self._load([s for s in wanted if s is not None and s not in cache])

    def _drain_pending(self) -> None:
        """Commit everything folded or pending before what comes next, in order."""
        while self._pending or self._worker.busy:
            self._flush(wait=True)
            with self.stream.keepalive_during():
                self._worker.wait()
            self._settle()

    # -- slot guard -----------------------------------------------------------------------------

    def _start_guard(self) -> None:
        interval = self.config.health_interval
        if not interval:
            return
        threading.Thread(
            target=self._guard, args=(interval,), name="ledger-cdc-guard", daemon=True
        ).start()

    def _guard(self, interval: float) -> None:
        """Check the slot on an interval: gauges, a warning before the keep-size bound, an error
        at the critical share, and the resync when the server reports the slot lost."""
        conn: psycopg.Connection[Any] | None = None
        last_status = 0
        last_log = 0.0
        last_spike = 0.0
        rates = RateWatch()
        while not self._stop.wait(interval):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.config.dsn, autocommit=True, connect_timeout=5)
                (h,) = check_slots(
                    conn, self.config.slot, thresholds=self.config.thresholds, sample_seconds=0
                )
            except (psycopg.Error, ValueError) as e:
                log.debug("slot check failed: %s", e)
                if conn is not None:
                    conn.close()
                conn = None
                continue
            now = time.monotonic()
            try:
                r = rates.sample(conn)
            except psycopg.Error as e:
                log.debug("rate sample failed: %s", e)
                r = None
            if r is not None:
                h.wal_rate_bytes_per_s, h.ledger_insert_rate = r.wal_bytes_per_s, r.inserts_per_s
                if h.safe_wal_size is not None and h.wal_rate_bytes_per_s:
                    h.seconds_to_invalidation = h.safe_wal_size / h.wal_rate_bytes_per_s
                if r.spike and now - last_spike > 60:
                    last_spike = now
                    log.warning("%s", r.spike)
                    self.metrics.extra["rate_spikes_total"] = (
                        self.metrics.extra.get("rate_spikes_total", 0.0) + 1
                    )
            self._gauges(h)
            if h.status != last_status or (h.status >= 1 and now - last_log > 60):
                last_log = now
                if h.status >= 2:
                    log.error("slot %s %s: %s", h.slot, h.status_name, "; ".join(h.reasons))
                elif h.status == 1:
                    log.warning("slot %s warning: %s", h.slot, "; ".join(h.reasons))
                elif last_status:
                    log.info("slot %s healthy again", h.slot)
                last_status = h.status
            if h.status == LOST and h.exists:
                self._lost.set()
        if conn is not None:
            conn.close()

    def _gauges(self, h: Any) -> None:
        x = self.metrics.extra
        x["slot_status"] = h.status
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

    # -- partitions -----------------------------------------------------------------------------

    def _start_partition_keeper(self) -> None:
        """On a partitioned ledger, create the upcoming partitions now and every interval, so an
        insert never lacks its partition even when no cron job runs ``partitions ensure``."""
        interval = self.config.partition_ensure_interval
        if not interval:
            return

        def keep() -> None:
            from .partitions import ensure, is_partitioned

            wait = 0.0
            while not self._stop.wait(wait):
                wait = interval
                try:
                    with psycopg.connect(self.config.dsn, autocommit=True, connect_timeout=5) as c:
                        if not is_partitioned(c):
                            return
                        made = ensure(c, self.config.partitions_ahead)
                    if made:
                        log.info("partitions created: %s", ", ".join(made))
                except (psycopg.Error, LedgerError) as e:
                    wait = min(interval, 60.0)
                    log.warning("could not create the upcoming partitions: %s", e)

        threading.Thread(target=keep, name="ledger-cdc-partitions", daemon=True).start()

    # -- lease watch ----------------------------------------------------------------------------

    def _start_lease_watch(self) -> None:
        """Tell schedulers when a lease expires: no event marks that moment, so every interval
        the consumer notifies the runs whose lease ran out since the last look (server clock)."""
        interval = self.config.lease_watch_interval
        if not interval:
            return
        channel = self.config.notify_channel
        last: list[Any] = [None]  # the first look also notifies leases that expired while down

        def watch(conn: psycopg.Connection[Any]) -> None:
            row = conn.execute(_EXPIRED_LEASES, {"ch": channel, "last": last[0]}).fetchone()
            if row is not None:
                last[0] = row[0]
                if row[1]:
                    log.info("%d lease(s) expired: schedulers notified", row[1])

        self._every("lease-watch", interval, self.config.target_dsn or self.config.dsn, watch)

    # -- heartbeat ------------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        interval = self.config.heartbeat_interval
        if not interval:
            return

        def beat(conn: psycopg.Connection[Any]) -> None:
            body = json.dumps({"slot": self.config.slot, "nonce": self._nonce, "ts": time.time()})
            conn.execute("SELECT pg_logical_emit_message(false, %s, %s)", (HEARTBEAT_PREFIX, body))

        self._heartbeat = self._every("heartbeat", interval, self.config.dsn, beat)

    def _every(
        self,
        name: str,
        interval: float,
        dsn: str,
        step: Callable[[psycopg.Connection[Any]], None],
    ) -> threading.Thread:
        """Run ``step`` every ``interval`` seconds on a connection of its own (reconnecting after
        a failure, which is logged at debug level) until the consumer stops."""

        def loop() -> None:
            conn: psycopg.Connection[Any] | None = None
            while not self._stop.wait(interval):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
                    step(conn)
                except psycopg.Error as e:
                    log.debug("%s failed: %s", name, e)
                    if conn is not None:
                        conn.close()
                    conn = None
            if conn is not None:
                conn.close()

        thread = threading.Thread(target=loop, name=f"ledger-cdc-{name}", daemon=True)
        thread.start()
        return thread
