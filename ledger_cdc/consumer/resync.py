"""Resync: the ledger table read as of a slot's exported snapshot, for a bootstrap (a new slot
over existing history) or after a slot was lost. Also the preflight checks that no retry cures.

:class:`History` yields what the projections lack, in session order, as the rows stream in
(never held whole): for sessions whose history was archived, their archive snapshot first
(:func:`archived_bases`), then every row past their projection's position.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.admin.schema import LEDGER_SCHEMA_SQL, load_migrations, slot_misfit
from ledger_cdc.client.read import events_query, row_event
from ledger_cdc.connect import connect
from ledger_cdc.errors import ConfigError, SchemaError, SlotError, translate
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.names import LEDGER_TABLE
from ledger_cdc.stream.assemble import estimate
from ledger_cdc.stream.ledger import REQUIRED_COLUMNS
from ledger_cdc.stream.route import ArchiveStart, Item, Quarantined

__all__ = [
    "History",
    "archived_bases",
    "check_schema",
    "connected",
    "count_unfolded",
    "preflight",
    "publication_problem",
]

_PREFLIGHT = sql.SQL("""
SELECT current_setting('wal_level'),
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = session_user),
       CASE WHEN to_regclass('ledger_migrations') IS NULL THEN NULL
            ELSE (SELECT array_agg(version) FROM ledger_migrations) END,
       EXISTS (SELECT FROM pg_publication WHERE pubname = %s),
       {schema},
       has_database_privilege(current_database(), 'TEMPORARY'), current_database()
