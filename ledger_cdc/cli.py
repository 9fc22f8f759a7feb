"""The ``ledger-cdc`` command line: a thin layer over the library.

Exit codes (every command):
  0  success
  1  the command ran and found a problem it reports (e.g. differences, unhealthy slot)
  2  usage error (bad option or argument)
  4  configuration or connection error (bad DSN, bad name, missing binaries)
  5  any other ledger-cdc error
An error is printed as one red line on stderr, with a hint where there is one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from ._version import __version__
from .errors import ConfigError, LedgerError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEM = 1
EXIT_CONFIG = 4
EXIT_ERROR = 5


@dataclass
class State:
    console: Console
    err: Console


def _fail(e: LedgerError) -> None:
    err = Console(stderr=True, highlight=False)
    err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
    code = EXIT_CONFIG if isinstance(e, ConfigError) else EXIT_ERROR
    sys.exit(code)


def handles_errors(fn: F) -> F:
    """Turn a LedgerError into one red line and its exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LedgerError as e:
            _fail(e)

    return wrapper  # type: ignore[return-value]


dsn_option = click.option(
    "--dsn",
    envvar="LEDGER_CDC_DSN",
    required=True,
    help="libpq connection string or URL of the ledger database [env: LEDGER_CDC_DSN].",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="ledger-cdc")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """PostgreSQL's write-ahead log as the state ledger of multi-agent systems.

    Writers only INSERT agent steps into agent_events; one consumer reads the agent_slot
    pgoutput stream in commit order and folds it into per-session projections.

    \b
    Start here:
      ledger-cdc demo               agents writing to a throwaway local PostgreSQL
      ledger-cdc init --dsn DSN     create the ledger schema, publication (and slot)
    """
    ctx.obj = State(console=Console(), err=Console(stderr=True))


@cli.command()
@dsn_option
@click.option(
    "--publication",
    default="agent_pub",
    show_default=True,
    envvar="LEDGER_CDC_PUBLICATION",
    help="Publication the consumer reads [env: LEDGER_CDC_PUBLICATION].",
)
@click.option(
    "--slot",
    default="agent_slot",
    show_default=True,
    envvar="LEDGER_CDC_SLOT",
    help="Logical replication slot to create with --create-slot [env: LEDGER_CDC_SLOT].",
)
@click.option("--create-slot", is_flag=True, help="Also create the pgoutput slot.")
@click.pass_obj
@handles_errors
def init(state: State, dsn: str, publication: str, slot: str, create_slot: bool) -> None:
    """Apply the schema migrations and create the publication (idempotent).

    Needs a role that may create tables, roles and publications (and slots, with
    --create-slot). Creates the group roles ledger_writer and ledger_consumer; see the
    README for logging in as their members.
    """
    from .schema import init as do_init

    res = do_init(dsn, publication=publication, slot=slot if create_slot else None)
    applied = ", ".join(f"{v:04d}" for v in res.applied) or "none (already up to date)"
    state.console.print(f"migrations applied: {applied}")
    state.console.print(
        f"publication {publication}: {'created' if res.publication_created else 'exists'}"
    )
    if res.slot_created is not None:
        state.console.print(f"slot {slot}: {'created' if res.slot_created else 'exists'}")


@cli.command()
@click.option("--sessions", default=6, show_default=True, help="Number of simulated agent runs.")
@click.option("--seed", default=7, show_default=True, help="Seed of the simulation.")
@click.option(
    "--pg-major",
    type=int,
    default=None,
    help="PostgreSQL major version of the throwaway cluster (default: first found).",
)
@click.option("--keep", is_flag=True, help="Keep the cluster running until Enter is pressed.")
@click.pass_obj
@handles_errors
def demo(state: State, sessions: int, seed: int, pg_major: int | None, keep: bool) -> None:
    """Start a throwaway PostgreSQL, init the ledger and let simulated agents write to it."""
    from .demo import ledger_rows, run_agents
    from .embedded import EmbeddedPostgres
    from .schema import init as do_init

    con = state.console
    with con.status("starting a throwaway PostgreSQL…"):
        pg = EmbeddedPostgres(major=pg_major)
        pg.__enter__()
    try:
        con.print(
            f"[green]PostgreSQL {pg.major}[/] on 127.0.0.1:{pg.port} ([dim]{pg.install.bindir}[/])"
        )
        dsn = pg.dsn()
        res = do_init(dsn, slot="agent_slot")
        con.print(
            f"ledger initialised: migrations {', '.join(f'{v:04d}' for v in res.applied)}, "
            "publication agent_pub, slot agent_slot"
        )
        with con.status(f"running {sessions} simulated agents…"):
            report = run_agents(dsn, sessions=sessions, seed=seed)
        rows = ledger_rows(dsn)
        table = Table(title="agent_events (append-only ledger)", show_lines=False)
        for col in ("seq", "session", "pos", "agent", "event_type", "summary", "hash"):
            table.add_column(col, overflow="fold" if col == "summary" else "ellipsis")
        for seq, sid, pos, agent, etype, payload, h in rows:
            table.add_row(
                str(seq), str(sid)[:8], str(pos), agent, etype, _summary(etype, payload), h[:12]
            )
        con.print(table)
        con.print(
            f"[bold]{report.events}[/] events in [bold]{len(report.sessions)}[/] sessions, "
            f"[bold]{report.outbox}[/] outbox rows; every agent turn committed as one transaction."
        )
        if keep:
            con.print(f"cluster kept at: [cyan]{dsn}[/]  (press Enter to stop)")
            sys.stdin.readline()
    finally:
        pg.__exit__(None, None, None)


