"""Where folded state becomes durable: projections, snapshots, dead letters and the checkpoint.

One PostgreSQL transaction per batch writes the changed session projections, the calls the batch
completed (``agent_memo``), the snapshots that came due, the dead letters and the checkpoint row
``(slot, end_lsn)``. Because the checkpoint is in
the same transaction as the projections it covers, a crash at any moment leaves both before or
both after the batch (exactly-once effect). The checkpoint write is fenced: it only succeeds if
the stored LSN is still the one this consumer read, so a consumer that lost its slot to another
can never overwrite newer projections.
"""

from __future__ import annotations

import datetime as dt
import functools
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import psycopg
from psycopg import generators, sql
from psycopg.adapt import Transformer
from psycopg.pq import DiagnosticField, ExecStatus, TransactionStatus
from psycopg.pq.abc import PGconn, PGresult

from ledger_cdc.batching import Batch, DeadLetter, SnapshotRow, context_size
from ledger_cdc.connect import connect
from ledger_cdc.errors import FencedError, WindowMissingError, first_line, translate
from ledger_cdc.fold import PROJECTION_FORMATS, SessionContext, attach, decode_context
from ledger_cdc.lsn import format_lsn, parse_lsn
from ledger_cdc.names import SESSIONS_CHANNEL
from ledger_cdc.sink.base import BOOTSTRAPPING, Publisher, Publishing
from ledger_cdc.sink.durable import DurableTracker
from ledger_cdc.sink.shape import (
    MEMO,
    SESSIONS,
    SNAPSHOTS,
    AgentSessionRow,
    Column,
    Table,
    memo_row,
    run_columns,
    session_row,
    snapshot_row,
)

__all__ = [
    "BOOTSTRAPPING",
    "Batch",
    "ChunkedTail",
    "DeadLetter",
    "FencedError",
    "PgSink",
    "SnapshotRow",
    "run_columns",
]


_STAGING_TOUCH = """
CREATE TEMP TABLE IF NOT EXISTS stage_touch (
    session_id uuid, count_before bigint, status_before text, run_before text,
    leases_before int) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS stage_touched (
    session_id uuid PRIMARY KEY, count_before bigint, status_before text, run_before text,
    leases_before int) ON COMMIT DELETE ROWS;
"""


def _stage(table: Table) -> sql.Identifier:
    """The staging table of a stored one (agent_sessions → stage_sessions)."""
    return sql.Identifier("stage_" + table.short)


def _names(table: Table) -> sql.Composable:
    return sql.SQL(", ").join(map(sql.Identifier, table.names))


def _staging(tables: Sequence[Table]) -> str:
    """One staging table per stored one, its columns as COPY sends them (Column.staged); a JSON
    column compressed as the stored one is."""
    parts: list[sql.Composable] = []
    alters: list[sql.Composable] = []
    for t in tables:
        columns = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.staged)) for c in t.columns
        )
        parts.append(
            sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} ({}) ON COMMIT DELETE ROWS;\n").format(
                _stage(t), columns
            )
        )
        alters += [
            sql.SQL("    ALTER TABLE pg_temp.{} ALTER COLUMN {} SET COMPRESSION lz4;\n").format(
                _stage(t), sql.Identifier(c.name)
            )
            for c in t.columns
            if c.json
        ]
    # a staged context, memo entry or snapshot over 2 kB is compressed on its way in, and
    # decompressed by the merge: lz4 where the server has it, as the tables they go to; the
    # default pglz costs the backend more than the merge itself
    do = sql.SQL(
        "DO $$\nBEGIN\n{}EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN\n"
        "    NULL;  -- no lz4 here: the staging tables keep pglz\nEND\n$$;\n"
    ).format(sql.SQL("").join(alters))
    return sql.SQL("").join([*parts, sql.SQL(_STAGING_TOUCH), do]).as_string()


# Rows go in by COPY (one C-level call per row) into session-local staging tables, then one
# statement per table moves them: far less client work than one INSERT per row.
_STAGING = _staging((SESSIONS, SNAPSHOTS, MEMO))
# A transaction too big for one batch (commit_chunked): the staging tables are emptied after each
# chunk's merge; stage_touched keeps, per session, what it was before the transaction.
_CLEAR_STAGES = "TRUNCATE stage_sessions, stage_snapshots, stage_memo, stage_touch"
_COPY_TOUCHED = (
    "COPY stage_touch (session_id, count_before, status_before, run_before, leases_before) "
    "FROM STDIN"
)
_MERGE_TOUCHED = """
INSERT INTO stage_touched SELECT DISTINCT ON (session_id) * FROM stage_touch
ON CONFLICT (session_id) DO NOTHING
"""
# The snapshot rule of the consumer (every N events of a session, and when its task ends), on
# what the chunks wrote.
_DUE_SNAPSHOTS = """
SELECT s.session_id, s.context::text, s.last_hash
FROM stage_touched t JOIN agent_sessions s USING (session_id)
WHERE (%(every)s > 0 AND s.event_count / greatest(%(every)s, 1)
                         <> t.count_before / greatest(%(every)s, 1))
   OR (s.status IS DISTINCT FROM t.status_before AND s.status IN ('completed', 'failed'))
"""
_NOTIFY_READY = """
SELECT count(pg_notify(%(ch)s, t.session_id::text))
FROM stage_touched t JOIN agent_sessions s USING (session_id)
WHERE s.run_status = 'pending'
  AND NOT (t.run_before IS NOT DISTINCT FROM 'pending'
           AND t.leases_before IS NOT DISTINCT FROM (s.context -> 'run' ->> 'leases')::int)
"""
_NOTIFY_TOUCHED = """
SELECT count(pg_notify(%(ch)s, t.session_id::text || ':' || s.last_position))
FROM stage_touched t JOIN agent_sessions s USING (session_id)
"""
# Projections with what they reference: the messages of their window (NULL when the context
# holds them itself) and the strings of the messages they took from events (fold.references).
LOAD_PROJECTIONS = """
SELECT s.session_id, s.format_version, s.context::text,
       CASE WHEN s.context #>> '{window,omitted}' = 'true'
            THEN ledger_window(s.session_id, (s.context #>> '{window,position}')::int8)::text
       END,
       (SELECT array_agg(ledger_message(s.session_id, (x.src ->> 1)::int8) ORDER BY x.o)
        FROM jsonb_array_elements(CASE jsonb_typeof(s.context -> 'sources')
                                  WHEN 'array' THEN s.context -> 'sources' END)
             WITH ORDINALITY AS x(src, o)
        WHERE x.src ->> 3 = 'true'),
       s.last_position, s.event_count
FROM agent_sessions s WHERE s.session_id = ANY($1::uuid[])
"""
_BIGINT = 1 << 63
_LARGE = 1024 * 1024  # a JSON value past this is staged by a statement of its own (binary)
_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_STREAM_CHUNK = 1 << 20


