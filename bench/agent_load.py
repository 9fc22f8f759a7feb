"""Agent-sized load: what the consumer costs when events are as big as agents write them.

A seeded profile of ``--sessions`` agents, ``--turns`` turns each: every turn a ``context.loaded``
holding the whole context window (20 kB at first, growing by the turn's messages up to 500 kB,
which the default 80 turns reach: the largest window written is printed),
then ``model.requested`` + ``model.responded`` (1-8 kB, sometimes with tool calls) in one
transaction, then for each tool call ``tool.invoked`` and, in its own transaction,
``tool.observed`` with a 1-50 kB result; now and then a handoff; a third of the agents idle
between turns. The same writes run three times, each in a database of its own on one server:

1. **alone** (no consumer): the WAL the ledger's own inserts write;
2. **live**: ``ledger-cdc consume`` streaming while the writers go at ``--rate`` turns/s in all
   (0: as fast as they can): commit → committed projection p50/p99 (from the consumer's own
   batches), the WAL written beyond phase 1 ÷ phase 1's, the projection and snapshot tables'
   size ÷ their size once rewritten (bloat), the consumer WAL by table (pg_walinspect, where
   the server has it), consumer CPU per MB of ledger WAL and per 1,000 events,
   peak RSS;
3. **backlog**: the writes first, then the drain, against ``pg_recvlogical`` on a twin slot:
   ledger WAL MB/s of each.

    sh scripts/dev.sh bench agent_load [--sessions 10] [--turns 80] [--rate 0] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from common import (
    ROOT,
    consume_until,
    init_db,
    percentile,
    proc_cpu_seconds,
    proc_peak_rss_mb,
    recvlogical,
    wait_until,
    words,
)

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.events import (
    ContextLoaded,
    HandoffEmitted,
    Message,
    ModelRequested,
    ModelResponded,
    ToolCall,
    ToolInvoked,
    ToolObserved,
    Usage,
)
from ledger_cdc.lsn import format_lsn, parse_lsn

PG_EPOCH = 946684800.0
WORDS = [
    "".join(random.Random(i).choice("etaoinshrdlucmfwyp") for _ in range(2 + i % 8))
    for i in range(4000)
]


def text(rng: random.Random, chars: int) -> str:
    return words(rng, chars, WORDS)


def agent(dsn: str, seed: int, turns: int, pace: float, counts: dict[str, int]) -> None:
    """One agent's session, written as an agent would (through the writer API)."""
    rng = random.Random(seed)
    sid = uuid.UUID(int=rng.getrandbits(128), version=4)
    idle = rng.random() < 1 / 3
    window: list[Message] = [Message("system", text(rng, 20_000))]
    with Ledger(dsn, pool_size=1) as ledger:
        for turn in range(turns):
            window.append(Message("user", text(rng, rng.randint(200, 2000))))
            while sum(len(m.content) for m in window) > 500_000:
                del window[1]
            calls = [
                ToolCall(
                    f"t{turn}-{k}", rng.choice(["search", "fetch", "sql"]), {"q": text(rng, 60)}
                )
                for k in range(rng.choice([0, 0, 1, 2]))
            ]
            with ledger.transaction() as tx:
                tx.append(sid, "agent", "context.loaded", ContextLoaded(list(window), task="bench"))
            with ledger.transaction() as tx:
                tx.append(sid, "agent", "model.requested", ModelRequested(f"r{turn}", "model-x"))
                content = text(rng, rng.randint(1000, 8000))
                tx.append(
                    sid,
                    "agent",
                    "model.responded",
                    ModelResponded(f"r{turn}", "model-x", content, Usage(1000, 200), calls),
                )
                for c in calls:
                    tx.append(
                        sid, "agent", "tool.invoked", ToolInvoked(c.call_id, c.tool, c.arguments)
                    )
            window.append(Message("assistant", content))
            for c in calls:
                result = text(rng, rng.randint(1000, 50_000))
                ledger.append(sid, "agent", "tool.observed", ToolObserved(c.call_id, result))
                window.append(Message("tool", result[:4000], tool_call_id=c.call_id))
            n = 3 + 2 * len(calls)
            if rng.random() < 0.1:
                ledger.append(
                    sid, "agent", "handoff.emitted", HandoffEmitted(f"h{turn}", "reviewer")
                )
                n += 1
            counts["events"] += n
            if pace:
                time.sleep(pace * (3 if idle else 1))


