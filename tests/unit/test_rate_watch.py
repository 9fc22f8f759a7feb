"""RateWatch's spike rule, on samples given to it (the server's side is
tests/integration/test_slot_health.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ledger_cdc.admin import health
from ledger_cdc.admin.health import RateWatch
from ledger_cdc.lsn import format_lsn


class _Samples:
    """What RateWatch reads from a connection: the WAL position and the ledger's sequence,
    one row per sample, a second apart (the module's clock is moved by the test)."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        self.rows = rows

    def execute(self, _query: str) -> _Samples:
        return self

    def fetchone(self) -> tuple[str, int]:
        lsn, seq = self.rows.pop(0)
        return format_lsn(lsn), seq


def _watch(monkeypatch: pytest.MonkeyPatch, steps: list[tuple[int, int]]) -> list[Any]:
    clock = iter(range(1000))
    monkeypatch.setattr(health.time, "monotonic", lambda: float(next(clock)))
    lsn, seq, rows = 1 << 24, 0, []
    for wal, inserts in [(0, 0), *steps]:
        lsn, seq = lsn + wal, seq + inserts
        rows.append((lsn, seq))
    conn: Any = _Samples(rows)
    watch = RateWatch()
    samples = [watch.sample(conn) for _ in range(len(rows))]
    return [r and r.spike for r in samples]


def test_a_quiet_servers_burst_of_wal_is_no_spike(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 kB/s, then 100 kB in a second (50× the average, a VACUUM): below 1 MB/s, no alarm."""
    spikes = _watch(monkeypatch, [(2000, 1)] * 5 + [(100_000, 1)])
    assert spikes == [None] * 7


def test_a_busy_burst_of_wal_and_a_storm_of_inserts_are_spikes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spikes = _watch(monkeypatch, [(2000, 1)] * 5 + [(20_000_000, 1), (2000, 1), (2000, 5000)])
    assert spikes[:6] == [None] * 6
    assert spikes[6] is not None and spikes[6].startswith("WAL generated at 20.0 MB/s")
    assert spikes[7] is None
    assert spikes[8] is not None and "retry storm" in spikes[8]
