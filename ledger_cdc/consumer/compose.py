"""The composition root: the real parts of a consumer, built from its config.

:func:`build_consumer` makes the projections' sink (:class:`~ledger_cdc.sink.postgres.PgSink`,
with a JetStream publisher per ``config.sinks`` URL), the slot's replication stream and the
ledger database's services, and hands them to :class:`~ledger_cdc.consumer.loop.Consumer`
complete. Tests hand the same constructor other parts (a
:class:`~ledger_cdc.sink.memory.MemorySink`, a stream of prepared bytes,
:class:`~ledger_cdc.consumer.server.NoLedgerServer`); the loop runs the same code either way.
"""

from __future__ import annotations

from collections.abc import Callable

from ledger_cdc.batching import Batch
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.loop import Consumer
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.server import PgLedgerServer
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.stream.transport import ReplicationStream

__all__ = ["build_consumer", "build_sink", "build_stream"]


def build_sink(config: ConsumerConfig) -> PgSink:
    """The projections of ``config.target_dsn`` (or of the ledger's database), with a
    JetStream publisher for each of ``config.sinks``."""
    sink = PgSink(
        config.target_dsn or config.dsn,
        config.slot,
        idle_timeout=config.sink_idle_timeout,
        publication=config.publication,
        # another database than the ledger's cannot read its events: copy them
        by_reference=not config.target_dsn,
        durable_commits=config.sink_commit == "sync",
        folds=config.fold,
    )
    if config.sinks:
        from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings

        for url in config.sinks:
            settings = JetStreamSettings.from_url(url)
            sink.publishers.append(JetStreamPublisher(settings, config.slot))
    return sink


def build_stream(
    config: ConsumerConfig, prefetched: ReplicationStream | None = None
) -> ReplicationStream:
    """The slot's replication stream; ``prefetched`` (begun by the caller:
    :meth:`ReplicationStream.prefetch`) is used if it streams what ``config`` says, closed if
    not."""
    stream = ReplicationStream(
        config.dsn,
        config.slot,
        config.publication,
        proto_version=config.proto_version,
        streaming=config.streaming,
        status_interval=config.status_interval,
    )
    if prefetched is not None:
        if prefetched.same_as(stream):
            stream = prefetched
        else:
            prefetched.close()
    stream.failover = config.failover
    return stream


def build_consumer(
    config: ConsumerConfig,
    *,
    on_batch: Callable[[Batch, Metrics], None] | None = None,
    prefetched: ReplicationStream | None = None,
) -> Consumer:
    """A consumer of ``config``'s slot into its projections (see the module)."""
    config.check()  # (before any part opens a thread or a socket)
    return Consumer(
        config,
        sink=build_sink(config),
        transport=build_stream(config, prefetched),
        server=PgLedgerServer(config),
        on_batch=on_batch,
    )
