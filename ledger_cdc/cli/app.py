"""The commands that look after the ledger's database: ``init`` (schema, publication, slots),
``slot`` (create, failover, drop, list) and ``lag`` (the slots' health, as a check)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from ledger_cdc.cli.base import (
    CheckCommand,
    Finite,
    State,
    _env,
    ahead_option,
    cli,
    dsn_option,
    failover_option,
    handles_errors,
    option,
    print_records,
    safe,
)
from ledger_cdc.settings import DAY

if TYPE_CHECKING:
    import psycopg

    from ledger_cdc.admin.health import SlotHealth, Thresholds


@cli.command()
@dsn_option
@option(
    "--publication",
    default="agent_pub",
    show_default=True,
    envvar="LEDGER_CDC_PUBLICATION",
    help="Publication the consumer reads.",
)
@option(
    "--slot",
    default="agent_slot",
    show_default=True,
    envvar="LEDGER_CDC_SLOT",
    help="Logical replication slot to create with --create-slot.",
)
@option("--create-slot", is_flag=True, help="Also create the pgoutput slot.")
@failover_option
@option(
    "--partition-by",
    type=click.Choice(["month", "week", "day"]),
    default=None,
    help="Create a new ledger range-partitioned on created_at (a fresh database only).",
)
@ahead_option(
    "--partitions-ahead", "Partitions created beyond the current one (partitioned ledgers)."
)
@option(
    "--shards",
    type=click.IntRange(1),
    default=None,
    help="Also create N shard publications (row filter on the session id) and one slot each.",
)
@click.pass_obj
@handles_errors
def init(
    state: State,
    dsn: str,
    publication: str,
    slot: str,
    create_slot: bool,
    failover: bool,
    partition_by: str | None,
    partitions_ahead: int,
    shards: int | None,
) -> None:
    """Create or upgrade the ledger's schema and create the publication (idempotent).

    Applies the versioned schema files not yet applied (a database made by the legacy
    numbered files is brought up to the baseline first), then every function, trigger, view
    and grant again, so a definition or privilege changed by hand is put back. Needs a role
    that may create tables, roles and publications (and slots, with --create-slot).

    \b
    Creates four NOLOGIN group roles; log in as a member of one:
      ledger_writer      appends (INSERT of the writer's columns, the outbox)
      ledger_reader      reads everything (rebuild_context, verify, inspect, runs)
      ledger_consumer    consume: its own tables; the login role needs REPLICATION itself
                         (CREATE ROLE cdc LOGIN REPLICATION IN ROLE ledger_consumer)
      ledger_dispatcher  dispatch: the outbox
    A worker that resumes sessions and appends is a member of writer and reader.

    With --partition-by the ledger is partitioned (see `ledger-cdc partitions --help`); on an
    existing partitioned ledger, init also creates the partitions that are due.
    """
    from ledger_cdc.admin.schema import init as do_init
    from ledger_cdc.admin.schema import validate_publication_name, validate_slot_name
    from ledger_cdc.connect import connect

    validate_publication_name(publication)  # (bad names are told before any connection)
    if create_slot:
        validate_slot_name(slot)
    with connect(dsn, doing="init", autocommit=True) as conn:
        res = do_init(
            conn,
            publication=publication,
            slot=slot if create_slot else None,
            partition_by=partition_by,
            partitions_ahead=partitions_ahead,
            shards=shards,
            failover=failover,
        )
    applied = ", ".join(f"{v:04d}" for v in res.applied) or "none (already up to date)"
    state.console.print(f"schema versions applied: {applied}; functions and grants applied")
    state.console.print(
        f"publication {publication}: {'created' if res.publication_created else 'exists'}"
    )
    if res.slot_created is not None:
        state.console.print(f"slot {slot}: {'created' if res.slot_created else 'exists'}")
    if res.partitions_created:
        state.console.print(f"partitions created: {', '.join(res.partitions_created)}")
    for pub, sl in res.shards:
        state.console.print(f"shard: publication {pub}, slot {sl}")


# -- lag ------------------------------------------------------------------------------------------


def _human_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _human_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@cli.command(
    cls=CheckCommand,
    exit_codes={
        0: "OK: every slot healthy",
        1: "warning: a slot past a warning threshold, or max_slot_wal_keep_size unbounded",
        2: "critical: a slot past a critical threshold, lost (invalidated), missing, or not a "
        "pgoutput slot of this database; no logical slot in this database at all",
        3: "unknown: a usage error (a bad option, an invalid --slot name), the database "
        "unreachable or holding no ledger, any other error",
    },
)
@dsn_option
@option(
    "--slot",
    default=None,
    envvar=_env("SLOT"),
    help="Only this slot (default: every logical slot).",
)
@option("--json", "as_json", is_flag=True, help="Machine-readable output (a JSON list).")
@option("--watch", is_flag=True, help="Refresh until interrupted.")
@option(
    "--interval",
    default=2.0,
    show_default=True,
    type=Finite(0.1, DAY),
    help="Seconds between --watch refreshes.",
)
@option(
    "--sample-seconds",
    default=1.0,
    show_default=True,
    type=Finite(0, 3600),
    help="How long to sample the WAL generation rate for the forecast.",
)
@option(
    "--warn-share",
    default=0.5,
    show_default=True,
    type=Finite(0, 1),
    help="Warning at this share of max_slot_wal_keep_size retained.",
)
@option(
    "--crit-share",
    default=0.8,
    show_default=True,
    type=Finite(0, 1),
    help="Critical at this share of max_slot_wal_keep_size retained.",
)
@option(
    "--warn-bytes",
    default=256 * 1024 * 1024,
    show_default=True,
    type=click.IntRange(0),
    help="Warning when confirmed_flush_lsn trails the WAL end by this many bytes.",
)
@option(
    "--crit-bytes",
    default=1024 * 1024 * 1024,
    show_default=True,
    type=click.IntRange(0),
    help="Critical when it trails by this many bytes.",
)
@option(
    "--warn-seconds",
    default=60.0,
    show_default=True,
    type=Finite(0),
    help="Warning when the consumer is this many seconds behind.",
)
@option(
    "--crit-seconds",
    default=300.0,
    show_default=True,
    type=Finite(0),
    help="Critical when it is this many seconds behind.",
)
@click.pass_obj
@handles_errors
def lag(
    state: State,
    dsn: str,
    slot: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
    sample_seconds: float,
    warn_share: float,
    crit_share: float,
    warn_bytes: int,
    crit_bytes: int,
    warn_seconds: float,
    crit_seconds: float,
) -> None:
    """Slot health: WAL retained, lag, keep-size share and the time left before invalidation.

    The slots of the --dsn database only (or the --slot named). The exit code follows the
    monitoring-plugin convention (Nagios, Icinga, Sensu): the worst slot's state, a lost or
    missing slot counting as critical; 3 when it cannot tell. (--json's `status` keeps 3 for a
    lost slot, as the ledger_cdc_slot_status metric does.) Needs no superuser: the consumer
    role is enough.
    """
    import psycopg

    from ledger_cdc.admin.health import Thresholds
    from ledger_cdc.admin.schema import validate_slot_name
    from ledger_cdc.connect import connect
    from ledger_cdc.errors import DatabaseUnavailable, describe

    if slot is not None:
        validate_slot_name(slot)
    th = _checked(
        Thresholds(warn_share, crit_share, warn_bytes, crit_bytes, warn_seconds, crit_seconds)
    )
    # (lift: its session sits idle while it samples and between refreshes; a database's
    # idle_session_timeout would end it there)
    conn = connect(dsn, autocommit=True, lift=True)
    try:
        while True:
            try:
                if conn.closed:
                    conn = connect(dsn, autocommit=True, lift=True)
                slots = _check_slots(conn, slot, th, sample_seconds)
            except (psycopg.OperationalError, DatabaseUnavailable) as e:
                if not watch:
                    raise
                # a server restarting, a connection dropped: said, and looked at again
                conn.close()
                state.console.print(f"[yellow]{safe(describe(e, dsn))}[/]: trying again")
                time.sleep(interval)
                continue
            code = _show_lag(state, slots, str(conn.info.dbname), as_json, watch)
            if not watch:
                sys.exit(code)
            time.sleep(interval)
    finally:
        conn.close()


def _checked(th: Thresholds) -> Thresholds:
    """``th``, each warning at or below its critical (else a usage error)."""
    for name in ("share", "bytes", "seconds"):
        warn, crit = getattr(th, f"warn_{name}"), getattr(th, f"crit_{name}")
        if warn > crit:
            raise click.BadParameter(
                f"--warn-{name} {warn} is above --crit-{name} {crit}: a warning comes first",
                param_hint=f"--warn-{name}",
            )
    return th


def _check_slots(
    conn: psycopg.Connection[Any], slot: str | None, th: Thresholds, sample_seconds: float
) -> list[SlotHealth]:
    """The health of this database's slots (or of ``slot``); a database without a ledger is
    an error: another database's slots are not this one's health."""
    from ledger_cdc.admin.health import check_slots, has_ledger
    from ledger_cdc.errors import SchemaError

    if not has_ledger(conn):
        raise SchemaError(
            f"database {conn.info.dbname!r} holds no ledger (no agent_events on "
            "the search path): nothing to judge; give the ledger database's DSN"
        )
    return check_slots(conn, slot, thresholds=th, sample_seconds=sample_seconds, this_database=True)


def _show_lag(
    state: State, slots: list[SlotHealth], dbname: str, as_json: bool, watch: bool
) -> int:
    """Print the slots' health; its exit code: the worst slot's state, a lost slot (status 3)
    critical, and none at all too (no consumer streams the ledger)."""
    import json as jsonlib

    from ledger_cdc.admin.health import CRITICAL

    if as_json:
        click.echo(jsonlib.dumps([h.as_json() for h in slots], indent=2))
    else:
        if watch:
            state.console.clear()
        _print_lag(state.console, slots)
    if not slots:
        state.err.print(
            f"no logical replication slot in database {safe(dbname)}: no "
            "consumer streams this ledger (`ledger-cdc consume --create-slot` makes one)",
            soft_wrap=True,
        )
    return min(CRITICAL, max((h.status for h in slots), default=CRITICAL))


def _print_lag(console: Console, slots: list[Any]) -> None:
    colour = {0: "green", 1: "yellow", 2: "red", 3: "bold red"}
    columns = [
        "slot",
        "status",
        "active",
        "wal_status",
        "retained",
        "keep size",
        "share",
        "safe_wal_size",
        "lag",
        "checkpoint behind",
        "time left",
        "why",
    ]
    rows = []
    for h in slots:
        rows.append(
            [
                safe(h.slot),
                f"[{colour[h.status]}]{h.status_name}[/]",
                "—" if not h.exists else (f"pid {h.active_pid}" if h.active else "no"),
                h.wal_status or "—",
                _human_bytes(h.retained_bytes),
                "unbounded"
                if h.exists and h.max_slot_wal_keep_size is None
                else _human_bytes(h.max_slot_wal_keep_size),
                "—" if h.keep_size_share is None else f"{h.keep_size_share:.0%}",
                _human_bytes(h.safe_wal_size),
                f"{_human_bytes(h.lag_bytes)} / {_human_seconds(h.lag_seconds)}",
                _human_bytes(h.checkpoint_behind_slot_bytes),
                _human_seconds(h.seconds_to_invalidation),
                safe("; ".join(h.reasons) or "—"),
            ]
        )
    caption = None
    if not slots:
        caption = "no logical slots"
    elif slots[0].wal_rate_bytes_per_s is not None:
        h = slots[0]
        inserts = "—" if h.ledger_insert_rate is None else f"{h.ledger_insert_rate:,.0f}/s"
        caption = (
            f"WAL generated: {_human_bytes(h.wal_rate_bytes_per_s)}/s · ledger inserts: {inserts}"
        )
    print_records(console, "logical replication slots", columns, rows, caption=caption)


# -- slot management ---------------------------------------------------------------------------


@cli.group()
def slot() -> None:
    """Create, drop and list logical replication slots."""


@slot.command("create")
@dsn_option
@click.argument("name", default="agent_slot")
@option("--two-phase", is_flag=True, help="Decode prepared transactions at PREPARE (protocol 3).")
@failover_option
@click.pass_obj
@handles_errors
def slot_create(state: State, dsn: str, name: str, two_phase: bool, failover: bool) -> None:
    """Create a pgoutput slot NAME (default agent_slot); refuses a slot of another kind."""
    from ledger_cdc.admin.schema import create_slot
    from ledger_cdc.connect import connect

    with connect(dsn, autocommit=True) as conn:
        made = create_slot(conn, name, two_phase=two_phase, failover=failover)
    state.console.print(f"slot {name}: {'created' if made else 'exists (pgoutput)'}")


@slot.command("failover")
@dsn_option
@click.argument("name", default="agent_slot")
@option("--off", is_flag=True, help="Turn the failover property off instead.")
@click.pass_obj
@handles_errors
def slot_failover(state: State, dsn: str, name: str, off: bool) -> None:
    """Make the existing slot NAME (default agent_slot) a failover slot (PostgreSQL 17+), or
    with --off an ordinary one. The slot must not be in use: stop its consumer first.

    A failover slot survives a standby's promotion only when the standby has
    sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name and a dbname in
    primary_conninfo, and the primary lists the standby's physical slot in
    synchronized_standby_slots (`ledger-cdc doctor` checks them; `lag` shows whether the slot
    is ready)."""
    from ledger_cdc.admin.schema import set_failover

    changed = set_failover(dsn, name, on=not off)
    what = "an ordinary slot" if off else "a failover slot"
    state.console.print(f"slot {name}: {'now' if changed else 'already'} {what}")


@slot.command("drop")
@dsn_option
@click.argument("name")
@option("--force", is_flag=True, help="Terminate the walsender of an active slot first.")
@click.pass_obj
@handles_errors
def slot_drop(state: State, dsn: str, name: str, force: bool) -> None:
    """Drop slot NAME. An active slot (a consumer is streaming it) is refused without --force."""
    from ledger_cdc.admin.schema import drop_slot
    from ledger_cdc.connect import connect

    with connect(dsn, autocommit=True) as conn:
        dropped = drop_slot(conn, name, force=force)
    if not dropped:
        from ledger_cdc.errors import SlotError

        raise SlotError(f"slot {name!r} does not exist")
    state.console.print(f"slot {name}: dropped")


@slot.command("list")
@dsn_option
@option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@handles_errors
def slot_list(state: State, dsn: str, as_json: bool) -> None:
    """List replication slots with their plugin, database, state and positions."""
    import json as jsonlib

    from ledger_cdc.connect import connect

    with connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT slot_name, slot_type, plugin, database, active, active_pid, wal_status, "
            "restart_lsn::text, confirmed_flush_lsn::text, two_phase FROM pg_replication_slots "
            "ORDER BY slot_name"
        ).fetchall()
    keys = (
        "slot",
        "type",
        "plugin",
        "database",
        "active",
        "active_pid",
        "wal_status",
        "restart_lsn",
        "confirmed_flush_lsn",
        "two_phase",
    )
    if as_json:
        click.echo(jsonlib.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
        return
    print_records(
        state.console,
        "replication slots",
        list(keys),
        [["—" if v is None else safe(v) for v in r] for r in rows],
    )
