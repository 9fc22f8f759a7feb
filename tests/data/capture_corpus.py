"""Regenerate the captured pgoutput corpora in this folder from real servers.

    .venv/bin/python tests/data/capture_corpus.py

Each line of ``pgoutput_pg<major>.txt`` is ``<in_stream 0|1> <lsn hex> <message hex>``: the
XLogData payloads a walsender sent, in order, for a mix of ledger appends, row changes of every
kind, TOAST, TRUNCATE, logical messages, an origin, binary format, streamed, aborted and
two-phase transactions. Unit tests (no server) read them for fuzzing and for truncation tests.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ledger_cdc.admin.schema import create_publication, migrate
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres, find_installations
from ledger_cdc.pgoutput import Decoder
from tests.support.pgcapture import StreamWatch, live_capture, make_slot

HERE = Path(__file__).resolve().parent


def actions(conn: psycopg.Connection[Any], seen: StreamWatch) -> None:
    conn.execute(
        "CREATE TYPE mood AS ENUM ('calm', 'busy');"
        "CREATE TABLE items (id int PRIMARY KEY, name text, big text, m mood, data jsonb);"
        "CREATE TABLE items_full (id int, name text); ALTER TABLE items_full REPLICA IDENTITY FULL;"
        "ALTER PUBLICATION agent_pub ADD TABLE items, items_full;"
    )
    with Ledger(conn=conn) as ledger:
        s = uuid.uuid4()
        for i in range(20):
            ledger.append(s, "planner", "tool.invoked", {"call_id": f"c{i}", "tool": "search"})
    conn.execute("INSERT INTO items VALUES (1, 'a', repeat(md5('x'), 5000), 'busy', '{\"k\": 1}')")
    conn.execute("UPDATE items SET name = 'b'")
    conn.execute("UPDATE items SET id = 2")
    conn.execute("DELETE FROM items")
    conn.execute("INSERT INTO items_full VALUES (1, 'a')")
    conn.execute("UPDATE items_full SET name = 'b'")
    conn.execute("DELETE FROM items_full")
    conn.execute("TRUNCATE items, items_full RESTART IDENTITY CASCADE")
    conn.execute("SELECT pg_logical_emit_message(false, 'hb', 'beat')")
    with conn.transaction():
        conn.execute("SELECT pg_logical_emit_message(true, 'tx', 'inside')")
        conn.execute("INSERT INTO items (id, name) VALUES (3, 'c')")
    conn.execute("SELECT pg_replication_origin_create('up')")
    with conn.transaction():
        conn.execute("SELECT pg_replication_origin_session_setup('up')")
        conn.execute("SELECT pg_replication_origin_xact_setup('0/ABC', now())")
        conn.execute("INSERT INTO items (id, name) VALUES (4, 'd')")
    conn.execute("SELECT pg_replication_origin_session_reset()")
    big = (
        "INSERT INTO items (id, name) SELECT g, repeat('y', 300) "
        "FROM generate_series(%s::int, %s::int) g"
    )
    with conn.transaction():
        conn.execute(big, (100, 1100))
        conn.execute("ALTER TABLE items_full ADD COLUMN extra int")
        conn.execute("INSERT INTO items_full VALUES (1, 'a', 2)")
    try:
        with conn.transaction():
            conn.execute(big, (5000, 6000))
            assert seen.wait_streamed(conn)
            raise RuntimeError
    except RuntimeError:
        pass
    conn.execute("BEGIN; INSERT INTO items (id, name) VALUES (9, 'p'); PREPARE TRANSACTION 'g1'")
    conn.execute("COMMIT PREPARED 'g1'")
    conn.execute("BEGIN; INSERT INTO items (id, name) VALUES (10, 'p'); PREPARE TRANSACTION 'g2'")
    conn.execute("ROLLBACK PREPARED 'g2'")


def main() -> None:
    for inst in find_installations():
        if inst.major not in (15, 18) or (HERE / f"pgoutput_pg{inst.major}.txt").exists():
            continue
        with EmbeddedPostgres(inst, logical_decoding_work_mem="64kB") as pg:
            with psycopg.connect(pg.dsn(), autocommit=True) as conn:
                migrate(conn)
                create_publication(conn)
                make_slot(conn, "corpus", two_phase=True)
            opts = {
                "proto_version": "4" if inst.major >= 16 else "3",
                "two_phase": "on",
                "streaming": "parallel" if inst.major >= 16 else "on",
            }
            raw = live_capture(pg.dsn(), "corpus", "agent_pub", actions, **opts)
        d = Decoder()
        lines = []
        for lsn, data in raw:
            lines.append(f"{int(d.in_stream)} {lsn:x} {data.hex()}")
            d.decode(data, lsn)
        (HERE / f"pgoutput_pg{inst.major}.txt").write_text("\n".join(lines) + "\n")
        print(f"PostgreSQL {inst.major}: {len(lines)} messages")


if __name__ == "__main__":
    main()
