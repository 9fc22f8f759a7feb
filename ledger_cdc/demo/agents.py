"""The demo: simulated agents writing to a real ledger on a throwaway cluster.

Each simulated agent run is a session: a planner loads its context, calls a (simulated) model,
invokes tools whose calls also leave outbox rows, hands off to a researcher, and finishes or fails.
Every agent turn is one transaction, as a real runtime would write it. Nothing here talks to a real
model or tool; the point is the shape of the ledger they leave.
"""

from __future__ import annotations

import hashlib
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger_cdc.client.read import COLUMNS, fold_all, projected_contexts, row_event
from ledger_cdc.client.writer import Ledger, OutboxItem
from ledger_cdc.events import (
    ContextLoaded,
    HandoffEmitted,
    HandoffReceived,
    LedgerEvent,
    Message,
    ModelRequested,
    ModelResponded,
    Rejected,
    TaskCompleted,
    TaskFailed,
    ToolCall,
    ToolInvoked,
    ToolObserved,
    Usage,
)
from ledger_cdc.fold import SessionContext

__all__ = ["DemoReport", "run_agents"]

_TASKS = [
    "summarise the incident report",
    "draft a migration plan",
    "compare three vendor quotes",
    "triage the failing build",
    "answer the customer ticket",
    "prepare the weekly metrics",
]
_TOOLS = ["search", "read_file", "http_get", "sql_query"]


@dataclass
class DemoReport:
    sessions: list[uuid.UUID]
    events: int
    outbox: int


def _prompt_hash(messages: list[Message]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(m.role.encode() + b"\x1f" + m.content.encode() + b"\x1e")
    return h.hexdigest()[:16]


def _run_session(dsn: str, session: uuid.UUID, task: str, rng: random.Random) -> tuple[int, int]:
    events = outbox = 0
    with Ledger(dsn) as ledger:
        messages = [Message("system", "You are a careful planner."), Message("user", task)]
        with ledger.transaction() as tx:
            tx.append(session, "planner", "context.loaded", ContextLoaded(messages, task=task))
            events += 1
        for turn in range(rng.randint(1, 3)):
            req = f"req-{turn}"
            calls = [
                ToolCall(f"call-{turn}-{i}", rng.choice(_TOOLS), {"q": f"{task} #{i}"})
                for i in range(rng.randint(1, 2))
            ]
            with ledger.transaction() as tx:
                tx.append(
                    session,
                    "planner",
                    "model.requested",
                    ModelRequested(req, "sim-large", prompt_hash=_prompt_hash(messages)),
                )
                tx.append(
                    session,
                    "planner",
                    "model.responded",
                    ModelResponded(
                        req,
                        "sim-large",
                        content=f"I will use {len(calls)} tool(s).",
                        usage=Usage(rng.randint(200, 900), rng.randint(20, 200)),
                        tool_calls=calls,
                    ),
                )
                for c in calls:
                    key = f"{session}:{c.call_id}"
                    tx.append(
                        session,
                        "planner",
                        "tool.invoked",
                        ToolInvoked(c.call_id, c.tool, c.arguments, idempotency_key=key),
                        idempotency_key=key,
                        outbox=[OutboxItem(f"tool:{c.tool}", c.arguments, key)],
                    )
                    events += 1
                    outbox += 1
                events += 2
            with ledger.transaction() as tx:
                for c in calls:
                    result: dict[str, Any] = {"rows": rng.randint(0, 40), "tool": c.tool}
                    tx.append(session, "planner", "tool.observed", ToolObserved(c.call_id, result))
                    messages.append(Message("tool", str(result), tool_call_id=c.call_id))
                    events += 1
        hid = f"handoff-{session.hex[:8]}"
        with ledger.transaction() as tx:
            tx.append(
                session, "planner", "handoff.emitted", HandoffEmitted(hid, "researcher", task)
            )
            tx.append(session, "researcher", "handoff.received", HandoffReceived(hid, "planner"))
            events += 2
        if rng.random() < 0.2:
            ledger.append(session, "researcher", "task.failed", TaskFailed("rate limited", True))
        else:
            ledger.append(
                session, "researcher", "task.completed", TaskCompleted({"answer": "done"})
            )
        events += 1
    return events, outbox


def run_agents(dsn: str, sessions: int = 6, seed: int = 7) -> DemoReport:
    """Drive ``sessions`` simulated agent runs concurrently (one thread each)."""
    ids = [
        uuid.UUID(int=random.Random(seed + i).getrandbits(128), version=4) for i in range(sessions)
    ]
    totals: list[tuple[int, int]] = [(0, 0)] * sessions
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            totals[i] = _run_session(
                dsn, ids[i], _TASKS[i % len(_TASKS)], random.Random(seed * 31 + i)
            )
        except BaseException as e:  # surfaced after join
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return DemoReport(ids, sum(e for e, _ in totals), sum(o for _, o in totals))


def ledger_rows(dsn: str, limit: int = 400) -> list[tuple[LedgerEvent | Rejected, str]]:
    """The first rows of the ledger as events, each with its hash (hex)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT {COLUMNS}, encode(hash, 'hex') FROM agent_events "  # noqa: S608 - fixed text
            "ORDER BY session_id, position LIMIT %s",
            (limit,),
        ).fetchall()
    return [(row_event(r[:-1]), r[-1]) for r in rows]


def projections(dsn: str) -> list[SessionContext]:
    with psycopg.connect(dsn) as conn:
        return list(projected_contexts(conn).values())


def verify_against_refold(dsn: str) -> tuple[bool, int]:
    """(projections equal a fold of the table from zero, number of snapshots)."""
    with psycopg.connect(dsn) as conn:
        expected = fold_all(conn)
        got = {c.session_id: c for c in projections(dsn)}
        row = conn.execute("SELECT count(*) FROM agent_snapshots").fetchone()
    return expected == got, int(row[0]) if row else 0
