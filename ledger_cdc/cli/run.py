"""The commands that run a stage of the stream until stopped: ``consume`` (the slot into the
projections, or onto JetStream) and ``fold`` (a JetStream partition into the projections).
Their work is the library's (:mod:`ledger_cdc.consumer`): here are their options, parsed into
its configuration, and the process around it (:mod:`ledger_cdc.cli.runner`: logging, the
status line, the stop)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import click

from ledger_cdc.cli.base import (
    Finite,
    Interval,
    State,
    _env,
    cli,
    dsn_option,
    failover_option,
    handles_errors,
    log_format_option,
    option,
    options,
    snapshot_every_option,
    stop_timeout_option,
    target_dsn_option,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ledger_cdc.consumer import ConsumerConfig

__all__ = ["ConsumeOptions", "consume", "fold"]

# -- consume ---------------------------------------------------------------------------------------

# the slot it reads and the database it writes
_STREAM = (
    dsn_option,
    option(
        "--slot",
        default="agent_slot",
        show_default=True,
        envvar=_env("SLOT"),
        help="Logical replication slot (pgoutput) to stream.",
    ),
    option(
        "--publication",
        default="agent_pub",
        show_default=True,
        envvar=_env("PUBLICATION"),
        help="Publication of the ledger.",
    ),
    target_dsn_option,
    option(
        "--create-slot",
        is_flag=True,
        envvar=_env("CREATE_SLOT"),
        help="Create the slot if it does not exist.",
    ),
    failover_option,
)
# when a batch is flushed and a snapshot cut; the heartbeat
_BATCHES = (
    option(
        "--batch-size",
        default=20000,
        show_default=True,
        type=click.IntRange(1, 2**31),
        envvar=_env("BATCH_SIZE"),
        help="Flush after this many events.",
    ),
    option(
        "--max-delay-ms",
        default=50,
        show_default=True,
        type=click.IntRange(0, 3_600_000),
        envvar=_env("MAX_DELAY_MS"),
        help="Flush at the latest this long after a batch's first transaction (while catching "
        "up on a backlog, at least half a second: fewer, larger batches; not with a nats:// sink).",
    ),
    snapshot_every_option,
    option(
        "--heartbeat-interval",
        default=0.0,
        show_default=True,
        type=Interval(),
        envvar=_env("HEARTBEAT_INTERVAL"),
        help="Seconds between heartbeat messages (0: off); keeps an idle slot advancing "
        "and measures end-to-end lag.",
    ),
)
# what it shows (metrics, log), what it may use (memory, disk), what it does when the slot is lost
_OPERATION = (
    option(
        "--metrics-port",
        default=None,
        type=click.IntRange(0, 65535),
        envvar=_env("METRICS_PORT"),
        help="Serve Prometheus metrics on this port.",
    ),
    option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        envvar=_env("METRICS_HOST"),
        help="Address for --metrics-port.",
    ),
    option(
        "--memory-limit-mb",
        default=512,
        show_default=True,
        type=click.IntRange(1, 2**42),
        envvar=_env("MEMORY_LIMIT_MB"),
        help="Memory for what grows with the data (buffered transactions, spilled to disk past "
        "their share; the session cache; the batch in hand; a tenth read ahead at start-up): peak "
        "RSS stays under the idle size + this + 32 MB.",
    ),
    option(
        "--spill-dir",
        default=None,
        type=click.Path(path_type=str),
        envvar=_env("SPILL_DIR"),
        help="Directory for what passes --memory-limit-mb: transactions buffered to disk, a large "
        "transaction sorted by session (default: the system's temporary directory, TMPDIR). Give "
        "it room for the largest transaction; one that cannot take a file (full, missing, not "
        "writable) stops the consumer with exit 4 naming it.",
    ),
    option(
        "--on-slot-lost",
        type=click.Choice(["resync", "exit"]),
        default="resync",
        show_default=True,
        envvar=_env("ON_SLOT_LOST"),
        help="When the server invalidates the slot: rebuild it from the ledger table, or exit "
        "with code 3 so you are paged.",
    ),
    option(
        "--health-interval",
        default=10.0,
        show_default=True,
        type=Interval(),
        envvar=_env("HEALTH_INTERVAL"),
        help="Seconds between checks of the slot's health and of the publication (0: off).",
    ),
    log_format_option(),
)
# where batches go and how it runs beside other consumers; how long a stop may take
_DEPLOYMENT = (
    option(
        "--sink",
        "sinks",
        multiple=True,
        default=("postgres",),
        show_default=True,
        envvar=_env("SINKS"),
        help="Where batches go, repeatable: postgres (the projections, always on: the checkpoint "
        "lives there) and nats://host:4222[,nats://…] (JetStream fan-out).",
    ),
    option(
        "--publish-only",
        is_flag=True,
        envvar=_env("PUBLISH_ONLY"),
        help="With --sink nats://…: publish the events to JetStream and keep only the checkpoint "
        "in PostgreSQL; `ledger-cdc fold --from nats://… --partition K/N` workers build the "
        "projections (the server decodes the WAL once, the folding scales with workers).",
    ),
    option(
        "--shard",
        type=click.IntRange(0),
        default=None,
        help="Stream shard K: slot <slot>_sK and publication <publication>_sK (init --shards).",
    ),
    option(
        "--vacuum-interval",
        default=2.0,
        show_default=True,
        type=Interval(),
        help="Seconds between VACUUMs of agent_sessions, which every batch rewrites, while batches "
        "are written (sooner after 200 rewritten rows; none while idle). 0: leave it to "
        "autovacuum, whose one-minute naptime lets a busy table grow several times its data.",
    ),
    option(
        "--standby-poll",
        default=0.5,
        show_default=True,
        type=Finite(0.1, 3600),
        help="Seconds between tries for a slot another consumer holds (hot standby); each try is a "
        "connection to the server.",
    ),
    option(
        "--sink-commit",
        type=click.Choice(["async", "sync"]),
        default="async",
        show_default=True,
        envvar=_env("SINK_COMMIT"),
        help="async: projection transactions commit without waiting for their WAL flush (visible "
        "sooner, no fsync per batch) and the slot is confirmed only past what the server has "
        "flushed; after a server crash the consumer re-applies what was lost. sync: each commit "
        "waits for its flush (and for synchronous standbys, if the server has them).",
    ),
    stop_timeout_option(
        "a database or NATS server that does not answer, a bootstrap still under way",
        "what it had not confirmed is read again at the next start (a bootstrap starts over)",
    ),
)


@dataclass(frozen=True)
class ConsumeOptions:
    """``consume``'s options as given (units as the command line has them: ms, MB)."""

    dsn: str
    slot: str
    publication: str
    target_dsn: str | None
    create_slot: bool
    failover: bool
    batch_size: int
    max_delay_ms: int
    snapshot_every: int
    heartbeat_interval: float
    metrics_port: int | None
    metrics_host: str
    memory_limit_mb: int
    spill_dir: str | None
    on_slot_lost: str
    health_interval: float
    log_format: str
    sinks: tuple[str, ...]
    publish_only: bool
    shard: int | None
    vacuum_interval: float
    standby_poll: float
    sink_commit: str
    stop_timeout: float

    def sharded(self) -> ConsumeOptions:
        """With --shard K: shard K's slot and publication (``<slot>_sK``, ``<publication>_sK``)."""
        if self.shard is None:
            return self
        from ledger_cdc.names import shard_names

        publication, slot = shard_names(self.shard, self.publication, self.slot)
        return replace(self, publication=publication, slot=slot)

    def extra_sinks(self) -> tuple[str, ...]:
        """The sinks besides postgres (each a NATS URL, once); usage errors name --sink."""
        extra = tuple(u for u in self.sinks if u != "postgres")
        for i, u in enumerate(extra):
            if not u.startswith(("nats://", "tls://")):
                raise click.BadParameter(
                    f"{u!r}: use postgres or nats://host:port", param_hint="--sink"
                )
            if u in extra[:i]:  # (a second publisher of every batch to the same stream)
                raise click.BadParameter(f"{u!r} given twice", param_hint="--sink")
        if self.publish_only and not extra:
            raise click.BadParameter(
                "--publish-only needs a --sink nats://host:port to publish to", param_hint="--sink"
            )
        return extra

    def config(self, progress: Callable[[int, int], None] | None = None) -> ConsumerConfig:
        """The consumer's configuration, the names checked first (a bad one: exit 4)."""
        from ledger_cdc.admin.schema import validate_publication_name, validate_slot_name
        from ledger_cdc.consumer import ConsumerConfig

        validate_slot_name(self.slot)
        validate_publication_name(self.publication)
        extra = self.extra_sinks()
        return ConsumerConfig(
            dsn=self.dsn,
            slot=self.slot,
            publication=self.publication,
            target_dsn=self.target_dsn,
            create_slot=self.create_slot,
            failover=self.failover,
            batch_size=self.batch_size,
            max_delay=self.max_delay_ms / 1000,
            snapshot_every=self.snapshot_every,
            heartbeat_interval=self.heartbeat_interval or None,
            memory_limit=self.memory_limit_mb * 1024 * 1024,
            spill_dir=self.spill_dir,
            on_slot_lost=self.on_slot_lost,
            health_interval=self.health_interval,
            progress=progress,
            sinks=extra,
            fold=not self.publish_only,
            standby_poll=self.standby_poll,
            vacuum_interval=self.vacuum_interval,
            sink_commit=self.sink_commit,
        )


