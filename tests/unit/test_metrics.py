"""Metrics through prometheus_client: the consumer's and the outbox dispatcher's, as text and
over HTTP (loopback, any free port)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ledger_cdc.client.dispatch import DispatchMetrics
from ledger_cdc.consumer.metrics import (
    DispatchCollector,
    Metrics,
    MetricsCollector,
    registry,
    serve,
)


def _samples(text: str) -> dict[str, tuple[str, float, dict[str, str]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = (fam.type, s.value, s.labels)
    return out


def test_consumer_metrics_are_typed_and_labelled_with_the_slot() -> None:
    m = Metrics(events=5, transactions=2, confirmed_lsn=0x16B3A40, server_wal_end=0x16B3A50)
    m.count("unknown_messages_total")
    m.count("unknown_messages_total")
    m.extra["slot_status"] = 1
    got = _samples(m.prometheus('agent"slot'))  # a hostile label value is escaped, not broken
    assert got["ledger_cdc_events_total"] == ("counter", 5.0, {"slot": 'agent"slot'})
    assert got["ledger_cdc_lag_bytes"] == ("gauge", 16.0, {"slot": 'agent"slot'})
    assert got["ledger_cdc_unknown_messages_total"][:2] == ("counter", 2.0)
    assert got["ledger_cdc_slot_status"][:2] == ("gauge", 1.0)
    assert "ledger_cdc_lag_seconds" not in got  # unknown until a commit or a heartbeat


def test_dispatcher_metrics_and_the_http_endpoint() -> None:
    dm = DispatchMetrics(dispatched=3, failures=1, parked=1)
    m = Metrics(events=7)
    server = serve(registry(DispatchCollector(dm, "w1"), MetricsCollector(m, "s")), 0)
    try:
        dm.dispatched += 1  # read at scrape time
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read()
    finally:
        server.stop()
    got = _samples(body.decode())
    assert got["ledger_cdc_outbox_dispatched_total"] == ("counter", 4.0, {"worker": "w1"})
    assert got["ledger_cdc_outbox_parked_total"][1] == 1.0
    assert got["ledger_cdc_events_total"][1] == 7.0
