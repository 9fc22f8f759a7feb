"""The consumer's counters and gauges (:class:`Metrics`), exposed through ``prometheus_client``,
and its health (``/healthz``).

:class:`Metrics` is a plain object the loop updates; a collector reads it at scrape time, so the
hot path never touches a Prometheus object, and ``prometheus_client`` is imported only when
metrics are rendered or served (not at every consumer's start-up). The outbox dispatcher's
:class:`DispatchMetrics` are exposed the same way. :func:`serve` starts the HTTP endpoint:
``/metrics`` and, given a :class:`HealthCheck`, ``/healthz`` (:func:`health` says what it
answers; it reads the same :class:`Metrics`, and no database).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from ledger_cdc.errors import ConfigError
from ledger_cdc.lsn import format_lsn

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from ledger_cdc.client.dispatch import DispatchMetrics

__all__ = [
    "STREAM_STATES",
    "DispatchCollector",
    "HealthCheck",
    "Metrics",
    "MetricsCollector",
    "MetricsServer",
    "health",
    "registry",
    "serve",
]

STREAM_STATES = ("connecting", "streaming", "resyncing", "standby", "stopped")
"""What the consumer's stream is doing: connecting (or reconnecting), streaming the slot,
resyncing (a bootstrap from the ledger table: the slot created or re-created), standby
(another consumer holds the slot), stopped (the loop has ended)."""


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
    # one of STREAM_STATES, set by the loop at each change (set_state); None: never set, and
    # stream_state() infers what it can
    state: str | None = None
    state_since: float | None = None  # Unix seconds
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

    def set_state(self, state: str, now: float | None = None) -> None:
        """The stream entered ``state`` (one of :data:`STREAM_STATES`); the time is kept only
        when it changes, so ``state_since`` says how long it has lasted."""
        if state not in STREAM_STATES:
            raise ValueError(f"stream state {state!r} is not one of {', '.join(STREAM_STATES)}")
        if state != self.state:
            self.state, self.state_since = state, time.time() if now is None else now

    def stream_state(self) -> tuple[str, float, bool]:
        """(state, since when in Unix seconds, whether the loop said so). Without a state set by
        the loop, it is inferred: standby while the standby gauge says so, streaming once a
        position was confirmed (the loop sets one right after START_REPLICATION), else
        connecting, each since the start (a reconnect or a resync is not seen this way)."""
        if self.state is not None:
            return self.state, self.state_since or self.started_at, True
        if self.extra.get("standby") == 1.0:
            return "standby", self.started_at, False
        return ("streaming" if self.confirmed_lsn else "connecting"), self.started_at, False

    def prometheus(self, slot: str) -> str:
        """The Prometheus text exposition of these metrics, labelled with the slot."""
        from prometheus_client import generate_latest

        return generate_latest(registry(MetricsCollector(self, slot))).decode()


_COUNTERS = (
    (
        "transactions",
        "Ledger transactions whose projections were committed, each counted once.",
    ),
    ("events", "Ledger events folded into projections and committed."),
    ("batches", "Sink transactions committed (a batch of ledger transactions and its checkpoint)."),
    (
        "dead_letters",
        "Events quarantined in ledger_dead_letters because they could not be loaded or folded; "
        "the stream goes on, each one needs a look.",
    ),
    (
        "anomalies",
        "UPDATE, DELETE or TRUNCATE seen on the append-only ledger table; stays 0 unless the "
        "database's guard was bypassed.",
    ),
    (
        "skipped_transactions",
        "Transactions resent by the server at or below the stored checkpoint and skipped "
        "(normal after a restart); counted from the last connection.",
    ),
    ("reconnects", "Replication connections lost and tried again after a backoff."),
    (
        "spills",
        "Streamed in-progress transactions whose buffers went to disk past their memory "
        "share; counted from the last connection.",
    ),
)

# HELP of the named gauges and counters in Metrics.extra, by name. The counters are exported
# at 0 until first counted, so that rate() and increase() see their first increase.
_EXTRA_HELP = {
    "standby": "1 while this consumer stands by because another consumer holds the slot, else 0.",
    "publication_streams_ledger": (
        "1 while the publication streams the ledger table's INSERTs; 0 when it was changed so "
        "that it does not (nothing is folded until it is put right)."
    ),
    "slot_status": (
        "Slot health from the slot check: 0 healthy, 1 warning, 2 critical, 3 missing or lost "
        "(the consumer resyncs from the ledger table)."
    ),
    "slot_wal_status": (
        "The slot's wal_status: 0 reserved, 1 extended (past max_wal_size, within "
        "max_slot_wal_keep_size), 2 unreserved (invalidated at the next checkpoint), 3 lost."
    ),
    "slot_failover_ready": (
        "1 when the slot would survive a promotion of a standby (a failover slot, PostgreSQL "
        "17+, synchronised to a standby that is streaming), else 0."
    ),
    "slot_retained_bytes": "Bytes of WAL the slot holds on the server (from its restart_lsn).",
    "slot_safe_wal_size_bytes": (
        "Bytes of WAL that may still be written before the slot passes max_slot_wal_keep_size "
        "(pg_replication_slots.safe_wal_size); absent when the bound is unset."
    ),
    "slot_keep_size_share": (
        "Share of max_slot_wal_keep_size the slot retains, 0 to 1 (1: invalidated); absent "
        "when the bound is unset."
    ),
    "slot_lag_bytes": "Bytes of WAL between the server's WAL end and the slot's confirmed LSN.",
    "slot_lag_seconds": (
        "Age in seconds of the oldest ledger event the consumer has not committed, measured on "
        "the server by the slot check; 0 when caught up."
    ),
    "slot_unfolded_events": "Ledger events past the consumer's checkpoint (counted up to 10,000).",
    "slot_inactive_seconds": (
        "Seconds since any consumer streamed the slot; absent while one streams it."
    ),
    "slot_seconds_to_invalidation": (
        "Seconds until the slot passes max_slot_wal_keep_size at the current WAL rate; absent "
        "when the bound is unset or no WAL is written."
    ),
    "wal_rate_bytes_per_second": "Bytes of WAL the server wrote per second between slot checks.",
    "ledger_inserts_per_second": "Ledger rows inserted per second between slot checks.",
    "max_slot_wal_keep_size_bytes": (
        "The server's max_slot_wal_keep_size in bytes; absent when unbounded (-1), which lets "
        "a stalled slot fill the disk."
    ),
    "slot_resyncs_total": (
        "Times the slot was found lost and the projections resynchronised from the ledger table."
    ),
    "projections_rebuilt_total": "Projections found unusable and rebuilt from the ledger.",
    "stream_gap_rows_read_total": (
        "Ledger rows the stream did not carry, read from the table and folded in order."
    ),
    "rate_spikes_total": (
        "Times the ledger's insert rate or the WAL rate jumped far above its recent average."
    ),
    "unknown_messages_total": (
        "Stream messages of a kind this version does not know (a newer server), passed over."
    ),
    "foreign_heartbeats_total": (
        "Heartbeat messages without this consumer's nonce (another consumer's, or forged), ignored."
    ),
}
_EXTRA_DEFAULTS = {"standby": 0.0, **{k: 0.0 for k in _EXTRA_HELP if k.endswith("_total")}}


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
        yield gauge(
            "confirmed_lsn",
            "Last LSN confirmed to the server as flushed (the slot may free WAL before it), as "
            "a number.",
            m.confirmed_lsn,
        )
        yield gauge(
            "lag_bytes",
            "Bytes of WAL between the server's WAL end last seen and the confirmed LSN; 0 when "
            "caught up.",
            m.lag_bytes,
        )
        lag = m.lag_seconds
        if lag is not None:
            yield gauge(
                "lag_seconds",
                "Seconds from a commit to its projection: the last heartbeat's round trip with "
                "--heartbeat-interval, else the last applied transaction's; absent until known.",
                lag,
            )
        state = m.stream_state()[0]
        states = GaugeMetricFamily(
            "ledger_cdc_stream_state",
            "1 for the state the consumer's stream is in (connecting, streaming, resyncing, "
            "standby, stopped), 0 for the others.",
            labels=["slot", "state"],
        )
        for s in STREAM_STATES:
            states.add_metric([self.slot, s], float(s == state))
        yield states
        extra = {**_EXTRA_DEFAULTS, **m.extra}
        for key, value in sorted(extra.items()):
            help_ = _EXTRA_HELP.get(key, key.replace("_", " ") + ".")
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
            ("dispatched", "Outbox calls completed and marked done.", m.dispatched),
            ("failures", "Outbox calls that failed (retried later or parked).", m.failures),
            ("parked", "Outbox rows parked after their last attempt; each needs a look.", m.parked),
            (
                "polls",
                "Claims of due outbox rows made, one per poll, whether any were due.",
                m.polls,
            ),
            (
                "lost_claims",
                "Outcomes not written because the claim had expired and another worker took it.",
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


# -- /healthz ------------------------------------------------------------------------------------

MAX_LAG_SECONDS = 60.0  # /healthz's bound on the lag unless ?max_lag_seconds= says otherwise
MAX_DOWN_SECONDS = 30.0  # … and on a reconnect, unless ?max_down_seconds= says otherwise


@dataclass(frozen=True)
class HealthCheck:
    """What ``/healthz`` reads (a consumer's :class:`Metrics` and its slot) and its bounds when
    the query gives none."""

    metrics: Metrics
    slot: str
    max_lag_seconds: float = MAX_LAG_SECONDS
    max_down_seconds: float = MAX_DOWN_SECONDS

    def __call__(self, query: str = "", now: float | None = None) -> tuple[int, dict[str, Any]]:
        return health(self, query, now)


def _bound(params: dict[str, list[str]], name: str, default: float | None) -> float | None:
    values = params.get(name)
    if not values:
        return default
    try:
        value = float(values[-1])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={values[-1]!r}: give a number of 0 or more")
    return value


def _is_set(params: dict[str, list[str]], name: str) -> bool:
    values = params.get(name)
    return values is not None and values[-1].lower() not in ("0", "false", "no")


def health(
    check: HealthCheck, query: str = "", now: float | None = None
) -> tuple[int, dict[str, Any]]:
    """``/healthz``: (HTTP status, JSON body). ValueError for a query it cannot read.

    With ``live=1`` (liveness) it is 200 whenever the process answers. Otherwise (readiness:
    caught up) 200 unless one of these holds, each named in ``reasons`` (503):

    - the stream is stopped, or resyncing (the projections are being rebuilt from the table);
    - it is connecting and has never streamed, or has been reconnecting longer than
      ``max_down_seconds``;
    - the lag, the worse of the consumer's (``lag_seconds``) and the server's view from the
      slot check (``slot_lag_seconds``), is over ``max_lag_seconds``;
    - ``max_lag_bytes`` is given and ``lag_bytes`` is over it;
    - the slot check found the slot missing or lost, or the publication not streaming the
      ledger.

    A standby (another consumer holds the slot) is ready: it takes over when that one dies.
    """
    m = check.metrics
    now = time.time() if now is None else now
    params = parse_qs(query, keep_blank_values=True)
    max_lag = _bound(params, "max_lag_seconds", check.max_lag_seconds)
    max_down = _bound(params, "max_down_seconds", check.max_down_seconds)
    max_bytes = _bound(params, "max_lag_bytes", None)
    live = _is_set(params, "live")
    state, since, told = m.stream_state()
    in_state = max(0.0, now - since)
    lag, slot_lag = m.lag_seconds, m.extra.get("slot_lag_seconds")
    reasons: list[str] = []
    if state == "stopped":
        reasons.append("the consumer has stopped")
    elif state == "resyncing":
        reasons.append("resyncing: the projections are being rebuilt from the ledger table")
    elif state == "connecting":
        if not m.confirmed_lsn:
            reasons.append(f"not streaming yet (connecting for {in_state:.0f} s)")
        elif max_down is not None and in_state > max_down:
            reasons.append(f"not streaming for {in_state:.0f} s (reconnecting)")
    worst = max((x for x in (lag, slot_lag) if x is not None), default=None)
    if worst is not None and max_lag is not None and worst > max_lag:
        reasons.append(f"{worst:.1f} s behind (more than {max_lag:g} s)")
    if max_bytes is not None and m.lag_bytes > max_bytes:
        reasons.append(f"{m.lag_bytes:,} bytes behind (more than {max_bytes:,.0f})")
    if m.extra.get("slot_status", 0.0) >= 3:
        reasons.append(f"slot {check.slot} is missing or lost")
    if m.extra.get("publication_streams_ledger") == 0.0:
        reasons.append("the publication does not stream the ledger table's inserts")
    body: dict[str, Any] = {
        "status": "alive" if live else ("unhealthy" if reasons else "ok"),
        "slot": check.slot,
        "state": state,
        "state_seconds": round(in_state, 3),
        "state_inferred": not told,
        "lag_seconds": lag,
        "slot_lag_seconds": slot_lag,
        "lag_bytes": m.lag_bytes,
        "confirmed_lsn": format_lsn(m.confirmed_lsn),
        "events": m.events,
        "dead_letters": m.dead_letters,
        "uptime_seconds": round(max(0.0, now - m.started_at), 3),
        "reasons": reasons,
    }
    return (200 if live or not reasons else 503), body


def _app(metrics_app: WSGIApplication, check: HealthCheck | None) -> WSGIApplication:
    """``/healthz`` from ``check``; everything else from prometheus_client's app."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if check is None or environ.get("PATH_INFO") != "/healthz":
            return metrics_app(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        try:
            code, body = check(environ.get("QUERY_STRING", ""))
        except ValueError as e:
            code, body = 400, {"status": "bad request", "reasons": [str(e)]}
        status = {200: "200 OK", 400: "400 Bad Request", 503: "503 Service Unavailable"}[code]
        out = (json.dumps(body) + "\n").encode()
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(out))),
            ("Cache-Control", "no-store"),
        ]
        start_response(status, headers)
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else out]

    return app


@dataclass
class MetricsServer:
    """A running ``/metrics`` (and ``/healthz``) endpoint."""

    port: int
    _server: object

    def stop(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve(
    reg: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    *,
    health: HealthCheck | None = None,
) -> MetricsServer:
    """Serve ``reg`` on ``host:port`` (port 0: any free port) in a daemon thread: ``/metrics``
    (as prometheus_client serves it, on any path) and, given ``health``, ``/healthz``."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # (probes every few seconds)
            pass

    class Server(ThreadingWSGIServer):
        pass

    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        Server.address_family, address = info[0][0], str(info[0][4][0])
        server = make_server(address, port, _app(make_wsgi_app(reg), health), Server, Quiet)
    except (OSError, ValueError, UnicodeError) as e:  # a name that resolves to nothing, a port
        # in use or not ours to bind, a host no socket takes
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot serve metrics on {host!r} port {port}: {why}") from None
    thread = threading.Thread(target=server.serve_forever, name="ledger-cdc-metrics", daemon=True)
    thread.start()
    return MetricsServer(int(server.server_address[1]), server)
