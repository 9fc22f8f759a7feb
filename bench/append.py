"""Cost of the hash chain and position trigger per append.

Runs on a throwaway cluster. Times the same single-row INSERT, one transaction each, into
``agent_events`` (position trigger + hash chain) and into a twin table with the same columns and
indexes but no trigger, then the full ``Ledger.append`` path. Prints µs per append and the ratio.

    sh scripts/dev.sh bench append [--n 5000] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import time
import uuid

import psycopg
from common import init_db

from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres

PLAIN = """
CREATE TABLE plain_events (LIKE agent_events INCLUDING DEFAULTS INCLUDING INDEXES);
ALTER TABLE plain_events ALTER COLUMN hash DROP NOT NULL;
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--fsync", action="store_true", help="run the cluster with fsync on")
    args = ap.parse_args()
    sessions = [uuid.uuid4() for _ in range(args.sessions)]
    payload = '{"call_id": "c1", "tool": "search", "arguments": {"q": "quarterly numbers"}}'
    with EmbeddedPostgres(major=args.pg_major, fsync=args.fsync) as pg:
        init_db(pg.dsn())
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(PLAIN)
            results = {}
            for table in ("plain_events", "agent_events"):
                pos = dict.fromkeys(sessions, 0)
                q = (
                    f"INSERT INTO {table} (session_id, position, agent_id, event_type, payload) "
                    "VALUES (%s, %s, 'a', 'tool.invoked', %s::jsonb)"
                )
                t0 = time.perf_counter()
                for i in range(args.n):
                    s = sessions[i % len(sessions)]
                    pos[s] += 1
                    conn.execute(q, (s, pos[s], payload))
                results[table] = (time.perf_counter() - t0) / args.n * 1e6
        with Ledger(pg.dsn()) as ledger:
            t0 = time.perf_counter()
            for i in range(args.n):
                ledger.append(
                    sessions[i % len(sessions)],
                    "a",
                    "tool.invoked",
                    {"call_id": f"c{i}", "tool": "search", "arguments": {"q": "x"}},
                )
            results["Ledger.append"] = (time.perf_counter() - t0) / args.n * 1e6
        base = results["plain_events"]
        print(
            f"PostgreSQL {pg.major}, {args.n} single-row transactions, "
            f"fsync={'on' if args.fsync else 'off'}"
        )
        for name, us in results.items():
            print(f"  {name:<16} {us:8.1f} µs/append   {us / base:5.2f}× plain INSERT")
        print(
            f"  hash chain + position trigger: +{results['agent_events'] - base:.1f} µs per append"
        )


if __name__ == "__main__":
    main()
