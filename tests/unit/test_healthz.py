"""``/healthz``: what it decides from a consumer's :class:`Metrics` (the rules of
:func:`~ledger_cdc.consumer.metrics.health`, one by one), and how it answers over HTTP beside
``/metrics``; and every exported metric's HELP says what its values mean."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ledger_cdc.client.dispatch import DispatchMetrics
from ledger_cdc.consumer.metrics import (
    STREAM_STATES,
    DispatchCollector,
    HealthCheck,
    Metrics,
    MetricsCollector,
    registry,
    serve,
)

NOW = 1_000_000.0


def _streaming(**kw: Any) -> Metrics:
    m = Metrics(started_at=NOW - 100, confirmed_lsn=0x1000, server_wal_end=0x1000, **kw)
    m.set_state("streaming", now=NOW - 50)
    return m


def _check(m: Metrics, query: str = "") -> tuple[int, dict[str, Any]]:
    return HealthCheck(m, "agent_slot")(query, now=NOW)


def test_a_streaming_consumer_that_is_caught_up_is_healthy() -> None:
    m = _streaming(heartbeat_lag=0.2)
    m.extra.update(slot_lag_seconds=0.0, slot_status=0.0, publication_streams_ledger=1.0)
    code, body = _check(m)
    assert code == 200
    assert body["status"] == "ok" and body["reasons"] == []
    assert body["state"] == "streaming" and body["state_seconds"] == 50.0
    assert body["state_inferred"] is False
    assert body["lag_seconds"] == 0.2 and body["slot_lag_seconds"] == 0.0
    assert body["lag_bytes"] == 0 and body["confirmed_lsn"] == "0/1000"
    json.dumps(body)  # (all of it is JSON)


@pytest.mark.parametrize(
    ("query", "lag", "slot_lag", "code"),
    [
        ("", 59.0, None, 200),
        ("", 61.0, None, 503),  # the consumer's own lag
        ("", 0.1, 61.0, 503),  # the server's view, when the stream itself has gone quiet
        ("max_lag_seconds=120", 0.1, 100.0, 200),
        ("max_lag_seconds=5", 6.0, None, 503),
        ("max_lag_seconds=0", None, None, 200),  # no lag known yet: nothing to judge
    ],
)
def test_lag_beyond_the_bound_is_unhealthy(
    query: str, lag: float | None, slot_lag: float | None, code: int
) -> None:
    m = _streaming(heartbeat_lag=lag)
    if slot_lag is not None:
        m.extra["slot_lag_seconds"] = slot_lag
    got, body = _check(m, query)
    assert got == code, body
    assert (got == 503) == any("behind" in r for r in body["reasons"])


def test_lag_in_bytes_only_when_asked() -> None:
    m = _streaming()
    m.server_wal_end = m.confirmed_lsn + 5_000_000
    assert _check(m)[0] == 200
    assert _check(m, "max_lag_bytes=10000000")[0] == 200
    code, body = _check(m, "max_lag_bytes=1000000")
    assert code == 503 and body["reasons"] == ["5,000,000 bytes behind (more than 1,000,000)"]


@pytest.mark.parametrize(
    ("state", "since", "streamed", "query", "code"),
    [
        ("connecting", 5, False, "", 503),  # never streamed yet: not ready
        ("connecting", 5, True, "", 200),  # a reconnect, within max_down_seconds
        ("connecting", 31, True, "", 503),
        ("connecting", 31, True, "max_down_seconds=60", 200),
        ("resyncing", 1, True, "", 503),
        ("stopped", 1, True, "", 503),
        ("standby", 500, False, "", 200),  # a hot standby is healthy
    ],
)
def test_not_streaming(state: str, since: float, streamed: bool, query: str, code: int) -> None:
    m = Metrics(started_at=NOW - 1000, confirmed_lsn=0x1000 if streamed else 0)
    m.set_state(state, now=NOW - since)
    got, body = _check(m, query)
    assert got == code, body
    assert body["state"] == state and body["state_seconds"] == since


def test_the_state_is_kept_from_its_first_report() -> None:
    m = Metrics()
    m.set_state("connecting", now=10.0)
    m.set_state("connecting", now=20.0)
    assert m.stream_state() == ("connecting", 10.0, True)
    with pytest.raises(ValueError, match="not one of"):
        m.set_state("dancing")


def test_without_a_state_from_the_loop_it_is_inferred() -> None:
    m = Metrics(started_at=NOW - 10)
    assert m.stream_state() == ("connecting", NOW - 10, False)
    code, body = _check(m)
    assert code == 503 and body["state_inferred"] is True
    assert body["reasons"] == ["not streaming yet (connecting for 10 s)"]
    m.extra["standby"] = 1.0
    assert m.stream_state()[0] == "standby"
    assert _check(m)[0] == 200
    m.extra["standby"] = 0.0
    m.confirmed_lsn = 0x1000  # the loop confirms a position right after START_REPLICATION
    assert m.stream_state()[0] == "streaming"
    assert _check(m)[0] == 200


def test_a_lost_slot_or_an_unpublished_ledger_is_unhealthy() -> None:
    m = _streaming()
    m.extra["slot_status"] = 2.0  # critical: a warning for the alerts, not unready
    assert _check(m)[0] == 200
    m.extra["slot_status"] = 3.0
    m.extra["publication_streams_ledger"] = 0.0
    code, body = _check(m)
    assert code == 503
    assert body["reasons"] == [
        "slot agent_slot is missing or lost",
        "the publication does not stream the ledger table's inserts",
    ]


def test_liveness_is_the_process_answering() -> None:
    m = Metrics(started_at=NOW)
    m.set_state("stopped", now=NOW)
    for query in ("live=1", "live", "live=true&max_lag_seconds=0"):
        code, body = _check(m, query)
        assert (code, body["status"]) == (200, "alive"), query
        assert body["reasons"] == ["the consumer has stopped"]  # said, not judged
    assert _check(m, "live=0")[0] == 503


@pytest.mark.parametrize(
    "query",
    ["max_lag_seconds=abc", "max_lag_seconds=-1", "max_down_seconds=nan", "max_lag_bytes=inf"],
)
def test_a_bound_that_is_no_number_is_refused(query: str) -> None:
    with pytest.raises(ValueError, match="give a number of 0 or more"):
        _check(_streaming(), query)


def _get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_healthz_over_http_beside_metrics() -> None:
    m = _streaming(heartbeat_lag=0.5)
    m.events = 3
    server = serve(
        registry(MetricsCollector(m, "agent_slot")), 0, health=HealthCheck(m, "agent_slot")
    )
    base = f"http://127.0.0.1:{server.port}"
    try:
        code, headers, body = _get(f"{base}/healthz")
        assert code == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body)["events"] == 3
        code, _, body = _get(f"{base}/healthz?max_lag_seconds=0.1")
        assert code == 503
        assert json.loads(body)["reasons"] == ["0.5 s behind (more than 0.1 s)"]
        assert _get(f"{base}/healthz?live=1&max_lag_seconds=0.1")[0] == 200
        code, _, body = _get(f"{base}/healthz?max_lag_seconds=x")
        assert code == 400 and "max_lag_seconds='x'" in json.loads(body)["reasons"][0]
        code, _, body = _get(f"{base}/healthz", "HEAD")
        assert (code, body) == (200, b"")
        assert _get(f"{base}/healthz", "POST")[0] == 405
        code, _, body = _get(f"{base}/metrics")
        assert code == 200 and b"ledger_cdc_events_total" in body
    finally:
        server.stop()


def test_a_server_without_a_health_check_serves_metrics_only() -> None:
    server = serve(registry(DispatchCollector(DispatchMetrics(), "w1")), 0)
    try:
        code, _, body = _get(f"http://127.0.0.1:{server.port}/healthz")
        assert code == 200 and b"ledger_cdc_outbox_polls_total" in body  # (any path)
    finally:
        server.stop()


def test_every_metric_says_what_its_values_mean() -> None:
    m = _streaming(heartbeat_lag=0.1, last_commit_ts=1.0, last_applied_at=2.0)
    for key in (
        "standby",
        "publication_streams_ledger",
        "slot_status",
        "slot_retained_bytes",
        "slot_safe_wal_size_bytes",
        "slot_keep_size_share",
        "slot_lag_bytes",
        "slot_lag_seconds",
        "slot_unfolded_events",
        "slot_inactive_seconds",
        "slot_seconds_to_invalidation",
        "wal_rate_bytes_per_second",
        "ledger_inserts_per_second",
        "max_slot_wal_keep_size_bytes",
    ):
        m.extra[key] = 1.0
    text = m.prometheus("agent_slot")
    text += generate_latest(registry(DispatchCollector(DispatchMetrics(), "w"))).decode()
    families = list(text_string_to_metric_families(text))
    for fam in families:
        bare = fam.name.removeprefix("ledger_cdc_").replace("_", " ")
        assert fam.documentation.rstrip(".").lower() != bare, fam.name
        assert len(fam.documentation) > 30, (fam.name, fam.documentation)
    names = {s.name for fam in families for s in fam.samples}
    # the counters a resync, a rebuild or a gap adds are there from the start, at 0, so that
    # increase() sees their first step
    for counter in ("slot_resyncs_total", "projections_rebuilt_total", "rate_spikes_total"):
        assert f"ledger_cdc_{counter}" in names
    states = {
        s.labels["state"]: s.value
        for fam in families
        if fam.name == "ledger_cdc_stream_state"
        for s in fam.samples
    }
    assert states == {s: float(s == "streaming") for s in STREAM_STATES}
