"""Running a consumer for the command line: logging, the status line, the metrics and health
endpoint."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ledger_cdc.consumer.loop import Consumer, Metrics
from ledger_cdc.consumer.metrics import (
    HealthCheck,
    MetricsCollector,
    MetricsServer,
    registry,
    serve,
)
from ledger_cdc.errors import DatabaseUnavailable
from ledger_cdc.lsn import format_lsn

__all__ = ["run_consumer", "setup_logging", "status_text", "watch_stop"]

log = logging.getLogger(__name__)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
                **getattr(record, "fields", {}),
            }
        )


def setup_logging(log_format: str) -> logging.Logger:
    """Log ledger_cdc's records to stderr, as JSON lines with ``--log-format json``."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("ledger_cdc")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return root


def status_text(m: Metrics, rate_txn: float, rate_ev: float) -> str:
    lag_s = m.lag_seconds
    return (
        f"{rate_txn:,.0f} txn/s  {rate_ev:,.0f} events/s  lag {m.lag_bytes:,} B"
        f"{'' if lag_s is None else f' / {lag_s:.2f} s'}  confirmed {format_lsn(m.confirmed_lsn)}"
        f"  total {m.events:,} events  dead letters {m.dead_letters}  reconnects {m.reconnects}"
    )


def bootstrap_progress(console: Console, log_format: str) -> Callable[[int, int], None]:
    """A progress callback for the bootstrap fold: a rich bar on a terminal, log lines otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    interactive = log_format == "auto" and console.is_terminal
    state: dict[str, Any] = {}

    def report(done: int, total: int) -> None:
        if interactive:
            if "bar" not in state:
                bar = Progress(
                    "folding the ledger's history",
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeRemainingColumn(),
                    console=console,
                    transient=True,
                )
                bar.start()
                state["bar"], state["task"] = bar, bar.add_task("fold", total=total)
            state["bar"].update(state["task"], completed=done, total=max(total, done))
            if done >= total:
                state.pop("bar").stop()
        else:
            log.info("bootstrap: %d / %d events folded", done, total)

    return report


def watch_stop(
    wait_stop: Callable[[], object], done: threading.Event, timeout: float, why: str, again: str
) -> None:
    """A daemon thread that, once ``wait_stop()`` returns (a stop was asked for), ends the
    process with status 4 if ``done`` is not set ``timeout`` seconds later: a thread blocked
    inside libpq on a server that stopped answering cannot be interrupted, and would hold the
    stop for good. ``why``: what may hold it; ``again``: what becomes of the work in hand."""

    def watchdog() -> None:
        wait_stop()
        if done.wait(timeout):
            return
        log.error(
            "stopping: not done %.0fs after the stop (%s); exiting now with what it holds "
            "unconfirmed, which %s",
            timeout,
            why,
            again,
        )
        logging.shutdown()  # (flushes every handler)
        os._exit(DatabaseUnavailable.exit_code)

    threading.Thread(target=watchdog, name="ledger-cdc-stop-watchdog", daemon=True).start()


def loopback(host: str) -> bool:
    """Whether ``host`` (as --metrics-host gives it) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to


def run_consumer(
    consumer: Consumer,
    console: Console,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
    stop_timeout: float = 30.0,
) -> None:
    """Run ``consumer`` with its status line (and metrics endpoint); once a stop is asked for,
    the process exits with status 4 if the consumer is not done ``stop_timeout`` seconds later
    (a database that stopped answering mid-statement holds its thread for good: nothing it
    did not confirm is lost, the next start reads it again from the slot)."""
    setup_logging(log_format)
    server = None
    if metrics_port is not None:
        server = _serve_metrics(consumer, metrics_port, metrics_host)
    done = threading.Event()
    reporter = threading.Thread(
        target=_report_status,
        args=(consumer.metrics, console, log_format, done),
        name="ledger-cdc-status",
        daemon=True,
    )
    reporter.start()
    watch_stop(
        consumer.wait_stop,
        done,
        stop_timeout,
        "a database or NATS server that does not answer, or a bootstrap still under way",
        "the next start reads again from the slot",
    )
    try:
        consumer.run()
    finally:
        done.set()
        reporter.join(2)
        if server is not None:
            server.stop()
    # (not after an error: that is the one line it ends with)
    log.info(
        "stopped at %s after %d events",
        format_lsn(consumer.metrics.confirmed_lsn),
        consumer.metrics.events,
    )


def _serve_metrics(consumer: Consumer, port: int, host: str) -> MetricsServer:
    """The metrics and /healthz endpoint of ``consumer`` on ``host:port``, serving."""
    slot = consumer.config.slot
    collector = MetricsCollector(consumer.metrics, slot)
    check = HealthCheck(consumer.metrics, slot)
    server = serve(registry(collector), port, host, health=check)
    log.info("metrics on http://%s:%d/metrics, health on /healthz", host, server.port)
    if not loopback(host):
        log.warning(
            "metrics and /healthz listen on %s: reachable from other machines, without "
            "authentication (they say the slot's state, lag and counts, nothing of any "
            "payload); keep the port behind the network's controls, or bind 127.0.0.1",
            host,
        )
    return server


def _report_status(m: Metrics, console: Console, log_format: str, done: threading.Event) -> None:
    """The status until ``done``: a live line on a terminal (each second), else a log record
    each ten seconds (with its figures as fields, in JSON)."""
    interactive = log_format == "auto" and console.is_terminal
    last = (time.monotonic(), m.transactions, m.events)
    live = None
    if interactive:
        live = Live(Text(""), console=console, refresh_per_second=4, transient=True)
        live.start()
    try:
        while not done.wait(1.0 if interactive else 10.0):
            now = time.monotonic()
            dt = max(1e-6, now - last[0])
            rt, re = (m.transactions - last[1]) / dt, (m.events - last[2]) / dt
            last = (now, m.transactions, m.events)
            line = status_text(m, rt, re)
            if live is not None:
                live.update(Text(line))
            elif log_format == "json":
                fields = {
                    "txn_per_s": round(rt, 1),
                    "events_per_s": round(re, 1),
                    "lag_bytes": m.lag_bytes,
                    "lag_seconds": m.lag_seconds,
                    "confirmed_lsn": format_lsn(m.confirmed_lsn),
                    "events": m.events,
                }
                log.info("status", extra={"fields": fields})
            else:
                log.info(line)
    finally:
        if live is not None:
            live.stop()
