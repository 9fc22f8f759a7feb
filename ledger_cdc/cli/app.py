"""The core commands: ``init``, ``demo``, ``consume``, ``fold``, ``lag`` and ``slot``."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ledger_cdc.cli.base import (
    DSN,
    CheckCommand,
    F,
    Finite,
    Interval,
    State,
    _env,
    ahead_option,
    cli,
    dsn_option,
    handles_errors,
    log_format_option,
    option,
    print_records,
    safe,
)
from ledger_cdc.errors import DAY, LedgerError

# options that consume and fold share
failover_option = option(
    "--failover",
    is_flag=True,
    envvar=_env("FAILOVER"),
    help="Make a slot this creates a failover slot (PostgreSQL 17+): a standby with "
    "sync_replication_slots keeps it in step, so it survives the standby's promotion.",
)
target_dsn_option = option(
    "--target-dsn",
    default=None,
    type=DSN,
    envvar=_env("TARGET_DSN"),
    help="Database for the projections (default: the ledger database).",
)
snapshot_every_option = option(
    "--snapshot-every",
    default=100,
    show_default=True,
    type=click.IntRange(0, 2**31),
    envvar=_env("SNAPSHOT_EVERY"),
    help="Snapshot a session every N events (and at task end); 0: only at task end.",
)


def stop_timeout_option(holds: str, then: str) -> Callable[[F], F]:
    """``--stop-timeout``: ``holds``, what may keep a stop from ending; ``then``, what becomes
    of the work in hand when it is cut short."""
    return option(
        "--stop-timeout",
        default=30.0,
        show_default=True,
        type=Finite(1, DAY),
        envvar=_env("STOP_TIMEOUT"),
        help=f"Seconds a stop (SIGINT, SIGTERM, SIGHUP) may take to finish the batch in hand: "
        f"past them ({holds}), the process exits with status 4 and {then}.",
    )


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

    res = do_init(
        dsn,
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
    import signal

    from ledger_cdc.admin.schema import init as do_init
    from ledger_cdc.admin.timeline import summarise
    from ledger_cdc.admin.verify import verify
    from ledger_cdc.demo.agents import ledger_rows, projections, run_agents, verify_against_refold
    from ledger_cdc.demo.crash import HELD_CALL, run_crash_story
    from ledger_cdc.demo.embedded import EmbeddedPostgres
    from ledger_cdc.errors import format_lsn
    from ledger_cdc.stopping import ignore_stop_signals

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the cluster goes with us

    # the throwaway cluster must not outlive the command: SIGTERM (a supervisor, `timeout`)
    # and SIGHUP (the terminal closed) end it as Ctrl-C does, not by default, which would
    # leave its server running and its directory behind
    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)
    con = state.console
    pg = EmbeddedPostgres(major=pg_major)
    try:
        with con.status("starting a throwaway PostgreSQL…"):
            pg.__enter__()
        con.print(
            f"[green]PostgreSQL {pg.major}[/] on 127.0.0.1:{pg.port} ([dim]{pg.install.bindir}[/])"
        )
        dsn = pg.dsn()
        res = do_init(dsn, slot="agent_slot")  # the slot before any write: nothing is missed
        con.print(
            f"ledger initialised: migrations {', '.join(f'{v:04d}' for v in res.applied)}, "
            "publication agent_pub, slot agent_slot"
        )
        from ledger_cdc.consumer.loop import Consumer, ConsumerConfig

        consumer = Consumer(ConsumerConfig(dsn=dsn, snapshot_every=5, heartbeat_interval=1.0))
        runner = threading.Thread(target=consumer.run, name="demo-consumer", daemon=True)
        runner.start()
        with con.status(f"running {sessions} simulated agents, consumer streaming agent_slot…"):
            report = run_agents(dsn, sessions=sessions, seed=seed)
            deadline = time.monotonic() + 60
            while consumer.metrics.events < report.events and time.monotonic() < deadline:
                time.sleep(0.05)
        rows = ledger_rows(dsn, limit=60)
        table = Table(title="agent_events (append-only ledger, first rows)", show_lines=False)
        for col in ("seq", "session", "pos", "agent", "event_type", "summary", "hash"):
            table.add_column(col, overflow="fold" if col == "summary" else "ellipsis")
        for ev, h in rows:
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
                {"completed": "[green]completed[/]", "failed": "[red]failed[/]"}.get(
                    ctx.status, ctx.status
                ),
                str(ctx.event_count),
                str(len(ctx.pending_tools)),
                str(len(ctx.completed_tools)),
                f"{ctx.usage.input_tokens}/{ctx.usage.output_tokens}",
                str(len(ctx.handoffs_emitted)),
                str(ctx.last_seq),
            )
        con.print(proj)
        same, snaps = verify_against_refold(dsn)
        m = consumer.metrics
        con.print(
            f"consumer: {m.transactions} transactions in {m.batches} batches, confirmed "
            f"{format_lsn(m.confirmed_lsn)}; {snaps} snapshots; projections "
            + ("[green]equal[/]" if same else "[red]differ from[/]")
            + " a refold of the ledger from zero"
        )
        con.rule("[bold]a worker dies mid-tool-call[/]")
        story = run_crash_story(dsn, say=con.print)
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
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            checked = verify(dsn)
            if checked.ok and not checked.notes:
                break
            time.sleep(0.1)
        con.print(
            ("[green]verify passed[/]" if checked.ok else "[red]verify found differences[/]")
            + f": {checked.sessions} sessions, {checked.events} events refolded, "
            f"{checked.projections} projections, {checked.snapshots} snapshots and "
            f"{checked.memo} memoised calls compared, "
            "hash chains intact" * checked.ok
        )
        consumer.stop()
        runner.join(30)
        if not checked.ok:
            raise LedgerError("the demo's ledger does not verify")
        if keep:
            con.print(f"cluster kept at: [cyan]{dsn}[/]  (press Enter to stop)")
            sys.stdin.readline()
    finally:
        ignore_stop_signals()  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        pg.__exit__(None, None, None)


@cli.command()
@dsn_option
@option(
    "--slot",
    default="agent_slot",
    show_default=True,
    envvar=_env("SLOT"),
    help="Logical replication slot (pgoutput) to stream.",
)
@option(
    "--publication",
    default="agent_pub",
    show_default=True,
    envvar=_env("PUBLICATION"),
    help="Publication of the ledger.",
)
@target_dsn_option
@option(
    "--create-slot",
    is_flag=True,
    envvar=_env("CREATE_SLOT"),
    help="Create the slot if it does not exist.",
)
@failover_option
@option(
    "--batch-size",
    default=20000,
    show_default=True,
    type=click.IntRange(1, 2**31),
    envvar=_env("BATCH_SIZE"),
    help="Flush after this many events.",
)
@option(
    "--max-delay-ms",
    default=50,
    show_default=True,
    type=click.IntRange(0, 3_600_000),
    envvar=_env("MAX_DELAY_MS"),
    help="Flush at the latest this long after a batch's first transaction (while catching "
    "up on a backlog, at least half a second: fewer, larger batches; not with a nats:// sink).",
)
@snapshot_every_option
@option(
    "--heartbeat-interval",
    default=0.0,
    show_default=True,
    type=Interval(),
    envvar=_env("HEARTBEAT_INTERVAL"),
    help="Seconds between heartbeat messages (0: off); keeps an idle slot advancing "
    "and measures end-to-end lag.",
)
@option(
    "--metrics-port",
    default=None,
    type=click.IntRange(0, 65535),
    envvar=_env("METRICS_PORT"),
    help="Serve Prometheus metrics on this port.",
)
@option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar=_env("METRICS_HOST"),
    help="Address for --metrics-port.",
)
@option(
    "--memory-limit-mb",
    default=512,
    show_default=True,
    type=click.IntRange(1, 2**42),
    envvar=_env("MEMORY_LIMIT_MB"),
    help="Memory for what grows with the data (buffered transactions, spilled to disk past "
    "their share; the session cache; the batch in hand; a tenth read ahead at start-up): peak "
    "RSS stays under the idle size + this + 32 MB.",
)
@option(
    "--spill-dir",
    default=None,
    type=click.Path(path_type=str),
    envvar=_env("SPILL_DIR"),
    help="Directory for what passes --memory-limit-mb: transactions buffered to disk, a large "
    "transaction sorted by session (default: the system's temporary directory, TMPDIR). Give "
    "it room for the largest transaction; one that cannot take a file (full, missing, not "
    "writable) stops the consumer with exit 4 naming it.",
)
@option(
    "--on-slot-lost",
    type=click.Choice(["resync", "exit"]),
    default="resync",
    show_default=True,
    envvar=_env("ON_SLOT_LOST"),
    help="When the server invalidates the slot: rebuild it from the ledger table, or exit "
    "with code 3 so you are paged.",
)
@option(
    "--health-interval",
    default=10.0,
    show_default=True,
    type=Interval(),
    envvar=_env("HEALTH_INTERVAL"),
    help="Seconds between checks of the slot's health and of the publication (0: off).",
)
@log_format_option()
@option(
    "--sink",
    "sinks",
    multiple=True,
    default=("postgres",),
    show_default=True,
    envvar=_env("SINKS"),
    help="Where batches go, repeatable: postgres (the projections, always on: the checkpoint "
    "lives there) and nats://host:4222[,nats://…] (JetStream fan-out).",
)
@option(
    "--publish-only",
    is_flag=True,
    envvar=_env("PUBLISH_ONLY"),
    help="With --sink nats://…: publish the events to JetStream and keep only the checkpoint "
    "in PostgreSQL; `ledger-cdc fold --from nats://… --partition K/N` workers build the "
    "projections (the server decodes the WAL once, the folding scales with workers).",
)
@option(
    "--shard",
    type=click.IntRange(0),
    default=None,
    help="Stream shard K: slot <slot>_sK and publication <publication>_sK (init --shards).",
)
@option(
    "--vacuum-interval",
    default=2.0,
    show_default=True,
    type=Interval(),
    help="Seconds between VACUUMs of agent_sessions, which every batch rewrites, while batches "
    "are written (sooner after 200 rewritten rows; none while idle). 0: leave it to "
    "autovacuum, whose one-minute naptime lets a busy table grow several times its data.",
)
@option(
    "--standby-poll",
    default=0.5,
    show_default=True,
    type=Finite(0.1, 3600),
    help="Seconds between tries for a slot another consumer holds (hot standby); each try is a "
    "connection to the server.",
)
@option(
    "--sink-commit",
    type=click.Choice(["async", "sync"]),
    default="async",
    show_default=True,
    envvar=_env("SINK_COMMIT"),
    help="async: projection transactions commit without waiting for their WAL flush (visible "
    "sooner, no fsync per batch) and the slot is confirmed only past what the server has "
    "flushed; after a server crash the consumer re-applies what was lost. sync: each commit "
    "waits for its flush (and for synchronous standbys, if the server has them).",
)
@stop_timeout_option(
    "a database or NATS server that does not answer, a bootstrap still under way",
    "what it had not confirmed is read again at the next start (a bootstrap starts over)",
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
    failover: bool,
    batch_size: int,
    max_delay_ms: int,
    snapshot_every: int,
    heartbeat_interval: float,
    metrics_port: int | None,
    metrics_host: str,
    memory_limit_mb: int,
    spill_dir: str | None,
    on_slot_lost: str,
    health_interval: float,
    log_format: str,
    sinks: tuple[str, ...],
    publish_only: bool,
    shard: int | None,
    vacuum_interval: float,
    standby_poll: float,
    sink_commit: str,
    stop_timeout: float,
) -> None:
    """Stream the slot into per-session projections, exactly once, in commit order.

    With --create-slot and no slot yet, the slot is created with an exported snapshot and the
    ledger's existing rows are folded from that snapshot first (a bootstrap, with a progress
    bar), so nothing written before, during or after it is lost or applied twice. The same
    handoff rebuilds a slot the server invalidated (--on-slot-lost resync).

    Runs until SIGINT, SIGTERM or SIGHUP, then finishes the current batch, commits, confirms and
    exits 0 (or, past --stop-timeout with a server that does not answer, exits 4).
    Reconnects by itself when the connection drops or the server restarts.

    Run a second `consume` for the same slot as a hot standby: it waits while the slot is in
    use and takes over within about a second of the active one's death; a consumer that lost
    the slot is fenced (its checkpoint write is a compare-and-set) and cannot overwrite newer
    projections. --shard K streams shard K (agent_slot_sK / agent_pub_sK, see init --shards).
    --sink nats://… also publishes every event and projection change to JetStream;
    with --publish-only it publishes the events only, for `ledger-cdc fold` workers.
    """
    from ledger_cdc.names import shard_names
    from ledger_cdc.stream.transport import ReplicationStream

    if shard is not None:
        publication, slot = shard_names(shard, publication, slot)
    # Streaming begins now, before the rest of the consumer loads (a fifth of a second here),
    # so that the server decodes a backlog meanwhile; the consumer takes it over when it
    # starts, after its checks (whatever failed here, it then meets and reports itself).
    early = ReplicationStream(dsn, slot, publication)
    early.prefetch(memory_limit_mb * 1024 * 1024 // 10)
    try:
        from ledger_cdc.admin.schema import validate_publication_name, validate_slot_name
        from ledger_cdc.cli.runner import bootstrap_progress, run_consumer
        from ledger_cdc.consumer.loop import Consumer, ConsumerConfig
        from ledger_cdc.stopping import ignore_stop_signals

        validate_slot_name(slot)
        validate_publication_name(publication)
        extra = tuple(u for u in sinks if u != "postgres")
        for i, u in enumerate(extra):
            if not u.startswith(("nats://", "tls://")):
                raise click.BadParameter(
                    f"{u!r}: use postgres or nats://host:port", param_hint="--sink"
                )
            if u in extra[:i]:  # (a second publisher of every batch to the same stream)
                raise click.BadParameter(f"{u!r} given twice", param_hint="--sink")
        if publish_only and not extra:
            raise click.BadParameter(
                "--publish-only needs a --sink nats://host:port to publish to", param_hint="--sink"
            )
        config = ConsumerConfig(
            dsn=dsn,
            slot=slot,
            publication=publication,
            target_dsn=target_dsn,
            create_slot=create_slot,
            failover=failover,
            batch_size=batch_size,
            max_delay=max_delay_ms / 1000,
            snapshot_every=snapshot_every,
            heartbeat_interval=heartbeat_interval or None,
            memory_limit=memory_limit_mb * 1024 * 1024,
            spill_dir=spill_dir,
            on_slot_lost=on_slot_lost,
            health_interval=health_interval,
            progress=bootstrap_progress(state.console, log_format),
            sinks=extra,
            fold=not publish_only,
            standby_poll=standby_poll,
            vacuum_interval=vacuum_interval,
            sink_commit=sink_commit,
        )
        consumer = Consumer(config, prefetched=early)
        consumer.install_signal_handlers()
        try:
            run_consumer(
                consumer, state.console, log_format, metrics_port, metrics_host, stop_timeout
            )
        finally:
            ignore_stop_signals()  # done: a late signal must not turn its exit status into -15
    finally:
        early.close()  # (the consumer's own stream, if it took it over: closed already)


# -- fold --------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@option(
    "--from",
    "source",
    required=True,
    envvar=_env("FOLD_FROM"),
    help="The JetStream stream a `consume --publish-only --sink nats://…` fills: "
    "nats://host:4222[,nats://…][?stream=LEDGER&prefix=ledger].",
)
@option(
    "--partition",
    default="0/1",
    show_default=True,
    envvar=_env("PARTITION"),
    help="Fold partition K of N: the sessions whose id's last byte is K modulo N (as "
    "init --shards splits them). Run one worker per K, on any machines.",
)
@target_dsn_option
@option(
    "--fetch",
    default=2000,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Messages asked of the stream at a time (a batch folds at most this many).",
)
@snapshot_every_option
@option(
    "--memory-limit-mb",
    default=256,
    show_default=True,
    type=click.IntRange(1, 2**42),
    envvar=_env("MEMORY_LIMIT_MB"),
    help="Memory for the session cache and the batch in hand.",
)
@log_format_option()
@stop_timeout_option(
    "a database or NATS server that does not answer",
    "what it had not committed is folded again at the next start",
)
@click.pass_obj
@handles_errors
def fold(
    state: State,
    dsn: str,
    source: str,
    partition: str,
    target_dsn: str | None,
    fetch: int,
    snapshot_every: int,
    memory_limit_mb: int,
    log_format: str,
    stop_timeout: float,
) -> None:
    """Fold one partition of the JetStream event stream into the projections, exactly once.

    The scale-out path: one `consume --publish-only --sink nats://…` reads the slot (the server
    decodes the WAL once) and N `fold --partition K/N` workers build the projections, snapshots
    and memo rows a consumer builds, each for its share of the sessions. Each worker's
    checkpoint (the stream sequence it folded up to, `nats:<stream>:K/N` in
    ledger_checkpoints) commits with what it covers, so a worker killed at any point restarts
    where it was. Runs until SIGINT, SIGTERM or SIGHUP (then finishes its batch and exits 0;
    past --stop-timeout with a server that does not answer, exits 4).
    """
    from ledger_cdc.cli.runner import setup_logging, watch_stop
    from ledger_cdc.consumer.fold_nats import FoldConfig, FoldWorker, parse_partition
    from ledger_cdc.stopping import ignore_stop_signals, on_stop_signals

    k, n = parse_partition(partition)
    setup_logging(log_format)
    worker = FoldWorker(
        FoldConfig(
            url=source,
            dsn=dsn,
            partition=k,
            partitions=n,
            target_dsn=target_dsn,
            fetch=fetch,
            snapshot_every=snapshot_every,
            memory_limit=memory_limit_mb * 1024 * 1024,
        )
    )

    on_stop_signals(worker.stop)
    done = threading.Event()
    watch_stop(
        worker.wait_stop,
        done,
        stop_timeout,
        "a database or NATS server that does not answer",
        "the next start folds again from the stream",
    )
    try:
        worker.run()
    finally:
        done.set()
        ignore_stop_signals()  # done: a late signal must not turn its exit status into -15
    click.echo(
        f"fold {worker.name}: {worker.folded:,} events folded, stream sequence "
        f"{worker.position:,} committed",
        err=True,
    )


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
    import json as jsonlib

    import psycopg

    from ledger_cdc.admin.health import CRITICAL, Thresholds, check_slots, has_ledger
    from ledger_cdc.admin.schema import validate_slot_name
    from ledger_cdc.connect import connect
    from ledger_cdc.errors import DatabaseUnavailable, SchemaError, describe

    if slot is not None:
        validate_slot_name(slot)
    for name, warn, crit in (
        ("share", warn_share, crit_share),
        ("bytes", warn_bytes, crit_bytes),
        ("seconds", warn_seconds, crit_seconds),
    ):
        if warn > crit:
            raise click.BadParameter(
                f"--warn-{name} {warn} is above --crit-{name} {crit}: a warning comes first",
                param_hint=f"--warn-{name}",
            )
    th = Thresholds(warn_share, crit_share, warn_bytes, crit_bytes, warn_seconds, crit_seconds)
    # (lift: its session sits idle while it samples and between refreshes; a database's
    # idle_session_timeout would end it there)
    conn = connect(dsn, autocommit=True, lift=True)
    try:
        while True:
            try:
                if conn.closed:
                    conn = connect(dsn, autocommit=True, lift=True)
                if not has_ledger(conn):
                    # (another database's slots are not this one's health)
                    raise SchemaError(
                        f"database {conn.info.dbname!r} holds no ledger (no agent_events on "
                        "the search path): nothing to judge; give the ledger database's DSN"
                    )
                slots = check_slots(
                    conn, slot, thresholds=th, sample_seconds=sample_seconds, this_database=True
                )
            except (psycopg.OperationalError, DatabaseUnavailable) as e:
                if not watch:
                    raise
                # a server restarting, a connection dropped: said, and looked at again
                conn.close()
                state.console.print(f"[yellow]{safe(describe(e, dsn))}[/]: trying again")
                time.sleep(interval)
                continue
            if as_json:
                click.echo(jsonlib.dumps([h.as_json() for h in slots], indent=2))
            else:
                if watch:
                    state.console.clear()
                _print_lag(state.console, slots)
            # a lost slot (status 3) is critical; none at all too: no consumer streams the ledger
            code = min(CRITICAL, max((h.status for h in slots), default=CRITICAL))
            if not slots:
                state.err.print(
                    f"no logical replication slot in database {safe(conn.info.dbname)}: no "
                    "consumer streams this ledger (`ledger-cdc consume --create-slot` makes one)",
                    soft_wrap=True,
                )
            if not watch:
                sys.exit(code)
            time.sleep(interval)
    finally:
        conn.close()


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

    if not drop_slot(dsn, name, force=force):
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
