"""--memory-limit-mb bounds the consumer's memory, whatever the size of a transaction and however
many sessions it touches: peak RSS stays under its idle RSS + the limit + 32 MB.

A real ``ledger-cdc consume`` process folds one transaction of 200,000 events (in 20,000
sessions) with a 16 MB limit: the server streams it in chunks, the consumer spills it, reads it
back in parts sorted by session and writes it in chunks inside one sink transaction. Its peak
RSS is read from /proc (VmHWM). Measured once, on the newest server of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger_cdc.admin.schema import create_slot
from tests.support.cdc import (
    ConsumerProcess,
    assert_projections_equal_refold,
    wait_caught_up,
    wait_streaming,
)
from tests.support.harness import Database

pytestmark = [pytest.mark.server, pytest.mark.slow]

LIMIT_MB = 16
HEADROOM_MB = 32  # the documented constant (README: the consumer, memory)


def _rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


@pytest.mark.one_server  # measured once per run, on the newest PostgreSQL
def test_a_200k_event_transaction_stays_within_the_memory_limit(
    db: Database, tmp_path: Path
) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    log = tmp_path / "consume.log"
    with ConsumerProcess(db.dsn, "--memory-limit-mb", str(LIMIT_MB), log=log) as consumer:
        wait_streaming(db.dsn)
        assert consumer.proc is not None
        pid = consumer.proc.pid
        idle = _rss(pid, "VmRSS")
        with db.connect() as conn:
            conn.execute(
                """INSERT INTO agent_events (session_id, position, agent_id, event_type, payload)
                SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, p, 'a',
                       'tool.invoked', jsonb_build_object('call_id', 'c' || p, 'tool', 'search',
                       'arguments', jsonb_build_object('q', repeat('x', 150)))
                FROM generate_series(1, 10) p, generate_series(1, 20000) s ORDER BY p, s"""
            )
        wait_caught_up(db.dsn, timeout=240)
        peak = _rss(pid, "VmHWM")
        assert consumer.alive(), log.read_text()[-2000:]
    assert peak <= idle + LIMIT_MB + HEADROOM_MB, (idle, peak)
    assert_projections_equal_refold(db.dsn)
