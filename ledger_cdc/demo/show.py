"""What ``ledger-cdc demo`` does, start to end: a throwaway PostgreSQL, the ledger initialised,
simulated agents writing while a consumer folds the slot, the crash story, then a verify of the
whole; each step printed on a rich console. The command line only parses the options and calls
:func:`run_demo`; the cluster never outlives it."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from ledger_cdc.admin.schema import init
from ledger_cdc.admin.timeline import summarise
from ledger_cdc.admin.verify import VerifyReport, verify
from ledger_cdc.connect import open_session
from ledger_cdc.consumer import ConsumerConfig, build_consumer
from ledger_cdc.demo.agents import (
    DemoReport,
    ledger_rows,
    projections,
    run_agents,
    verify_against_refold,
)
from ledger_cdc.demo.crash import HELD_CALL, CrashStory, run_crash_story
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.errors import LedgerError
from ledger_cdc.lsn import format_lsn
from ledger_cdc.stopping import ignore_stop_signals

__all__ = ["run_demo"]

_WAIT = 60.0  # seconds the demo waits for the consumer to catch up, at most


def run_demo(
    console: Console,
    *,
    sessions: int = 6,
    seed: int = 7,
    pg_major: int | None = None,
    keep: bool = False,
) -> None:
    """Run the demo on a throwaway cluster of PostgreSQL ``pg_major`` (default: the first
    found), with ``sessions`` simulated agent runs seeded by ``seed``; with ``keep``, the
    cluster runs on until Enter is pressed. Raises :class:`LedgerError` if the ledger does not
    verify at the end."""
    # the throwaway cluster must not outlive the demo: SIGTERM (a supervisor, `timeout`) and
    # SIGHUP (the terminal closed) end it as Ctrl-C does, not by default, which would leave
    # its server running and its directory behind
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGHUP, _terminated)
    pg = EmbeddedPostgres(major=pg_major)
    try:
        with console.status("starting a throwaway PostgreSQL…"):
            pg.__enter__()
        console.print(
            f"[green]PostgreSQL {pg.major}[/] on 127.0.0.1:{pg.port} ([dim]{pg.install.bindir}[/])"
        )
        _demo_on(console, pg.dsn(), sessions, seed)
        if keep:
            console.print(f"cluster kept at: [cyan]{pg.dsn()}[/]  (press Enter to stop)")
            sys.stdin.readline()
    finally:
        ignore_stop_signals()  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        pg.__exit__(None, None, None)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the cluster goes with it


def _demo_on(con: Console, dsn: str, sessions: int, seed: int) -> None:
    """The demo on the (empty) database ``dsn``."""
    with open_session(dsn, autocommit=True) as conn:
        res = init(conn, slot="agent_slot")  # the slot before any write: nothing is missed
    con.print(
        f"ledger initialised: migrations {', '.join(f'{v:04d}' for v in res.applied)}, "
        "publication agent_pub, slot agent_slot"
    )
    consumer = build_consumer(ConsumerConfig(dsn=dsn, snapshot_every=5, heartbeat_interval=1.0))
    runner = threading.Thread(target=consumer.run, name="demo-consumer", daemon=True)
    runner.start()
    with con.status(f"running {sessions} simulated agents, consumer streaming agent_slot…"):
        report = run_agents(dsn, sessions=sessions, seed=seed)
        _wait_for(lambda: consumer.metrics.events >= report.events)
    _print_ledger(con, dsn, report)
    _print_projections(con, dsn)
    same, snaps = verify_against_refold(dsn)
    m = consumer.metrics
    con.print(
        f"consumer: {m.transactions} transactions in {m.batches} batches, confirmed "
        f"{format_lsn(m.confirmed_lsn)}; {snaps} snapshots; projections "
        + ("[green]equal[/]" if same else "[red]differ from[/]")
        + " a refold of the ledger from zero"
    )
    con.rule("[bold]a worker dies mid-tool-call[/]")
    _print_crash_story(con, run_crash_story(dsn, say=con.print))
    checked = _verify(con, dsn)
    consumer.stop()
    runner.join(30)
    if not checked.ok:
        raise LedgerError("the demo's ledger does not verify")


def _wait_for(done: Callable[[], bool]) -> None:
    """Until ``done()``, for :data:`_WAIT` seconds at most (past them the demo shows what
    there is)."""
    deadline = time.monotonic() + _WAIT
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _print_ledger(con: Console, dsn: str, report: DemoReport) -> None:
    table = Table(title="agent_events (append-only ledger, first rows)", show_lines=False)
    for col in ("seq", "session", "pos", "agent", "event_type", "summary", "hash"):
        table.add_column(col, overflow="fold" if col == "summary" else "ellipsis")
    for ev, h in ledger_rows(dsn, limit=60):
        table.add_row(
            str(ev.seq),
            str(ev.session_id)[:8],
            str(ev.position),
            ev.agent_id,
            ev.event_type,
            summarise(ev),
            h[:12],
        )
    con.print(table)
    con.print(
        f"[bold]{report.events}[/] events in [bold]{len(report.sessions)}[/] sessions, "
        f"[bold]{report.outbox}[/] outbox rows; every agent turn committed as one transaction."
    )


_STATUS = {"completed": "[green]completed[/]", "failed": "[red]failed[/]"}


def _print_projections(con: Console, dsn: str) -> None:
    proj = Table(title="agent_sessions (projections folded from the slot, in commit order)")
    for col in (
        "session",
        "status",
        "events",
        "pending tools",
        "completed tools",
        "tokens in/out",
        "handoffs",
        "last seq",
    ):
        proj.add_column(col)
    for ctx in projections(dsn):
        proj.add_row(
            str(ctx.session_id)[:8],
            _STATUS.get(ctx.status, ctx.status),
            str(ctx.event_count),
            str(len(ctx.pending_tools)),
            str(len(ctx.completed_tools)),
            f"{ctx.usage.input_tokens}/{ctx.usage.output_tokens}",
            str(len(ctx.handoffs_emitted)),
            str(ctx.last_seq),
        )
    con.print(proj)


def _print_crash_story(con: Console, story: CrashStory) -> None:
    sb = story.standby
    inflight = ", ".join(f"{c} (key {k})" for c, k in sb.in_flight) or "none"
    con.print(
        f"worker-2 (standby) called rebuild_context: {sb.rebuild_ms:.1f} ms; in flight: "
        f"[yellow]{inflight}[/]"
    )
    con.print(
        "worker-2 answered from the ledger, calling nothing: "
        f"[green]{', '.join(sb.answered_from_ledger)}[/]"
    )
    for call_id, key in sb.retried:
        con.print(f"worker-2 retried {call_id} with its original key {key}")
    con.print(f"worker-2 called: {', '.join(sb.called)}; session {story.status}")
    by_call = ", ".join(f"{k.rsplit(':', 1)[-1]} ×{n}" for k, n in sorted(story.calls.items()))
    con.print(
        f"the tool service saw: {by_call} — only {HELD_CALL}, in flight at the kill, twice, "
        "both times with the same idempotency key (a real service deduplicates by it)"
    )


def _verify(con: Console, dsn: str) -> VerifyReport:
    """``verify``, again until the consumer has folded everything (no notes), and its report."""
    deadline = time.monotonic() + _WAIT
    checked = verify(dsn)
    while not (checked.ok and not checked.notes) and time.monotonic() < deadline:
        time.sleep(0.1)
        checked = verify(dsn)
    con.print(
        ("[green]verify passed[/]" if checked.ok else "[red]verify found differences[/]")
        + f": {checked.sessions} sessions, {checked.events} events refolded, "
        f"{checked.projections} projections, {checked.snapshots} snapshots and "
        f"{checked.memo} memoised calls compared, "
        "hash chains intact" * checked.ok
    )
    return checked
