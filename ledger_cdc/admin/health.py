"""Slot health: the figures behind ``ledger-cdc lag``, the consumer's guard and its metrics.

A logical slot that stalls holds WAL until the disk fills; with ``max_slot_wal_keep_size`` set
the server invalidates it instead. For each slot this reads what the server reports
(``pg_replication_slots``: ``wal_status``, ``safe_wal_size``, ``restart_lsn``,
``confirmed_flush_lsn``, the invalidation reason on PostgreSQL 17+), what our consumer stored
(``ledger_checkpoints``), and the WAL generation rate sampled over a short interval, and derives
the figure an operator needs: the time left before invalidation at the current rate.

Statuses: 0 healthy, 1 warning, 2 critical, 3 slot missing or lost (``lag`` exits 2 for a lost
slot: its exit code is a monitoring plugin's, where 3 means it could not tell). An unbounded
``max_slot_wal_keep_size`` (-1) is a warning by itself: then a stalled slot can fill the disk.
Works with the consumer role (no superuser): everything read here is readable by any role.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.admin.schema import publication_table, slot_misfit
from ledger_cdc.lsn import format_lsn, parse_lsn

__all__ = [
    "CRITICAL",
    "HEALTHY",
    "LOST",
    "WARNING",
    "RateWatch",
    "Rates",
    "SlotHealth",
    "Thresholds",
    "check_slots",
    "has_ledger",
]

HEALTHY, WARNING, CRITICAL, LOST = 0, 1, 2, 3
STATUS_NAMES = {HEALTHY: "healthy", WARNING: "warning", CRITICAL: "critical", LOST: "lost"}


@dataclass(frozen=True)
class Thresholds:
    warn_share: float = 0.5
    crit_share: float = 0.8
    warn_bytes: int = 256 * 1024 * 1024
    crit_bytes: int = 1024 * 1024 * 1024
    warn_seconds: float = 60.0
    crit_seconds: float = 300.0


@dataclass
class SlotHealth:
    slot: str
    exists: bool
    plugin: str | None = None
    database: str | None = None
    active: bool = False
    active_pid: int | None = None
    wal_status: str | None = None
    safe_wal_size: int | None = None
    restart_lsn: str | None = None
    confirmed_flush_lsn: str | None = None
    current_wal_lsn: str | None = None
    retained_bytes: int | None = None
    lag_bytes: int | None = None
    # the age of the oldest ledger event the consumer has not committed (0: it has them all;
    # None: no consumer has committed to this slot in this database)
    lag_seconds: float | None = None
    unfolded_events: int | None = None  # ledger events past the consumer's checkpoint (≤ 10,000)
    max_slot_wal_keep_size: int | None = None  # bytes; None when unbounded (-1)
    keep_size_share: float | None = None
    checkpoint_lsn: str | None = None
    checkpoint_behind_slot_bytes: int | None = None
    checkpoint_age_seconds: float | None = None
    heartbeat_age_seconds: float | None = None
    inactive_seconds: float | None = None  # how long no consumer has streamed the slot
    invalidation_reason: str | None = None
    failover: bool | None = None  # a failover slot (PostgreSQL 17+; None before)
    failover_ready: bool | None = None  # one that a promoted standby would have
    failover_standbys: list[str] | None = None  # the standbys that keep it (their slots)
    standby_stall: str | None = None  # synchronized_standby_slots holding decoding back
    wal_rate_bytes_per_s: float | None = None
    ledger_insert_rate: float | None = None  # agent_events rows per second over the sample
    seconds_to_invalidation: float | None = None
    status: int = HEALTHY
    status_name: str = "healthy"
    reasons: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


_SLOTS = """
SELECT slot_name, plugin, slot_type, database, active, active_pid, wal_status,
       safe_wal_size, restart_lsn::text, confirmed_flush_lsn::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8,
       {reason}