@cli.command()
@options(*_STREAM, *_BATCHES, *_OPERATION, *_DEPLOYMENT)
@click.pass_obj
@handles_errors
def consume(state: State, /, **given: Any) -> None:
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
    from ledger_cdc.stream.transport import ReplicationStream

    o = ConsumeOptions(**given).sharded()
    # Streaming begins now, before the rest of the consumer loads (psycopg among it, which the
    # stream's module must not import: tests/unit/test_connect.py), so that the server decodes
    # a backlog meanwhile; the consumer takes it over when it starts, after its checks
    # (whatever failed here, it then meets and reports itself).
    early = ReplicationStream(o.dsn, o.slot, o.publication)
    early.prefetch(o.memory_limit_mb * 1024 * 1024 // 10)
    try:
        from ledger_cdc.cli.runner import bootstrap_progress, run_consumer
        from ledger_cdc.consumer import build_consumer
        from ledger_cdc.stopping import ignore_stop_signals

        config = o.config(bootstrap_progress(state.console, o.log_format))
        consumer = build_consumer(config, prefetched=early)
        consumer.install_signal_handlers()
        try:
            run_consumer(
                consumer,
                state.console,
                o.log_format,
                o.metrics_port,
                o.metrics_host,
                o.stop_timeout,
            )
        finally:
            ignore_stop_signals()  # done: a late signal must not turn its exit status into -15
    finally:
        early.close()  # (the consumer's own stream, if it took it over: closed already)


# -- fold ------------------------------------------------------------------------------------------


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
