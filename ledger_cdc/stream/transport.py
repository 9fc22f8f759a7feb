"""The replication connection: START_REPLICATION, reading XLogData, keepalives and feedback.

Built on psycopg2's ``LogicalReplicationConnection``, which answers keepalives that request a
reply inside ``read_message`` and sends status updates every ``status_interval``. On top of it:

- the flush position we report is only ever what the caller confirmed (:meth:`confirm`): an LSN
  whose effects are durable, never just "received";
- :meth:`keepalive_during` runs a block (a long sink commit) while a helper thread keeps sending
  feedback, so ``wal_sender_timeout`` never fires while we are busy applying;
- the walsender's session is pinned to ISO dates and UTC, so text values are what the loaders
  expect whatever the server's defaults;
- driver errors are translated here into :class:`TransportError` (retryable: connection lost,
  walsender terminated, server restarting, slot momentarily active) or :class:`SlotError`.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any, Protocol

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras

from ledger_cdc.conninfo import options_with, timeout_option
from ledger_cdc.errors import (
    ConfigError,
    LedgerError,
    SlotBusyError,
    SlotError,
    SlotLostError,
    TransportError,
    first_line,
    translate,
)
from ledger_cdc.lsn import format_lsn

__all__ = [
    "FEEDBACK_EVERY",
    "MESSAGE_OVERHEAD",
    "ReplicationStream",
    "SlotBusyError",
    "SlotError",
    "SlotLostError",
    "Transport",
    "TransportError",
    "XLogData",
]


def _given(dsn: str) -> dict[str, Any] | None:
    """The DSN's parameters as psycopg2 parses them (None: it does not parse; the connect says
    why). Not psycopg's parser: the stream begins before psycopg is loaded (cli/run.py)."""
    try:
        return dict(psycopg2.extensions.parse_dsn(dsn))
    except psycopg2.Error:
        return None


# client_encoding: the walsender converts every text value and name to the session's client
# encoding (a role's or database's setting, PGCLIENTENCODING): the loaders read UTF-8
_SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=postgres -c extra_float_digits=3 "
    "-c client_encoding=UTF8"
)


class XLogData(Protocol):
    """One XLogData message as psycopg2 hands it over (``decode=False``: payload is bytes)."""

    data_start: int
    wal_end: int
    send_time: datetime  # the server's clock when it sent the message (naive, local time)
    payload: bytes


MESSAGE_OVERHEAD = 160
"""Bytes a message read ahead holds beyond its payload (psycopg2's message object, the payload's
bytes object, the buffer's slot): the read-ahead bound counts them."""


_PAYLOAD = operator.attrgetter("payload")


def _held(msg: XLogData) -> int:
    """Bytes a message read ahead takes, as the read-ahead bound counts them."""
    return len(msg.payload) + MESSAGE_OVERHEAD


FEEDBACK_EVERY = 0.1
"""Seconds between two status messages that confirm a position (unless one is forced)."""


class Transport(Protocol):
    """What the consumer loop needs of a replication stream (:class:`ReplicationStream`, or a
    stream of prepared bytes in tests)."""

    confirmed: int  # the last LSN confirmed to the server
    # a stream begun before its consumer took it (:meth:`ReplicationStream.prefetch`): seconds
    # since it began and bytes read ahead by then; None otherwise
    adopted: tuple[float, int] | None

    def create_slot_exported(self) -> tuple[int, str]: ...

    def start(self, start_lsn: int, *, reuse: bool = False) -> None: ...

    def read_many(self, limit: int) -> list[XLogData]: ...

    def wait(self, timeout: float, *also: int) -> None: ...

    @property
    def wal_end(self) -> int: ...

    def confirm(self, lsn: int, *, force: bool = True) -> None: ...

    def keepalive_during(self) -> contextlib.AbstractContextManager[None]: ...

    def close(self) -> None: ...


