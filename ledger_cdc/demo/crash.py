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
        if ctx.last_position == 0:
            msgs = [Message("user", "triage last night's incidents")]
            ledger.append(
                sid,
                agent,
                "context.loaded",
                ContextLoaded(msgs, task="triage"),
                expected_position=0,
            )
            ctx = rebuild_context(conn, sid)
        for request_id, calls in PLAN:
            if memoised_model(conn, ctx, request_id) is not None:
                out.answered_from_ledger.append(request_id)
            else:
                key = f"{sid}:{request_id}"
                answer = _call(f"{service}/model", key, {"request": request_id})
                out.called.append(request_id)
                with ledger.transaction() as tx:
                    pos = ctx.last_position
                    tx.append(
                        sid,
                        agent,
                        "model.requested",
                        ModelRequested(request_id, "sim", idempotency_key=key),
                        expected_position=pos,
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
                        tx.append(
                            sid,
                            agent,
                            "tool.invoked",
                            ToolInvoked(call_id, tool, args, idempotency_key=f"{sid}:{call_id}"),
                        )
                ctx = rebuild_context(conn, sid)
            for call_id, tool, args in calls:
                if memoised_tool(conn, ctx, call_id) is not None:
                    out.answered_from_ledger.append(call_id)
                    continue
                pending = ctx.pending_tools[call_id]
                if request_id not in out.called:  # invoked by a worker that died: a retry
                    retry_tool(conn, ctx, call_id, agent)  # the log shows the retry
                    out.retried.append((call_id, pending.idempotency_key or ""))
                result = _call(f"{service}/tool/{tool}", pending.idempotency_key or call_id, args)
                out.called.append(call_id)
                ledger.append(
                    sid,
                    agent,
                    "tool.observed",
                    ToolObserved(call_id, result),
                    expected_position=ctx.last_position,
                )
                ctx = rebuild_context(conn, sid)
        if ctx.status != "completed":
            ledger.append(
                sid,
                agent,
                "task.completed",
                TaskCompleted({"incidents": 2}),
                expected_position=ctx.last_position,
            )
    return out


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
