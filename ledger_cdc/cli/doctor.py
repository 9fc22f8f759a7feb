"""``ledger-cdc doctor``: the deployment's preflight (:mod:`ledger_cdc.admin.doctor`), one line a
finding."""

from __future__ import annotations

import json
import sys

import click

from ledger_cdc.cli.base import (
    DSN,
    CheckCommand,
    State,
    _env,
    cli,
    dsn_option,
    handles_errors,
    option,
    safe,
)

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@cli.command(
    cls=CheckCommand,
    exit_codes={
        0: "every finding ok",
        1: "a warning: it works, but a loss or a stop waits on it",
        2: "a failure: the consumer cannot run, or runs and loses data, until it is fixed",
        3: "cannot tell: the ledger database would not connect, a usage error, any other error",
    },
)
@dsn_option
@option(
    "--consumer-dsn",
    default=None,
    type=DSN,
    envvar=_env("CONSUMER_DSN"),
    help="How the consumer logs in, if not as --dsn: its role's grants are checked, and a "
    "replication connection is made as it.",
)
@option(
    "--slot",
    default="agent_slot",
    show_default=True,
    envvar=_env("SLOT"),
    help="The consumer's replication slot.",
)
@option(
    "--publication",
    default="agent_pub",
    show_default=True,
    envvar=_env("PUBLICATION"),
    help="The publication the consumer reads.",
)
@option("--json", "as_json", is_flag=True, help="Machine-readable output (one JSON object).")
@click.pass_obj
@handles_errors
def doctor(
    state: State,
    dsn: str,
    consumer_dsn: str | None,
    slot: str,
    publication: str,
    as_json: bool,
) -> None:
    """Check the server, the roles and the ledger's objects as a deployment needs them: one
    line per finding (ok, warn or fail) with its fix. Run it before the first start and after
    a server change (an upgrade, a failover, a restore). Changes nothing.

    \b
    Checks: wal_level; max_wal_senders and max_replication_slots against those in use;
    max_slot_wal_keep_size (and pg_wal's size); wal_sender_timeout;
    idle_replication_slot_timeout (18+); synchronized_standby_slots naming slots that exist
    (17+); a standby given for the primary; the consumer's role: ledger_consumer, REPLICATION,
    TEMPORARY, VACUUM of the projections (owner, or MAINTAIN / pg_maintain on 17+); a
    replication connection made as that role (pg_hba.conf); the schema's migrations; the
    publication; the slot: kind, plugin, database, invalidation, failover (17+).

    The WAL disk's free space cannot be read over SQL: the finding says how much to keep.
    """
    from ledger_cdc.admin.doctor import CANNOT_TELL, diagnose, exit_code
    from ledger_cdc.admin.schema import validate_publication_name, validate_slot_name
    from ledger_cdc.consumer.resync import check_schema, publication_problem
    from ledger_cdc.errors import LedgerError
    from ledger_cdc.redact import redact

    validate_slot_name(slot)
    validate_publication_name(publication)
    try:
        findings = diagnose(
            dsn,
            consumer_dsn=consumer_dsn,
            slot=slot,
            publication=publication,
            schema_judge=check_schema,
            publication_judge=publication_problem,
        )
    except LedgerError as e:
        if as_json:
            error = redact(" ".join(str(e).split()), dsn)
            click.echo(json.dumps({"status": CANNOT_TELL, "error": error, "findings": []}))
        raise  # (one red line, exit 3: a check's error)
    code = exit_code(findings)
    if as_json:
        body = {"status": code, "findings": [f.as_json() for f in findings]}
        click.echo(json.dumps(body, indent=2))
        sys.exit(code)
    width = max(len(f.check) for f in findings)
    for f in findings:
        level = f.level.name.lower()
        line = f"[{_STYLE[level]}]{level:<4}[/] {safe(f.check):<{width}}  {safe(f.what)}"
        if f.fix:
            line += f" [dim]— fix:[/] {safe(f.fix)}"
        state.console.print(line, soft_wrap=True, highlight=False)
    counts = {lv: sum(f.level.name.lower() == lv for f in findings) for lv in _STYLE}
    state.console.print(
        f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failure(s)",
        highlight=False,
    )
    sys.exit(code)