def _copy_binary(
    cur: psycopg.Cursor[Any], statement: str, types: tuple[str, ...], row: tuple[Any, ...]
) -> None:
    """One row by COPY … (FORMAT binary): see :func:`_copy_binary_rows`."""
    _copy_binary_rows(cur, statement, types, (row,))


def _copy_binary_rows(
    cur: psycopg.Cursor[Any],
    statement: str,
    types: tuple[str, ...],
    rows: Iterable[tuple[Any, ...]],
) -> None:
    """Rows by one COPY … (FORMAT binary), each value in PostgreSQL's binary form, large ones
    sent from a memoryview of their bytes, a chunk at a time: no copy of them is made here (nor
    the hex text a bytea takes in a text COPY)."""
    with cur.copy(statement) as copy:
        head = bytearray(_BINARY_HEADER)
        width = struct.pack(">h", len(types))
        for row in rows:
            head += width
            for kind, value in zip(types, row, strict=True):
                if value is None:
                    head += b"\xff\xff\xff\xff"
                    continue
                if kind == "uuid":
                    raw: bytes | memoryview = value.bytes
                elif kind == "int8":
                    raw = struct.pack(">q", value)
                elif kind == "int4":
                    raw = struct.pack(">i", value)
                elif kind == "ts":
                    raw = struct.pack(">q", (value - _PG_EPOCH) // dt.timedelta(microseconds=1))
                elif isinstance(value, str):
                    raw = value.encode()
                else:
                    raw = memoryview(value)
                head += struct.pack(">i", len(raw))
                if len(raw) < _STREAM_CHUNK:
                    head += raw
                    continue
                copy.write(head)
                head = bytearray()
                for i in range(0, len(raw), _STREAM_CHUNK):
                    copy.write(raw[i : i + _STREAM_CHUNK])
            if len(head) >= _STREAM_CHUNK:
                copy.write(head)
                head = bytearray()
        head += b"\xff\xff"
        copy.write(head)


# The statements each stored shape's rows go by, derived from its declaration (sink.shape).
_BINARY = {  # a staged type → how _copy_binary sends a value of it
    "uuid": "uuid",
    "bigint": "int8",
    "integer": "int4",
    "timestamp with time zone": "ts",
    "text": "bytes",
    "bytea": "bytes",
}


def _copy(table: Table, binary: bool = False) -> str:
    return (
        sql.SQL("COPY {} ({}) FROM STDIN{}")
        .format(_stage(table), _names(table), sql.SQL(" (FORMAT binary)" if binary else ""))
        .as_string()
    )


def _binary_kinds(table: Table) -> tuple[str, ...]:
    return tuple(_BINARY[c.staged] for c in table.columns)


def _from_bytes(table: Table) -> tuple[int, ...]:
    """Where a row holds bytes that its staging table takes as text (a JSON value): the text
    COPY must send them as a string (bytes it would send as bytea)."""
    return tuple(i for i, c in enumerate(table.columns) if c.staged == "text" and c.json)


def _insert(table: Table, *, stamped: str = "") -> sql.Composed:
    """INSERT INTO the table SELECT its staged rows, each value cast to the table's type
    (``stamped``: a column the server sets to now())."""
    values: list[sql.Composable] = [
        sql.Identifier(c.name)
        if c.staged == c.pgtype
        else sql.SQL("{}::{}").format(sql.Identifier(c.name), sql.SQL(c.pgtype))
        for c in table.columns
    ]
    names: sql.Composable = _names(table)
    if stamped:
        names = sql.SQL("{}, {}").format(names, sql.Identifier(stamped))
        values.append(sql.SQL("now()"))
    return sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
        sql.Identifier(table.name), names, sql.SQL(", ").join(values), _stage(table)
    )


def _updates(table: Table) -> sql.Composed:
    """SET every written column but the key to the row that conflicted."""
    return sql.SQL(", ").join(
        sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c.name))
        for c in table.columns
        if c.name not in table.key
    )


