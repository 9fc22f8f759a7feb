"""The JetStream traffic of a fan-out drain, published by a process of its own: what
``bench drain --fan-out`` runs beside a ``--sink postgres`` drain to show what that traffic
costs on this machine's cores when none of it is in the consumer's process.

It reads the ledger's events (in commit order) and the projections a drain left, then, told
``go`` on its standard input, publishes them as a fan-out consumer would, through the same
publisher: batches of ``BATCH`` events, each followed by the projections of the sessions it
touched. It prints one JSON line: seconds from ``go``, its own CPU seconds, messages published.

    python bench/js_traffic.py NATS_URL LEDGER_DSN PROJECTIONS_DSN SLOT BATCH
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any

import psycopg
from common import ROOT  # noqa: F401 - puts the package on the path

from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings


def main() -> None:
    url, ledger_dsn, projections_dsn, slot, size = sys.argv[1:6]
    batch = int(size)
    with psycopg.connect(ledger_dsn) as conn:
        rows = conn.execute(f"SELECT {COLUMNS} FROM agent_events ORDER BY seq").fetchall()
    # (a commit LSN of the same width as a real one: its header is as long)
    events = [(row_event(row), 0x1_0000_0000 + i * 200) for i, row in enumerate(rows)]
    with psycopg.connect(projections_dsn) as conn:
        contexts: dict[uuid.UUID, tuple[int, bytes]] = {
            sid: (pos, ctx.encode())
            for sid, pos, ctx in conn.execute(
                "SELECT session_id, last_position, context::text FROM agent_sessions"
            )
        }
    batches: list[tuple[list[Any], list[tuple[Any, ...]]]] = []
    for i in range(0, len(events), batch):
        part = events[i : i + batch]
        # each session's projection as of its last event in the batch (its JSON: the final
        # one, of much the same size)
        touched = {ev.session_id: (ev.position, lsn) for ev, lsn in part}
        sessions = [
            (sid, position, contexts[sid][1], lsn)
            for sid, (position, lsn) in touched.items()
            if sid in contexts
        ]
        batches.append((part, sessions))
    publisher = JetStreamPublisher(JetStreamSettings.from_url(url), slot)
    publisher.connect()
    print("ready", flush=True)
    sys.stdin.readline()
    t0, cpu0 = time.monotonic(), time.process_time()
    for part, sessions in batches:
        publisher.begin(part, sessions).wait()
    seconds, cpu = time.monotonic() - t0, time.process_time() - cpu0
    print(
        json.dumps({"seconds": seconds, "cpu": cpu, "published": publisher.published}), flush=True
    )
    publisher.close()


if __name__ == "__main__":
    main()
