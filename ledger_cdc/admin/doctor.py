"""The preflight of a deployment: every server setting, grant and object the consumer needs,
each judged as one :class:`Finding` (ok, warn or fail) with its fix. ``ledger-cdc doctor``
prints them; nothing here changes the server.

What is read: ``pg_settings`` (wal_level, walsenders and slots against those in use, WAL
retention, timeouts, the standby slots a failover slot waits for), ``pg_replication_slots``,
the consumer role's attributes, memberships and privileges (asked on a connection made as that
role), a replication connection made as that role (what pg_hba.conf, the REPLICATION attribute
and max_wal_senders decide together), the schema's migrations and the publication. What SQL
does not show is said as such: the free space of the server's WAL disk, a standby's own
settings.

The schema and publication are judged by the consumer's own functions (``check_schema`` and
``publication_problem`` of :mod:`ledger_cdc.consumer.resync`), a layer above this one:
:func:`diagnose` takes them as arguments, so the doctor and the consumer's start can never
disagree.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.admin.health import (
    checkpoints,
    failover_slot,
    invalidated,
    setting_amount,
    standby_slots,
)
from ledger_cdc.admin.schema import slot_misfit
from ledger_cdc.connect import connect, connect_timeout
from ledger_cdc.errors import LedgerError, describe
from ledger_cdc.names import DEFAULT_PUBLICATION, DEFAULT_SLOT, LEDGER_TABLE

__all__ = [
    "CANNOT_TELL",
    "Finding",
    "Level",
    "PublicationJudge",
    "SchemaJudge",
    "diagnose",
    "exit_code",
]


class Level(enum.IntEnum):
    """How a finding stands; its value is the doctor's exit code when it is the worst."""

    OK = 0
    """As the deployment needs it."""
    WARN = 1
    """Works, but a failure or a loss waits on it (an unbounded WAL retention, no headroom)."""
    FAIL = 2
    """The consumer cannot run (or runs and loses data) until it is fixed."""