FROM pg_replication_slots
WHERE slot_type = 'logical' {where}
ORDER BY slot_name
"""


def _keep_size(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT setting::int8, unit FROM pg_settings WHERE name = 'max_slot_wal_keep_size'"
    ).fetchone()
    if row is None or int(row[0]) < 0:
        return None
    value, unit = int(row[0]), row[1]
    return value * (1024 * 1024 if unit == "MB" else 1)


def current_wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


_Checkpoint = tuple[str, float | None, float | None, int, str | None]


def _checkpoints(conn: psycopg.Connection[Any]) -> dict[str, _Checkpoint]:
    exists = conn.execute("SELECT to_regclass('ledger_checkpoints') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return {}
    try:
        rows = conn.execute(
            "SELECT slot_name, lsn::text, extract(epoch FROM now() - updated_at)::float8, "
            "extract(epoch FROM now() - heartbeat_at)::float8, folded_seq, publication "
            "FROM ledger_checkpoints"
        ).fetchall()
    except psycopg.errors.InsufficientPrivilege:
        return {}
    return {r[0]: (r[1], r[2], r[3], int(r[4]), r[5]) for r in rows}


# The ledger events past what the consumer committed: by seq from its checkpoint (seq values may
# commit out of order, so one committed just below it is not seen here; it is at most the width
# of one batch, and the next event shows the lag anyway), within the slot's publication filter.
_UNFOLDED = """
SELECT extract(epoch FROM now() - min(created_at))::float8, count(*)
FROM (SELECT created_at FROM agent_events WHERE seq > %s {filter} ORDER BY seq LIMIT 10000) u
"""


def publication_filter(conn: psycopg.Connection[Any], publication: str | None) -> sql.Composable:
    """``AND (row filter)`` of the ledger table in ``publication`` (a shard's), as the catalog
    gives it (not user input); empty when there is none or no publication is named."""
    row = publication_table(conn, publication) if publication else None
    if row is None or not row[1]:
        return sql.SQL("")
    return sql.SQL("AND ({})").format(sql.SQL(row[1]))


def _unfolded(
    conn: psycopg.Connection[Any], folded_seq: int, publication: str | None
) -> tuple[float, int] | None:
    """(age in seconds of the oldest ledger event past ``folded_seq``, how many: up to 10,000)."""
    try:
        filt = publication_filter(conn, publication)
        found = conn.execute(sql.SQL(_UNFOLDED).format(filter=filt), (folded_seq,)).fetchone()
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable):
        return None
    if found is None:
        return None
    return (0.0 if found[0] is None else max(0.0, float(found[0]))), int(found[1])


def has_ledger(conn: psycopg.Connection[Any]) -> bool:
    """Whether the connection's database holds a ledger (as its search path finds it)."""
    row = conn.execute(
        "SELECT to_regclass('agent_events') IS NOT NULL OR to_regclass('ledger_migrations') "
        "IS NOT NULL"
    ).fetchone()
    return bool(row and row[0])


_FAILOVER = """
SELECT s.failover, current_setting('synchronized_standby_slots'),
       (SELECT array_agg(name) FROM unnest(string_to_array(
            replace(current_setting('synchronized_standby_slots'), ' ', ''), ',')) AS name
        WHERE name <> '' AND NOT EXISTS (SELECT FROM pg_replication_slots p
                                         WHERE p.slot_name = name AND p.slot_type = 'physical')),
       (SELECT array_agg(name) FROM unnest(string_to_array(
            replace(current_setting('synchronized_standby_slots'), ' ', ''), ',')) AS name
        WHERE EXISTS (SELECT FROM pg_replication_slots p WHERE p.slot_name = name
                      AND p.slot_type = 'physical' AND NOT p.active))
FROM pg_replication_slots s WHERE s.slot_name = %s
"""


_STANDBYS = """
SELECT p.slot_name || coalesce(' (' || nullif(r.application_name, '') || ')', '')
FROM pg_replication_slots p LEFT JOIN pg_stat_replication r ON r.pid = p.active_pid
WHERE p.slot_type = 'physical' AND p.active AND p.slot_name = ANY(string_to_array(
      replace(current_setting('synchronized_standby_slots'), ' ', ''), ','))
ORDER BY 1
"""


def failover_state(conn: psycopg.Connection[Any], slot: str) -> tuple[bool, str | None]:
    """(whether ``slot`` is ready to survive a failover: a failover slot whose standbys in
    ``synchronized_standby_slots`` have their physical slots in use, what stalls its logical
    decoding or None). PostgreSQL 17+."""
    row = conn.execute(_FAILOVER, (slot,)).fetchone()
    if row is None:
        return False, None
    failover, named, missing, inactive = row
    stall = None
    if missing:
        stall = (
            f"synchronized_standby_slots names {', '.join(missing)}, which this server does not "
            "have: logical decoding waits for it for ever (a promoted standby inherits the "
            "setting from pg_basebackup); ALTER SYSTEM RESET synchronized_standby_slots; "
            "SELECT pg_reload_conf(); on this server"
        )
    elif inactive:
        stall = (
            f"the standby of slot(s) {', '.join(inactive)} named in synchronized_standby_slots "
            "is not connected: logical decoding waits until it is (start the standby, or remove "
            "it from synchronized_standby_slots)"
        )
    return bool(failover) and bool(named.strip()) and not missing and not inactive, stall


def check_slots(
    conn: psycopg.Connection[Any],
    slot: str | None = None,
    *,
    thresholds: Thresholds | None = None,
    sample_seconds: float = 1.0,
    this_database: bool = False,
) -> list[SlotHealth]:
    """Health of every logical slot (or of ``slot``, reported as missing if it does not exist).
    ``this_database``: only the slots of the connection's database; a ``slot`` that is not a
    pgoutput slot of it is reported lost, with what it is (:func:`slot_misfit`)."""
    th = thresholds or Thresholds()
    version = conn.info.server_version
    reason = "invalidation_reason" if version >= 170000 else "NULL::text"
    where = "AND slot_name = %s" if slot else ""
    if this_database and slot:
        misfit = slot_misfit(conn, slot)
        if misfit is not None:
            h = SlotHealth(slot=slot, exists=True, status=LOST, status_name=STATUS_NAMES[LOST])
            h.reasons.append(misfit)
            return [h]
    elif this_database:
        where = "AND database = current_database()"
    rate = inserts = None
    if sample_seconds > 0:
        watch = RateWatch()
        watch.sample(conn)
        time.sleep(sample_seconds)
        sampled = watch.sample(conn)
        if sampled is not None:
            rate, inserts = sampled.wal_bytes_per_s, sampled.inserts_per_s
    rows = conn.execute(
        _SLOTS.format(reason=reason, where=where).encode(), (slot,) if slot else ()
    ).fetchall()
    current = format_lsn(current_wal_lsn(conn))
    keep = _keep_size(conn)
    checkpoints = _checkpoints(conn)
    inactive: dict[str, float | None] = {}
    if version >= 170000:  # the server knows since when (before 17: the checkpoint's age)
        inactive = {
            r[0]: r[1]
            for r in conn.execute(
                "SELECT slot_name, extract(epoch FROM now() - inactive_since)::float8 "
                "FROM pg_replication_slots WHERE inactive_since IS NOT NULL"
            )
        }
    out: list[SlotHealth] = []
    if slot and not rows:
        h = SlotHealth(slot=slot, exists=False, current_wal_lsn=current, status=LOST)
        other = conn.execute(
            "SELECT slot_type FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        h.reasons.append(
            "slot does not exist" if other is None else f"a {other[0]} slot, not a logical one"
        )
        h.status_name = STATUS_NAMES[LOST]
        return [h]
    for r in rows:
        (
            name,
            plugin,
            _,
            database,
            active,
            pid,
            wal_status,
            safe,
            restart,
            confirmed,
            retained,
            lag,
            why,
        ) = r
        h = SlotHealth(
            slot=name,
            exists=True,
            plugin=plugin,
            database=database,
            active=bool(active),
            active_pid=pid,
            wal_status=wal_status,
            safe_wal_size=None if safe is None else int(safe),
            restart_lsn=restart,
            confirmed_flush_lsn=confirmed,
            current_wal_lsn=current,
            retained_bytes=None if retained is None else int(retained),
            lag_bytes=None if lag is None else max(0, int(lag)),
            max_slot_wal_keep_size=keep,
            invalidation_reason=why,
            wal_rate_bytes_per_s=rate,
            ledger_insert_rate=inserts,
        )
        if keep and h.retained_bytes is not None:
            h.keep_size_share = h.retained_bytes / keep
        ck = checkpoints.get(name)
        if ck is not None:
            h.checkpoint_lsn, h.checkpoint_age_seconds, h.heartbeat_age_seconds = ck[:3]
            if confirmed is not None:
                h.checkpoint_behind_slot_bytes = max(0, parse_lsn(confirmed) - parse_lsn(ck[0]))
            behind = _unfolded(conn, ck[3], ck[4])
            if behind is not None:
                h.lag_seconds, h.unfolded_events = behind
        elif h.lag_bytes and database == conn.info.dbname:
            # never consumed (no checkpoint yet): every ledger event waits, the oldest first
            # (before PostgreSQL 17 nothing else tells how long the slot has stood unread)
            behind = _unfolded(conn, 0, None)
            if behind is not None and behind[1]:
                h.lag_seconds, h.unfolded_events = behind
        if not h.active:
            h.inactive_seconds = inactive.get(name, h.checkpoint_age_seconds)
        if h.safe_wal_size is not None and rate:
            h.seconds_to_invalidation = max(0.0, h.safe_wal_size / rate)
        if version >= 170000:
            ready, stall = failover_state(conn, name)
            h.failover_ready, h.standby_stall = ready, stall
            row = conn.execute(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (name,)
            ).fetchone()
            h.failover = None if row is None else bool(row[0])
            if h.failover:
                h.failover_standbys = [str(r[0]) for r in conn.execute(_STANDBYS).fetchall()]
        _classify(h, th)
        out.append(h)
    return out


def _classify(h: SlotHealth, th: Thresholds) -> None:
    def flag(level: int, why: str) -> None:
        h.status = max(h.status, level)
        h.reasons.append(why)

    if h.wal_status == "lost" or h.invalidation_reason:
        flag(
            LOST, f"slot invalidated ({h.invalidation_reason or 'wal_status lost'}): resync needed"
        )
    elif h.wal_status == "unreserved":
        flag(CRITICAL, "WAL past max_slot_wal_keep_size: invalidated at the next checkpoint")
    if h.max_slot_wal_keep_size is None:
        flag(WARNING, "max_slot_wal_keep_size is unbounded (-1): a stalled slot can fill the disk")
    share = h.keep_size_share
    if share is not None:
        if share >= th.crit_share:
            flag(CRITICAL, f"retains {share:.0%} of max_slot_wal_keep_size")
        elif share >= th.warn_share:
            flag(WARNING, f"retains {share:.0%} of max_slot_wal_keep_size")
    if h.lag_bytes is not None:
        if h.lag_bytes >= th.crit_bytes:
            flag(CRITICAL, f"{h.lag_bytes:,} bytes behind the WAL end")
        elif h.lag_bytes >= th.warn_bytes:
            flag(WARNING, f"{h.lag_bytes:,} bytes behind the WAL end")
    if h.lag_seconds is not None:
        behind = (
            f"{h.lag_seconds:.0f} s behind: the oldest ledger event not yet committed by the "
            f"consumer is that old ({h.unfolded_events:,}{'+' * (h.unfolded_events == 10000)} "
            "waiting)"
        )
        if h.lag_seconds >= th.crit_seconds:
            flag(CRITICAL, behind)
        elif h.lag_seconds >= th.warn_seconds:
            flag(WARNING, behind)
    idle = h.inactive_seconds
    if h.exists and not h.active and idle is not None and idle >= th.warn_seconds:
        flag(WARNING, f"no consumer has streamed this slot for {idle:.0f} s")
    if h.standby_stall is not None:
        # a standby slot the server lacks holds decoding back for ever; one not connected, until
        # its standby returns
        flag(CRITICAL if "does not have" in h.standby_stall else WARNING, h.standby_stall)
    h.status_name = STATUS_NAMES[h.status]


# -- WAL discipline: generation and insert rates, and spikes ------------------------------------


@dataclass
class Rates:
    wal_bytes_per_s: float
    inserts_per_s: float
    spike: str | None = None  # set when a rate jumps far above its recent average


_SAMPLE = (
    "SELECT pg_current_wal_lsn()::text, "
    "coalesce(pg_sequence_last_value(to_regclass('agent_events_seq_seq')), 0)"
)


class RateWatch:
    """Rates from successive samples, with a slow moving average to tell a spike (an agent
    retry storm writing the ledger many times faster than usual) from the usual load."""

    def __init__(
        self,
        factor: float = 5.0,
        min_inserts: float = 50.0,
        alpha: float = 0.1,
        min_wal_bytes: float = 1e6,
    ) -> None:
        self.factor = factor
        self.min_inserts = min_inserts
        # a quiet server's WAL is a few kB/s: five times that (a VACUUM, a checkpoint) is no
        # storm, and warning of it would teach to ignore the warning
        self.min_wal_bytes = min_wal_bytes
        self.alpha = alpha
        self._prev: tuple[float, int, int] | None = None
        self._avg: tuple[float, float] | None = None
        self._samples = 0

    def sample(self, conn: psycopg.Connection[Any]) -> Rates | None:
        row = conn.execute(_SAMPLE).fetchone()
        assert row is not None
        now, lsn, seq = time.monotonic(), parse_lsn(row[0]), int(row[1])
        prev, self._prev = self._prev, (now, lsn, seq)
        if prev is None or now <= prev[0]:
            return None
        dt_s = now - prev[0]
        rates = Rates(max(0.0, (lsn - prev[1]) / dt_s), max(0.0, (seq - prev[2]) / dt_s))
        if self._avg is not None and self._samples >= 3:
            wal_avg, ins_avg = self._avg
            if rates.inserts_per_s >= self.min_inserts and rates.inserts_per_s > self.factor * max(
                ins_avg, 1.0
            ):
                rates.spike = (
                    f"ledger inserts at {rates.inserts_per_s:,.0f}/s, "
                    f"{rates.inserts_per_s / max(ins_avg, 1.0):.0f}× their recent average "
                    f"({ins_avg:,.0f}/s): an agent retry storm?"
                )
            elif (
                rates.wal_bytes_per_s >= self.min_wal_bytes
                and rates.wal_bytes_per_s > self.factor * max(wal_avg, 1.0)
                and wal_avg > 0
            ):
                rates.spike = (
                    f"WAL generated at {rates.wal_bytes_per_s / 1e6:,.1f} MB/s, "
                    f"{rates.wal_bytes_per_s / wal_avg:.0f}× its recent average"
                )
        a = self.alpha
        self._avg = (
            (rates.wal_bytes_per_s, rates.inserts_per_s)
            if self._avg is None
            else (
                (1 - a) * self._avg[0] + a * rates.wal_bytes_per_s,
                (1 - a) * self._avg[1] + a * rates.inserts_per_s,
            )
        )
        self._samples += 1
        return rates