def write_all(dsn: str, args: argparse.Namespace) -> int:
    counts = {"events": 0}
    pace = args.sessions / args.rate if args.rate else 0.0
    threads = [
        threading.Thread(target=agent, args=(dsn, 1000 + s, args.turns, pace, counts))
        for s in range(args.sessions)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts["events"]


def lsn(conn: psycopg.Connection[Any]) -> int:
    (text_lsn,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
    return parse_lsn(text_lsn)


def folded(conn: psycopg.Connection[Any]) -> int:
    (n,) = conn.execute("SELECT coalesce(sum(event_count), 0) FROM agent_sessions").fetchone()  # type: ignore[misc]
    return int(n)


def consumer_role(dsn: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from ledger_cdc.consumer import ConsumerConfig, build_consumer

    lat: list[float] = []

    def on_batch(batch: Any, m: Any) -> None:
        lat.extend(batch.committed_at - (PG_EPOCH + ts / 1e6) for ts in batch.commit_times)

    c = build_consumer(ConsumerConfig(dsn=dsn, slot="live_slot"), on_batch=on_batch)
    signal.signal(signal.SIGTERM, lambda *_: c.stop())
    c.run()
    Path(out).write_text(json.dumps(lat))


PROJECTION_TABLES = ("agent_sessions", "agent_snapshots", "agent_memo")


def sizes(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(on disk after a plain VACUUM, on disk once rewritten by VACUUM FULL) of the consumer's
    tables, indexes and TOAST included: bloat is the first over the second (a table of ten rows
    takes its few fixed pages either way)."""
    total = "SELECT sum(pg_total_relation_size(t)) FROM unnest(%s::regclass[]) AS t"
    conn.execute(f"VACUUM {', '.join(PROJECTION_TABLES)}")
    (disk,) = conn.execute(total, (list(PROJECTION_TABLES),)).fetchone()  # type: ignore[misc]
    conn.execute(f"VACUUM FULL {', '.join(PROJECTION_TABLES)}")
    (compact,) = conn.execute(total, (list(PROJECTION_TABLES),)).fetchone()  # type: ignore[misc]
    return int(disk), int(compact)


# Each WAL record's bytes (its full-page images included) by the relation of its first block;
# records without a block (commits, running xacts, …) are "(no relation)".
_WAL_BY_RELATION = """
SELECT coalesce(c.relname, '(no relation)'), sum(w.record_length)
FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) w
LEFT JOIN pg_class c
  ON c.relfilenode = (regexp_match(w.block_ref, 'rel \\d+/\\d+/(\\d+)'))[1]::oid
GROUP BY 1
"""
_OWNER = """
SELECT c.relname, coalesce(o.relname, i.relname, c.relname)
FROM pg_class c
LEFT JOIN pg_class o ON o.reltoastrelid = c.oid
LEFT JOIN pg_index x ON x.indexrelid = c.oid
LEFT JOIN pg_class i ON i.oid = x.indrelid
"""


def wal_by_table(conn: psycopg.Connection[Any], start: int, end: int) -> dict[str, int] | None:
    """WAL bytes written between two LSNs, by table (its indexes and TOAST counted with it), read
    with pg_walinspect (None where the server lacks it)."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    except psycopg.Error:
        return None
    owner = dict(conn.execute(_OWNER).fetchall())
    # an index's TOAST-index chain ends at its table: resolve twice
    owner = {k: owner.get(v, v) for k, v in owner.items()}
    out: dict[str, int] = {}
    for rel, n in conn.execute(_WAL_BY_RELATION, (format_lsn(start), format_lsn(end))):
        name = owner.get(rel, rel)
        out[name] = out.get(name, 0) + int(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="agent-sized load benchmark")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--turns", type=int, default=80)
    ap.add_argument("--rate", type=float, default=0.0, help="turns per second in all (0: full)")
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "consumer":
        consumer_role(args.dsn, args.out)
        return
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            for name in ("alone", "live", "backlog"):
                conn.execute(f"CREATE DATABASE {name}")
        for name in ("alone", "live", "backlog"):
            init_db(pg.dsn(name))
        with psycopg.connect(pg.dsn("backlog"), autocommit=True) as conn:
            create_slot(conn, "backlog_slot")  # slot names are cluster-wide
            create_slot(conn, "twin")
        with psycopg.connect(pg.dsn("live"), autocommit=True) as conn:
            create_slot(conn, "live_slot")

        # 1. the ledger's own WAL
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            a0 = lsn(conn)
            t0 = time.monotonic()
            events = write_all(pg.dsn("alone"), args)
            t_alone = time.monotonic() - t0
            ledger_wal = lsn(conn) - a0
        with psycopg.connect(pg.dsn("alone"), autocommit=True) as conn:
            (widest,) = conn.execute(  # type: ignore[misc]
                "SELECT max(octet_length(payload::text)) FROM agent_events "
                "WHERE event_type = 'context.loaded'"
            ).fetchone()

        # 2. live
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "consumer", "--dsn", pg.dsn("live"), "--out", out],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        with psycopg.connect(pg.dsn("live"), autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = 'live_slot'"
                    ).fetchone()
                    == (True,)
                ),
                60,
            )
            l0 = lsn(conn)
            cpu0 = proc_cpu_seconds(proc.pid)
            t0 = time.monotonic()
            write_all(pg.dsn("live"), args)
            t_live = time.monotonic() - t0
            wait_until(lambda: folded(conn) >= events, 600)
            l1 = lsn(conn)
            live_wal = l1 - l0
            cpu = proc_cpu_seconds(proc.pid) - cpu0
            rss = proc_peak_rss_mb(proc.pid)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            lat = json.loads(Path(out).read_text())
            by_table = wal_by_table(conn, l0, l1)
            disk, compact = sizes(conn)

        # 3. backlog, then the drain, against pg_recvlogical on a twin slot
        with psycopg.connect(pg.dsn("backlog"), autocommit=True) as conn:
            b0 = lsn(conn)
            write_all(pg.dsn("backlog"), args)
            b1 = lsn(conn)
            end = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
        t_ref = recvlogical(pg, end, "backlog")
        t_drain, t_start, _, _ = consume_until(
            pg.dsn("backlog"), pg.dsn("backlog"), events, ["--slot", "backlog_slot"]
        )

    mb = ledger_wal / 1e6
    rate = f"{args.rate:g} turns/s" if args.rate else "full speed"
    print(
        f"PostgreSQL {pg.major}: {args.sessions} agents × {args.turns} turns = {events:,} events, "
        f"{mb:.1f} MB of ledger WAL (writes alone {t_alone:.1f}s); context windows "
        f"up to {int(widest or 0) / 1000:.0f} kB"
    )
    print(f"  live ({rate}, writes {t_live:.1f}s):")
    print(
        f"    commit → projection      p50 {percentile(lat, 0.5) * 1000:7.1f} ms   "
        f"p99 {percentile(lat, 0.99) * 1000:7.1f} ms"
    )
    print(
        f"    consumer WAL             {(live_wal - ledger_wal) / 1e6:7.1f} MB = "
        f"{(live_wal - ledger_wal) / ledger_wal:.2f}× the ledger's"
    )
    if by_table:
        ledger_own = sum(v for k, v in by_table.items() if k.startswith("agent_events"))
        shown = sorted(
            ((k, v) for k, v in by_table.items() if not k.startswith("agent_events")),
            key=lambda kv: -kv[1],
        )
        print(
            "      by table (pg_walinspect): "
            + ", ".join(f"{k} {v / ledger_own:.3f}×" for k, v in shown[:6])
        )
    print(
        f"    consumer tables          {disk / 1e6:7.2f} MB on disk, {compact / 1e6:.2f} MB once "
        f"rewritten = {disk / max(1, compact):.2f}× ({', '.join(PROJECTION_TABLES)})"
    )
    print(
        f"    consumer CPU             {cpu / mb:.3f} s per MB, {cpu / events * 1000:.2f} s per "
        f"1,000 events; peak RSS {rss:.0f} MB"
    )
    backlog = (b1 - b0) / 1e6
    streaming = max(1e-6, t_drain - t_start)
    print(
        f"  backlog drain: ledger-cdc {backlog / t_drain:6.1f} MB/s ({t_drain:.2f}s), "
        f"pg_recvlogical {backlog / t_ref:6.1f} MB/s ({t_ref:.2f}s) = "
        f"{t_ref / t_drain:.2f}× pg_recvlogical end to end"
    )
    print(
        f"    of which start-up (imports, checks, the early stream taken over) {t_start:.2f}s; "
        f"streaming alone {backlog / streaming:.1f} MB/s = {t_ref / streaming:.2f}× pg_recvlogical"
    )


if __name__ == "__main__":
    main()