CANNOT_TELL = 3
"""The doctor's exit code when it could not look: the ledger database would not connect."""


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One thing checked: its ``level``, the ``check`` (a setting's or an object's name), what
    was found, and the ``fix`` (empty when ok, or when ``what`` says it)."""

    level: Level
    check: str
    what: str
    fix: str = ""

    def as_json(self) -> dict[str, str]:
        return {"level": self.level.name.lower(), "check": self.check, "what": self.what,
                "fix": self.fix}  # fmt: skip


SchemaJudge = Callable[[list[int] | None, str], None]
"""``check_schema(applied_versions, where)``: raises a LedgerError saying what is missing."""
PublicationJudge = Callable[[psycopg.Connection[Any], str, str], str | None]
"""``publication_problem(conn, publication, table)``: why it does not stream the ledger, or
None."""


def _verdict(good: bool, check: str, ok: str, level: Level, what: str, fix: str) -> Finding:
    """``ok`` if ``good``, else ``what`` at ``level`` with its ``fix``."""
    return (
        Finding(level=Level.OK, check=check, what=ok)
        if good
        else Finding(level=level, check=check, what=what, fix=fix)
    )


def exit_code(findings: list[Finding]) -> int:
    """0 all ok, 1 a warning, 2 a failure."""
    return max((int(f.level) for f in findings), default=0)


# -- what is read --------------------------------------------------------------------------------

_SETTINGS = (
    "wal_level",
    "max_wal_senders",
    "max_replication_slots",
    "max_slot_wal_keep_size",
    "max_wal_size",
    "wal_sender_timeout",
    "checkpoint_timeout",
    "idle_replication_slot_timeout",  # PostgreSQL 18
)
# a replication slot whose consumer stays away this long is lost to idle_replication_slot_timeout
# at the next checkpoint: shorter than a deploy, a night's outage or a restore is a warning
IDLE_TIMEOUT_LEAST = 3600.0
SENDER_TIMEOUT_LEAST = 10.0  # seconds: a consumer busy for a moment is not cut off


@dataclass
class _Server:
    version: int
    database: str
    settings: dict[str, tuple[str, str | None]]  # name → (setting, unit)
    in_recovery: bool

    def text(self, name: str) -> str | None:
        found = self.settings.get(name)
        return None if found is None else found[0]

    def amount(self, name: str) -> float | None:
        """The setting in bytes or seconds (its unit may carry a factor: ``8kB``, ``16MB``)."""
        found = self.settings.get(name)
        return None if found is None else setting_amount(*found)


def _server(conn: psycopg.Connection[Any]) -> _Server:
    rows = conn.execute(
        "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)", (list(_SETTINGS),)
    ).fetchall()
    row = conn.execute("SELECT current_database(), pg_is_in_recovery()").fetchone()
    assert row is not None
    return _Server(
        conn.info.server_version, str(row[0]), {r[0]: (str(r[1]), r[2]) for r in rows}, row[1]
    )


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:g} s"
    if s < 7200:
        return f"{s / 60:g} min"
    return f"{s / 3600:g} h"


def _count(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> int:
    row = conn.execute(query.encode(), params).fetchone()  # (a literal: see the callers)
    return int(row[0]) if row is not None and row[0] is not None else 0


# -- the checks ----------------------------------------------------------------------------------


def _recovery(server: _Server) -> Iterator[Finding]:
    if server.in_recovery:
        yield Finding(
            level=Level.FAIL,
            check="server",
            what=f"database {server.database!r} is on a standby (in recovery): the consumer and "
            "the writers need the primary",
            fix="give the primary's DSN (a multi-host DSN with target_session_attrs=read-write "
            "follows a promotion)",
        )


def _wal_level(server: _Server) -> Iterator[Finding]:
    level = server.text("wal_level")
    yield _verdict(
        level == "logical",
        "wal_level",
        "logical",
        Level.FAIL,
        f"{level!r}, not 'logical': logical decoding is off",
        "ALTER SYSTEM SET wal_level = logical, then restart the server",
    )


def _senders(conn: psycopg.Connection[Any], server: _Server, slot: str) -> Iterator[Finding]:
    most = int(server.amount("max_wal_senders") or 0)
    used = _count(conn, "SELECT count(*) FROM pg_stat_replication")
    ours = _count(
        conn, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
    )
    need = 0 if ours else 1  # the consumer's replication connection, unless it streams now
    free = most - used
    what = f"{used} of {most} in use"
    raise_it = "raise max_wal_senders (ALTER SYSTEM SET max_wal_senders = …, then restart)"
    if free < need:
        yield Finding(
            level=Level.FAIL,
            check="max_wal_senders",
            what=f"{what}: the consumer's replication connection would be refused",
            fix=raise_it,
        )
    elif free - need < 1:
        yield Finding(
            level=Level.WARN,
            check="max_wal_senders",
            what=f"{what}: none beyond the consumer's, for a standby consumer, a physical standby "
            "reconnecting or pg_basebackup",
            fix=raise_it,
        )
    else:
        yield Finding(level=Level.OK, check="max_wal_senders", what=f"{what} ({free} free)")


def _slots_room(conn: psycopg.Connection[Any], server: _Server, slot: str) -> Iterator[Finding]:
    most = int(server.amount("max_replication_slots") or 0)
    used = _count(conn, "SELECT count(*) FROM pg_replication_slots")
    exists = _count(conn, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    need = 0 if exists else 1
    free = most - used
    what = f"{used} of {most} in use"
    fix = (
        "raise max_replication_slots (ALTER SYSTEM SET max_replication_slots = …, then "
        "restart), or drop slots nothing reads (`ledger-cdc slot list`)"
    )
    if free < need:
        yield Finding(
            level=Level.FAIL,
            check="max_replication_slots",
            what=f"{what}: slot {slot!r} cannot be created",
            fix=fix,
        )
    elif free - need < 1:
        yield Finding(
            level=Level.WARN,
            check="max_replication_slots",
            what=f"{what}: none free for a shard, a standby or a slot made again after a loss",
            fix=fix,
        )
    else:
        yield Finding(level=Level.OK, check="max_replication_slots", what=f"{what} ({free} free)")


def _keep_size(conn: psycopg.Connection[Any], server: _Server) -> Iterator[Finding]:
    keep = server.amount("max_slot_wal_keep_size")
    if keep is None:
        return
    try:
        held = _count(conn, "SELECT coalesce(sum(size), 0) FROM pg_ls_waldir()")
        now = f"pg_wal holds {_bytes(held)} now"
    except psycopg.errors.InsufficientPrivilege:
        now = "pg_wal's size unknown (pg_ls_waldir needs pg_monitor)"
    disk = "the WAL disk's free space cannot be read over SQL"
    if keep >= 0:
        spare = keep + (server.amount("max_wal_size") or 0)
        disk += f": keep at least max_slot_wal_keep_size + max_wal_size ({_bytes(spare)}) free"
    if keep < 0:
        yield Finding(
            level=Level.WARN,
            check="max_slot_wal_keep_size",
            what=f"unbounded (-1): a stalled or abandoned slot holds WAL until the disk fills and "
            f"the server stops; {now}; {disk}",
            fix="ALTER SYSTEM SET max_slot_wal_keep_size = '…' (what the WAL disk can spare), "
            "then SELECT pg_reload_conf(); past it the slot is invalidated and the consumer "
            "resyncs from the ledger table",
        )
    else:
        yield Finding(
            level=Level.OK,
            check="max_slot_wal_keep_size",
            what=f"bounded at {_bytes(keep)}; {now}; {disk}",
        )


def _sender_timeout(server: _Server) -> Iterator[Finding]:
    timeout = server.amount("wal_sender_timeout")
    if timeout is None:
        return
    fix = "ALTER SYSTEM SET wal_sender_timeout = '60s', then SELECT pg_reload_conf()"
    if timeout == 0:
        yield Finding(
            level=Level.WARN,
            check="wal_sender_timeout",
            what="0 (off): a consumer gone without closing its connection (host down, network cut) "
            "keeps the slot active until TCP notices, hours later, and a standby consumer "
            "cannot take it over",
            fix=fix,
        )
    elif timeout < SENDER_TIMEOUT_LEAST:
        yield Finding(
            level=Level.WARN,
            check="wal_sender_timeout",
            what=f"{_seconds(timeout)}: a consumer paused for a moment (a long commit, a busy "
            "host) is cut off and reconnects",
            fix=fix,
        )
    else:
        yield Finding(level=Level.OK, check="wal_sender_timeout", what=_seconds(timeout))


def _idle_timeout(server: _Server) -> Iterator[Finding]:
    timeout = server.amount("idle_replication_slot_timeout")
    if timeout is None:  # (before PostgreSQL 18)
        return
    if timeout == 0:
        yield Finding(level=Level.OK, check="idle_replication_slot_timeout", what="0 (off)")
        return
    checkpoint = server.amount("checkpoint_timeout") or 0
    what = (
        f"{_seconds(timeout)}: a slot no consumer streams for that long is invalidated at the "
        f"next checkpoint (within {_seconds(checkpoint)} more); the consumer's heartbeat does "
        "not count, only a connected consumer does, and after it the consumer resyncs the "
        "whole ledger from the table"
    )
    if timeout < IDLE_TIMEOUT_LEAST:
        yield Finding(
            level=Level.WARN,
            check="idle_replication_slot_timeout",
            what=f"{what}: shorter than a deploy or an outage may keep the consumer away",
            fix="ALTER SYSTEM SET idle_replication_slot_timeout = "
            f"'{IDLE_TIMEOUT_LEAST / 3600:g}h' or more (0: off), then SELECT pg_reload_conf()",
        )
    else:
        yield Finding(level=Level.OK, check="idle_replication_slot_timeout", what=what)


# physical slots a standby streams now: a standby of this server (as far as SQL shows)
_STANDBYS = "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical' AND active"


def _standby_slots(conn: psycopg.Connection[Any], slot: str) -> Iterator[Finding]:
    """synchronized_standby_slots (17+), as :func:`~ledger_cdc.admin.health.standby_slots`
    judges it for ``lag``: each name a physical slot a standby streams."""
    standbys = standby_slots(conn)
    if standbys is None:  # (before PostgreSQL 17)
        return
    reset = (
        "ALTER SYSTEM SET synchronized_standby_slots = '<the standbys' physical slots>' "
        "(or ALTER SYSTEM RESET synchronized_standby_slots), then SELECT pg_reload_conf()"
    )
    if not standbys.slots:
        if failover_slot(conn, slot) and _count(conn, _STANDBYS):
            yield Finding(
                level=Level.WARN,
                check="synchronized_standby_slots",
                what=f"empty while slot {slot!r} is a failover slot: the consumer may confirm what "
                "the standby has not received, and after a promotion the synced slot is behind "
                "the projections",
                fix="ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical "
                "slot>', then SELECT pg_reload_conf()",
            )
        return
    for s in standbys.slots:
        if s.slot_type is None:
            yield Finding(
                level=Level.FAIL,
                check="synchronized_standby_slots",
                what=f"names slot {s.name!r}, which does not exist on this server: logical "
                "decoding of failover slots waits for it for ever (the server logs 'waiting on the "
                "standby associated with replication slot …'); after a promotion, "
                "pg_basebackup's copy of the old primary's setting does this",
                fix=reset,
            )
        elif s.slot_type != "physical":
            yield Finding(
                level=Level.FAIL,
                check="synchronized_standby_slots",
                what=f"names slot {s.name!r}, a {s.slot_type} slot: it must name standbys' "
                "physical slots",
                fix=reset,
            )
        elif not s.active:
            yield Finding(
                level=Level.WARN,
                check="synchronized_standby_slots",
                what=f"names slot {s.name!r}, which no standby streams now: logical decoding of "
                "failover slots waits until one does",
                fix="start the standby, or take its slot out: " + reset,
            )
        else:
            yield Finding(
                level=Level.OK,
                check="synchronized_standby_slots",
                what=f"{s.name!r}: a standby streams it",
            )


_ROLE = """
SELECT session_user, r.rolsuper, r.rolreplication,
       EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer'),
       CASE WHEN EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer')
            THEN pg_has_role(current_user, 'ledger_consumer', 'MEMBER') END,
       CASE WHEN EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer')
            THEN pg_has_role(current_user, 'ledger_consumer', 'USAGE') END,
       has_database_privilege(current_database(), 'TEMPORARY')
