"""The story the product exists for, run for real: an agent worker is SIGKILLed in the middle of
a tool call; a standby worker rebuilds the session from the ledger, retries the call that was in
flight with its original idempotency key, answers the completed model and tool calls from the
ledger without calling anything again, and finishes the session.

The "model" and the "tools" are a local HTTP service on loopback that counts every call by
idempotency key, so the demo can show what was (and was not) called twice. The worker is a
separate process (``python -m ledger_cdc.demo.crash``) so the kill is a real SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from ledger_cdc.client.recovery import memoised_model, memoised_tool, rebuild_context, retry_tool
from ledger_cdc.client.writer import Ledger
from ledger_cdc.events import (
    ContextLoaded,
    Message,
    ModelRequested,
    ModelResponded,
    TaskCompleted,
    ToolCall,
    ToolInvoked,
    ToolObserved,
    Usage,
)
from ledger_cdc.fold import SessionContext

__all__ = ["CrashStory", "ToolService", "run_crash_story"]

# The agent's plan: two model turns, each asking for tool calls.
PLAN: list[tuple[str, list[tuple[str, str, dict[str, Any]]]]] = [
    ("r1", [("c1", "search", {"q": "open incidents"}), ("c2", "fetch", {"url": "/runbook"})]),
    ("r2", [("c3", "summarise", {"of": ["c1", "c2"]})]),
]
HELD_CALL = "c2"  # the service holds this call's first attempt until the worker is killed


class ToolService:
    """Loopback HTTP 'model' and 'tools' counting calls by idempotency key."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.holding = threading.Event()
        self.release = threading.Event()
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                svc.calls[key] += 1
                if key.endswith(f":{HELD_CALL}") and svc.calls[key] == 1:
                    svc.holding.set()
                    svc.release.wait(30)
                reply = json.dumps({"ok": True, "echo": body, "served": svc.calls[key]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:
                    pass  # the caller was killed while the call was held: nobody to answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _call(url: str, key: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@dataclass
class WorkerLog:
    answered_from_ledger: list[str] = field(default_factory=list)
    retried: list[tuple[str, str]] = field(default_factory=list)  # (call id, key)
    called: list[str] = field(default_factory=list)
    rebuild_ms: float = 0.0
    in_flight: list[tuple[str, str]] = field(default_factory=list)


def work(dsn: str, sid: uuid.UUID, service: str, agent: str) -> WorkerLog:
    """Run (or resume) the session: everything it does is decided by what the ledger holds."""
    out = WorkerLog()
    with Ledger(dsn) as ledger, psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        ctx: SessionContext = rebuild_context(conn, sid)
        out.rebuild_ms = (time.perf_counter() - t0) * 1000
        out.in_flight = [(p.call_id, p.idempotency_key or "") for p in ctx.pending_tools.values()]
        w = _Worker(ledger, conn, sid, agent, service, out, ctx)
        if ctx.last_position == 0:
            msgs = [Message("user", "triage last night's incidents")]
            w.append("context.loaded", ContextLoaded(msgs, task="triage"))
        for request_id, calls in PLAN:
            w.model_turn(request_id, calls)
            for call_id, tool, args in calls:
                w.tool_call(request_id, call_id, tool, args)
        if w.ctx.status != "completed":
            w.append("task.completed", TaskCompleted({"incidents": 2}))
    return out


@dataclass
class _Worker:
    """One worker's session: ``ctx`` is rebuilt from the ledger after each of its writes."""

    ledger: Ledger
    conn: psycopg.Connection[Any]
    sid: uuid.UUID
    agent: str
    service: str
    out: WorkerLog
    ctx: SessionContext

    def append(self, event_type: str, payload: Any) -> None:
        self.ledger.append(
            self.sid, self.agent, event_type, payload, expected_position=self.ctx.last_position
        )
        self.ctx = rebuild_context(self.conn, self.sid)

    def model_turn(self, request_id: str, calls: list[tuple[str, str, dict[str, Any]]]) -> None:
        """The model's answer to ``request_id`` from the ledger, or else asked for and written
        with the tool calls it asks for, in one transaction."""
        if memoised_model(self.conn, self.ctx, request_id) is not None:
            self.out.answered_from_ledger.append(request_id)
            return
        sid, agent = self.sid, self.agent
        key = f"{sid}:{request_id}"
        answer = _call(f"{self.service}/model", key, {"request": request_id})
        self.out.called.append(request_id)
        with self.ledger.transaction() as tx:
            tx.append(
                sid,
                agent,
                "model.requested",
                ModelRequested(request_id, "sim", idempotency_key=key),
                expected_position=self.ctx.last_position,
            )
            tx.append(
                sid,
                agent,
                "model.responded",
                ModelResponded(
                    request_id,
                    "sim",
                    content=f"served {answer['served']}",
                    usage=Usage(100, 10),
                    tool_calls=[ToolCall(c, t, a) for c, t, a in calls],
                ),
            )
            for call_id, tool, args in calls:
                invoked = ToolInvoked(call_id, tool, args, idempotency_key=f"{sid}:{call_id}")
                tx.append(sid, agent, "tool.invoked", invoked)
        self.ctx = rebuild_context(self.conn, sid)

    def tool_call(self, request_id: str, call_id: str, tool: str, args: dict[str, Any]) -> None:
        """The tool call's result from the ledger, or else the call made (retried with its
        original key when a worker that died invoked it) and its result written."""
        if memoised_tool(self.conn, self.ctx, call_id) is not None:
            self.out.answered_from_ledger.append(call_id)
            return
        pending = self.ctx.pending_tools[call_id]
        if request_id not in self.out.called:  # invoked by a worker that died: a retry
            retry_tool(self.conn, self.ctx, call_id, self.agent)  # the log shows the retry
            self.out.retried.append((call_id, pending.idempotency_key or ""))
        key = pending.idempotency_key or call_id
        result = _call(f"{self.service}/tool/{tool}", key, args)
        self.out.called.append(call_id)
        self.append("tool.observed", ToolObserved(call_id, result))


@dataclass
class CrashStory:
    session_id: uuid.UUID
    killed_pid: int
    standby: WorkerLog
    calls: dict[str, int]
    status: str


def run_crash_story(dsn: str, say: Any = print) -> CrashStory:
    """Worker 1 in a child process, killed mid-call; the standby resumes in this process."""
    sid = uuid.uuid4()
    service = ToolService()
    try:
        worker = subprocess.Popen(
            [sys.executable, "-m", "ledger_cdc.demo.crash", dsn, str(sid), service.url, "worker-1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        say(f"worker-1 (pid {worker.pid}) runs session {sid}")
        if not service.holding.wait(60):
            worker.kill()
            err = worker.communicate()[1].decode(errors="replace")
            raise RuntimeError(f"worker-1 never reached the tool call: {err[-500:]}")
        say(f"worker-1 is inside tool call {HELD_CALL}: [bold red]SIGKILL[/]")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        standby = work(dsn, sid, service.url, "worker-2")
        with psycopg.connect(dsn) as conn:
            status = rebuild_context(conn, sid).status
        return CrashStory(sid, worker.pid, standby, dict(service.calls), status)
    finally:
        service.close()


def _main() -> None:
    p = argparse.ArgumentParser(description="one agent worker of the crash demo")
    p.add_argument("dsn")
    p.add_argument("session", type=uuid.UUID)
    p.add_argument("service")
    p.add_argument("agent")
    a = p.parse_args()
    work(a.dsn, a.session, a.service, a.agent)


if __name__ == "__main__":
    _main()
