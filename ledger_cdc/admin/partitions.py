"""Retention: a range-partitioned ledger, partitions created ahead, old ones archived.

``ledger-cdc init --partition-by month|week|day`` creates ``agent_events`` partitioned by range
on ``created_at`` (a fresh database only: converting a ledger would mean rewriting it). The
publication uses ``publish_via_partition_root`` so the consumer sees one relation whatever the
partition. PostgreSQL enforces a unique index on a partitioned table only when it contains the
partition key; per-session uniqueness must hold for sessions that span partitions, so it is kept
by two small unpartitioned tables the insert trigger writes in the event's transaction:
``agent_session_heads`` (each session's head position and hash, advanced by compare-and-set, so
of two inserts at one position exactly one commits — which also makes the hash chain's link
across partitions exact) and ``agent_event_keys`` (idempotency keys). Both raise the same errors,
with the same constraint names, as the unpartitioned ledger's unique indexes, so writers behave
the same on either.

:func:`ensure` creates the partitions for the current and the next ``ahead`` intervals (UTC),
each with its own TRUNCATE guard (statement triggers are not inherited by partitions).
Archiving old partitions is :mod:`ledger_cdc.admin.archive`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.errors import ConfigError, InvalidEventError

__all__ = [
    "PARTITION_LOCK",
    "UNITS",
    "Partition",
    "ensure",
    "ensure_for",
    "guards_always",
    "is_partitioned",
    "list_partitions",
    "partition_unit",
    "recreate",
    "setup",
]

UNITS = ("day", "week", "month")
PARTITION_LOCK = 517399233
"""Advisory lock key of whoever creates partitions (one at a time): this module and
ledger_make_partitions (sql/functions/partitions.sql), which spells it the same way."""


def _sql(name: str) -> str:
    packaged = resources.files("ledger_cdc") / "sql" / name
    if packaged.is_file():
        return packaged.read_text()
    return (Path(__file__).resolve().parents[2] / "sql" / name).read_text()


def is_partitioned(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
        "WHERE c.relname = 'agent_events' AND c.relnamespace = current_schema()::regnamespace)"
    ).fetchone()
    return bool(row and row[0])


def setup(conn: psycopg.Connection[Any], unit: str) -> bool:
    """Before the migrations: create the partitioned ledger tables (True), or check an existing
    ledger is partitioned (False)."""
    if unit not in UNITS:
        raise ConfigError(f"--partition-by must be one of {', '.join(UNITS)}, got {unit!r}")
    row = conn.execute("SELECT to_regclass('agent_events') IS NOT NULL").fetchone()
    if row and row[0]:
        if not is_partitioned(conn):
            raise ConfigError(
                "agent_events exists and is not partitioned: --partition-by applies to a new "
                "ledger only (converting one would rewrite it); run init without it"
            )
        return False
    with conn.transaction():
        conn.execute(_sql("partitioned/pre.sql").encode())
        conn.execute("INSERT INTO ledger_partitioning (unit) VALUES (%s)", (unit,))
    return True


def recreate(conn: psycopg.Connection[Any]) -> None:
    """After the baseline, on a fresh database: agent_events made again, partitioned. Its
    guards and grants follow from the definitions (``schema.apply_definitions``), before the
    first partitions (:func:`ensure`), which take the parent's row triggers."""
    with conn.transaction():
        conn.execute(_sql("partitioned/post.sql").encode())


@dataclass(frozen=True)
class Partition:
    name: str
    start: dt.datetime
    end: dt.datetime
    rows: int | None = None  # estimate (pg_class.reltuples), None if never analysed


_PARTITIONS = """
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.reltuples::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'agent_events'::regclass
ORDER BY c.relname
"""


def _bounds(expr: str) -> tuple[dt.datetime, dt.datetime]:
    # FOR VALUES FROM ('2026-11-01 00:00:00+00') TO ('2026-12-01 00:00:00+00')
    parts = expr.split("'")
    return _timestamp(parts[1]), _timestamp(parts[3])


# a timestamptz as PostgreSQL prints it: a year of 4 digits or more, fractions of 1 to 6
# digits, an offset of hours (minutes, seconds) when not whole, BC last
_TIMESTAMPTZ = re.compile(
    r"(\d{4,})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?( BC)?"
)


