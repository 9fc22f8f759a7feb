"""Drain: a backlog of single-event transactions consumed to committed projections, against
pg_recvlogical draining the same backlog from a twin slot, in the same run.

Both slots are created before the backlog is written; each reader then drains alone (so they do
not compete for the two cores). ``ledger-cdc consume`` runs as its own process, timed from start
until every event is folded into a committed projection; its CPU seconds and peak RSS are read
from /proc. pg_recvlogical is timed from start until it reaches the WAL end (``--endpos``).

    sh scripts/dev.sh bench drain [--events 100000] [--sessions 1000] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import ROOT, proc_cpu_seconds, proc_peak_rss_mb, wait_until, write_backlog

from ledger_cdc.admin.schema import create_slot, init
from ledger_cdc.demo.embedded import EmbeddedPostgres


def main() -> None:
    ap = argparse.ArgumentParser(description="drain benchmark")
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=20000)
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg:
        dsn = pg.dsn()
        init(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_slot(conn, "agent_slot")
            create_slot(conn, "twin")
        t0 = time.monotonic()
        write_backlog(dsn, args.events, args.sessions)
        print(
            f"PostgreSQL {pg.major}: backlog of {args.events:,} single-event transactions over "
            f"{args.sessions:,} sessions written in {time.monotonic() - t0:.1f}s"
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            (end,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]

        t0 = time.monotonic()
        subprocess.run(
            [
                pg.bin("pg_recvlogical"),
                "-d",
                pg.url(),
                "--slot",
                "twin",
                "--start",
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=agent_pub",
                "-f",
                "/dev/null",
                "-E",
                end,
                "--no-loop",
            ],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        t_ref = time.monotonic() - t0
        r_ref = args.events / t_ref

        log = tempfile.NamedTemporaryFile(prefix="ledger-cdc-drain-", suffix=".log", delete=False)  # noqa: SIM115
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ledger_cdc.cli",
                "consume",
                "--dsn",
                dsn,
                "--log-format",
                "text",
                "--batch-size",
                str(args.batch_size),
                "--snapshot-every",
                "100",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
        t0 = time.monotonic()
        cpu = rss = 0.0
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                started: list[float] = []

                def done() -> bool:
                    nonlocal cpu, rss
                    cpu, rss = proc_cpu_seconds(proc.pid), proc_peak_rss_mb(proc.pid)
                    if not started and "streaming slot" in Path(log.name).read_text():
                        started.append(time.monotonic() - t0)
                    row = conn.execute(
                        "SELECT coalesce(sum(event_count), 0) FROM agent_sessions"
                    ).fetchone()
                    return row is not None and int(row[0]) >= args.events

                try:
                    wait_until(done, 600, 0.02)
                except TimeoutError:
                    print(Path(log.name).read_text()[-3000:])
                    raise
            t_ours = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(60)
        r_ours = args.events / t_ours
        t_start = started[0] if started else 0.0
        r_stream = args.events / max(1e-6, t_ours - t_start)
        print(
            f"  pg_recvlogical (reference, output discarded)  {r_ref:>9,.0f} txn/s  ({t_ref:.2f}s)"
        )
        print(
            f"  ledger-cdc consume → committed projections   {r_ours:>9,.0f} txn/s  ({t_ours:.2f}s)  "
            f"{r_ours / r_ref:.2f}× pg_recvlogical"
        )
        print(
            f"    of which start-up (imports, connections, START_REPLICATION) {t_start:.2f}s; "
            f"streaming alone {r_stream:,.0f} txn/s = {r_stream / r_ref:.2f}× pg_recvlogical"
        )
        print(
            f"  consumer CPU: {cpu / args.events * 1000:.3f} s per 1,000 events; peak RSS {rss:.0f} MB"
        )


if __name__ == "__main__":
    main()
