"""Fold workers: projections built from the JetStream stream instead of a replication slot.

``consume --publish-only --sink nats://…`` reads the slot once and publishes every committed
event to ``<prefix>.events.<session>``, in commit order. ``ledger-cdc fold --from nats://…
--partition K/N`` folds the events of partition K of N — the sessions whose id's last byte is K
modulo N, the split ``init --shards`` uses — into the same projections, snapshots, memo rows and
dead letters a consumer writes, with the same reducers. Partitions are disjoint and together
cover every session, so N workers, on any machines, fold N times what one does while the server
decodes the WAL once.

Exactly once: each worker's checkpoint is the stream sequence of the last message it folded,
kept in ``ledger_checkpoints`` under ``nats:<stream>:<K>/<N>`` (the ``lsn`` column holds the
sequence) and committed in the transaction that writes what it covers, fenced like a slot's.
A worker that restarts reads the stream from the message after it. Each worker reads the whole
event stream and skips what is not its own by the subject's last byte, before decoding anything.

Consecutive messages of one ledger transaction (the same commit LSN) are folded as one
transaction, so snapshots are cut between transactions as the consumer cuts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import psycopg

from ledger_cdc.batching import Batch, BatchBuilder, SessionCache, SnapshotPolicy
from ledger_cdc.client.read import COLUMNS, load_events, row_event
from ledger_cdc.connect import connect
from ledger_cdc.consumer.config import RANGES
from ledger_cdc.errors import ConfigError, FencedError, LedgerError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import default_reducers
from ledger_cdc.natswire import (
    check_storable,
    commit_lsn,
    events_wildcard,
    left_out,
    read_event,
    rejected_event,
    status_of,
    subject_byte,
    wire_event,
)
from ledger_cdc.pgoutput.messages import pg_micros
from ledger_cdc.retry import Backoff
from ledger_cdc.settings import check_ranges
from ledger_cdc.sink.jetstream import JetStreamSettings
from ledger_cdc.sink.jetstream_link import first_line, require_nats, subscribe_raw
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.sink.worker import SinkWorker
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Item, Quarantined

__all__ = ["FoldConfig", "FoldWorker", "parse_partition"]

log = logging.getLogger(__name__)

# a message read: (stream sequence, its event — None when another partition's —, commit LSN,
# bytes)
_Row = tuple[int, "LedgerEvent | Rejected | None", int, int]
_ONE = f"SELECT {COLUMNS} FROM agent_events WHERE session_id = %s AND position = %s"  # noqa: S608


_PART = re.compile(r"[0-9]{1,3}")  # ASCII digits only ("²".isdigit() is True)


def parse_partition(text: str) -> tuple[int, int]:
    """``K/N`` → (K, N), 0 ≤ K < N ≤ 256."""
    k, sep, n = text.partition("/")
    if not sep or not _PART.fullmatch(k.strip()) or not _PART.fullmatch(n.strip()):
        raise ConfigError(f"--partition {text!r}: expected K/N, e.g. 0/4")
    kk, nn = int(k), int(n)
    if not 1 <= nn <= 256 or not 0 <= kk < nn:
        raise ConfigError(f"--partition {text!r}: need 0 <= K < N <= 256")
    return kk, nn


_SHARED = ("snapshot_every", "memory_limit", "reconnect_base", "reconnect_cap")


@dataclass(frozen=True)
class FoldConfig:
    url: str  # nats://…[?stream=&prefix=]
    dsn: str  # the ledger's database: projections, checkpoint, payloads left out of the stream
    partition: int = 0
    partitions: int = 1
    target_dsn: str | None = None  # projections elsewhere (everything copied, by_reference off)
    fetch: int = 2000  # messages asked for at a time
    snapshot_every: int = 100
    memory_limit: int = 256 * 1024 * 1024
    reconnect_base: float = 0.1
    reconnect_cap: float = 5.0

    def check(self) -> None:
        """Raise ConfigError for a value out of range (as ``ConsumerConfig.check``): the
        worker checks its config before it starts anything."""
        check_ranges(
            "fold settings",
            self,
            {
                "partition": (0, 255),
                "partitions": (1, 256),
                "fetch": (1, 100_000),
                # the settings it shares with the consumer, bounded as the consumer's are
                **{k: RANGES[k] for k in _SHARED},
            },
        )
        if self.partition >= self.partitions:
            raise ConfigError(
                f"fold settings out of range: partition {self.partition} of "
                f"{self.partitions} (need 0 <= partition < partitions)"
            )


class FoldWorker:
    def __init__(self, config: FoldConfig) -> None:
        config.check()
        require_nats("fold --from nats://…")
        self.config = config
        self.settings = JetStreamSettings.from_url(config.url, "--from")
        # its checkpoint's row in ledger_checkpoints
        self.name = f"nats:{self.settings.stream}:{config.partition}/{config.partitions}"
        self.sink = PgSink(
            config.target_dsn or config.dsn, self.name, by_reference=not config.target_dsn
        )
        reducers = default_reducers()
        self.builder = BatchBuilder(
            load=self.sink.load_contexts_sized,
            cache=SessionCache(config.memory_limit * 15 // 100),
            budget=max(1, config.memory_limit * 15 // 100),
            reducers=reducers,
            snapshots=SnapshotPolicy(config.snapshot_every),
            by_reference=self.sink.by_reference,
            fill_gap=self._gap_rows,
        )
        self._stop = threading.Event()
        self._backoff = Backoff(
            base=config.reconnect_base, cap=config.reconnect_cap, healthy_after=30.0
        )
        self._got: list[tuple[int, bytes | None]] = []  # the pull under way: (seq, data|None)
        self._done = asyncio.Event()
        self._pull_error: str | None = None
        # subject bytes that end in the session id: whether its last byte is ours, by its two
        # last hex digits (computed once per value)
        self._mine = [b % config.partitions == config.partition for b in range(256)]
        self._carry: list[_Row] = []  # read, held back for the next fetch
        self._uncommitted = 0  # the last stream sequence read and folded, not yet committed
        self.folded = 0  # events of this partition folded
        self.position = 0  # the stream sequence committed
        # payloads left out of the stream are read from the ledger: the sink's connection when
        # the projections are in the ledger's database, else one of its own
        self._ledger: psycopg.Connection[Any] | None = None

    def stop(self) -> None:
        self._stop.set()

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Whether a stop was asked for (:meth:`stop`), waiting up to ``timeout`` seconds."""
        return self._stop.wait(timeout)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        backoff = self._backoff
        while not self._stop.is_set():
            try:
                asyncio.run(self._attempt())
            except FencedError as e:
                log.warning("%s", e)
                self._close()
            except ConfigError:
                raise
            except Exception as e:  # connection, server, sink; nats-py's own errors
                log.warning("fold %s: %s; reconnecting", self.name, first_line(e))
                self._close()
            else:
                break
            self._stop.wait(backoff.failed())
        self._close()
        self.sink.shutdown()

    def _close(self) -> None:
        self.sink.close()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    async def _attempt(self) -> None:
        """One connection: read the stream from the checkpoint on, until a stop or a fault."""
        import nats

        s = self.settings
        nc = await nats.connect(
            servers=s.servers,
            connect_timeout=5,
            ping_interval=2,
            max_outstanding_pings=2,
            # a lost connection ends the attempt at once: the pull under way (and, after a
            # server restart, the consumer) is gone; the next attempt starts from the checkpoint
            allow_reconnect=False,
            name=f"ledger-cdc:{self.name}",
            error_cb=_quiet,
            disconnected_cb=self._disconnected,
        )
        try:
            js = nc.jetstream(timeout=s.ack_timeout)
            self._carry = []
            self.position = self.sink.load_checkpoint() or 0
            self._uncommitted = self.position
            self.builder.cache.clear()
            consumer = await self._add_consumer(js)
            inbox = nc.new_inbox()
            await subscribe_raw(nc, inbox, self._on_msg, pending=4 * self.config.fetch + 100)
            log.info(
                "fold %s: reading stream %s after sequence %d", self.name, s.stream, self.position
            )
            self._backoff.succeeded()
            worker = self._worker = SinkWorker(self.sink)
            try:
                await self._pull_until_stopped(nc, inbox, consumer)
            finally:
                worker.close()
        finally:
            with contextlib.suppress(Exception):  # closing anyway
                await asyncio.wait_for(nc.close(), 5)

    async def _add_consumer(self, js: Any) -> str:
        """A consumer of the stream's events from the message after the checkpoint: its name.
        Ephemeral (in memory, gone 30 s after its last pull) and unacknowledged: the checkpoint
        in the database is what says where the next attempt starts."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        s = self.settings
        consumer = f"ledger-cdc-fold-{self.config.partition}-{uuid.uuid4().hex[:12]}"
        try:
            await js.add_consumer(
                s.stream,
                ConsumerConfig(
                    name=consumer,
                    filter_subject=events_wildcard(s.prefix),
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=self.position + 1,
                    ack_policy=AckPolicy.NONE,
                    inactive_threshold=30.0,
                    max_waiting=1,
                    mem_storage=True,
                ),
            )
        except NotFoundError as e:  # the relay may not have started yet: waited for
            raise LedgerError(
                f"JetStream stream {s.stream!r} does not exist at {', '.join(s.servers)} "
                "yet (consume --publish-only --sink nats://… creates it)"
            ) from e
        return consumer

    async def _pull_until_stopped(self, nc: Any, inbox: str, consumer: str) -> None:
        """Pull after pull (answered on ``inbox``), each folded while the next is under way."""
        s = self.settings
        request = f"$JS.API.CONSUMER.MSG.NEXT.{s.stream}.{consumer}"
        ask = msgspec.json.encode({"batch": self.config.fetch, "expires": 1_000_000_000})

        async def pull() -> None:
            self._got = []
            self._done = asyncio.Event()
            self._pull_error = None
            await nc.publish(request, ask, reply=inbox)

        await pull()
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._done.wait(), 1.0 + s.ack_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"JetStream did not answer a pull within {1 + s.ack_timeout:.0f}s"
                ) from None
            if self._pull_error is not None:
                raise LedgerError(f"JetStream: {self._pull_error}")
            got = self._got
            # the next pull is under way (the server sends it meanwhile) while this one is
            # folded, and the sink thread commits the batch before it
            await pull()
            if got:
                self._take(got, full=len(got) >= self.config.fetch)
            else:
                self._commit_idle()
            self._settle()
        self._worker.wait()
        self._settle()

    async def _disconnected(self) -> None:
        self._pull_error = self._pull_error or "the connection to NATS was lost"
        self._done.set()

    def _settle(self) -> None:
        """What the sink thread committed (re-raising its error)."""
        done = self._worker.take()
        if done is not None:
            self.position = max(self.position, done.end_lsn)
            self.folded += done.events

    def _submit(self, batch: Batch) -> None:
        self._worker.wait()
        self._settle()
        self._worker.submit(batch)

    def _on_msg(self, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        """A message of the pull under way, straight from the connection's parser: only its
        stream sequence (from its reply subject) when another partition's, by its subject's
        last two hex digits, before anything is decoded."""
        code = status_of(headers)
        if code:  # a status: NATS/1.0 <code> <description>
            if code != b"100":  # 100: an idle heartbeat
                if code not in (b"404", b"408"):  # no (more) messages: the pull is over
                    self._pull_error = headers.split(b"\r\n", 1)[0][9:].decode(errors="replace")
                self._done.set()
            return
        tokens = reply.split(b".")
        # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>,
        # or with <domain>.<account hash> after ACK and a token at the end
        seq = int(tokens[5] if len(tokens) == 9 else tokens[7])
        last = subject_byte(subject)
        # not a session subject: decoded, and rejected if not an event
        ours = True if last is None else self._mine[last]
        self._got.append((seq, data if ours else None))
        if len(self._got) >= self.config.fetch:
            self._done.set()

    def _take(self, got: list[tuple[int, bytes | None]], *, full: bool) -> None:
        """Fold what a pull brought and commit it with the stream sequence it reaches. After a
        full pull the trailing ledger transaction waits for the next one (more of it may
        follow), so a snapshot is never cut inside a transaction."""
        rows = self._carry
        self._carry = []
        for seq, data in got:
            if seq <= max(self.position, self._uncommitted) or (rows and seq <= rows[-1][0]):
                continue  # a redelivery
            read = None if data is None else self._read(seq, data)
            if read is None:
                rows.append((seq, None, 0, 0))  # not ours: only its sequence counts
            else:
                rows.append((seq, read[0], read[1], len(data or b"")))
        if not rows:
            return
        cut = len(rows)
        if full:
            own = [i for i, r in enumerate(rows) if r[1] is not None]
            if own and rows[own[-1]][2]:
                last = rows[own[-1]][2]
                k = len(own) - 1
                while k > 0 and rows[own[k - 1]][2] == last:
                    k -= 1
                if own[k] > 0:
                    cut = own[k]
        self._carry = rows[cut:]
        self._fold(rows[:cut])

    def _fold(self, rows: list[_Row]) -> None:
        if not rows:
            return
        end = rows[-1][0]
        txns: list[Transaction[Item]] = []
        for seq, ev, lsn, size in rows:
            if ev is None:
                continue
            item: Item = Quarantined(lsn, ev) if isinstance(ev, Rejected) else ev
            t = txns[-1] if txns else None
            if t is not None and lsn and t.commit_lsn == lsn:
                assert isinstance(t.items, list)
                t.items.append(item)
                t.end_lsn = seq
                t.size += size
                continue
            ts = pg_micros(ev.created_at) if type(ev) is LedgerEvent else 0
            txns.append(Transaction(1, lsn, seq, ts, [item], size=size))
        self._uncommitted = end
        if not txns and end - self.position < 10 * self.config.fetch:
            return  # only others' messages: the checkpoint moves with our next commit
        self._commit(txns, end)

    def _commit(self, txns: list[Transaction[Item]], end: int) -> None:
        if not txns:
            self._submit(Batch(end_lsn=end))
            return
        while txns:
            self._worker.wait()  # the fold reads contexts on the sink's connection
            self._settle()
            batch, txns = self.builder.fold(txns)
            if not txns:
                batch.end_lsn = end  # the last part covers the others' messages after it
            self._worker.submit(batch)

    def _commit_idle(self) -> None:
        """Nothing came: fold what was held back (its transaction is whole by now) and move
        the checkpoint over others' messages."""
        if self._carry:
            rows, self._carry = self._carry, []
            self._fold(rows)
        elif self._uncommitted > self.position and not self._worker.busy:
            self._commit([], self._uncommitted)

    def _read(self, seq: int, data: bytes) -> tuple[LedgerEvent | Rejected, int] | None:
        """The event of an own message; None for another partition's session (a subject that
        does not match its body) and for a message that is no event at all (anyone allowed to
        publish on the subjects can put one there: logged and skipped, never folded)."""
        try:
            ev, lsn = self._event(data)
        # ValueError: its commit_lsn (DecodeError too for one nested deeper than an event's)
        except (msgspec.DecodeError, ValueError) as e:
            log.warning(
                "fold %s: stream message %d is not an event, skipped: %s", self.name, seq, e
            )
            return None
        if not self._mine[ev.session_id.bytes[15]]:
            return None
        return ev, lsn

    def _event(self, data: bytes) -> tuple[LedgerEvent | Rejected, int]:
        """A message's event and its commit LSN. What cannot be read is Rejected (the fold
        quarantines it, as the consumer quarantines a row); a payload left out of the stream
        is read from agent_events."""
        w = read_event(data)
        lsn = commit_lsn(w)
        payload = bytes(w.payload)
        check_storable(w, payload)
        if left_out(w):
            row = self._ledger_conn().execute(_ONE, (w.session_id, w.position)).fetchone()
            if row is not None:
                return row_event(row), lsn
            why = f"published without its payload ({w.omitted} bytes), not in agent_events"
            return rejected_event(w, why), lsn
        return wire_event(w, payload), lsn

    def _gap_rows(self, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
        """Session ``sid``'s rows at positions ``first``..``last``, from the ledger table: what
        the stream lacks before a later position (the relay never had them), folded there."""
        conn = self._ledger_conn()
        return list(load_events(conn, sid, after_position=first - 1, upto_position=last))

    def _ledger_conn(self) -> psycopg.Connection[Any]:
        if self.config.target_dsn is None:
            self._worker.wait()  # the sink's connection, not in use by its thread
            return self.sink.conn
        if self._ledger is None or self._ledger.closed:
            self._ledger = connect(self.config.dsn, autocommit=True, lift=True)  # (idle long)
        return self._ledger


async def _quiet(e: Exception) -> None:
    log.warning("NATS: %s", first_line(e))
