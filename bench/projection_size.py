"""Projection size against the ledger's, on a soak-like workload: many short agent sessions of
0.5-5 kB events, most tools answering with a JSON object.

Each of ``--sessions`` sessions is one or two turns: ``model.requested`` + ``model.responded``
(0.5-5 kB of text, one tool call) in one transaction, then ``tool.invoked`` and, in its own,
``tool.observed`` whose result is a JSON object of 0.5-5 kB (``--string-share`` of them a plain
string instead). ``ledger-cdc consume`` folds it all; then the size of ``agent_sessions`` (the
projections, with their TOAST and indexes) is printed against ``agent_events``'s, as the tables
stand and once both are rewritten (VACUUM FULL: the live data alone), with ``agent_memo`` and
``agent_snapshots`` beside them.

    sh scripts/dev.sh bench projection_size [--sessions 5000] [--string-share 0.2] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
import time
import uuid

import psycopg
from common import consume, init_db, wait_until, words

from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.events import ModelRequested, ModelResponded, ToolCall, ToolInvoked, ToolObserved

# words of random letters, drawn uniformly: text that compresses about as an agent's does (the
# ledger's payloads are TOASTed and compressed past 2 kB; a dozen words over again would not be)
_VOCABULARY = random.Random(1)
WORDS = [
    "".join(_VOCABULARY.choices(string.ascii_lowercase, k=_VOCABULARY.randint(2, 10)))
    for _ in range(5000)
]
TABLES = ("agent_events", "agent_sessions", "agent_memo", "agent_snapshots")


def text(rng: random.Random, chars: int) -> str:
    return words(rng, chars, WORDS)


def tool_result(rng: random.Random, chars: int) -> dict[str, object]:
    """A JSON object of about ``chars`` characters, as a search or SQL tool returns."""
    rows: list[dict[str, object]] = []
    size = 0
    while size < chars:
        row = {
            "id": rng.randint(1, 10**6),
            "title": text(rng, rng.randint(20, 120)),
            "rank": len(rows),
        }
        rows.append(row)
        size += len(str(row))
    return {"rows": rows, "total": len(rows), "truncated": False}


def write(dsn: str, sessions: int, string_share: float, seed: int = 7) -> int:
    rng = random.Random(seed)
    events = 0
    with Ledger(dsn) as ledger:
        for _ in range(sessions):
            sid = uuid.UUID(int=rng.getrandbits(128))
            for turn in range(rng.choice([1, 1, 2])):
                call = ToolCall(f"t{turn}", "search", {"q": text(rng, 40)})
                with ledger.transaction() as tx:
                    tx.append(sid, "agent", "model.requested", ModelRequested(f"r{turn}", "m"))
                    reply = text(rng, rng.randint(500, 5000))
                    tx.append(
                        sid,
                        "agent",
                        "model.responded",
                        ModelResponded(f"r{turn}", "m", reply, tool_calls=[call]),
                    )
                    tx.append(
                        sid,
                        "agent",
                        "tool.invoked",
                        ToolInvoked(call.call_id, call.tool, call.arguments),
                    )
                chars = rng.randint(500, 5000)
                result: object = (
                    text(rng, chars) if rng.random() < string_share else tool_result(rng, chars)
                )
                ledger.append(sid, "agent", "tool.observed", ToolObserved(call.call_id, result))
                events += 4
    return events


def sizes(conn: psycopg.Connection[object]) -> dict[str, int]:
    return {
        t: int(conn.execute("SELECT pg_total_relation_size(%s::regclass)", (t,)).fetchone()[0])  # type: ignore[index]
        for t in TABLES
    }


def line(label: str, s: dict[str, int]) -> str:
    ledger = s["agent_events"]
    parts = "  ".join(f"{t} {s[t] / 2**20:6.1f} MB ({s[t] / ledger:4.2f}×)" for t in TABLES[1:])
    return f"  {label:<10} agent_events {ledger / 2**20:6.1f} MB   {parts}"


def main() -> None:
    ap = argparse.ArgumentParser(description="projection size against the ledger's")
    ap.add_argument("--sessions", type=int, default=5000)
    ap.add_argument("--string-share", type=float, default=0.2)
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major) as pg:
        dsn = pg.dsn()
        init_db(dsn, slot="bench")  # (the slot first: the writes go through the stream)
        t0 = time.monotonic()
        events = write(dsn, args.sessions, args.string_share)
        print(
            f"PostgreSQL {pg.major}: {events:,} events in {args.sessions:,} sessions written in "
            f"{time.monotonic() - t0:.1f} s ({args.string_share:.0%} of tool results strings)"
        )
        with tempfile.TemporaryFile() as log, psycopg.connect(dsn, autocommit=True) as conn:
            (last,) = conn.execute("SELECT max(seq) FROM agent_events").fetchone()  # type: ignore[misc]
            proc = consume(dsn, ["--slot", "bench"], log)
            try:
                wait_until(
                    lambda: (
                        conn.execute(
                            "SELECT coalesce(max(folded_seq), 0) >= %s FROM ledger_checkpoints",
                            (last,),
                        ).fetchone()
                        == (True,)
                    ),
                    1800,
                )
            except TimeoutError:
                log.seek(0)
                print(log.read().decode()[-3000:])
                raise
            finally:
                proc.terminate()
                proc.wait(60)
            print(line("as they are", sizes(conn)))
            conn.execute("VACUUM FULL agent_events, agent_sessions, agent_memo, agent_snapshots")
            s = sizes(conn)
            print(line("live data", s))
            (per,) = conn.execute(  # type: ignore[misc]
                "SELECT avg(pg_column_size(context)) FROM agent_sessions"
            ).fetchone()
            print(f"  a projection's context: {float(per) / 1024:.1f} kB on average (stored)")
            print(fields(conn))


def fields(conn: psycopg.Connection[object]) -> str:
    """What a stored context is made of: each top-level field's JSON, in bytes per projection
    on average (uncompressed), largest first."""
    rows = conn.execute(
        "SELECT key, avg(length(value::text))::float8, count(*) FROM agent_sessions,"
        " jsonb_each(context) GROUP BY key ORDER BY sum(length(value::text)) DESC"
    ).fetchall()
    (n,) = conn.execute("SELECT count(*) FROM agent_sessions").fetchone()  # type: ignore[misc]
    parts = [f"{k} {float(avg) * c / max(n, 1):.0f}" for k, avg, c in rows]
    return "  its fields (bytes of JSON per projection): " + ", ".join(parts)


if __name__ == "__main__":
    main()