FROM pg_roles r WHERE r.rolname = session_user
"""
_VACUUM = """
SELECT c.oid IS NOT NULL, c.relname,
       pg_has_role(current_user, c.relowner, 'USAGE'),
       pg_has_role(current_user, d.datdba, 'USAGE'),
       {maintain}
FROM (SELECT to_regclass('agent_sessions') AS oid) t
LEFT JOIN pg_class c ON c.oid = t.oid
JOIN pg_database d ON d.datname = current_database()
"""


def _role(conn: psycopg.Connection[Any], server: _Server) -> Iterator[Finding]:
    row = conn.execute(_ROLE).fetchone()
    assert row is not None
    name, superuser, replication, group, member, inherits, temporary = row
    if superuser:
        yield Finding(
            level=Level.WARN,
            check="role",
            what=f"the consumer's role {name!r} is a superuser: a bug or a stolen password can do "
            "anything to the database",
            fix="give the consumer a role of its own: CREATE ROLE cdc LOGIN REPLICATION IN ROLE "
            "ledger_consumer",
        )
        return  # (a superuser has every grant below)
    if not group:
        yield Finding(
            level=Level.FAIL,
            check="role",
            what="the group role ledger_consumer does not exist",
            fix="`ledger-cdc init --dsn …` creates it, with its grants",
        )
    elif not member:
        yield Finding(
            level=Level.FAIL,
            check="role",
            what=f"role {name!r} is not a member of ledger_consumer: the consumer may not write "
            "its projections or checkpoint",
            fix=f"GRANT ledger_consumer TO {name}",
        )
    elif not inherits:
        yield Finding(
            level=Level.FAIL,
            check="role",
            what=f"role {name!r} is a member of ledger_consumer but does not inherit its "
            "privileges",
            fix=f"ALTER ROLE {name} INHERIT (or GRANT ledger_consumer TO {name} WITH INHERIT TRUE, "
            "PostgreSQL 16+)",
        )
    else:
        yield Finding(level=Level.OK, check="role", what=f"{name!r} is a member of ledger_consumer")
    yield _verdict(
        replication,
        "REPLICATION",
        f"role {name!r} has it",
        Level.FAIL,
        f"role {name!r} lacks the REPLICATION attribute: it may not stream a slot (attributes "
        "are not inherited from ledger_consumer)",
        f"ALTER ROLE {name} REPLICATION",
    )
    if not temporary:
        yield Finding(
            level=Level.FAIL,
            check="TEMPORARY",
            what=f"role {name!r} may not create temporary tables in {server.database!r}, where the "
            "consumer stages a large batch",
            fix=f"GRANT TEMPORARY ON DATABASE {server.database} TO ledger_consumer",
        )
    yield from _vacuum(conn, server, name)


def _vacuum(conn: psycopg.Connection[Any], server: _Server, name: str) -> Iterator[Finding]:
    """The consumer VACUUMs the projections every few seconds while it writes them: the table's
    owner may (and, before PostgreSQL 17, the database's owner), on 17+ whoever has MAINTAIN on
    it (pg_maintain has it on every table)."""
    maintain = (
        "has_table_privilege(current_user, t.oid, 'MAINTAIN')"
        if server.version >= 170000
        else "NULL::bool"
    )
    row = conn.execute(sql.SQL(_VACUUM).format(maintain=sql.SQL(maintain))).fetchone()
    if row is None or not row[0]:
        return  # no projections table: the schema check says so
    _, table, owner, db_owner, may_maintain = row
    if server.version >= 170000:
        can = bool(may_maintain)
        fix = f"GRANT MAINTAIN ON {table} TO ledger_consumer (or GRANT pg_maintain TO {name})"
    else:
        can = bool(owner or db_owner)
        fix = (
            f"ALTER TABLE {table} OWNER TO ledger_consumer (before PostgreSQL 17 only an owner "
            "may VACUUM it; init then needs a superuser or a member of ledger_consumer), or "
            "leave it to autovacuum (consume --vacuum-interval 0)"
        )
    yield _verdict(
        can,
        "VACUUM",
        f"role {name!r} may VACUUM {table}",
        Level.WARN,
        f"role {name!r} may not VACUUM {table}, which every batch rewrites: it is left to "
        "autovacuum and grows between its visits",
        fix,
    )


def _replication_connection(
    dsn: str, server: _Server, replication: bool | None
) -> Iterator[Finding]:
    """A replication connection made as the consumer's role: what pg_hba.conf (a logical
    replication connection matches the lines of its database, not the ``replication``
    keyword), the REPLICATION attribute and max_wal_senders decide together."""
    try:
        with psycopg.connect(
            dsn, replication="database", autocommit=True, **connect_timeout(dsn)
        ) as rep:
            row = rep.execute("IDENTIFY_SYSTEM").fetchone()
    except psycopg.Error as e:
        if replication is False:
            fix = "give the role REPLICATION (see above)"
        else:
            fix = (
                "let the role connect to this database from this host in pg_hba.conf (a "
                "logical replication connection matches its database's lines, not "
                "'replication'), and keep max_wal_senders above those in use"
            )
        yield Finding(
            level=Level.FAIL,
            check="replication connection",
            what=f"refused: {describe(e, dsn)}",
            fix=fix,
        )
        return
    timeline = row[1] if row is not None else "?"
    yield Finding(
        level=Level.OK,
        check="replication connection",
        what=f"made to {server.database!r} as the consumer's role (timeline {timeline})",
    )


def _schema(conn: psycopg.Connection[Any], judge: SchemaJudge) -> Iterator[Finding]:
    applied: list[int] | None = None
    row = conn.execute("SELECT to_regclass('ledger_migrations') IS NOT NULL").fetchone()
    if row is not None and row[0]:  # (a query naming a missing table fails as it is planned)
        applied = [int(v) for (v,) in conn.execute("SELECT version FROM ledger_migrations")]
    try:
        judge(applied, "the ledger database")
    except LedgerError as e:
        yield Finding(level=Level.FAIL, check="schema", what=str(e))
        return
    assert applied is not None
    yield Finding(
        level=Level.OK, check="schema", what=f"every migration applied (up to {max(applied):04d})"
    )


def _publication(
    conn: psycopg.Connection[Any], publication: str, judge: PublicationJudge
) -> Iterator[Finding]:
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = %s)", (publication,)
    ).fetchone()
    if not row or not row[0]:
        yield Finding(
            level=Level.FAIL,
            check="publication",
            what=f"publication {publication!r} does not exist: nothing reaches the slot",
            fix="`ledger-cdc init --dsn …` creates it (with --shards N, the shards' too)",
        )
        return
    problem = judge(conn, publication, LEDGER_TABLE)
    if problem is not None:
        yield Finding(level=Level.FAIL, check="publication", what=problem)
    else:
        yield Finding(
            level=Level.OK,
            check="publication",
            what=f"{publication!r} streams the INSERTs of {LEDGER_TABLE!r}, every column the "
            "fold reads",
        )


_SLOT = """
SELECT slot_type, plugin, database, active, wal_status, {failover}, {reason}
FROM pg_replication_slots WHERE slot_name = %s
"""


def _slot(conn: psycopg.Connection[Any], server: _Server, slot: str) -> Iterator[Finding]:
    v17 = server.version >= 170000
    row = conn.execute(
        sql.SQL(_SLOT).format(
            failover=sql.SQL("failover" if v17 else "NULL::bool"),
            reason=sql.SQL("invalidation_reason" if v17 else "NULL::text"),
        ),
        (slot,),
    ).fetchone()
    if row is None:
        if slot in checkpoints(conn):  # (a consumer has committed one in this database)
            yield Finding(
                level=Level.FAIL,
                check="slot",
                what=f"slot {slot!r} does not exist, but the consumer has a checkpoint for it: the "
                "slot was dropped, and what was written since reached no slot",
                fix="`ledger-cdc consume --create-slot` makes it again and folds the ledger table "
                "from a snapshot: nothing is lost",
            )
        else:
            yield Finding(
                level=Level.OK,
                check="slot",
                what=f"slot {slot!r} does not exist yet: `ledger-cdc consume --create-slot` (or "
                "`init --create-slot`) makes it",
            )
        return
    misfit = slot_misfit(conn, slot)
    if misfit is not None:
        yield Finding(level=Level.FAIL, check="slot", what=misfit)
        return
    _, _, _, active, wal_status, failover, reason = row
    lost = invalidated(wal_status, reason)
    if lost is not None:
        yield Finding(
            level=Level.FAIL,
            check="slot",
            what=f"slot {slot!r} was invalidated ({lost}): the WAL it needed is gone",
            fix="a running consumer resyncs from the ledger table (--on-slot-lost resync); else "
            "`ledger-cdc slot drop` it and `consume --create-slot`",
        )
        return
    state = "streamed now" if active else "not streamed now"
    if wal_status == "unreserved":
        yield Finding(
            level=Level.WARN,
            check="slot",
            what=f"slot {slot!r} ({state}) retains more WAL than max_slot_wal_keep_size: it is "
            "invalidated at the next checkpoint",
            fix="let the consumer catch up (see `ledger-cdc lag`)",
        )
    else:
        yield Finding(
            level=Level.OK, check="slot", what=f"slot {slot!r}: pgoutput, {state}, WAL {wal_status}"
        )
    if not v17:
        return
    standbys = _count(conn, _STANDBYS)
    if failover:
        yield Finding(level=Level.OK, check="failover", what=f"slot {slot!r} is a failover slot")
    elif standbys:
        yield Finding(
            level=Level.WARN,
            check="failover",
            what=f"slot {slot!r} is not a failover slot while a standby streams from this server: "
            "a promotion loses it, and the consumer then resyncs the whole ledger",
            fix=f"stop the consumer, then ALTER_REPLICATION_SLOT {slot} (FAILOVER true) on a "
            "replication connection; on the standby sync_replication_slots = on, "
            "hot_standby_feedback = on and a dbname in primary_conninfo",
        )
    else:
        yield Finding(
            level=Level.OK,
            check="failover",
            what=f"slot {slot!r} is not a failover slot (no standby streams)",
        )


# -- the whole ------------------------------------------------------------------------------------


def diagnose(
    dsn: str,
    *,
    schema_judge: SchemaJudge,
    publication_judge: PublicationJudge,
    consumer_dsn: str | None = None,
    slot: str = DEFAULT_SLOT,
    publication: str = DEFAULT_PUBLICATION,
) -> list[Finding]:
    """Every finding on the deployment of the ledger in ``dsn``'s database, for a consumer
    logging in with ``consumer_dsn`` (default: ``dsn``) and streaming ``slot`` of
    ``publication``. ``schema_judge`` and ``publication_judge``: the consumer's
    (``ledger_cdc.consumer.resync.check_schema``, ``publication_problem``).

    Raises the LedgerError of the connection to ``dsn`` when it cannot be made (the doctor
    cannot tell: :data:`CANNOT_TELL`); one as the consumer's role that fails is a finding.
    It takes DSNs, not a connection: making its connections is part of what it checks (one as
    each role, and a replication connection)."""
    out: list[Finding] = []
    with connect(dsn, doing="doctor: the ledger database", autocommit=True) as conn:
        server = _server(conn)
        out.append(
            Finding(
                level=Level.OK,
                check="server",
                what=f"PostgreSQL {server.version // 10000}.{server.version % 10000}, database "
                f"{server.database!r}",
            )
        )
        for check in (
            _recovery(server),
            _wal_level(server),
            _senders(conn, server, slot),
            _slots_room(conn, server, slot),
            _keep_size(conn, server),
            _sender_timeout(server),
            _idle_timeout(server),
            _standby_slots(conn, slot),
        ):
            out.extend(check)
        as_consumer = consumer_dsn or dsn
        replication: bool | None = None
        try:
            own = connect(as_consumer, doing="doctor: as the consumer's role", autocommit=True)
        except LedgerError as e:
            out.append(
                Finding(
                    level=Level.FAIL,
                    check="role",
                    what=f"cannot connect as the consumer's role: {e}",
                    fix="fix --consumer-dsn, the role's LOGIN or password, or pg_hba.conf",
                )
            )
            own = None
        if own is not None:
            with own:
                found = _checked("role", _role(own, server), as_consumer)
                out.extend(found)
                replication = not any(
                    f.check == "REPLICATION" and f.level is Level.FAIL for f in found
                )
                # (as the consumer sees them: its search_path, its privileges)
                out.extend(_checked("schema", _schema(own, schema_judge), as_consumer))
                out.extend(
                    _checked(
                        "publication",
                        _publication(own, publication, publication_judge),
                        as_consumer,
                    )
                )
        else:
            out.extend(_checked("schema", _schema(conn, schema_judge), dsn))
            out.extend(
                _checked("publication", _publication(conn, publication, publication_judge), dsn)
            )
        out.extend(_replication_connection(as_consumer, server, replication))
        out.extend(_checked("slot", _slot(conn, server, slot), dsn))
    return out


def _checked(check: str, findings: Iterator[Finding], dsn: str) -> list[Finding]:
    """The findings, or what kept them from being made (the consumer's role refused a read of
    the ledger's tables, say) as a failure of their own."""
    done: list[Finding] = []
    try:
        done.extend(findings)
    except psycopg.Error as e:
        done.append(
            Finding(
                level=Level.FAIL,
                check=check,
                what=f"could not be checked: {describe(e, dsn)}",
                fix="log in as a member of ledger_consumer (see the role finding)",
            )
        )
    return done
