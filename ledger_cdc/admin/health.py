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

import re
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
    "StandbySlot",
    "StandbySlots",
    "Thresholds",
    "check_slots",
    "checkpoints",
    "failover_slot",
    "failover_state",
    "has_ledger",
    "invalidated",
    "setting_amount",
    "standby_slots",
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


_UNITS = {
    "B": 1,
    "kB": 1024,
    "MB": 1024**2,
    "GB": 1024**3,
    "TB": 1024**4,
    "ms": 0.001,
    "s": 1,
    "min": 60,
    "h": 3600,
    "d": 86400,
}


def setting_amount(setting: str, unit: str | None) -> float:
    """A numeric server setting (``pg_settings``' ``setting`` and ``unit``) in bytes or seconds:
    the unit may carry a factor (``8kB``, ``16MB``)."""
    m = re.fullmatch(r"(\d*)\s*([A-Za-z]+)", unit or "")
    if m is None:
        return float(setting)
    return float(setting) * int(m[1] or 1) * _UNITS.get(m[2], 1)


def _keep_size(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT setting, unit FROM pg_settings WHERE name = 'max_slot_wal_keep_size'"
    ).fetchone()
    if row is None or int(row[0]) < 0:
        return None
    return int(setting_amount(row[0], row[1]))


def current_wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


_Checkpoint = tuple[str, float | None, float | None, int, str | None]


def checkpoints(conn: psycopg.Connection[Any]) -> dict[str, _Checkpoint]:
    """The consumers' checkpoints in this database by slot: (LSN, seconds since it moved,
    seconds since the heartbeat, folded seq, publication); none where there is no
    ledger_checkpoints or the role may not read it."""
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


# the slots synchronized_standby_slots names, each with the standby streaming it (if one does)
_STANDBY_SLOTS = """
SELECT p.slot_name, p.slot_type, p.active, nullif(r.application_name, '')
FROM pg_replication_slots p LEFT JOIN pg_stat_replication r ON r.pid = p.active_pid
WHERE p.slot_name = ANY(%s)
"""


@dataclass(frozen=True, kw_only=True)
class StandbySlot:
    """A name in ``synchronized_standby_slots`` and the slot of that name on this server."""

    name: str
    slot_type: str | None = None  # None: this server has no slot of that name
    active: bool = False  # a standby streams it now
    application: str | None = None  # that standby's application_name

    @property
    def label(self) -> str:
        return self.name + ("" if self.application is None else f" ({self.application})")


@dataclass(frozen=True, kw_only=True)
class StandbySlots:
    """``synchronized_standby_slots`` (PostgreSQL 17+), judged against this server's slots: the
    logical decoding of every failover slot waits until each standby named has received what
    it sends, so a name that is not a physical slot here stalls it for ever (a promoted
    standby inherits the setting from pg_basebackup), and one no standby streams until it
    does."""

    slots: tuple[StandbySlot, ...] = ()  # in the setting's order

    @property
    def missing(self) -> list[str]:
        """Names that are not a physical slot of this server."""
        return [s.name for s in self.slots if s.slot_type != "physical"]

    @property
    def idle(self) -> list[str]:
        """Physical slots named that no standby streams now."""
        return [s.name for s in self.slots if s.slot_type == "physical" and not s.active]

    @property
    def streaming(self) -> list[str]:
        """The standbys that keep failover slots: their slots, with their application_name."""
        return sorted(s.label for s in self.slots if s.slot_type == "physical" and s.active)

    @property
    def stall(self) -> str | None:
        """What stalls logical decoding, with its fix; None when nothing does."""
        if self.missing:
            return (
                f"synchronized_standby_slots names {', '.join(self.missing)}, which this server "
                "does not have: logical decoding waits for it for ever (a promoted standby "
                "inherits the setting from pg_basebackup); ALTER SYSTEM RESET "
                "synchronized_standby_slots; SELECT pg_reload_conf(); on this server"
            )
        if self.idle:
            return (
                f"the standby of slot(s) {', '.join(self.idle)} named in "
                "synchronized_standby_slots is not connected: logical decoding waits until it "
                "is (start the standby, or remove it from synchronized_standby_slots)"
            )
        return None


