"""A run worker for the tests: takes ready runs from ``pending_runs``, and for each performs one
tool call against an HTTP target (idempotency key ``<session>:tool``) and completes the run. A
run taken over from a dead worker first retries its in-flight call with the same key.

    python -m tests.support.runworker DSN WORKER TARGET_URL [--ttl 2] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from typing import Any

import psycopg

from ledger_cdc.client.recovery import memoised_tool_async, retry_tool_async
from ledger_cdc.client.runs import (
    AsyncLeasedRun,
    LeaseLostError,
    RunNotReadyError,
    lease_async,
    pending_runs,
)
from ledger_cdc.errors import ConcurrentAppendError
from ledger_cdc.events import ToolInvoked, ToolObserved


def _post(url: str, key: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


async def work(run: AsyncLeasedRun, target: str) -> None:
    sid = run.session_id
    call = "tool"
    if call in run.ctx.pending_tools:  # taken over: the dead worker's call was in flight
        await retry_tool_async(run.conn, run.ctx, call, run.worker)
    elif await memoised_tool_async(run.conn, run.ctx, call) is None:
        await run.append(
            "tool.invoked", ToolInvoked(call, "http", {"n": 1}, idempotency_key=f"{sid}:{call}")
        )
    if await memoised_tool_async(run.conn, run.ctx, call) is None:
        key = run.ctx.pending_tools[call].idempotency_key or ""
        status = await asyncio.to_thread(_post, target, key, {"session": str(sid)})
        await run.append("tool.observed", ToolObserved(call, {"status": status}))
    await run.complete({"by": run.worker})


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dsn")
    ap.add_argument("worker")
    ap.add_argument("target")
    ap.add_argument("--ttl", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    slots = asyncio.Semaphore(a.concurrency)
    busy: set[Any] = set()

    async def take(sid: Any) -> None:
        try:
            async with await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as conn:
                try:
                    run = await lease_async(conn, sid, a.worker, ttl=a.ttl)
                except (ConcurrentAppendError, RunNotReadyError):
                    return
                print(f"leased {sid}", flush=True)
                try:
                    await work(run, a.target)
                except LeaseLostError:
                    print(f"lost {sid}", flush=True)
                finally:
                    print(f"done {sid}", flush=True)  # (every "leased" line gets one)
        finally:
            busy.discard(sid)
            slots.release()

    print("ready", flush=True)
    tasks = set()
    async for ready in pending_runs(a.dsn, recheck=0.5):
        if ready.session_id in busy:
            continue
        await slots.acquire()
        busy.add(ready.session_id)
        t = asyncio.create_task(take(ready.session_id))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
