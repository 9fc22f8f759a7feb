"""``consume``'s options, parsed as the command line parses them, make the consumer's
configuration: every option has its field, the units are converted, a shard names its slot and
publication, and a bad --sink is a usage error that names it."""

from __future__ import annotations

import dataclasses

import click
import pytest

from ledger_cdc.cli.run import ConsumeOptions, consume


def _options(*args: str) -> ConsumeOptions:
    ctx = consume.make_context("consume", ["--dsn", "dbname=ledger", *args])
    return ConsumeOptions(**ctx.params)


def test_every_option_of_consume_is_a_field() -> None:
    params = {p.name for p in consume.params}
    assert params == {f.name for f in dataclasses.fields(ConsumeOptions)}


def test_the_defaults_make_the_consumers_defaults_in_its_units() -> None:
    config = _options().sharded().config()
    assert (config.slot, config.publication) == ("agent_slot", "agent_pub")
    assert config.max_delay == 0.05 and config.memory_limit == 512 * 1024 * 1024
    assert config.heartbeat_interval is None  # 0: off
    assert config.sinks == () and config.fold and config.batch_size == 20000


def test_a_shard_publishing_to_nats_only() -> None:
    o = _options("--shard", "2", "--sink", "nats://127.0.0.1:4222", "--publish-only")
    config = o.sharded().config()
    assert (config.slot, config.publication) == ("agent_slot_s2", "agent_pub_s2")
    assert config.sinks == ("nats://127.0.0.1:4222",) and not config.fold


@pytest.mark.parametrize(
    ("sinks", "says"),
    [
        (["--sink", "kafka://h"], "use postgres or nats://host:port"),
        (["--sink", "nats://h:1", "--sink", "nats://h:1"], "given twice"),
        (["--publish-only"], "--publish-only needs a --sink nats://"),
    ],
)
def test_a_bad_sink_is_a_usage_error_naming_it(sinks: list[str], says: str) -> None:
    with pytest.raises(click.BadParameter, match=says) as e:
        _options(*sinks).config()
    assert e.value.param_hint == "--sink"