class ReplicationStream:
    """One START_REPLICATION session on a pgoutput slot."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        publication: str,
        *,
        proto_version: int = 2,
        streaming: bool = True,
        messages: bool = True,
        binary: bool = False,
        two_phase: bool = False,
        status_interval: float = 2.0,
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.options: dict[str, str] = {
            "proto_version": str(proto_version),
            "publication_names": publication,
        }
        if messages:
            self.options["messages"] = "true"
        if streaming and proto_version >= 2:
            self.options["streaming"] = "on"
        if binary:
            self.options["binary"] = "true"
        if two_phase and proto_version >= 3:
            self.options["two_phase"] = "on"
        self.status_interval = status_interval
        # a slot this stream creates is a failover slot (PostgreSQL 17+: kept on standbys with
        # sync_replication_slots, so it survives a promotion)
        self.failover = False
        self._conn: Any = None
        self._cur: Any = None
        self._lock = threading.Lock()
        self.confirmed = 0
        # what status messages report: only what confirm() was given on this connection (the
        # position streaming started from is where the caller stands, not yet something it
        # vouches for: its sink may still have it only in memory); 0 reports nothing new
        self._reported = 0
        self.server_version = 0
        self._fed_at = 0.0  # when feedback was last sent (monotonic)
        self._owed = False  # a confirmed LSN not sent yet
        self._prefetch: _Prefetch | None = None
        # (seconds since it began, bytes read ahead) of the prefetch the last start took over
        self.adopted: tuple[float, int] | None = None
        self._ahead = _ReadAhead()

    def same_as(self, other: ReplicationStream) -> bool:
        """Whether ``other`` streams what this stream would (server, slot, options)."""
        return (self.dsn, self.slot, self.options, self.status_interval) == (
            other.dsn,
            other.slot,
            other.options,
            other.status_interval,
        )

    def prefetch(self, limit_bytes: int) -> None:
        """Start streaming now, from where the slot stands, on a thread of its own that reads
        up to ``limit_bytes`` of messages ahead, until :meth:`start` takes them over: the
        server decodes a backlog while the caller is still loading and checking (``ledger-cdc
        consume`` starts one before importing the rest of itself). Whatever goes wrong here
        is silent: :meth:`start` then connects as if nothing had been tried, and reports it.

        Streaming from the slot's own position instead of the caller's checkpoint is safe for
        a caller that drops what ends at or below its checkpoint, as the consumer's assembler
        does (``skip_upto``): the server may resend what the slot has not been told of."""
        self.close()
        self._prefetch = _Prefetch(self, limit_bytes)

    # -- connection -----------------------------------------------------------------------------

    def _open(self) -> Any:
        given = _given(self.dsn)
        try:
            return psycopg2.connect(
                self.dsn,
                connection_factory=psycopg2.extras.LogicalReplicationConnection,
                options=options_with(given, _SESSION_OPTIONS),
                # names this process in pg_stat_replication (which consumer holds the slot)
                application_name=f"ledger-cdc:{self.slot}:{os.getpid()}"[:63],
                **timeout_option(given),
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            )
        except psycopg2.Error as e:
            raise self._failure(e, "cannot open a replication connection") from e

    def _failure(self, e: BaseException, doing: str) -> ConfigError | TransportError:
        """A driver error as what the consumer does about it: a permanent cause (credentials,
        privileges, wal_level, a missing publication) stops it; anything else is retried."""
        err = translate(e, dsn=self.dsn, doing=doing)
        if isinstance(err, ConfigError):
            text = str(err)
            if 'publication "' in text and "does not exist" in text:
                # the checks before streaming found it: the server decodes with the catalog of
                # each change's time, when it did not exist (dropped, then made again)
                return ConfigError(
                    f"{text} (the slot holds changes made while the publication did not "
                    "exist, and cannot read past them: make it again from the table with "
                    f"`ledger-cdc slot drop {self.slot} --force`, then `ledger-cdc consume "
                    "--create-slot`)"
                )
            return err
        return TransportError(str(err))

    def create_slot_exported(self) -> tuple[int, str]:
        """CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT on a connection kept open for
        :meth:`start` (``reuse=True``): returns (consistent point, snapshot name). The snapshot is
        valid until the next command on this connection, i.e. until streaming starts."""
        self.close()
        conn = self._open()
        if self.failover and conn.server_version < 170000:
            conn.close()
            raise ConfigError(
                "failover slots need PostgreSQL 17 or later (the server is "
                f"{conn.server_version // 10000}): leave out --failover"
            )
        try:
            cur = conn.cursor()
            # the slot name is validated ([a-z0-9_]{1,63}) and this command takes no parameters
            if self.failover:
                cur.execute(
                    f'CREATE_REPLICATION_SLOT "{self.slot}" LOGICAL pgoutput '
                    "(SNAPSHOT 'export', FAILOVER true)"
                )
            else:
                cur.execute(
                    f'CREATE_REPLICATION_SLOT "{self.slot}" LOGICAL pgoutput EXPORT_SNAPSHOT'
                )
            _, consistent_point, snapshot_name, _ = cur.fetchone()
        except psycopg2.errors.DuplicateObject as e:
            conn.close()
            raise SlotError(f"slot {self.slot!r} already exists") from e
        except psycopg2.Error as e:
            conn.close()
            raise self._failure(e, f"cannot create slot {self.slot!r}") from e
        self._conn, self._cur = conn, cur
        hi, lo = str(consistent_point).split("/")
        return (int(hi, 16) << 32) | int(lo, 16), str(snapshot_name)

    def start(self, start_lsn: int, *, reuse: bool = False) -> None:
        """Stream from where the slot stands, the caller standing at ``start_lsn`` (what it has
        applied: :attr:`confirmed` starts there), on a new connection or (``reuse``) on the
        one :meth:`create_slot_exported` left open.

        The server is asked for the slot's own position, not ``start_lsn``: given a later one,
        it would skip what was decoded before it, and with a two-phase slot that includes the
        changes of a transaction prepared before it and committed since, which the consumer
        held in memory only. What the slot resends before ``start_lsn`` is the caller's to
        drop (the consumer's assembler does: ``skip_upto``)."""
        taken = None if reuse else self._take_prefetch()
        if taken is not None:
            conn, cur = taken
            self._started(conn, cur, start_lsn)
            return
        if reuse and self._conn is not None:
            conn, cur = self._conn, self._cur
        else:
            self.close()
            conn = self._open()
            cur = conn.cursor()
        try:
            self._start_replication(cur)
        except psycopg2.Error as e:
            conn.close()
            self._conn = self._cur = None
            raise _refused(self.slot, e) or self._failure(e, "START_REPLICATION failed") from e
        self.adopted = None
        self._started(conn, cur, start_lsn)

    def _start_replication(self, cur: Any) -> None:
        """START_REPLICATION from where the slot stands (see :meth:`start`)."""
        cur.start_replication(
            slot_name=self.slot,
            decode=False,
            start_lsn=0,
            options=self.options,
            status_interval=self.status_interval,
        )

    def _started(self, conn: Any, cur: Any, start_lsn: int) -> None:
        self._conn, self._cur = conn, cur
        self.server_version = conn.server_version
        self.confirmed = start_lsn
        self._reported = 0

    def _take_prefetch(self) -> tuple[Any, Any] | None:
        """(connection, cursor) of what :meth:`prefetch` started, if it is streaming, with what
        it read ahead in the buffer (see there)."""
        pre, self._prefetch = self._prefetch, None
        if pre is None:
            return None
        taken = pre.take()
        if pre.lost is not None:
            # the stream was up, then lost (a server restart, a cut connection): that is a
            # stream lost, retried as one, not a start to make as if nothing had happened
            raise self._failure(pre.lost, "replication stream lost") from pre.lost
        if taken is None:
            return None
        conn, cur, ahead = taken
        self._ahead = _ReadAhead(ahead, pre.limit)
        self.adopted = (time.monotonic() - pre.began, self._ahead.size)
        return conn, cur

    def close(self) -> None:
        pre, self._prefetch = self._prefetch, None
        if pre is not None:
            pre.discard()
        self._ahead = _ReadAhead()
        if self._conn is not None:
            if self._owed:  # the last confirmation, before the connection goes
                self._owed = False
                with contextlib.suppress(Exception):
                    self._feedback(True)
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = self._cur = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def fileno(self) -> int:
        return int(self._conn.fileno())

    # -- reading --------------------------------------------------------------------------------

    def read_many(self, limit: int) -> list[XLogData]:
        """Up to ``limit`` XLogData that are ready now, in order (an empty list if none).

        One lock acquisition and one error translation for the whole run of messages: the
        stream loop's per-message overhead, where a backlog is drained, is what this saves.
        """
        out: list[XLogData] = []
        ahead = self._ahead
        if ahead.messages:
            self._read_ahead()  # the server goes on sending while this is worked off
            return ahead.take(limit)
        try:
            with self._lock:
                read = self._cur.read_message
                append = out.append
                for _ in range(limit):
                    msg = read()
                    if msg is None:
                        break
                    append(msg)
        except (psycopg2.Error, AttributeError) as e:
            self.close()
            raise self._failure(e, "replication stream lost") from e
        return out

    def _read_ahead(self) -> None:
        """What the socket has ready, into the read-ahead buffer, up to its byte limit."""
        try:
            with self._lock:
                self._ahead.fill(self._cur.read_message)
        except (psycopg2.Error, AttributeError) as e:
            self.close()  # (the buffer goes with the connection)
            raise self._failure(e, "replication stream lost") from e

    def wait(self, timeout: float, *also: int) -> None:
        """Block until the socket (or one of the ``also`` descriptors) is readable, or
        ``timeout`` passes (less if a confirmation is owed: it is sent on time)."""
        if self._conn is None:
            time.sleep(timeout)
            return
        if self._ahead.messages:
            return  # read ahead by a prefetch: ready now
        if self._owed:
            due = self._fed_at + FEEDBACK_EVERY - time.monotonic()
            if due <= 0:
                self._feedback(True)
            else:
                timeout = min(timeout, due)
        try:
            select.select([self._conn, *also], [], [], timeout)
        except (OSError, ValueError) as e:
            self.close()
            raise TransportError(f"replication stream lost: {e}") from e

    @property
    def wal_end(self) -> int:
        """The server's WAL end as of the last message or keepalive."""
        return int(self._cur.wal_end) if self._cur is not None else 0

    # -- feedback -------------------------------------------------------------------------------

    def confirm(self, lsn: int, *, force: bool = True) -> None:
        """Report ``lsn`` as written and flushed: its effects are durable on our side. Sent at
        once if ``force``, else at most every FEEDBACK_EVERY seconds (the rest by :meth:`wait`,
        or on close): one status message per batch costs an idle consumer as much as its
        batch's statement."""
        if lsn < self.confirmed:
            return
        self.confirmed = self._reported = lsn
        if force or time.monotonic() - self._fed_at >= FEEDBACK_EVERY:
            self._feedback(True)
        else:
            self._owed = True

    def _feedback(self, force: bool) -> None:
        if self._cur is None:
            return
        try:
            with self._lock:
                self._cur.send_feedback(
                    write_lsn=self._reported,
                    flush_lsn=self._reported,
                    apply_lsn=self._reported,
                    force=force,
                )
            self._fed_at, self._owed = time.monotonic(), False
        except psycopg2.Error as e:
            self.close()
            raise TransportError(f"cannot send feedback: {first_line(e)}") from e

    def keepalive_during(self) -> contextlib.AbstractContextManager[None]:
        """Keep sending status updates from a helper thread while the caller is busy."""
        return _beating(lambda: self._feedback(True), self.status_interval / 2)

    def describe(self) -> str:
        return f"slot {self.slot} confirmed {format_lsn(self.confirmed)}"


def _refused(slot: str, e: psycopg2.Error) -> LedgerError | None:
    """What a START_REPLICATION refused because of its slot means (None: another cause)."""
    if isinstance(e, psycopg2.errors.UndefinedObject):
        return SlotError(
            f"replication slot {slot!r} does not exist; create it with --create-slot "
            "or `ledger-cdc slot create`"
        )
    if isinstance(e, psycopg2.errors.ObjectInUse):
        return SlotBusyError(f"slot {slot!r} is in use by another process: {first_line(e)}")
    if isinstance(e, psycopg2.errors.ObjectNotInPrerequisiteState):
        # PostgreSQL 15 says "cannot read from logical replication slot", 16+ "can no longer
        # get changes from / access replication slot"; the DETAIL says "invalidated" in all
        detail = getattr(getattr(e, "diag", None), "message_detail", None) or ""
        text = f"{e} {detail}"
        if "invalidated" in text or "can no longer" in text:
            why = f"{first_line(e)} ({detail.strip()})" if detail else first_line(e)
            return SlotLostError(f"slot {slot!r} was invalidated: {why}")
        return SlotError(f"slot {slot!r} cannot be used: {first_line(e)}")
    if isinstance(e, psycopg2.errors.FeatureNotSupported):
        return SlotError(f"slot {slot!r}: {first_line(e)}")
    return None


@contextlib.contextmanager
def _beating(beat: Callable[[], None], every: float) -> Iterator[None]:
    """Call ``beat`` every ``every`` seconds from a helper thread while the block runs (a
    TransportError it raises is the next beat's to retry)."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(every):
            with contextlib.suppress(TransportError):
                beat()

    t = threading.Thread(target=run, name="ledger-cdc-keepalive", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


class _ReadAhead:
    """Messages read ahead of the loop, up to a byte limit: what a prefetch read, then what the
    socket has ready while that is worked off (so the server goes on sending). ``size`` counts
    what they hold as :func:`_held` does."""

    __slots__ = ("limit", "messages", "size")

    def __init__(self, messages: Iterable[XLogData] = (), limit: int = 0) -> None:
        self.messages: collections.deque[XLogData] = collections.deque(messages)
        self.size = sum(map(_held, self.messages))
        self.limit = limit

    def fill(self, read: Callable[[], XLogData | None]) -> None:
        """Messages from ``read`` (None: none ready) until the limit is reached."""
        append = self.messages.append
        size, limit = self.size, self.limit
        try:
            while size < limit:
                msg = read()
                if msg is None:
                    break
                append(msg)
                size += len(msg.payload) + MESSAGE_OVERHEAD  # (_held, inline)
        finally:
            self.size = size

    def take(self, limit: int) -> list[XLogData]:
        """Up to ``limit`` messages, oldest first."""
        ahead = self.messages
        n = min(limit, len(ahead))
        if n == len(ahead):
            out = list(ahead)
            ahead.clear()
        else:
            popleft = ahead.popleft
            out = [popleft() for _ in range(n)]
        # (_held of each, summed without a call per message)
        self.size -= sum(map(len, map(_PAYLOAD, out))) + n * MESSAGE_OVERHEAD
        return out


class _Prefetch:
    """A START_REPLICATION begun ahead of its stream's :meth:`~ReplicationStream.start`, read on
    a daemon thread up to a byte limit, then handed over (:meth:`take`) or closed
    (:meth:`discard`). The thread owns the connection until then; whoever comes last closes a
    connection nobody took."""

    def __init__(self, stream: ReplicationStream, limit_bytes: int) -> None:
        self.limit = max(0, limit_bytes)
        self.began = time.monotonic()
        self.messages: list[XLogData] = []
        self._conn: Any = None
        self._cur: Any = None
        self._streaming = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ended = False  # take() or discard() was called
        self._taken = False
        self.lost: BaseException | None = None  # what ended it once it was streaming
        self._thread = threading.Thread(
            target=self._run, args=(stream,), name="ledger-cdc-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, stream: ReplicationStream) -> None:
        try:
            conn = stream._open()
            with self._lock:
                self._conn = conn
                if self._ended:
                    return
            cur = conn.cursor()
            stream._start_replication(cur)
            self._cur, self._streaming = cur, True
            size = 0
            while size < self.limit and not self._stop.is_set():
                msg = cur.read_message()
                if msg is None:
                    select.select([conn], [], [], 0.01)
                    continue
                self.messages.append(msg)
                size += _held(msg)
        except Exception as e:  # start() connects again, and reports what fails
            if self._streaming:  # lost while streaming: as any stream lost, for start() to say
                self.lost = e
            self._streaming = False
        finally:
            with self._lock:
                if self._ended and not self._taken:
                    self._close()

    def take(self, timeout: float = 2.0) -> tuple[Any, Any, list[XLogData]] | None:
        """(connection, cursor, messages read) if it is streaming; None otherwise (closed)."""
        self._stop.set()
        self._thread.join(timeout)
        with self._lock:
            self._ended = True
            if self._thread.is_alive():
                return None  # closed by the thread when it ends
            if not self._streaming or self._conn is None or self._conn.closed:
                self._close()
                return None
            self._taken = True
            return self._conn, self._cur, self.messages

    def discard(self) -> None:
        self._stop.set()
        with self._lock:
            self._ended = True
            if not self._thread.is_alive():
                self._close()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = self._cur = None
        self.messages = []