def standby_slots(conn: psycopg.Connection[Any]) -> StandbySlots | None:
    """``synchronized_standby_slots`` against this server's slots; None before PostgreSQL 17."""
    row = conn.execute(
        "SELECT setting FROM pg_settings WHERE name = 'synchronized_standby_slots'"
    ).fetchone()
    if row is None:
        return None
    names = [n.strip().strip('"') for n in str(row[0]).split(",") if n.strip()]
    found = {
        str(r[0]): StandbySlot(name=str(r[0]), slot_type=r[1], active=bool(r[2]), application=r[3])
        for r in conn.execute(_STANDBY_SLOTS, (names,))
    }
    return StandbySlots(slots=tuple(found.get(n, StandbySlot(name=n)) for n in names))


def failover_slot(conn: psycopg.Connection[Any], slot: str) -> bool | None:
    """Whether ``slot`` is a failover slot (None: no such slot, or before PostgreSQL 17)."""
    if conn.info.server_version < 170000:
        return None
    row = conn.execute(
        "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    return None if row is None else bool(row[0])


def failover_state(conn: psycopg.Connection[Any], slot: str) -> tuple[bool, str | None]:
    """(whether ``slot`` is ready to survive a failover: a failover slot whose standbys in
    ``synchronized_standby_slots`` have their physical slots in use, what stalls its logical
    decoding or None). PostgreSQL 17+."""
    failover, standbys = failover_slot(conn, slot), standby_slots(conn)
    if failover is None or standbys is None:
        return False, None
    stall = standbys.stall
    return failover and bool(standbys.slots) and stall is None, stall


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
            return [_lost(SlotHealth(slot=slot, exists=True), misfit)]
    elif this_database:
        where = "AND database = current_database()"
    rate, inserts = _sample(conn, sample_seconds)
    rows = conn.execute(
        _SLOTS.format(reason=reason, where=where).encode(), (slot,) if slot else ()
    ).fetchall()
    current = format_lsn(current_wal_lsn(conn))
    if slot and not rows:
        other = conn.execute(
            "SELECT slot_type FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        missing = SlotHealth(slot=slot, exists=False, current_wal_lsn=current)
        return [
            _lost(
                missing,
                "slot does not exist" if other is None else f"a {other[0]} slot, not a logical one",
            )
        ]
    server = _Server(
        conn=conn,
        current=current,
        keep=_keep_size(conn),
        checkpoints=checkpoints(conn),
        inactive=_inactive_since(conn),
        standbys=standby_slots(conn),
        rate=rate,
        inserts=inserts,
    )
    out = []
    for r in rows:
        h = server.health(r)
        _classify(h, th, for_ever=bool(server.standbys and server.standbys.missing))
        out.append(h)
    return out


def _lost(h: SlotHealth, why: str) -> SlotHealth:
    h.status, h.status_name = LOST, STATUS_NAMES[LOST]
    h.reasons.append(why)
    return h


def _sample(conn: psycopg.Connection[Any], seconds: float) -> tuple[float | None, float | None]:
    """(WAL bytes, ledger inserts) per second over ``seconds`` (none when 0)."""
    if seconds <= 0:
        return None, None
    watch = RateWatch()
    watch.sample(conn)
    time.sleep(seconds)
    sampled = watch.sample(conn)
    return (None, None) if sampled is None else (sampled.wal_bytes_per_s, sampled.inserts_per_s)


def _inactive_since(conn: psycopg.Connection[Any]) -> dict[str, float | None]:
    """Seconds since each slot was last streamed, as the server knows it (PostgreSQL 17+;
    before, the checkpoint's age stands for it)."""
    if conn.info.server_version < 170000:
        return {}
    return {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT slot_name, extract(epoch FROM now() - inactive_since)::float8 "
            "FROM pg_replication_slots WHERE inactive_since IS NOT NULL"
        )
    }


@dataclass(frozen=True, kw_only=True)
class _Server:
    """What is read once for every slot of :func:`check_slots`."""

    conn: psycopg.Connection[Any]
    current: str  # the WAL's end
    keep: int | None  # max_slot_wal_keep_size in bytes (None: unbounded)
    checkpoints: dict[str, _Checkpoint]
    inactive: dict[str, float | None]
    standbys: StandbySlots | None  # (None before PostgreSQL 17)
    rate: float | None
    inserts: float | None

    def health(self, row: tuple[Any, ...]) -> SlotHealth:
        """One slot's figures (not yet classified) from its row of ``_SLOTS``."""
        name, plugin, _, database, active, pid, wal_status, safe = row[:8]
        restart, confirmed, retained, lag, why = row[8:]
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
            current_wal_lsn=self.current,
            retained_bytes=None if retained is None else int(retained),
            lag_bytes=None if lag is None else max(0, int(lag)),
            max_slot_wal_keep_size=self.keep,
            invalidation_reason=why,
            wal_rate_bytes_per_s=self.rate,
            ledger_insert_rate=self.inserts,
        )
        if self.keep and h.retained_bytes is not None:
            h.keep_size_share = h.retained_bytes / self.keep
        self._consumer(h)
        if not h.active:
            h.inactive_seconds = self.inactive.get(name, h.checkpoint_age_seconds)
        if h.safe_wal_size is not None and self.rate:
            h.seconds_to_invalidation = max(0.0, h.safe_wal_size / self.rate)
        if self.standbys is not None:
            h.failover = failover_slot(self.conn, name)
            h.standby_stall = self.standbys.stall
            h.failover_ready = (
                bool(h.failover) and bool(self.standbys.slots) and not h.standby_stall
            )
            if h.failover:
                h.failover_standbys = self.standbys.streaming
        return h

    def _consumer(self, h: SlotHealth) -> None:
        """What the slot's consumer committed, and how far behind the ledger it is."""
        ck = self.checkpoints.get(h.slot)
        if ck is not None:
            h.checkpoint_lsn, h.checkpoint_age_seconds, h.heartbeat_age_seconds = ck[:3]
            if h.confirmed_flush_lsn is not None:
                h.checkpoint_behind_slot_bytes = max(
                    0, parse_lsn(h.confirmed_flush_lsn) - parse_lsn(ck[0])
                )
            behind = _unfolded(self.conn, ck[3], ck[4])
            if behind is not None:
                h.lag_seconds, h.unfolded_events = behind
        elif h.lag_bytes and h.database == self.conn.info.dbname:
            # never consumed (no checkpoint yet): every ledger event waits, the oldest first
            # (before PostgreSQL 17 nothing else tells how long the slot has stood unread)
            behind = _unfolded(self.conn, 0, None)
            if behind is not None and behind[1]:
                h.lag_seconds, h.unfolded_events = behind


