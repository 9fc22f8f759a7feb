"""Sustained load: commit→projection latency of the consumer, next to the two patterns it
replaces (a 1-second ``seq > last`` poller and a LISTEN/NOTIFY tail), on the same load.

Writers are pgbench clients inserting single-event transactions (each client its own sessions):
"full" is 8 clients as fast as the machine goes, "200/s" is rate-limited. For each load:

  phase 1: ledger-cdc (its own process) + the 1 s poller, concurrently
  phase 2: ledger-cdc + a LISTEN/NOTIFY tail (an AFTER INSERT trigger calling pg_notify)

Every latency counts from the same instant, the writer's commit timestamp (the server runs with
``track_commit_timestamp``): ledger-cdc's ends when the consumer saw the sink transaction
holding the event commit (the commit's answer back in its process); the poller's and NOTIFY's
when the row (or its notification) reached the reader (``pg_xact_commit_timestamp(xmin)`` of the
row). The poller's missed events are rows it never returned (their seq was below its cursor
when they committed). After the writers stop: the time for the consumer to drain to zero, and a
check that every projection holds all its session's events up to its last position (no loss,
order kept). At the limited rate, the part of ledger-cdc's latency that is PostgreSQL's own is
printed too: from the commit to the walsender's send of the transaction (the send time the
server stamps on each message; one clock, one machine), over the batches of one transaction.
Consumer CPU is what its process used from the writers' start until it drained (its start-up
is not spread over the events).

At the limited rate a third phase measures a floor: the least a Python reader does per
transaction, in its own process on a slot of its own (no ledger-cdc running): wake on the
replication socket, read the messages with the same driver, and at each Commit one one-row
UPDATE committed asynchronously, as the consumer's sink commits (prepared once, run by libpq's
own blocking call: no driver layer above it). Its p50 and its CPU per transaction (counted as
the consumer's is) are what this machine, this server and the language take before any of
ledger-cdc's own work (decode, fold, the projection's statement).

    sh scripts/dev.sh bench sustained [--seconds 10] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from common import (
    PGBENCH_SCRIPT,
    ROOT,
    init_db,
    percentile,
    pgbench_argv,
    proc_cpu_seconds,
    wait_until,
)

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.consumer import ConsumerConfig, build_consumer
from ledger_cdc.demo.embedded import EmbeddedPostgres

PG_EPOCH = 946684800.0
NOTIFY = """
CREATE OR REPLACE FUNCTION bench_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('ledger', NEW.seq::text); RETURN NEW; END $$;
CREATE TRIGGER bench_notify AFTER INSERT ON agent_events FOR EACH ROW EXECUTE FUNCTION bench_notify();
"""


def consumer_role(dsn: str, out: str) -> None:
    lat: list[float] = []
    sent: list[float] = []  # commit → the walsender's send, for batches of one transaction

    def on_batch(batch: object, m: object) -> None:
        done = batch.committed_at  # type: ignore[attr-defined]
        times = batch.commit_times  # type: ignore[attr-defined]
        lat.extend(done - (PG_EPOCH + ts / 1e6) for ts in times)
        if len(times) == 1:  # the send time of the last message read is this transaction's
            sent.append(c.flow.sent_at - (PG_EPOCH + times[0] / 1e6))

    c = build_consumer(ConsumerConfig(dsn=dsn), on_batch=on_batch)
    c.install_signal_handlers()
    c.run()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(
        json.dumps(
            {
                "latencies": lat,
                "sent": sent,
                "cpu": ru.ru_utime + ru.ru_stime,
                "maxrss_mb": ru.ru_maxrss / 1024,
                "events": c.metrics.events,
            }
        )
    )


FLOOR_SLOT = "bench_floor"


def floor_role(dsn: str, out: str) -> None:
    """The floor reader (see the module's doc): until SIGTERM, then its latencies to ``out``."""
    import psycopg2
    import psycopg2.extras

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lat: list[float] = []
    repl = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    cur = repl.cursor()
    cur.start_replication(
        slot_name=FLOOR_SLOT,
        decode=False,
        options={"proto_version": "1", "publication_names": "agent_pub"},
    )
    with psycopg.connect(dsn, autocommit=True) as w:
        w.execute("SET synchronous_commit = off")
        pgconn = w.pgconn  # libpq itself: a statement prepared once, run blocking
        pgconn.prepare(b"floor", b"UPDATE bench_floor SET lsn = $1 WHERE id = 1")
        while not stop.is_set():
            msg = cur.read_message()
            if msg is None:
                select.select([repl], [], [], 0.2)
                continue
            if msg.payload[:1] == b"C":  # Commit: flags, commit LSN, end LSN, commit time
                (ts,) = struct.unpack_from(">q", msg.payload, 18)
                res = pgconn.exec_prepared(b"floor", [str(msg.data_start).encode()])
                assert res.status == psycopg.pq.ExecStatus.COMMAND_OK, res.error_message
                lat.append(time.time() - (PG_EPOCH + ts / 1e6))
                cur.send_feedback(flush_lsn=msg.data_start)
    repl.close()
    Path(out).write_text(json.dumps({"latencies": lat}))


def start_role(role: str, dsn: str, tmp: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """This script as ``role`` in a process of its own, writing its results to a file in
    ``tmp``, and the pgbench script beside it: (the process, the results file, the script).
    Waits a second for it to start streaming."""
    script = Path(tmp) / "insert.sql"
    script.write_text(PGBENCH_SCRIPT)
    os.chmod(tmp, 0o755)
    os.chmod(script, 0o644)
    out = Path(tmp) / f"{role}.json"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--dsn", dsn, "--out", str(out)], cwd=ROOT
    )
    time.sleep(1.0)
    return proc, out, script


def floor_phase(
    pg: EmbeddedPostgres, dsn: str, clients: int, rate: int, seconds: int
) -> tuple[list[float], float]:
    """The floor reader's latencies and its CPU seconds per 1,000 transactions, counted as the
    consumer's are: from the writers' start until it has read them all."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_floor (id int PRIMARY KEY, lsn bigint)")
        conn.execute("INSERT INTO bench_floor VALUES (1, 0)")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (FLOOR_SLOT,))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            reader, out, script = start_role("floor", dsn, tmp)
            argv = pgbench_argv(pg, script, clients, seconds)
            argv[1:1] = ["-R", str(rate)]
            cpu_before = proc_cpu_seconds(reader.pid)
            subprocess.run(argv, capture_output=True, text=True, check=True)
            time.sleep(0.5)
            cpu = proc_cpu_seconds(reader.pid) - cpu_before
            reader.send_signal(signal.SIGTERM)
            reader.wait(60)
            lat: list[float] = json.loads(out.read_text())["latencies"]
            cpu = cpu / max(1, len(lat)) * 1000
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (FLOOR_SLOT,))
            conn.execute("DROP TABLE bench_floor")
    return lat, cpu


class Poller(threading.Thread):
    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.stop, self.lat, self.seen = dsn, threading.Event(), [], set()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            (last,) = conn.execute("SELECT coalesce(max(seq), 0) FROM agent_events").fetchone()  # type: ignore[misc]
            while not self.stop.wait(1.0):
                rows = conn.execute(
                    "SELECT seq, extract(epoch FROM pg_xact_commit_timestamp(xmin)) "
                    "FROM agent_events WHERE seq > %s ORDER BY seq",
                    (last,),
                ).fetchall()
                now = time.time()
                for seq, created in rows:
                    self.seen.add(seq)
                    self.lat.append(now - float(created))
                if rows:
                    last = rows[-1][0]


class Listener(threading.Thread):
    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.stop, self.lat = dsn, threading.Event(), []
        self.seqs: list[tuple[int, float]] = []

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("LISTEN ledger")
            while not self.stop.is_set():
                for n in conn.notifies(timeout=0.2):
                    self.seqs.append((int(n.payload), time.time()))


def one_phase(
    pg: EmbeddedPostgres, dsn: str, clients: int, rate: int | None, seconds: int, reader: str
) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        cons, out, script = start_role("consumer", dsn, tmp)
        side: Poller | Listener = Poller(dsn) if reader == "poller" else Listener(dsn)
        side.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            (before,) = conn.execute("SELECT coalesce(max(seq), 0) FROM agent_events").fetchone()  # type: ignore[misc]
        argv = pgbench_argv(pg, script, clients, seconds)
        if rate:
            argv[1:1] = ["-R", str(rate)]
        cpu_before = proc_cpu_seconds(cons.pid)
        res = subprocess.run(argv, capture_output=True, text=True, check=True)
        tps = next((line for line in res.stdout.splitlines() if line.startswith("tps")), "tps = ?")
        t_stop = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            (total,) = conn.execute("SELECT count(*) FROM agent_events").fetchone()  # type: ignore[misc]

            def drained() -> bool:
                row = conn.execute(
                    "SELECT coalesce(sum(event_count), 0) FROM agent_sessions"
                ).fetchone()
                return row is not None and int(row[0]) >= total

            wait_until(drained, 300, 0.01)
            drain = time.monotonic() - t_stop
            cpu = proc_cpu_seconds(cons.pid) - cpu_before
            (complete,) = conn.execute(
                "SELECT count(*) = 0 FROM agent_sessions s JOIN ("
                " SELECT session_id, count(*) n, max(position) p FROM agent_events"
                " GROUP BY session_id) e USING (session_id)"
                " WHERE s.event_count <> e.n OR s.last_position <> e.p"
                "    OR e.n <> e.p"  # positions 1..n: none missing, none twice
            ).fetchone()  # type: ignore[misc]
            time.sleep(1.5)
            side.stop.set()
            side.join(5)
            if isinstance(side, Listener):
                created = dict(
                    conn.execute(
                        "SELECT seq, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8 "
                        "FROM agent_events WHERE seq > %s",
                        (before,),
                    ).fetchall()
                )
                side_lat = [t - created[s] for s, t in side.seqs if s in created]
                missed = len(created) - len({s for s, _ in side.seqs})
            else:
                new = {
                    s
                    for (s,) in conn.execute(
                        "SELECT seq FROM agent_events WHERE seq > %s", (before,)
                    )
                }
                side_lat = side.lat
                missed = len(new - side.seen)
        cons.send_signal(signal.SIGTERM)
        cons.wait(60)
        c = json.loads(out.read_text())
    lat = c["latencies"]
    return {
        "tps": tps.split("(")[0].strip(),
        "events": c["events"],
        "p50": percentile(lat, 50) * 1000,
        "p99": percentile(lat, 99) * 1000,
        "sent_p50": percentile(c["sent"], 50) * 1000,
        "sent_n": len(c["sent"]),
        "drain": drain,
        "complete": complete,
        "cpu_per_1000": cpu / max(1, c["events"]) * 1000,
        "cpu_total_per_1000": c["cpu"] / max(1, c["events"]) * 1000,
        "rss": c["maxrss_mb"],
        "side_p50": percentile(side_lat, 50) * 1000,
        "side_p99": percentile(side_lat, 99) * 1000,
        "missed": missed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="sustained-load latency benchmark")
    ap.add_argument("--role", default="main")
    ap.add_argument("--dsn")
    ap.add_argument("--out")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument(
        "--loads",
        default="full,200",
        help="which loads to run, comma-separated: full (8 clients unpaced), 200 (200 txn/s)",
    )
    args = ap.parse_args()
    if args.role == "consumer":
        consumer_role(args.dsn, args.out)
        return
    if args.role == "floor":
        floor_role(args.dsn, args.out)
        return
    with EmbeddedPostgres(
        major=args.pg_major, fsync=True, settings={"track_commit_timestamp": "on"}
    ) as pg:
        dsn = pg.dsn()
        init_db(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_slot(conn, "agent_slot")
        print(f"PostgreSQL {pg.major}, fsync on, {args.seconds}s per phase")
        loads = {"full": ("full load, 8 clients", 8, None), "200": ("200 txn/s", 2, 200)}
        wanted = [w.strip() for w in args.loads.split(",") if w.strip()]
        if not wanted or any(w not in loads for w in wanted):
            ap.error(f"--loads takes a comma-separated list of {', '.join(loads)}")
        for label, clients, rate in (loads[w] for w in wanted):
            a = one_phase(pg, dsn, clients, rate, args.seconds, "poller")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(NOTIFY)
            b = one_phase(pg, dsn, clients, rate, args.seconds, "listen")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP TRIGGER bench_notify ON agent_events")
            print(f"{label}: writers {a['tps']} (with the NOTIFY trigger: {b['tps']})")
            print(
                f"  ledger-cdc       p50 {a['p50']:7.2f} ms  p99 {a['p99']:7.1f} ms  drain after stop "
                f"{a['drain']:.2f}s  CPU {a['cpu_per_1000']:.3f} s/1000 events "
                f"({a['cpu_total_per_1000']:.3f} with its start-up)  peak RSS {a['rss']:.0f} MB"
            )
            if rate:  # (under full load a batch holds many transactions)
                print(
                    f"    of which PostgreSQL's own: the walsender sent a transaction p50 "
                    f"{a['sent_p50']:.2f} ms after its commit ({a['sent_n']} batches of one "
                    f"transaction); the rest is the consumer's wake, read, fold and sink commit"
                )
            print(
                "  projections: "
                + (
                    "every event folded once, in position order"
                    if a["complete"] and b["complete"]
                    else "EVENTS MISSING OR OUT OF ORDER"
                )
            )
            print(
                f"  1 s poller       p50 {a['side_p50']:7.1f} ms  p99 {a['side_p99']:7.1f} ms  "
                f"missed {a['missed']} events for good"
            )
            print(
                f"  LISTEN/NOTIFY    p50 {b['side_p50']:7.1f} ms  p99 {b['side_p99']:7.1f} ms  "
                f"(ledger-cdc beside it: p50 {b['p50']:.1f} ms, p99 {b['p99']:.1f} ms)"
            )
            if rate:
                floor, floor_cpu = floor_phase(pg, dsn, clients, rate, args.seconds)
                print(
                    f"  floor reader     p50 {percentile(floor, 50) * 1000:7.2f} ms  p99 "
                    f"{percentile(floor, 99) * 1000:7.1f} ms  (wake, read, one one-row UPDATE "
                    f"per transaction, {len(floor)} of them: the least a Python reader takes)"
                )
                print(
                    f"                   CPU {floor_cpu:.3f} s/1000 transactions, counted as "
                    f"ledger-cdc's {a['cpu_per_1000']:.3f} is"
                )
                floor_p50 = percentile(floor, 50) * 1000
                print(
                    f"  ledger-cdc ÷ the floor reader: p50 {a['p50'] / floor_p50:.2f}× "
                    f"(target ≤ 1.3×), CPU per 1,000 {a['cpu_per_1000'] / floor_cpu:.2f}× "
                    f"(target ≤ 2.0×)"
                )
                print(
                    f"  p50 ÷ LISTEN/NOTIFY p50: ledger-cdc {a['p50'] / b['side_p50']:.2f}×, "
                    f"the floor reader {floor_p50 / b['side_p50']:.2f}×"
                )


if __name__ == "__main__":
    main()
