"""The consumer's counters and gauges (:class:`Metrics`), exposed through ``prometheus_client``.

:class:`Metrics` is a plain object the loop updates; a collector reads it at scrape time, so the
hot path never touches a Prometheus object, and ``prometheus_client`` is imported only when
metrics are rendered or served (not at every consumer's start-up). The outbox dispatcher's
:class:`DispatchMetrics` are exposed the same way. :func:`serve` starts the HTTP endpoint
(``/metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ledger_cdc.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from ledger_cdc.client.dispatch import DispatchMetrics

__all__ = ["DispatchCollector", "Metrics", "MetricsCollector", "MetricsServer", "registry", "serve"]


@dataclass
class Metrics:
    """Counters and gauges of one consumer."""

    transactions: int = 0
    events: int = 0
    batches: int = 0
    dead_letters: int = 0
    anomalies: int = 0
    skipped_transactions: int = 0
    reconnects: int = 0
    spills: int = 0
    session_rows: int = 0  # agent_sessions row versions written (each is a dead one to vacuum)
    confirmed_lsn: int = 0
    server_wal_end: int = 0
    last_commit_ts: float | None = None  # Unix seconds of the last applied transaction's commit
    last_applied_at: float | None = None
    heartbeat_lag: float | None = None
    started_at: float = field(default_factory=time.time)
    # named gauges (and counters, by a ``_total`` suffix) of the slot guard, the stream, …
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def lag_bytes(self) -> int:
        return max(0, self.server_wal_end - self.confirmed_lsn)

    @property
    def lag_seconds(self) -> float | None:
        if self.heartbeat_lag is not None:
            return self.heartbeat_lag
        if self.last_commit_ts is None or self.last_applied_at is None:
            return None
        return max(0.0, self.last_applied_at - self.last_commit_ts)

    def count(self, name: str, by: float = 1.0) -> None:
        """Add to the extra counter ``name`` (which ends in ``_total``)."""
        self.extra[name] = self.extra.get(name, 0.0) + by

    def prometheus(self, slot: str) -> str:
        """The Prometheus text exposition of these metrics, labelled with the slot."""
        from prometheus_client import generate_latest

        return generate_latest(registry(MetricsCollector(self, slot))).decode()


_COUNTERS = (
    ("transactions", "Transactions applied."),
    ("events", "Ledger events folded."),
    ("batches", "Sink transactions committed."),
    ("dead_letters", "Events sent to the dead-letter table."),
    ("anomalies", "UPDATE/DELETE/TRUNCATE seen on the ledger."),
    ("skipped_transactions", "Resent transactions skipped (at or below the checkpoint)."),
    ("reconnects", "Replication reconnects."),
    ("spills", "Streamed transaction buffers spilled to disk."),
)


class MetricsCollector:
    """Reads a :class:`Metrics` at each scrape (a ``prometheus_client`` collector)."""

    def __init__(self, metrics: Metrics, slot: str) -> None:
        self.metrics = metrics
        self.slot = slot

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, labels = self.metrics, [self.slot]

        def counter(name: str, help_: str, value: float) -> Metric:
            c = CounterMetricFamily(f"ledger_cdc_{name}", help_, labels=["slot"])
            c.add_metric(labels, value)
            return c

        def gauge(name: str, help_: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"ledger_cdc_{name}", help_, labels=["slot"])
            g.add_metric(labels, value)
            return g

        for name, help_ in _COUNTERS:
            yield counter(name, help_, getattr(m, name))
        yield gauge("confirmed_lsn", "Last LSN confirmed to the server.", m.confirmed_lsn)
        yield gauge("lag_bytes", "Server WAL end minus the confirmed LSN.", m.lag_bytes)
        lag = m.lag_seconds
        if lag is not None:
            yield gauge("lag_seconds", "Commit-to-projection lag (heartbeat when enabled).", lag)
        for key, value in sorted(m.extra.items()):
            help_ = key.replace("_", " ") + "."
            yield (counter if key.endswith("_total") else gauge)(key, help_, value)


class DispatchCollector:
    """Reads the outbox dispatcher's :class:`~ledger_cdc.client.dispatch.DispatchMetrics`."""

    def __init__(self, metrics: DispatchMetrics, worker: str) -> None:
        self.metrics = metrics
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        m = self.metrics
        for name, help_, value in (
            ("dispatched", "Outbox calls completed.", m.dispatched),
            ("failures", "Outbox calls that failed (retried later or parked).", m.failures),
            ("parked", "Outbox rows parked after their last attempt.", m.parked),
            ("polls", "Claims of due rows.", m.polls),
            (
                "lost_claims",
                "Outcomes not written: the claim had expired and been taken.",
                m.lost_claims,
            ),
        ):
            c = CounterMetricFamily(f"ledger_cdc_outbox_{name}", help_, labels=["worker"])
            c.add_metric([self.worker], value)
            yield c


def registry(*collectors: MetricsCollector | DispatchCollector) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) holding these collectors."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    return reg


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    port: int
    _server: object

    def stop(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve(reg: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``reg`` on ``host:port`` (port 0: any free port) in a daemon thread."""
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host, registry=reg)
    except (OSError, ValueError, UnicodeError) as e:  # a name that resolves to nothing, a port
        # in use or not ours to bind, a host no socket takes
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot serve metrics on {host!r} port {port}: {why}") from None
    return MetricsServer(int(server.server_address[1]), server)