# Rows with a large value go by a binary COPY of their own, the value streamed from its bytes
# (text COPY would copy it into a str and again to escape it): see _copy_binary.
_COPY_SESSIONS, _COPY_SESSIONS_BINARY = _copy(SESSIONS), _copy(SESSIONS, binary=True)
_COPY_MEMO, _COPY_MEMO_BINARY = _copy(MEMO), _copy(MEMO, binary=True)
_COPY_SNAPSHOTS, _COPY_SNAPSHOTS_BINARY = _copy(SNAPSHOTS), _copy(SNAPSHOTS, binary=True)
_SESSION_TYPES, _MEMO_TYPES, _SNAPSHOT_TYPES = map(_binary_kinds, (SESSIONS, MEMO, SNAPSHOTS))
_SESSION_TEXT, _MEMO_TEXT, _SNAPSHOT_TEXT = map(_from_bytes, (SESSIONS, MEMO, SNAPSHOTS))
_MERGE_SESSIONS = (
    sql.SQL("{} ON CONFLICT ({}) DO UPDATE SET {}, updated_at = now()")
    .format(
        _insert(SESSIONS, stamped="updated_at"),
        sql.SQL(", ").join(map(sql.Identifier, SESSIONS.key)),
        _updates(SESSIONS),
    )
    .as_string()
)
_MERGE_MEMO = sql.SQL("{} ON CONFLICT DO NOTHING").format(_insert(MEMO)).as_string()
SNAPSHOT_CONFLICT = (
    sql.SQL(
        "\nON CONFLICT ({}) DO UPDATE SET {}, context = NULL\n"
        "-- a row at the same point that rebuild_context cannot use (another format or reducer\n"
        "-- version, e.g. from before an upgrade) is replaced; a usable one is kept as it is\n"
        "WHERE agent_snapshots.format_version IS DISTINCT FROM EXCLUDED.format_version\n"
        "   OR agent_snapshots.reducer_version IS DISTINCT FROM EXCLUDED.reducer_version\n"
    )
    .format(sql.SQL(", ").join(map(sql.Identifier, SNAPSHOTS.key)), _updates(SNAPSHOTS))
    .as_string()
)
_MERGE_SNAPSHOTS = _insert(SNAPSHOTS).as_string() + SNAPSHOT_CONFLICT
# One statement each, never a pipeline (executemany): a consumer frozen mid-pipeline leaves a
# backend that is neither idle (no Sync yet) nor timed out, holding the batch's row locks.
_INSERT_DEAD = """
INSERT INTO ledger_dead_letters (slot_name, seq, session_id, lsn, kind, reason, row_data)
SELECT %s, seq, session_id, lsn::pg_lsn, kind, reason, row_data::jsonb
FROM unnest(%s::int8[], %s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[])
     AS d(seq, session_id, lsn, kind, reason, row_data)
ON CONFLICT DO NOTHING
"""
# the notifications as one JSON array of [channel, payload] pairs: a batch owes one per session
# it changed, and two text[] parameters of thousands of strings cost psycopg's list dumping
# several times the CPU of one JSON encoding (on the sink's thread, under the interpreter's lock)
_NOTIFY = "SELECT count(pg_notify(n ->> 0, n ->> 1)) FROM json_array_elements(%s::json) AS n"
_CHECKPOINT = """
INSERT INTO ledger_checkpoints AS c (slot_name, lsn, epoch, heartbeat_at, updated_at, folded_seq,
                                     publication, applied_commit_at)
VALUES (%(slot)s, %(lsn)s::pg_lsn, coalesce(%(epoch)s, 0), to_timestamp(%(heartbeat_at)s), now(),
        coalesce(%(folded_seq)s, 0), %(publication)s, %(applied_commit_at)s::timestamptz)
ON CONFLICT (slot_name) DO UPDATE SET
    lsn = EXCLUDED.lsn, updated_at = now(),
    epoch = coalesce(%(epoch)s, c.epoch),
    heartbeat_at = coalesce(EXCLUDED.heartbeat_at, c.heartbeat_at),
    folded_seq = greatest(c.folded_seq, EXCLUDED.folded_seq),
    publication = coalesce(EXCLUDED.publication, c.publication),
    applied_commit_at = coalesce(EXCLUDED.applied_commit_at, c.applied_commit_at)
WHERE c.lsn IS NOT DISTINCT FROM %(prev)s::pg_lsn
RETURNING 1
"""
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


_F = TypeVar("_F", bound=Callable[..., Any])