""").format(schema=sql.SQL(LEDGER_SCHEMA_SQL))


@contextlib.contextmanager
def connected(dsn: str, what: str, *, autocommit: bool = True) -> Iterator[psycopg.Connection[Any]]:
    """A short-lived connection whose failures leave translated (errors.translate), without
    the timeouts a database or role may set for its applications (:func:`lift_timeouts`: a
    bootstrap or a resync reads the whole ledger)."""
    try:
        with connect(dsn, doing=what, autocommit=autocommit, lift=True) as conn:
            yield conn
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing=what) from e


def check_schema(applied: list[int] | None, where: str) -> None:
    want = {m.version for m in load_migrations()}
    missing = sorted(want - set(applied or ()))
    if applied is None:
        raise SchemaError(f"{where} has no ledger schema: run `ledger-cdc init --dsn …` first")
    if missing:
        raise SchemaError(
            f"{where} lacks migration(s) {', '.join(f'{v:04d}' for v in missing)} of this "
            "version: run `ledger-cdc init --dsn …` (stop the consumer first)"
        )


def preflight(
    dsn: str,
    publication: str,
    target_dsn: str | None,
    table: str = LEDGER_TABLE,
    slot: str | None = None,
) -> str | None:
    """What no retry cures is said at once, as one ConfigError with its fix: the server's
    wal_level, the role's REPLICATION, the schema's migrations and the publication (and the
    projection database's schema); and ``slot``, if it exists, being a pgoutput logical slot
    of this database (SlotError). Returns the schema of the ledger table (as the role's
    search_path finds it), the one whose relation the stream folds."""
    with connected(dsn, "ledger database") as conn:
        row = conn.execute(_PREFLIGHT, (publication, table)).fetchone()
        assert row is not None
        wal_level, replication, applied, has_pub, schema, temp, name = row
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
        check_schema(applied, "the ledger database")
        if not has_pub:
            raise ConfigError(
                f"publication {publication!r} does not exist in the ledger database: "
                "run `ledger-cdc init` (with --shards N for shard publications)"
            )
        unpublished = publication_problem(conn, publication, table)
        if unpublished is not None:
            raise ConfigError(unpublished)
        misfit = slot_misfit(conn, slot) if slot else None
        if misfit is not None:
            raise SlotError(misfit)
    where = "the role in --dsn"
    if target_dsn:
        with connected(target_dsn, "projection database") as conn:
            row = conn.execute(_PREFLIGHT, (publication, table)).fetchone()
            assert row is not None
            check_schema(row[2], "the projection database (--target-dsn)")
            temp, name, where = row[5], row[6], "the role in --target-dsn"
    if not temp:
        raise ConfigError(
            f"{where} may not create temporary tables in database {name!r}, where the "
            "consumer stages a large batch (GRANT TEMPORARY ON DATABASE … TO the role; "
            "`ledger-cdc init` grants it to ledger_consumer)"
        )
    return str(schema) if schema is not None else None


_PUBLISHED = sql.SQL("""
SELECT p.pubinsert, p.pubviaroot,
       (SELECT t.attnames FROM pg_publication_tables t WHERE t.pubname = p.pubname
        AND t.tablename = %s AND t.schemaname = {schema}),
       EXISTS (SELECT FROM pg_partitioned_table WHERE partrelid = to_regclass(quote_ident(%s))),
       to_regclass(quote_ident(%s)) IS NOT NULL
FROM pg_publication p WHERE p.pubname = %s
""").format(schema=sql.SQL(LEDGER_SCHEMA_SQL))


def publication_problem(conn: psycopg.Connection[Any], publication: str, table: str) -> str | None:
    """Why ``publication`` does not stream the ledger table's rows as the consumer reads them
    (not in it, INSERTs not published, a partitioned ledger published partition by partition),
    else None. What the slot does not carry never reaches the projections: said at the start,
    not found missing later."""
    row = conn.execute(_PUBLISHED, (table, table, table, table, publication)).fetchone()
    if row is None or not row[4]:
        return None  # (no such publication: said by the caller; no table of that name: renamed)
    inserts, via_root, columns, partitioned, _ = row
    listed = columns is not None
    lost = (
        "; what is written meanwhile never reaches the slot (once it is published again, a "
        "session's next event has the consumer read what it lacks from the ledger table)"
    )
    if not listed:
        if partitioned and not via_root:
            return (
                f"publication {publication!r} publishes the partitions of {table!r}, not the "
                "table the consumer reads: ALTER PUBLICATION … SET (publish_via_partition_root "
                "= true)"
            )
        return (
            f"publication {publication!r} does not publish the ledger table {table!r} "
            f"(ALTER PUBLICATION … ADD TABLE {table}, or `ledger-cdc init` for a new one){lost}"
        )
    left_out = [c for c in REQUIRED_COLUMNS if c not in columns]
    if left_out:
        return (
            f"publication {publication!r} leaves out {', '.join(left_out)} of {table!r}, "
            "which the fold needs: every row would be a dead letter (`ledger-cdc init` puts "
            f"the column list back, or ALTER PUBLICATION … SET TABLE {table} (…)){lost}"
        )
    if not inserts:
        return (
            f"publication {publication!r} does not publish INSERTs, the only change the "
            f"ledger has (ALTER PUBLICATION … SET (publish = 'insert, update, delete, "
            f"truncate')){lost}"
        )
    return None


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


def archived_bases(
    src: psycopg.Connection[Any],
    positions: dict[uuid.UUID, int],
    *,
    version: str,
    other_database: bool,
) -> list[tuple[Item, int]]:
    """For each session whose history up to some position was archived and whose projection
    is behind that point: its archive snapshot (with its memo), to fold the rest on (and
    ``positions`` moved to it). Only in the ledger's own database, where the archive keeps its
    snapshots and memo rows; into another (``other_database``) the bootstrap is refused rather
    than folded wrong."""
    from ledger_cdc.admin.archive import archived_heads
    from ledger_cdc.admin.verify import archive_base

    out: list[tuple[Item, int]] = []
    for sid, (upto, _, name) in archived_heads(src).items():
        if positions.get(sid, 0) >= upto:
            continue
        if other_database:
            raise ConfigError(
                f"session {sid}: its history up to position {upto} was archived ({name}) and "
                "the projection database lacks it: a bootstrap into another database cannot "
                "rebuild it (bootstrap into the ledger's own database, which keeps the "
                "archive snapshots, or restore the archive)"
            )
        base = archive_base(src, sid, upto, version)
        if base is None:
            raise ConfigError(
                f"session {sid}: its history up to position {upto} was archived ({name}) "
                "and no usable snapshot covers it: the bootstrap cannot fold it (restore "
                "the archive)"
            )
        positions[sid] = base.last_position
        out.append((ArchiveStart(base), 0))
    return out


class History:
    """The rows a bootstrap folds, read inside the snapshot's transaction on ``src``.

    Iterating yields (change, estimated bytes) grouped by session; ``folded`` counts the rows
    read, ``total`` is what the progress bar expects (``progress(done, total)`` every 5,000)."""

    def __init__(
        self,
        src: psycopg.Connection[Any],
        positions: dict[uuid.UUID, int],
        *,
        lsn: int,
        version: str,
        other_database: bool,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.src = src
        self.positions = positions
        self.lsn = lsn
        self.progress = progress
        self.total = count_unfolded(src, positions)
        self.folded = 0
        if progress:
            progress(0, self.total)
        self.bases = archived_bases(src, positions, version=version, other_database=other_database)

    def __iter__(self) -> Iterator[tuple[Item, int]]:
        yield from self.bases
        positions, progress, lsn = self.positions, self.progress, self.lsn
        for ev, size in _table_rows(self.src):
            if ev.position <= positions.get(ev.session_id, 0):
                continue
            self.folded += 1
            if progress and self.folded % 5000 == 0:
                progress(self.folded, self.total)
            item: Item = ev if type(ev) is LedgerEvent else Quarantined(lsn, ev)  # type: ignore[arg-type]
            yield item, estimate(size)

    def done(self) -> None:
        if self.progress:
            self.progress(self.folded, self.folded)


# The whole table in (session, position) order, in one query whose rows the server sends in
# chunks as it reads them (a cursor's fetches would each wait for the next), when the client
# library can (libpq 17); else row by row. Read by the (session, position) index: planned for
# its total cost, the query would sort the whole table first, and send nothing until then.
_CHUNK = 2000
_BY_INDEX = "SET LOCAL enable_sort = off"


def _table_rows(src: psycopg.Connection[Any]) -> Iterator[tuple[LedgerEvent | Rejected, int]]:
    """Every row of the ledger table (in ``src``'s transaction) → (event, or the row
    :class:`Rejected` with the reason; the size of its payload's JSON), by the rule every reader
    shares (``row_event``), as the rows stream in: never held whole."""
    query, params = events_query(None, 0, None)
    size = _CHUNK if psycopg.capabilities.has_stream_chunked() else 1
    with src.cursor() as cur:
        cur.execute(_BY_INDEX)  # (the snapshot's transaction ends with the bootstrap)
        for row in cur.stream(query, params, size=size):
            yield row_event(row), len(row[5] or b"") + 200
