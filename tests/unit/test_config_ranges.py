"""The consumer's and the dispatcher's settings, given through the Python API, are checked
before anything starts: a value no wait or batch can take is a ConfigError naming it, not a
thread that dies later (a slot check or heartbeat stopped for good) or a wait that overflows."""

from __future__ import annotations

import math

import pytest

from ledger_cdc.client.dispatch import DispatchConfig, Dispatcher
from ledger_cdc.consumer import build_consumer
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.errors import ConfigError

DSN = "host=127.0.0.1 port=1 connect_timeout=1"  # never reached: refused before any connection


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("health_interval", 1e10),
        ("health_interval", 1e-320),  # not 0 (off): a slot check without pause
        ("vacuum_interval", 0.001),
        ("health_interval", math.nan),
        ("vacuum_interval", -1.0),
        ("standby_poll", 0.0),
        ("standby_poll", 0.001),  # a connection a millisecond against the server
        ("max_delay", math.inf),
        ("batch_size", 0),
        ("heartbeat_interval", 1e10),
        ("heartbeat_interval", math.nan),
        ("heartbeat_interval", 1e-9),
        ("sink_idle_timeout", "10"),
        ("partitions_ahead", 10_000),
    ],
)
def test_a_consumer_setting_out_of_range_is_refused_by_name(field: str, value: object) -> None:
    config = ConsumerConfig(dsn=DSN, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        build_consumer(config)


def test_the_default_consumer_settings_and_the_tests_own_pass() -> None:
    ConsumerConfig(dsn=DSN).check()
    ConsumerConfig(
        dsn=DSN,
        heartbeat_interval=0.2,
        health_interval=0,
        vacuum_interval=0,
        lease_watch_interval=0,
        max_delay=0.001,
        memory_limit=1000,
    ).check()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("poll_interval", 1e10),
        ("claim_seconds", math.nan),
        ("backoff_cap", math.inf),
        ("call_timeout", 0.0),
        ("concurrency", 0),
    ],
)
def test_a_dispatcher_setting_out_of_range_is_refused_by_name(field: str, value: object) -> None:
    config = DispatchConfig(dsn=DSN, targets={"x": lambda m: None}, **{field: value})  # type: ignore[arg-type, dict-item]
    with pytest.raises(ConfigError, match=field):
        Dispatcher(config)
    DispatchConfig(dsn=DSN, targets={}).check()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"reconnect_cap": 1e10}, "reconnect_cap"),
        ({"fetch": 0}, "fetch"),
        ({"memory_limit": math.nan}, "memory_limit"),
        ({"partition": 4, "partitions": 4}, "need 0 <= partition < partitions"),
        ({"partitions": 0}, "partitions"),
    ],
)
def test_a_fold_worker_setting_out_of_range_is_refused_by_name(
    changes: dict[str, object], says: str
) -> None:
    pytest.importorskip("nats")
    from ledger_cdc.consumer.fold_nats import FoldConfig, FoldWorker

    config = FoldConfig(url="nats://127.0.0.1:1", dsn=DSN, **changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=says):
        FoldWorker(config)
    FoldConfig(url="nats://127.0.0.1:1", dsn=DSN).check()
