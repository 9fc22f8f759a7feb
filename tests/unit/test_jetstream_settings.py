"""The JetStream sink's URL: every option is checked where it is read, with a message that
names the option and what it must be (a bad value never reaches the server or a timer)."""

from __future__ import annotations

import pytest

from ledger_cdc.errors import ConfigError
from ledger_cdc.sink.jetstream import JetStreamSettings


def test_a_url_with_every_option_is_read() -> None:
    s = JetStreamSettings.from_url(
        "nats://a:4222,nats://b:4222?stream=AGENTS&prefix=org.ledger&replicas=3"
        "&duplicate_window=30&ack_timeout=2.5&batched=false"
    )
    assert s.servers == ["nats://a:4222", "nats://b:4222"]
    assert (s.stream, s.prefix, s.replicas) == ("AGENTS", "org.ledger", 3)
    assert (s.duplicate_window, s.ack_timeout, s.batched) == (30.0, 2.5, False)
    assert JetStreamSettings.from_url("nats://a:4222").batched is True


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("replicas=0", "replicas='0' is not a whole number from 1 to 5"),
        ("replicas=7", "from 1 to 5"),
        ("replicas=two", "from 1 to 5"),
        ("ack_timeout=nan", "ack_timeout='nan' is not a positive number of seconds"),
        ("ack_timeout=0", "positive number of seconds"),
        ("ack_timeout=inf", "positive number of seconds"),
        ("duplicate_window=-1", "duplicate_window='-1' is not a positive number"),
        ("stream=a.b", "stream='a.b' is not a stream name"),
        ("stream=", "is not a stream name"),
        ("stream=A B", "is not a stream name"),
        ("prefix=a.*", "prefix='a.*' is not a subject prefix"),
        ("prefix=a..b", "is not a subject prefix"),
        ("prefix=>", "is not a subject prefix"),
        ("batched=maybe", "batched='maybe' is not true or false"),
        ("colour=red", "unknown option 'colour'"),
    ],
)
def test_a_bad_option_is_refused_with_what_it_must_be(query: str, said: str) -> None:
    with pytest.raises(ConfigError, match="--sink") as e:
        JetStreamSettings.from_url(f"nats://a:4222?{query}")
    assert said in str(e.value)
    assert "\n" not in str(e.value)


def test_a_url_without_servers_is_refused() -> None:
    for url in ("", "?stream=X", "http://a:4222", "nats://a:4222,redis://b"):
        with pytest.raises(ConfigError, match="expected nats://host:port"):
            JetStreamSettings.from_url(url)