def _translated(fn: _F) -> _F:
    """Driver errors leave the sink translated (errors.translate): permanent ones as
    ConfigError / SchemaError, the rest as DatabaseUnavailable, the connection dropped."""

    @functools.wraps(fn)
    def wrapper(self: PgSink, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except psycopg.Error as e:
            self.close()
            raise translate(e, dsn=self.dsn, doing="projection database") from e

    return wrapper  # type: ignore[return-value]


class _AllPublishing:
    def __init__(self, parts: list[Publishing]) -> None:
        self.parts = parts

    def wait(self) -> None:
        for p in self.parts:
            p.wait()

    def cancel(self) -> None:
        for p in self.parts:
            p.cancel()


_NOTHING = _AllPublishing([])


_FLUSH_PATIENCE = 2.0  # seconds the WAL writer is given before a synchronous commit of ours


class _Statements:
    """The hot path's statements, straight through libpq: prepared once per connection, then
    sent with their parameters as text, their results checked as psycopg checks one (an
    error is raised as psycopg raises it). A small batch's commit costs the client much less
    CPU than through a cursor. Awaited by psycopg's wait, not libpq's blocking call (which costs
    a little less CPU): that wait returns to the interpreter every 0.1 s, so a stop signal is
    handled while the loop's inline commit waits on a server that stopped answering; held in C,
    the main thread would never run the handler, and the stop would hang for good."""

    def __init__(self) -> None:
        self._for: PGconn | None = None  # the connection _names were prepared on
        self._names: set[bytes] = set()

    def run(
        self,
        conn: psycopg.Connection[Any],
        name: bytes,
        query: bytes,
        args: tuple[bytes | None, ...],
    ) -> PGresult:
        """One statement of the hot path, straight through libpq: prepared once per
        connection, then sent with its parameters as text, its result checked as psycopg
        checks one (an error is raised as psycopg raises it). A small batch's commit costs the
        client much less CPU than through a cursor."""
        pgconn = conn.pgconn
        if self._for is not pgconn:
            self._for, self._names = pgconn, set()
        with conn.lock:
            for again in (False, True):
                if name not in self._names:
                    pgconn.send_prepare(name, query)
                    self._result(conn.wait(generators.execute(pgconn)), conn)
                    self._names.add(name)
                pgconn.send_query_prepared(name, args)
                results = conn.wait(generators.execute(pgconn))
                if (
                    again
                    or not _unprepared(results)
                    or pgconn.transaction_status != TransactionStatus.IDLE
                ):
                    break
                self._names.clear()  # deallocated by someone (DISCARD ALL): prepared anew
            return self._result(results, conn)

    @staticmethod
    def rows(conn: psycopg.Connection[Any], res: PGresult) -> list[tuple[Any, ...]]:
        """A result's rows loaded as a cursor loads them (psycopg's loaders)."""
        tx = Transformer(conn)
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    @staticmethod
    def _result(results: list[PGresult], conn: psycopg.Connection[Any]) -> PGresult:
        for res in results:
            if res.status == ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
        if not results or results[-1].status not in (ExecStatus.TUPLES_OK, ExecStatus.COMMAND_OK):
            raise psycopg.OperationalError("unexpected result from the server")
        return results[-1]


class PgSink:
    """Projections in a PostgreSQL database (the source database, or ``--target-dsn``)."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        *,
        idle_timeout: float = 10.0,
        publication: str | None = None,
        by_reference: bool = True,
        durable_commits: bool = True,
        folds: bool = True,
    ) -> None:
        self.dsn = dsn
        # False: a relay (consume --publish-only), whose slot position says what it published,
        # not what projections hold (recorded in ledger_relays, for verify)
        self.folds = folds
        # False: commits do not wait for their WAL flush (synchronous_commit = off); what is
        # durable is learnt from the server's WAL positions afterwards (see sink.durable)
        self.durable_commits = durable_commits
        self.tracker = DurableTracker()
        self._observed_at = 0.0  # when the server's WAL positions were last read
        self._statements = _Statements()
        # False when this database is not the ledger's (--target-dsn): what stored contexts and
        # memo rows would reference of the ledger's events is copied instead
        self.by_reference = by_reference
        self.slot = slot
        self.publication = publication
        self.idle_timeout = idle_timeout
        self._conn: psycopg.Connection[Any] | None = None
        self._cur: psycopg.Cursor[Any] | None = None  # for the one-statement batches
        self._staged = False
        self.checkpoint: int | None = None
        self.epoch: int | None = None
        self.publishers: list[Publisher] = []  # e.g. JetStreamPublisher
        # sessions whose projection load_contexts_sized could not use, and why
        self.unusable: dict[uuid.UUID, str] = {}

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            # UTF-8 whatever the database's or role's client_encoding: the hot path's statements
            # send the batch's JSON as the UTF-8 bytes msgspec made (and any text fits)
            # (lift: no statement_timeout or idle_session_timeout of the database's or role's)
            self._conn = connect(self.dsn, doing="projection database", autocommit=True, lift=True)
            # psycopg prepares nothing here on its own: it would DEALLOCATE ALL after a
            # ROLLBACK or a DROP/ALTER, and with it the statements _prepared made
            self._conn.prepare_threshold = None
            # A consumer frozen mid-transaction (SIGSTOP, a stalled VM) would hold the
            # checkpoint row's lock and block the standby that took its slot: the server ends
            # such a session after this long idle inside a transaction (ours never idle: every
            # statement is a round trip of its own, and rows are staged before any lock).
            self._conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false), "
                "set_config('synchronous_commit', %s, false)",
                (f"{int(self.idle_timeout * 1000)}ms", "on" if self.durable_commits else "off"),
            )
            self._staged = False
        return self._conn

    def close(self) -> None:
        self.tracker.forget()
        if self._conn is not None:
            self._conn.close()
            self._conn = self._cur = None

    def shutdown(self) -> None:
        self.close()
        for pub in self.publishers:
            pub.close()

    @_translated
    def load_checkpoint(self) -> int | None:
        self.conn.execute(
            "INSERT INTO ledger_relays (slot_name) VALUES (%s) ON CONFLICT DO NOTHING"
            if not self.folds
            else "DELETE FROM ledger_relays WHERE slot_name = %s",
            (self.slot,),
        )
        row = self.conn.execute(
            "SELECT lsn::text, epoch FROM ledger_checkpoints WHERE slot_name = %s", (self.slot,)
        ).fetchone()
        self.checkpoint = parse_lsn(row[0]) if row else None
        self.epoch = int(row[1]) if row else None
        if self.checkpoint:
            # what was read may be a commit not on disk yet (this consumer's or another's,
            # asynchronous, before a lost connection). On disk before streaming starts from it:
            # the replication driver itself confirms keepalive positions past the start point
            # until the first change arrives.
            _await_flush(self._cursor(), self.conn, self.slot)
            self.tracker.durable = max(self.tracker.durable, self.checkpoint)
        return self.checkpoint

    @_translated
    def mark_bootstrap(self) -> None:
        """Record that the slot is being (re)built from the table (see BOOTSTRAPPING)."""
        self.commit(Batch(end_lsn=0, epoch=BOOTSTRAPPING))
        self.epoch = BOOTSTRAPPING
        if not self.durable_commits:
            # on disk before the slot is dropped and rebuilt (its end LSN is 0: the tracker,
            # which follows LSNs, cannot tell it from nothing)
            _flush_wal(self.conn, self.slot)

    @_translated
    def unmark_bootstrap(self) -> None:
        """A bootstrap that could not start (a permanent error before the slot existed): no
        later start must take it for one interrupted."""
        self.conn.execute(
            "UPDATE ledger_checkpoints SET epoch = 0 WHERE slot_name = %s AND epoch = %s",
            (self.slot, BOOTSTRAPPING),
        )
        self.epoch = 0

    @_translated
    def positions(self) -> dict[uuid.UUID, int]:
        """How far each session's projection has folded (its last position)."""
        return {
            sid: int(pos)
            for sid, pos in self.conn.execute(
                "SELECT session_id, last_position FROM agent_sessions"
            )
        }

    @_translated
    def load_contexts_sized(
        self, session_ids: Iterable[uuid.UUID]
    ) -> dict[uuid.UUID, tuple[SessionContext, int]]:
        """Each session's projected context, whole (its window's messages read back), with its
        estimated size in memory, for the sessions that have one this version can use. One it
        cannot (edited into another shape, numbers past a bigint, counters that disagree with
        its row, references to nothing, a format this version does not know) is left out and
        named in :attr:`unusable` with the reason, for the consumer to rebuild from the ledger:
        folded on from nothing, it would be wrong, and every batch would fail to write it."""
        ids = list(session_ids)
        if not ids:
            return {}
        out: dict[uuid.UUID, tuple[SessionContext, int]] = {}
        ids_text = ("{" + ",".join(map(str, ids)) + "}").encode()
        res = self._statements.run(self.conn, _LOAD_NAME, _LOAD_RAW, (ids_text,))
        rows = self._statements.rows(self.conn, res)
        for row in rows:
            loaded = _loaded(*row)
            if isinstance(loaded, str):
                self.unusable[row[0]] = loaded
            else:
                out[row[0]] = loaded
        return out

    def load_contexts(self, session_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, SessionContext]:
        return {sid: ctx for sid, (ctx, _) in self.load_contexts_sized(session_ids).items()}

    @_translated
    def commit(self, batch: Batch) -> None:
        """Write the batch in one transaction; raises FencedError if the checkpoint moved.

        Publishers (JetStream) get the batch first and store it while its rows are written; the
        commit waits until every publish is acknowledged, so the checkpoint never covers a
        message JetStream lacks, and a crash in between republishes under the same message
        ids."""
        publishing = self._publish(batch)
        try:
            if _small(batch):
                publishing.wait()
                self._apply(batch)
                self._committed(batch)
                return
            conn = self._staged_conn()
            with conn.transaction():
                with conn.cursor() as cur:
                    self._observe(cur)
                    _stage_rows(cur, batch, self.by_reference)
                    # Only now, with every row staged, take locks on shared rows: a consumer
                    # frozen mid-COPY (its backend waiting for data, not idle) must not hold
                    # them, or it would block the standby that took its slot; frozen between
                    # the statements below, it is ended by idle_in_transaction_session_timeout.
                    _merge_rows(cur, batch, self.slot)
                    self._notices(cur, batch)
                self._checkpoint(conn, batch)
                # the rows were written while JetStream stored the batch; the commit waits
                # until it holds every message
                publishing.wait()
            self._committed(batch)
        finally:
            publishing.cancel()  # unless waited for: the batch is given up

    @_translated
    def commit_chunked(
        self,
        chunks: Iterable[Batch],
        finish: Callable[[ChunkedTail], Batch],
    ) -> None:
        """One transaction too big to hold in memory, written in chunks inside one database
        transaction: each chunk's projections (and the sessions it touched first, with what they
        were before), memo rows, dead letters and published events as it comes; then ``finish``
        gives the last part (the snapshots that came due, found and cut from the projections
        written, and the notifications) and the checkpoint commits with it, or nothing does.

        ``chunks`` may load contexts through this sink meanwhile: the same connection, so it
        sees the chunks already written. A standby is blocked on the projections' row locks for
        as long as this takes (idle_in_transaction_session_timeout ends it if this consumer
        freezes between statements)."""
        conn = self._staged_conn()
        with conn.transaction():
            with conn.cursor() as cur:
                self._observe(cur)
                for chunk in chunks:
                    self._publish(chunk).wait()
                    _stage_rows(cur, chunk, self.by_reference)
                    _merge_rows(cur, chunk, self.slot)
                    cur.execute(_CLEAR_STAGES)
                final = finish(ChunkedTail(self, conn))
                self._publish(final).wait()
                _stage_rows(cur, final, self.by_reference)
                _merge_rows(cur, final, self.slot)
                self._notices(cur, final)
                cur.execute(_CLEAR_STAGES)
            self._checkpoint(conn, final)
        self._committed(final)

    def write_part(self, batch: Batch) -> None:
        """Inside :meth:`commit_chunked` (called back from its chunks or its finish): write a
        part's rows now, on the connection and in the transaction of the commit under way
        (its events published first, like every chunk's)."""
        self._publish(batch).wait()
        with self.conn.cursor() as cur:
            _stage_rows(cur, batch, self.by_reference, binary=True)
            _merge_rows(cur, batch, self.slot)
            cur.execute(_CLEAR_STAGES)

    # -- the parts of a commit ------------------------------------------------------------------

    def _publish(self, batch: Batch) -> Publishing:
        """Starts publishing the batch to every publisher (JetStream); ``wait()`` before the
        commit."""
        if not self.publishers:
            return _NOTHING
        # a projection's LSN for the fan-out: the latest commit of its events in this batch
        # (0, unknown, for a bootstrap's or when none was published)
        lsn: dict[uuid.UUID, int] = {}
        for ev, at in batch.published:
            if at > lsn.get(ev.session_id, 0):
                lsn[ev.session_id] = at
        sessions = [
            (sid, ctx.last_position, data, lsn.get(sid, 0))
            for sid, (ctx, data, _, _) in batch.sessions.items()
        ]
        return _AllPublishing([pub.begin(batch.published, sessions) for pub in self.publishers])

    def _apply(self, batch: Batch) -> None:
        """A small batch in one statement (ledger_apply_batch): no staging, one round trip."""
        params = _checkpoint_params(self.slot, self.checkpoint, self.publication, batch)
        prev = params["prev"]
        doc = _batch_doc(batch, self.by_reference, params)
        args = (self.slot.encode(), None if prev is None else prev.encode(), doc)
        try:
            now = time.monotonic()
            if self.durable_commits or now - self._observed_at < OBSERVE_EVERY:
                self._statements.run(self.conn, _APPLY_NAME, _APPLY_RAW, args)
            else:  # (the slot hears of it at most every 0.1 s anyway: no need to look more)
                res = self._statements.run(
                    self.conn, _APPLY_OBSERVED_NAME, _APPLY_OBSERVED_RAW, args
                )
                row = None
                if res.ntuples:
                    insert, flush = res.get_value(0, 0), res.get_value(0, 1)
                    if insert is not None and flush is not None:
                        row = (bytes(insert).decode(), bytes(flush).decode())
                self._observed(row)
        except psycopg.Error as e:
            if e.sqlstate == _FENCED:
                raise self._fenced(prev) from None
            raise

    # -- durability (durable_commits=False) -----------------------------------------------------

    def durable(self) -> int:
        """The highest end LSN of a committed batch known to be on disk."""
        return self.tracker.durable

    @property
    def pending(self) -> bool:
        """Whether a committed batch is not known to be on disk yet."""
        return self.tracker.pending

    @_translated
    def probe(self) -> None:
        """Read the server's WAL positions (no write, no wait): what came durable since. Not
        again within ``_PROBE_AFTER`` of the last look (a small batch's statement looks too)."""
        if self.tracker.pending and time.monotonic() - self._observed_at >= _PROBE_AFTER:
            self._observed(self._cursor().execute(_WAL_POSITIONS).fetchone())

    @_translated
    def flush(self) -> None:
        """Until every committed batch is on disk (one synchronous commit)."""
        if self.tracker.pending:
            _flush_wal(self.conn, self.slot)
            self.tracker.flushed()

    def _observe(self, cur: psycopg.Cursor[Any]) -> None:
        if not self.durable_commits:
            self._observed(cur.execute(_WAL_POSITIONS).fetchone())

    def _observed(self, row: tuple[Any, ...] | None) -> None:
        self._observed_at = time.monotonic()
        if row is not None:
            self.tracker.observed(parse_lsn(row[0]), parse_lsn(row[1]))

    def _cursor(self) -> psycopg.Cursor[Any]:
        """The connection's own cursor, kept: a cursor made per statement costs as much as
        the statement's own work on the client, for a one-statement batch."""
        conn = self.conn
        if self._cur is None or self._cur.connection is not conn:
            self._cur = conn.cursor()
        return self._cur

    def _staged_conn(self) -> psycopg.Connection[Any]:
        conn = self.conn
        if not self._staged:
            conn.execute(_STAGING)
            self._staged = True
        return conn

    def _notices(self, cur: psycopg.Cursor[Any], batch: Batch) -> None:
        notices = _owed_notices(batch)
        if notices:
            # delivered by PostgreSQL only when this transaction commits
            cur.execute(_NOTIFY, (_doc.encode(notices).decode(),))

    def _checkpoint(self, conn: psycopg.Connection[Any], batch: Batch) -> None:
        params = _checkpoint_params(self.slot, self.checkpoint, self.publication, batch)
        if conn.execute(_CHECKPOINT, params).fetchone() is None:
            raise self._fenced(params["prev"])

    def _fenced(self, prev: str | None) -> FencedError:
        return FencedError(
            f"checkpoint of slot {self.slot} is no longer {prev}: another consumer "
            "advanced it; this batch is dropped unwritten and this consumer stands by"
        )

    def _committed(self, batch: Batch) -> None:
        self.tracker.committed(batch.end_lsn)
        if self.durable_commits:
            self.tracker.flushed()
        self.checkpoint = batch.end_lsn
        if batch.epoch is not None:
            self.epoch = batch.epoch


class ChunkedTail:
    """What ``finish`` of :meth:`PgSink.commit_chunked` reads, inside its transaction: the
    sessions the chunks touched whose snapshot came due, and the notifications owed."""

    def __init__(self, sink: PgSink, conn: psycopg.Connection[Any]) -> None:
        self.sink = sink
        self.conn = conn

    def due_snapshots(
        self, every: int, size: int = 200
    ) -> Iterator[list[tuple[uuid.UUID, str, bytes | None]]]:
        """(session, projected context JSON, last hash) of each touched session whose snapshot
        came due, a few hundred at a time (a server-side cursor: never all at once)."""
        with self.conn.cursor(name="ledger_due_snapshots") as cur:
            cur.itersize = size
            cur.execute(_DUE_SNAPSHOTS, {"every": every})
            rows: list[tuple[uuid.UUID, str, bytes | None]] = []
            for sid, text, head in cur:
                rows.append((sid, text, None if head is None else bytes(head)))
                if len(rows) >= size:
                    yield rows
                    rows = []
            if rows:
                yield rows

    def notify(self, channel: str, sessions: bool) -> None:
        """NOTIFY the runs the chunks made ready to lease, and (``sessions``) every touched
        session's new position."""
        self.conn.execute(_NOTIFY_READY, {"ch": channel})
        if sessions:
            self.conn.execute(_NOTIFY_TOUCHED, {"ch": SESSIONS_CHANNEL})


def _dead_params(slot: str, dead: Sequence[DeadLetter]) -> Sequence[Any]:
    """The arrays of one INSERT … SELECT FROM unnest(…) of the dead letters."""
    return (
        slot,
        [d.seq for d in dead],
        [d.session_id for d in dead],
        [format_lsn(d.lsn) for d in dead],
        [d.kind for d in dead],
        [d.reason for d in dead],
        [None if d.row is None else msgspec.json.encode(d.row).decode() for d in dead],
    )


def _owed_notices(batch: Batch) -> list[tuple[str, str]]:
    """(channel, payload) of every notification the batch owes."""
    notices = [(batch.channel, str(s)) for s in batch.notify]
    notices += [(SESSIONS_CHANNEL, n) for n in batch.session_notices]
    return notices


# A batch goes in one statement (ledger_apply_batch) when it is this small: what an idle
# consumer commits, one transaction at a time. Larger ones are staged by COPY.
_SMALL_BYTES = 256 * 1024
_SMALL_ROWS = 200
OBSERVE_EVERY = 0.1  # seconds: a small batch reads the WAL positions at most this often
# seconds: an idle look at them no sooner than this after the last one. Longer than
# OBSERVE_EVERY: while small batches come, their statements look (no round trip of its own);
# shorter, the loop's looks came first and the statements never did (13 looks a second at
# 200 transactions a second, each a round trip)
_PROBE_AFTER = 1.5 * OBSERVE_EVERY
# the WAL positions as this statement starts: after every earlier commit of this connection
_WAL_POSITIONS = "SELECT pg_current_wal_insert_lsn()::text, pg_current_wal_flush_lsn()::text"
_APPLY_NAME, _APPLY_OBSERVED_NAME = b"ledger_apply", b"ledger_apply_observed"
_LOAD_NAME, _LOAD_RAW = b"ledger_load", LOAD_PROJECTIONS.encode()
_APPLY_CALL = "ledger_apply_batch($1, $2::pg_lsn, $3::jsonb)"
_APPLY_RAW = f"SELECT {_APPLY_CALL}".encode()
_APPLY_OBSERVED_RAW = f"{_WAL_POSITIONS}, {_APPLY_CALL}".encode()
_FENCED = "LF001"


def _unprepared(results: list[PGresult]) -> bool:
    """Whether the statement was refused because its prepared statement does not exist."""
    return any(
        r.status == ExecStatus.FATAL_ERROR and r.error_field(DiagnosticField.SQLSTATE) == b"26000"
        for r in results
    )


_doc = msgspec.json.Encoder()


def _small(batch: Batch) -> bool:
    if batch.touched or len(batch.sessions) + len(batch.memo) + len(batch.snapshots) > _SMALL_ROWS:
        return False
    return batch.stored_size() < _SMALL_BYTES


def _commit_time(us: int | None) -> dt.datetime | None:
    """A commit time off the wire, None when unknown or past what a datetime holds: a
    transaction with a replication origin carries the origin's time, which may be any
    timestamptz ('infinity' included)."""
    if not us:
        return None
    try:
        return _PG_EPOCH + dt.timedelta(microseconds=us)
    except OverflowError:
        return None


def _as_text(row: tuple[Any, ...], at: tuple[int, ...]) -> Sequence[Any]:
    """A row for the text COPY: its JSON bytes at ``at`` as strings."""
    if not at:
        return row
    values = list(row)
    for i in at:
        values[i] = values[i].decode()
    return values


_Form = tuple[tuple[str, ...], tuple[tuple[str, Callable[[Any], Any]], ...]]


def _document_form(table: Table) -> _Form:
    """How a row goes into ledger_apply_batch's document: an object keyed by column name, each
    value as its record takes it (Column.in_document): JSON embedded as is, bytes as hex, or the
    UTF-8 string they are."""

    def form(c: Column) -> Callable[[Any], Any] | None:
        if c.pgtype == "jsonb":
            return msgspec.Raw
        if c.pgtype == "bytea":
            return bytes.decode if c.utf8 else bytes.hex
        return None

    forms = ((c.name, form(c)) for c in table.columns)
    return table.names, tuple((name, f) for name, f in forms if f is not None)


_SESSION_DOC, _MEMO_DOC, _SNAPSHOT_DOC = map(_document_form, (SESSIONS, MEMO, SNAPSHOTS))


def _in_document(form: _Form, rows: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    names, forms = form
    out = []
    for row in rows:
        obj = dict(zip(names, row, strict=False))  # (both follow the declaration)
        for name, f in forms:
            value = obj[name]
            if value is not None:
                obj[name] = f(value)
        out.append(obj)
    return out


def _batch_doc(batch: Batch, by_reference: bool, checkpoint: dict[str, Any]) -> bytes:
    """The JSON document ledger_apply_batch reads: stored contexts and memo entries embedded as
    the JSON they already are (msgspec.Raw: not encoded again)."""
    doc: dict[str, Any] = {
        "checkpoint": {k: v for k, v in checkpoint.items() if k not in ("slot", "prev")}
    }
    # what the batch lacks is left out: ledger_apply_batch then runs no statement for it
    if batch.sessions:
        doc[SESSIONS.short] = _in_document(
            _SESSION_DOC,
            [session_row(sid, *value) for sid, value in batch.sessions.items()],
        )
    if batch.memo:
        doc[MEMO.short] = _in_document(
            _MEMO_DOC, [memo_row(sid, at, done, by_reference) for sid, at, done in batch.memo]
        )
    if batch.snapshots:
        doc[SNAPSHOTS.short] = _in_document(_SNAPSHOT_DOC, list(map(snapshot_row, batch.snapshots)))
    if batch.dead_letters:
        doc["dead"] = [
            {
                "seq": d.seq,
                "session_id": d.session_id,
                "lsn": format_lsn(d.lsn),
                "kind": d.kind,
                "reason": d.reason,
                "row_data": d.row,
            }
            for d in batch.dead_letters
        ]
    notices = _owed_notices(batch)
    if notices:
        doc["notify"] = [{"channel": c, "payload": p} for c, p in notices]
    return _doc.encode(doc)


def _stage_rows(
    cur: psycopg.Cursor[Any], batch: Batch, by_reference: bool, *, binary: bool = False
) -> None:
    """COPY the batch's rows into the session's staging tables (no lock taken yet). A row
    holding a large JSON value goes by a statement of its own with the value as a binary
    parameter: COPY's text form would copy and escape it twice more in memory. ``binary``:
    the snapshots all go by one binary COPY (a chunked commit's many, each a bytea that text
    COPY would send as hex)."""
    if batch.sessions:
        large: list[AgentSessionRow] = []
        with cur.copy(_COPY_SESSIONS) as copy:
            for sid, (ctx, data, commit_lsn, head) in batch.sessions.items():
                row = session_row(sid, ctx, data, commit_lsn, head)
                if len(data) > _LARGE:
                    large.append(row)
                else:
                    copy.write_row(_as_text(row, _SESSION_TEXT))
        for big in large:
            _copy_binary(cur, _COPY_SESSIONS_BINARY, _SESSION_TYPES, big)
            # staged: let go of the JSON now, before the next large value is built
            ctx, _, commit_lsn, head = batch.sessions[big[0]]
            batch.sessions[big[0]] = (ctx, b"", commit_lsn, head)
        large.clear()
    if batch.memo:
        memos = (memo_row(sid, at, done, by_reference) for sid, at, done in batch.memo)
        statements = (_COPY_MEMO, _COPY_MEMO_BINARY)
        _copy_rows(cur, statements, _MEMO_TYPES, _MEMO_TEXT, ((m, len(m.entry)) for m in memos))
    if batch.snapshots and binary:
        rows = map(snapshot_row, batch.snapshots)
        _copy_binary_rows(cur, _COPY_SNAPSHOTS_BINARY, _SNAPSHOT_TYPES, rows)
    elif batch.snapshots:
        snaps = (snapshot_row(snap) for snap in batch.snapshots)
        statements = (_COPY_SNAPSHOTS, _COPY_SNAPSHOTS_BINARY)
        sized = ((r, len(r.data)) for r in snaps)
        _copy_rows(cur, statements, _SNAPSHOT_TYPES, _SNAPSHOT_TEXT, sized)
    if batch.touched:
        with cur.copy(_COPY_TOUCHED) as copy:
            for touched in batch.touched:
                copy.write_row(touched)


def _copy_rows(
    cur: psycopg.Cursor[Any],
    statements: tuple[str, str],
    types: tuple[str, ...],
    text: tuple[int, ...],
    rows: Iterable[tuple[tuple[Any, ...], int]],
) -> None:
    """COPY ``rows`` (each with the size of its large value) in text (``statements[0]``), but
    those whose value is large after, one by one in binary (``statements[1]``)."""
    large: list[tuple[Any, ...]] = []
    with cur.copy(statements[0]) as copy:
        for row, size in rows:
            if size > _LARGE:
                large.append(row)
            else:
                copy.write_row(_as_text(row, text))
    for row in large:
        _copy_binary(cur, statements[1], types, row)


def _merge_rows(cur: psycopg.Cursor[Any], batch: Batch, slot: str) -> None:
    if batch.touched:  # before the sessions change: what they were is what is recorded
        cur.execute(_MERGE_TOUCHED)
    if batch.sessions:
        cur.execute(_MERGE_SESSIONS)
    if batch.memo:
        cur.execute(_MERGE_MEMO)  # before the snapshots that leave their memo to it
    if batch.snapshots:
        cur.execute(_MERGE_SNAPSHOTS)
    if batch.dead_letters:
        cur.execute(_INSERT_DEAD, _dead_params(slot, batch.dead_letters))


def _await_flush(cur: psycopg.Cursor[Any], conn: psycopg.Connection[Any], slot: str) -> None:
    """Until everything committed so far is on disk: the flush position passing the insert
    position read now (the WAL writer or any synchronous commit gets it there, usually at
    once); after ``_FLUSH_PATIENCE`` seconds, by a synchronous commit of our own. No transaction id
    is used up in the usual case (a standby starts every 0.5 s)."""
    row = cur.execute(_WAL_POSITIONS).fetchone()
    if row is None:
        return
    target = parse_lsn(row[0])
    flushed = parse_lsn(row[1])
    deadline = time.monotonic() + _FLUSH_PATIENCE
    while flushed < target and time.monotonic() < deadline:
        time.sleep(0.01)
        row = cur.execute(_WAL_POSITIONS).fetchone()
        flushed = parse_lsn(row[1]) if row is not None else flushed
    if flushed < target:
        _flush_wal(conn, slot)


def _flush_wal(conn: psycopg.Connection[Any], slot: str) -> None:
    # a transaction that wrote WAL, committed synchronously, is flushed and with it every
    # record before it (one that only took an xid is not: PostgreSQL commits it
    # asynchronously). Rewriting our checkpoint row unchanged is the write: nothing else
    # reads a difference, and no logical slot of this database sees it.
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("UPDATE ledger_checkpoints SET lsn = lsn WHERE slot_name = %s", (slot,))


def _loaded(
    sid: uuid.UUID, version: int, text: bytes, window: Any, said: Any, last: int, count: int
) -> tuple[SessionContext, int] | str:
    """A stored projection read back (its context and estimated size), or why it cannot be
    used."""
    if version not in PROJECTION_FORMATS:
        return f"format {version}, which this version does not read"
    try:
        ctx = decode_context(text)
        attach(ctx, window, said)
    except (msgspec.DecodeError, WindowMissingError, ValueError, TypeError) as e:
        return f"cannot be read back ({first_line(e)})"
    if (ctx.session_id, ctx.last_position, ctx.event_count) != (sid, last, count) or not (
        0 <= ctx.last_seq < _BIGINT and 0 <= ctx.memo_position <= last
    ):
        return "its counters disagree with its row or pass a bigint"
    return ctx, context_size(ctx, text)


def _checkpoint_params(
    slot: str, prev: int | None, publication: str | None, batch: Batch
) -> dict[str, Any]:
    """The checkpoint row a batch writes, fenced on ``prev`` (the one read)."""
    return {
        "slot": slot,
        "lsn": format_lsn(batch.end_lsn),
        "heartbeat_at": batch.heartbeat_at,
        "prev": None if prev is None else format_lsn(prev),
        "epoch": batch.epoch,
        "folded_seq": batch.max_seq,
        "publication": publication,
        "applied_commit_at": _commit_time(batch.last_commit_ts),
    }
