"""The JetStream sink's URL: every option is checked where it is read, with a message that
names the option and what it must be (a bad value never reaches the server or a timer)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ledger_cdc.errors import ConfigError
from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings


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
        ("ack_timeout=nan", "ack_timeout='nan' is not seconds, from 0.1 to 3600"),
        ("ack_timeout=0", "from 0.1 to 3600"),
        ("ack_timeout=inf", "from 0.1 to 3600"),
        ("duplicate_window=-1", "duplicate_window='-1' is not seconds, from 0.1"),
        ("duplicate_window=0.05", "from 0.1 to a year"),  # the server's own lower bound
        ("stream=a.b", "stream='a.b' is not a stream name"),
        ("stream=", "is not a stream name"),
        ("stream=A B", "is not a stream name"),
        ("prefix=a.*", "prefix='a.*' is not a subject prefix"),
        ("prefix=a..b", "is not a subject prefix"),
        ("prefix=>", "is not a subject prefix"),
        ("batched=maybe", "batched='maybe' is not true or false"),
        ("colour=red", "unknown option 'colour'"),
        ("ack_timeout=1e-9", "from 0.1 to 3600"),
        ("duplicate_window=1e-300", "from 0.1 to a year"),
        ("duplicate_window=60&duplicate_window=5", "duplicate_window given twice"),
        ("stream=A%00B", "is not a stream name"),
        ("stream=LED%20GER", "stream='LED GER' is not a stream name"),
        ("stream=$SYS", "is not a stream name"),
        ("prefix=$JS.API", "is not a subject prefix"),
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


def test_a_sink_without_nats_py_installed_is_a_config_error_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "nats", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'ledger-cdc\[nats\]'"):
        JetStreamPublisher(JetStreamSettings.from_url("nats://127.0.0.1:4222"), "agent_slot")


def test_making_the_sink_leaves_importing_nats_py_to_the_thread_that_connects() -> None:
    # importing it takes a tenth of a second, which the consumer's start-up does not wait for:
    # the connecting thread imports it while the consumer's checks wait on the server
    code = (
        "import sys\n"
        "from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings\n"
        "p = JetStreamPublisher(JetStreamSettings.from_url('nats://127.0.0.1:4222'), 's')\n"
        "print('nats' in sys.modules)\n"
        "p.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False"]
