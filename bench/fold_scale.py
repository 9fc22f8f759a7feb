"""Scale beyond one slot: fold workers on the JetStream stream against row-filtered shards.

One backlog of single-event transactions, then, each alone on the machine:

- **relay**: ``consume --publish-only --sink nats://…`` reads ``agent_slot`` once and publishes
  every event (its walsender's CPU is what the server spends decoding the WAL once);
- **fold workers**: 1, 2 and 4 ``fold --from nats://… --partition K/N`` processes build the
  projections of the whole backlog from the stream, into a database of their own each time:
  folded events per second;
- **shards**: 4 ``consume --shard K`` processes on 4 row-filtered slots: folded events per
  second, and the CPU of their 4 walsenders (each decodes the whole WAL).

    sh scripts/dev.sh bench fold_scale [--events 30000] [--sessions 1000] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import consume, init_db, proc_cpu_seconds, timed_backlog, wait_until
from drain import NatsProcess

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.demo.embedded import EmbeddedPostgres


def main() -> None:
    ap = argparse.ArgumentParser(description="fold workers vs shards")
    ap.add_argument("--events", type=int, default=30_000)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg, NatsProcess() as url:
        dsn = pg.dsn()
        init_db(dsn, shards=4)  # agent_pub_s0..3 and their slots
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_slot(conn, "agent_slot")
            for name in ("fold1", "fold2", "fold4", "shards"):
                conn.execute(f"CREATE DATABASE {name}")
        for name in ("fold1", "fold2", "fold4", "shards"):
            init_db(pg.dsn(name))
        end = timed_backlog(pg, dsn, args.events, args.sessions)

        # the relay: one slot, decoded once, published
        log = tempfile.NamedTemporaryFile(prefix="ledger-cdc-relay-", delete=False)  # noqa: SIM115
        t0 = time.monotonic()
        relay = consume(dsn, ["--publish-only", "--sink", url, "--batch-size", "20000"], log)
        senders = [0.0]

        def relayed() -> bool:
            senders[0] = walsender_cpu(dsn, ["agent_slot"]) or senders[0]
            return confirmed(dsn, "agent_slot", end)

        wait_until(relayed, 1800, 0.05)
        t_relay = time.monotonic() - t0
        relay.terminate()
        relay.wait(60)
        print(
            f"  relay (consume --publish-only): {t_relay:.2f}s, "
            f"{args.events / t_relay:,.0f} events/s published; walsender CPU {senders[0]:.2f}s"
        )

        for n in (1, 2, 4):
            target = pg.dsn(f"fold{n}")
            t0 = time.monotonic()
            procs = [fold_process(dsn, target, url, f"{k}/{n}", log) for k in range(n)]
            wait_until(lambda t=target: folded(t) >= args.events, 1800, 0.05)
            t = time.monotonic() - t0
            cpu = sum(proc_cpu_seconds(p.pid) for p in procs)
            for p in procs:
                p.terminate()
                p.wait(60)
            print(
                f"  {n} fold worker{'s' if n > 1 else ' '}: {t:.2f}s, "
                f"{args.events / t:>7,.0f} events/s folded; their CPU {cpu:.2f}s"
            )

        target = pg.dsn("shards")
        t0 = time.monotonic()
        shards = [
            consume(dsn, ["--shard", str(k), "--target-dsn", target, "--batch-size", "20000"], log)
            for k in range(4)
        ]
        names = [f"agent_slot_s{k}" for k in range(4)]
        cpus = [0.0]

        def sharded() -> bool:
            cpus[0] = walsender_cpu(dsn, names) or cpus[0]
            return folded(target) >= args.events

        wait_until(sharded, 1800, 0.05)
        t = time.monotonic() - t0
        for p in shards:
            p.terminate()
            p.wait(60)
        print(
            f"  4 shards (consume --shard K): {t:.2f}s, {args.events / t:>7,.0f} events/s "
            f"folded; their 4 walsenders' CPU {cpus[0]:.2f}s "
            f"({cpus[0] / max(senders[0], 1e-6):.1f}× the relay's one)"
        )
        print(f"  (logs: {log.name})")


def fold_process(
    dsn: str, target: str, url: str, part: str, log: object
) -> subprocess.Popen[bytes]:
    # --fetch as the consumers' --batch-size below
    opts = ["--target-dsn", target, "--from", url, "--partition", part, "--fetch", "20000"]
    return consume(dsn, opts, log, command="fold")


def folded(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(sum(event_count), 0) FROM agent_sessions").fetchone()
    return int(row[0]) if row else 0


def confirmed(dsn: str, slot: str, end: str) -> bool:
    """Whether the slot has confirmed ``end``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (end, slot),
        ).fetchone()
    return bool(row and row[0])


def walsender_cpu(dsn: str, slots: list[str]) -> float:
    """CPU seconds of the walsenders now streaming these slots (0 when none is)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            r[0]
            for r in conn.execute(
                "SELECT active_pid FROM pg_replication_slots "
                "WHERE slot_name = ANY(%s) AND active_pid IS NOT NULL",
                (slots,),
            )
        ]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # ended meanwhile
            total += proc_cpu_seconds(pid)
    return total


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
