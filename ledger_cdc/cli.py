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