def _env(name: str) -> str:
    return f"LEDGER_CDC_{name}"


@cli.command()
@dsn_option
@click.option(
    "--slot",
    default="agent_slot",
    show_default=True,
    envvar=_env("SLOT"),
    help="Logical replication slot (pgoutput) to stream [env: LEDGER_CDC_SLOT].",
)
@click.option(
    "--publication",
    default="agent_pub",
    show_default=True,
    envvar=_env("PUBLICATION"),
    help="Publication of the ledger [env: LEDGER_CDC_PUBLICATION].",
)
@click.option(
    "--target-dsn",
    default=None,
    envvar=_env("TARGET_DSN"),
    help="Database for the projections (default: the ledger database) "
    "[env: LEDGER_CDC_TARGET_DSN].",
)
@click.option(
    "--create-slot",
    is_flag=True,
    envvar=_env("CREATE_SLOT"),
    help="Create the slot if it does not exist [env: LEDGER_CDC_CREATE_SLOT].",
)
@click.option(
    "--batch-size",
    default=20000,
    show_default=True,
    type=click.IntRange(1),
    envvar=_env("BATCH_SIZE"),
    help="Flush after this many events [env: LEDGER_CDC_BATCH_SIZE].",
)
@click.option(
    "--max-delay-ms",
    default=50,
    show_default=True,
    type=click.IntRange(0),
    envvar=_env("MAX_DELAY_MS"),
    help="Flush at the latest this long after a batch's first transaction "
    "[env: LEDGER_CDC_MAX_DELAY_MS].",
)
@click.option(
    "--snapshot-every",
    default=100,
    show_default=True,
    type=click.IntRange(0),
    envvar=_env("SNAPSHOT_EVERY"),
    help="Snapshot a session every N events (and at task end); 0: only at task end "
    "[env: LEDGER_CDC_SNAPSHOT_EVERY].",
)
@click.option(
    "--heartbeat-interval",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    envvar=_env("HEARTBEAT_INTERVAL"),
    help="Seconds between heartbeat messages (0: off); keeps an idle slot advancing "
    "and measures end-to-end lag [env: LEDGER_CDC_HEARTBEAT_INTERVAL].",
)
@click.option(
    "--metrics-port",
    default=None,
    type=click.IntRange(0, 65535),
    envvar=_env("METRICS_PORT"),
    help="Serve Prometheus metrics on this port [env: LEDGER_CDC_METRICS_PORT].",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar=_env("METRICS_HOST"),
    help="Address for --metrics-port [env: LEDGER_CDC_METRICS_HOST].",
)
@click.option(
    "--memory-limit-mb",
    default=64,
    show_default=True,
    type=click.IntRange(1),
    envvar=_env("MEMORY_LIMIT_MB"),
    help="Buffer for in-progress streamed transactions before spilling to disk "
    "[env: LEDGER_CDC_MEMORY_LIMIT_MB].",
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "text", "json"]),
    default="auto",
    show_default=True,
    envvar=_env("LOG_FORMAT"),
    help="auto: a live status line on a terminal, text lines otherwise "
    "[env: LEDGER_CDC_LOG_FORMAT].",
)
@click.pass_obj
@handles_errors
def consume(
    state: State,
    dsn: str,
    slot: str,
    publication: str,
    target_dsn: str | None,
    create_slot: bool,
    batch_size: int,
    max_delay_ms: int,
    snapshot_every: int,
    heartbeat_interval: float,
    metrics_port: int | None,
    metrics_host: str,
    memory_limit_mb: int,
    log_format: str,
) -> None:
    """Stream the slot into per-session projections, exactly once, in commit order.

    Runs until SIGINT or SIGTERM, then finishes the current batch, commits, confirms and exits 0.
    Reconnects by itself when the connection drops or the server restarts.
    """
    from .consumer import Consumer, ConsumerConfig
    from .runner import run_consumer
    from .schema import validate_publication_name, validate_slot_name

    validate_slot_name(slot)
    validate_publication_name(publication)
    config = ConsumerConfig(
        dsn=dsn,
        slot=slot,
        publication=publication,
        target_dsn=target_dsn,
        create_slot=create_slot,
        batch_size=batch_size,
        max_delay=max_delay_ms / 1000,
        snapshot_every=snapshot_every,
        heartbeat_interval=heartbeat_interval or None,
        memory_limit=memory_limit_mb * 1024 * 1024,
    )
    consumer = Consumer(config)
    consumer.install_signal_handlers()
    run_consumer(consumer, state.console, log_format, metrics_port, metrics_host)


def _summary(event_type: str, payload: dict[str, Any]) -> str:
    if event_type == "context.loaded":
        return f"{len(payload.get('messages', []))} messages: {payload.get('task')}"
    if event_type == "model.requested":
        return f"{payload.get('model')} prompt {payload.get('prompt_hash')}"
    if event_type == "model.responded":
        u = payload.get("usage", {})
        return (
            f"{u.get('input_tokens', 0)}→{u.get('output_tokens', 0)} tokens, "
            f"{len(payload.get('tool_calls', []))} tool call(s)"
        )
    if event_type == "tool.invoked":
        return f"{payload.get('tool')}({payload.get('call_id')})"
    if event_type == "tool.observed":
        return f"{payload.get('call_id')} → {payload.get('result')}"
    if event_type.startswith("handoff."):
        other = payload.get("to_agent") or payload.get("from_agent")
        return f"{payload.get('handoff_id')} ↔ {other}"
    if event_type == "task.failed":
        return f"[red]{payload.get('error')}[/]"
    return str(payload)[:60]


def main() -> None:
    cli(prog_name="ledger-cdc")


if __name__ == "__main__":
    main()