def invalidated(wal_status: str | None, reason: str | None) -> str | None:
    """Why a slot was invalidated (the WAL it needs is gone): the server's reason (PostgreSQL
    17+), else ``wal_status lost``; None while the slot is usable."""
    if reason:
        return reason
    return "wal_status lost" if wal_status == "lost" else None


def _classify(h: SlotHealth, th: Thresholds, *, for_ever: bool = False) -> None:
    """``h``'s status and reasons by ``th``; ``for_ever``: its standby stall is one by a standby
    slot the server does not have (see :class:`StandbySlots`)."""

    def flag(level: int, why: str) -> None:
        h.status = max(h.status, level)
        h.reasons.append(why)

    lost = invalidated(h.wal_status, h.invalidation_reason)
    if lost is not None:
        flag(LOST, f"slot invalidated ({lost}): resync needed")
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
        flag(CRITICAL if for_ever else WARNING, h.standby_stall)
    h.status_name = STATUS_NAMES[h.status]


# -- WAL discipline: generation and insert rates, and spikes ------------------------------------


@dataclass(kw_only=True)
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
        rates = Rates(
            wal_bytes_per_s=max(0.0, (lsn - prev[1]) / dt_s),
            inserts_per_s=max(0.0, (seq - prev[2]) / dt_s),
        )
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
