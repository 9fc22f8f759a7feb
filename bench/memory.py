"""Memory: the consumer's peak RSS against the size of one transaction, with --memory-limit-mb.

For each size, one transaction is written to a fresh ledger while ``ledger-cdc consume`` (its own
process) streams the slot; its idle RSS (after start-up) and its peak RSS (VmHWM) once every event
is in a committed projection are printed, with peak − idle beside the limit. Two shapes: many
small events over many sessions (ten per session, position-major as a bulk INSERT sends them),
with the time per event against the first size's (linear time: 1.0×), and one event carrying a
single large tool result, with peak − idle against its size: there idle is read once a small
event has been folded and committed, so that what the consumer sets up on its first batch
(connections, prepared statements, modules loaded on first use) is not counted as the payload's.

    sh scripts/dev.sh bench memory [--limit-mb 16] [--pg-major 18]
        [--sessions 1000,5000,20000] [--payload-mb 10,50]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psycopg
from common import consume, init_db, proc_peak_rss_mb, wait_until

from ledger_cdc.demo.embedded import EmbeddedPostgres

MANY = """
INSERT INTO agent_events (session_id, position, agent_id, event_type, payload)
SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, p, 'a', 'tool.invoked',
       jsonb_build_object('call_id', 'c' || p, 'tool', 'search',
                          'arguments', jsonb_build_object('q', repeat('x', 150)))
FROM generate_series(1, 10) p, generate_series(1, %(sessions)s) s ORDER BY p, s
"""
ONE = """
INSERT INTO agent_events (session_id, agent_id, event_type, payload)
VALUES (gen_random_uuid(), 'a', 'tool.observed',
        jsonb_build_object('call_id', 'c', 'result', repeat('x', %(bytes)s)))
"""


def _rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fold_all(conn: psycopg.Connection[object], slot: str, timeout: float) -> None:
    """Wait until the checkpoint covers the ledger's last row: one row read per look (a sum
    over the projections would scan what the consumer's open transaction writes)."""
    (last,) = conn.execute("SELECT max(seq) FROM agent_events").fetchone()  # type: ignore[misc]
    wait_until(
        lambda: (
            conn.execute(
                "SELECT folded_seq >= %s FROM ledger_checkpoints WHERE slot_name = %s",
                (last, slot),
            ).fetchone()
            == (True,)
        ),
        timeout,
    )


def run(
    pg: EmbeddedPostgres,
    limit: int,
    query: str,
    params: dict[str, int],
    events: int,
    warm: bool = False,
) -> tuple[str, float, float]:
    """(the line, seconds to fold, peak − idle MB); ``warm``: idle once one small event is
    folded."""
    dbname = f"m{time.monotonic_ns()}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {dbname}")
    dsn = pg.dsn(dbname)
    init_db(dsn, slot=f"s_{dbname}")
    with tempfile.TemporaryFile() as log:
        proc = consume(dsn, ["--slot", f"s_{dbname}", "--memory-limit-mb", str(limit)], log)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                wait_until(
                    lambda: (
                        conn.execute(
                            "SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                            (f"s_{dbname}",),
                        ).fetchone()
                        == (True,)
                    ),
                    60,
                )
                if warm:
                    conn.execute(ONE, {"bytes": 100})
                    _fold_all(conn, f"s_{dbname}", 60)
                    events += 1
                idle = _rss(proc.pid)
                started = time.monotonic()
                conn.execute(query, params)
                _fold_all(conn, f"s_{dbname}", 3600)
                took = time.monotonic() - started
                (folded,) = conn.execute(  # type: ignore[misc]
                    "SELECT coalesce(sum(event_count), 0) FROM agent_sessions"
                ).fetchone()
                if int(folded) < events:
                    raise SystemExit(f"{folded} of {events} events folded at the checkpoint")
            peak = proc_peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
    line = f"idle {idle:5.0f} MB  peak {peak:5.0f} MB  peak − idle {peak - idle:5.0f} MB  ({took:.1f} s)"
    return line, took, peak - idle


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description="memory benchmark")
    ap.add_argument("--limit-mb", type=int, default=16)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--sessions", type=_ints, default=[1_000, 5_000, 20_000])
    ap.add_argument("--payload-mb", type=_ints, default=[10, 50])
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major, max_slot_wal_keep_size="8GB") as pg:
        print(f"PostgreSQL {pg.major}, consume --memory-limit-mb {args.limit_mb}")
        first: float | None = None
        for sessions in args.sessions:
            events = sessions * 10
            line, took, _ = run(pg, args.limit_mb, MANY, {"sessions": sessions}, events)
            per = took / events
            first = first or per
            print(
                f"  one transaction of {events:>9,} events in {sessions:>7,} sessions  {line}"
                f"  {per * 1e6:6.1f} µs/event = {per / first:4.2f}× the first's"
            )
        for mb in args.payload_mb:
            line, _, over = run(pg, args.limit_mb, ONE, {"bytes": mb * 1024 * 1024}, 1, True)
            print(
                f"  one event with a {mb:>3} MB tool result                      {line}"
                f"  {over / mb:4.1f}× its size"
            )


if __name__ == "__main__":
    main()
