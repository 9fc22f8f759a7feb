"""Resync at scale: a consumer whose slot was lost rebuilds its projections from the ledger
table, against PostgreSQL reading the same table with ``COPY … TO '/dev/null'``, in one run.

A consumer streams a fresh ledger until it holds a checkpoint (one event), then stops; its slot
is dropped (lost, as a failover to a server without it or an invalidation would lose it) and
``--events`` events of history are written in ``--sessions`` sessions. ``ledger-cdc consume`` is
started again: it finds the slot gone, makes it again and folds the table as of the slot's
snapshot. Timed from its start until every event is in a committed projection and the slot's
confirmed position has reached the checkpoint (folded and confirmed); then ``COPY agent_events
TO '/dev/null'`` (the server reading the whole table, no client) and the same COPY in the order
the bootstrap reads (session, position), each timed on the same server. Last, ``ledger-cdc
verify`` refolds a sample of the sessions (``--verify`` of them; 0: all) and compares them with
their projections and snapshots: the result must be what a normal fold gives.

    sh scripts/dev.sh bench resync [--events 1000000] [--sessions 10000] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import psycopg
from common import (
    ROOT,
    compiled,
    consume,
    init_db,
    proc_cpu_seconds,
    proc_peak_rss_mb,
    wait_until,
)

from ledger_cdc.demo.embedded import EmbeddedPostgres

HISTORY = """
INSERT INTO agent_events (session_id, position, agent_id, event_type, payload)
SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, p, 'agent',
       'tool.invoked',
       jsonb_build_object('call_id', 'c' || p, 'tool', 'search',
                          'arguments', jsonb_build_object('q', repeat('x', 100), 'k', p))
FROM generate_series(%(first)s::int, %(last)s::int) p, generate_series(1, %(sessions)s::int) s
"""
FIRST = """
INSERT INTO agent_events (session_id, position, agent_id, event_type, payload)
VALUES (gen_random_uuid(), 1, 'agent', 'message.user', '{"text": "hi"}')
"""
DONE = """
SELECT c.folded_seq >= %(last)s AND s.confirmed_flush_lsn >= c.lsn
FROM ledger_checkpoints c JOIN pg_replication_slots s USING (slot_name)
WHERE c.slot_name = %(slot)s
"""


def main() -> None:
    ap = argparse.ArgumentParser(description="resync benchmark")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--memory-limit-mb", type=int, default=512)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--verify", type=int, default=20, help="sessions verified after (0: all)")
    args = ap.parse_args()
    per = max(1, args.events // args.sessions)
    slot = "agent_slot"
    compiled()
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg:
        dsn = pg.dsn()
        init_db(dsn, slot=slot)
        extra = ["--slot", slot, "--memory-limit-mb", str(args.memory_limit_mb)]
        with tempfile.TemporaryFile() as log, psycopg.connect(dsn, autocommit=True) as conn:
            proc = consume(dsn, extra, log)  # a checkpoint, as a consumer that ran holds one
            try:
                conn.execute(FIRST)
                wait_until(lambda: conn.execute(DONE, {"last": 1, "slot": slot}).fetchone(), 120)
            finally:
                proc.terminate()
                proc.wait(60)
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))  # lost
            t0 = time.monotonic()
            for first in range(1, per + 1, 10):  # (ten positions of every session at a time)
                conn.execute(
                    HISTORY,
                    {"first": first, "last": min(per, first + 9), "sessions": args.sessions},
                )
            (last, events) = conn.execute(  # type: ignore[misc]
                "SELECT max(seq), count(*) FROM agent_events"
            ).fetchone()
            conn.execute("VACUUM ANALYZE agent_events")
            (mb,) = conn.execute(  # type: ignore[misc]
                "SELECT pg_table_size('agent_events') / 1048576.0"
            ).fetchone()
            print(
                f"PostgreSQL {pg.major}: {events:,} events in {args.sessions:,} sessions "
                f"({float(mb):.0f} MB table) written in {time.monotonic() - t0:.0f} s; slot dropped"
            )

            log.seek(0)
            log.truncate()
            t0 = time.monotonic()
            proc = consume(dsn, extra, log)
            try:
                wait_until(
                    lambda: conn.execute(DONE, {"last": last, "slot": slot}).fetchone() == (True,),
                    7200,
                    0.02,
                )
                t_resync = time.monotonic() - t0
                rss = proc_peak_rss_mb(proc.pid)
                cpu = proc_cpu_seconds(proc.pid)
            except TimeoutError:
                log.seek(0)
                print(log.read().decode()[-3000:])
                raise
            finally:
                proc.terminate()
                proc.wait(60)
            log.seek(0)
            if b"resynchronising from the ledger table" not in log.read():
                raise SystemExit("the consumer did not resynchronise from the table")
            (folded,) = conn.execute(  # type: ignore[misc]
                "SELECT sum(event_count) FROM agent_sessions"
            ).fetchone()
            assert int(folded) == events, (folded, events)
            (projected_mb, snapshots_mb) = conn.execute(  # type: ignore[misc]
                "SELECT pg_total_relation_size('agent_sessions') / 1048576.0, "
                "pg_total_relation_size('agent_snapshots') / 1048576.0"
            ).fetchone()

            t0 = time.monotonic()
            conn.execute("COPY agent_events TO '/dev/null'")
            t_copy = time.monotonic() - t0
            t0 = time.monotonic()
            conn.execute(
                "COPY (SELECT * FROM agent_events ORDER BY session_id, position) TO '/dev/null'"
            )
            t_sorted = time.monotonic() - t0
            verified = verify(dsn, conn, args.verify)
    print(
        f"  resync (slot lost → projections folded and the slot confirmed) {t_resync:7.1f} s  "
        f"{events / t_resync:,.0f} events/s  CPU {cpu:.1f} s  peak RSS {rss:.0f} MB"
    )
    print(
        f"  COPY agent_events TO '/dev/null'                                {t_copy:7.1f} s  "
        f"resync = {t_resync / t_copy:.1f}×"
    )
    print(
        f"  the same COPY by (session, position)                            {t_sorted:7.1f} s  "
        f"resync = {t_resync / t_sorted:.1f}×"
    )
    print(
        f"  written: projections {float(projected_mb):.0f} MB, snapshots "
        f"{float(snapshots_mb):.0f} MB (the table: {float(mb):.0f} MB)"
    )
    print(f"  verify: {verified}")


def verify(dsn: str, conn: psycopg.Connection[tuple[object, ...]], sample: int) -> str:
    """``ledger-cdc verify`` of ``sample`` sessions spread over the id range (0: all of them);
    raises if anything differs."""
    if sample:
        ids = [
            sid
            for (sid,) in conn.execute(
                "SELECT min(session_id::text) FROM (SELECT session_id, ntile(%s) OVER "
                "(ORDER BY session_id) AS part FROM agent_sessions) s GROUP BY part",
                (sample,),
            )
        ]
    else:
        ids = ["--all"]
    argv = [sys.executable, "-m", "ledger_cdc.cli", "verify", "--dsn", dsn, *ids]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"verify failed after the resync:\n{done.stdout}{done.stderr}")
    return " ".join(done.stdout.split())


if __name__ == "__main__":
    main()