def _timestamp(text: str) -> dt.datetime:
    """A partition bound as PostgreSQL prints it, read the same on every Python this package
    supports (3.10's ``fromisoformat`` reads neither the ``+00`` offset nor a fraction of other
    than 3 or 6 digits). A bound Python cannot hold — the year 10000 that ends a partition of
    9999's last interval, or a year BC, which a ledger made by the legacy schema files before
    sql/legacy/0017 may hold — is the latest (earliest) time it can:
    such a partition is listed, and never archived for its end, instead of breaking every
    command that lists partitions."""
    m = _TIMESTAMPTZ.fullmatch(text)
    if m is None:
        raise ConfigError(f"cannot read the partition bound {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.group(1, 2, 3, 4, 5, 6))
    if m.group(12):
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    if year > 9999:
        return dt.datetime.max.replace(tzinfo=dt.timezone.utc)
    sign = -1 if m.group(8) == "-" else 1
    offset = dt.timedelta(
        hours=int(m.group(9)), minutes=int(m.group(10) or 0), seconds=int(m.group(11) or 0)
    )
    micro = int((m.group(7) or "").ljust(6, "0"))
    return dt.datetime(year, month, day, hour, minute, second, micro, dt.timezone(sign * offset))


def list_partitions(conn: psycopg.Connection[Any]) -> list[Partition]:
    conn.execute("SET TIME ZONE 'UTC'")
    out = []
    for name, expr, tuples in conn.execute(_PARTITIONS):
        start, end = _bounds(expr)
        out.append(Partition(name, start, end, None if tuples < 0 else int(tuples)))
    return sorted(out, key=lambda p: p.start)


def partition_unit(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT unit FROM ledger_partitioning").fetchone()
    if row is None:
        raise ConfigError("this ledger is not partitioned (init --partition-by creates one)")
    return str(row[0])


def ensure(
    conn: psycopg.Connection[Any], ahead: int = 3, *, at: dt.datetime | None = None
) -> list[str]:
    """Create the partitions for the interval holding ``at`` (now) and the next ``ahead``
    intervals (at most 120), if missing. Returns the names created. Idempotent, safe to run
    concurrently, and open to the consumer's role: ``ledger_ensure_partitions`` (SECURITY
    DEFINER, sql/functions/partitions.sql) creates them as the ledger's owner, for the
    years 1 to 9999 only (past them: ConfigError)."""
    if not 0 <= ahead <= 120:
        raise ConfigError(f"partitions ahead must be 0 to 120, got {ahead}")
    try:
        with conn.transaction():
            return [
                str(r[0])
                for r in conn.execute("SELECT ledger_ensure_partitions(%s, %s)", (ahead, at))
            ]
    except psycopg.errors.DatetimeFieldOverflow as e:  # past year 9999 (ledger_ensure_partitions)
        raise ConfigError(e.diag.message_primary or str(e)) from None


def ensure_for(conn: psycopg.Connection[Any], times: Iterable[dt.datetime]) -> list[str]:
    """Create the partitions these times fall into, if missing (an import of old history).
    Refused for a range that was archived: its archive is final."""
    unit = partition_unit(conn)
    created = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (PARTITION_LOCK,))
        existing = {p.name for p in list_partitions(conn)}
        archived = {
            r[0] for r in conn.execute("SELECT partition_name FROM ledger_archives").fetchall()
        }
        starts = set()
        for t in times:
            row = conn.execute(
                "SELECT date_trunc(%s, %s::timestamptz AT TIME ZONE 'UTC')", (unit, t)
            ).fetchone()
            assert row is not None
            starts.add(row[0].replace(tzinfo=dt.timezone.utc))
        for start in sorted(starts):
            name = f"agent_events_p{start:%Y%m%d}"
            if name in archived:
                raise ConfigError(
                    f"{name} ({start:%Y-%m-%d}) was archived: events cannot be imported into it"
                )
            if name not in existing:
                if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() != (None,):
                    raise ConfigError(
                        f"{name} ({start:%Y-%m-%d}) is being archived: events cannot be "
                        "imported into it"
                    )
                _next(start, unit)  # refuses a range past year 9999
                created.extend(ensure(conn, 0, at=start))
                existing.add(name)
    return created


def _next(start: dt.datetime, unit: str) -> dt.datetime:
    try:
        if unit == "day":
            return start + dt.timedelta(days=1)
        if unit == "week":
            return start + dt.timedelta(days=7)
        return (start.replace(day=28) + dt.timedelta(days=4)).replace(day=1)
    except OverflowError:  # the partition of 9999-12 would end in year 10000
        raise InvalidEventError(
            f"no partition can hold events at {start:%Y-%m-%d}: its range would end after year 9999"
        ) from None


def guards_always(conn: psycopg.Connection[Any], part: sql.Identifier) -> None:
    """The guards fire for replicas too (``session_replication_role``), as
    ``ledger_ensure_partitions`` made them. A partition attached again gets fresh clones of the
    parent's row triggers: this is said again then."""
    for trigger in (
        "agent_events_no_truncate",
        "agent_events_append_only",
        "agent_events_before_insert",
    ):
        conn.execute(
            sql.SQL("ALTER TABLE {} ENABLE ALWAYS TRIGGER {}").format(part, sql.Identifier(trigger))
        )
