"""Wake-up latency of suspended runs: from a signal's commit to a scheduler seeing the run ready.

100 runs are suspended waiting for ``approve``; a real ``ledger-cdc consume`` process folds the
stream. One thread sends the signals one by one (``--gap`` apart); a scheduler iterating
``pending_runs`` (recheck 30 s, so only the consumer's notification can wake it in time) records
when each run shows up. Reference in the same run: a scheduler polling the projections every
second, the pattern this replaces. Target: p99 under 1 s.

    sh scripts/dev.sh bench wake [--runs 100] [--gap 0.05] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
import uuid

import psycopg
from common import ROOT, init_db, percentile, wait_until

from ledger_cdc.client.runs import lease, pending_runs, signal, submit
from ledger_cdc.demo.embedded import EmbeddedPostgres


def main() -> None:
    ap = argparse.ArgumentParser(description="wake-up latency benchmark")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.05)
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg:
        dsn = pg.dsn()
        init_db(dsn, slot="agent_slot")
        consumer = subprocess.Popen(
            [sys.executable, "-m", "ledger_cdc", "consume", "--dsn", dsn, "--log-format", "text"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        runs = [uuid.uuid4() for _ in range(args.runs)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            for sid in runs:
                submit(conn, sid)
                lease(conn, sid, "w").suspend("approval", ["approve"])

            def suspended() -> bool:
                row = conn.execute(
                    "SELECT count(*) FROM agent_sessions WHERE run_status = 'suspended'"
                ).fetchone()
                return row is not None and row[0] == args.runs

            wait_until(suspended, 120)
        sent: dict[uuid.UUID, float] = {}
        woke: dict[uuid.UUID, float] = {}
        polled: dict[uuid.UUID, float] = {}
        done = threading.Event()
        stop_at = [float("inf")]

        async def scheduler() -> None:
            async for r in pending_runs(dsn, recheck=30):
                woke.setdefault(r.session_id, time.monotonic())
                if len(woke) == args.runs:
                    return

        def poller() -> None:  # the reference: look at the projections once a second
            with psycopg.connect(dsn, autocommit=True) as c:
                while len(polled) < args.runs and not (
                    done.is_set() and time.monotonic() > stop_at[0]
                ):
                    for (sid,) in c.execute(
                        "SELECT session_id FROM agent_sessions WHERE run_status = 'pending'"
                    ):
                        polled.setdefault(sid, time.monotonic())
                    time.sleep(1.0)

        def signaller() -> None:
            time.sleep(0.5)
            with psycopg.connect(dsn, autocommit=True) as c:
                for sid in runs:
                    signal(c, sid, "approve")
                    sent[sid] = time.monotonic()  # committed: the autocommit INSERT returned
                    time.sleep(args.gap)

        threads = [threading.Thread(target=poller), threading.Thread(target=signaller)]
        for t in threads:
            t.start()
        asyncio.run(asyncio.wait_for(scheduler(), 120))
        stop_at[0] = time.monotonic() + 3
        done.set()
        for t in threads:
            t.join(30)
        consumer.terminate()
        consumer.wait(30)
    lat = [(woke[s] - sent[s]) * 1000 for s in runs]
    ref = [(polled[s] - sent[s]) * 1000 for s in runs if s in polled]
    print(
        f"PostgreSQL {pg.major}: {args.runs} suspended runs, one signal every {args.gap * 1000:.0f} ms"
    )
    print(
        f"signal → pending_runs (consumer NOTIFY): p50 {statistics.median(lat):7.1f} ms  "
        f"p99 {percentile(lat, 99):7.1f} ms  max {max(lat):7.1f} ms"
    )
    print(
        f"signal → 1 s polling scheduler (ref.):   p50 {statistics.median(ref):7.1f} ms  "
        f"p99 {percentile(ref, 99):7.1f} ms  ({len(ref)} seen)"
    )
    print(
        f"ratio p99: {percentile(ref, 99) / percentile(lat, 99):.0f}x faster; target p99 < 1 s: "
        f"{'met' if percentile(lat, 99) < 1000 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
