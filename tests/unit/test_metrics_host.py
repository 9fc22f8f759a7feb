"""--metrics-host beyond loopback is said (the endpoint has no authentication)."""

from __future__ import annotations

import pytest

from ledger_cdc.cli.runner import loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "localhost"])
def test_loopback_hosts_are_quiet(host: str) -> None:
    assert loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "metrics.internal"])
def test_every_other_host_is_warned_of(host: str) -> None:
    assert not loopback(host)
