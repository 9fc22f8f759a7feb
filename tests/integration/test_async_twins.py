"""The ``_async`` twins of the writer, recovery and runs, on a real server: each runs the same
generator as its sync twin (:mod:`ledger_cdc.client.steps`), so each answers as the sync one
does, refusals included."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

from ledger_cdc.client.recovery import (
    load_memo,
    load_memo_async,
    rebuild_context,
    rebuild_context_async,
    retry_tool_async,
)
from ledger_cdc.client.runs import (
    LeaseLostError,
    RunNotReadyError,
    lease,
    lease_async,
    signal_async,
    submit,
    submit_async,
)
from ledger_cdc.client.writer import append_async, session_head, session_head_async
from ledger_cdc.errors import (
    ConcurrentAppendError,
    IdempotencyConflictError,
    InvalidEventError,
    NoSuchSessionError,
)
from tests.integration.test_recovery import RunningConsumer, _agent_run
from tests.support.cdc import wait_caught_up, wait_streaming
from tests.support.harness import Database

T = TypeVar("T")


def _on_async(dsn: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    async def go() -> T:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await work(conn)

    return asyncio.run(go())


def test_append_async_checks_position_and_key_as_append_does(db: Database) -> None:
    sid = uuid.uuid4()
    call = {"call_id": "c1", "tool": "t"}

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        first = await append_async(conn, sid, "w", "tool.invoked", call, idempotency_key="k1")
        again = await append_async(conn, sid, "w", "tool.invoked", call, idempotency_key="k1")
        assert again.duplicate and again.seq == first.seq and first.position == 1
        with pytest.raises(IdempotencyConflictError):
            await append_async(
                conn, sid, "w", "tool.invoked", {**call, "tool": "u"}, idempotency_key="k1"
            )
        with pytest.raises(ConcurrentAppendError):
            await append_async(
                conn, sid, "w", "tool.observed", {"call_id": "c1"}, expected_position=0
            )
        with pytest.raises(InvalidEventError, match="session_id"):
            await append_async(conn, "nope", "w", "tool.invoked", call)
        async with conn.transaction():  # inside the caller's transaction: a savepoint
            await append_async(conn, sid, "w", "tool.observed", {"call_id": "c1", "result": 1})
        assert await session_head_async(conn, sid) == 2
        assert await session_head_async(conn, uuid.uuid4()) == 0

    _on_async(db.dsn, work)
    with db.connect() as conn:
        assert session_head(conn, sid) == 2


def test_a_run_held_on_an_async_connection_goes_through_every_ending(db: Database) -> None:
    """submit, lease, append (rebased past a signal), renew, suspend, signal, release, fail and
    complete, all on an async connection, each refusing what its sync twin refuses."""
    sid = uuid.uuid4()

    async def work(conn: psycopg.AsyncConnection[Any]) -> list[str]:
        seen: list[str] = []
        await submit_async(conn, sid, reason="test")
        run = await lease_async(conn, sid, "w1", ttl=10)
        with pytest.raises(RunNotReadyError, match="leased by w1"):
            await lease_async(conn, sid, "w2")
        async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as other:
            await signal_async(other, sid, "note", {"x": 1}, signal_id="s1")
            assert (await signal_async(other, sid, "note", {"x": 1}, signal_id="s1")).duplicate
            with pytest.raises(NoSuchSessionError):
                await signal_async(other, uuid.uuid4(), "note")
        await run.append("tool.invoked", {"call_id": "c", "tool": "t"})  # rebased: no conflict
        assert run.ctx.run is not None and [s.name for s in run.ctx.run.inbox] == ["note"]
        assert await run.renew() is False  # more than half the ttl left
        head = run.ctx.last_position
        assert await run.renew(force=True) is True and run.ctx.last_position == head + 1
        await run.suspend("approval", ["approve"])
        seen.append(run.ctx.run.status)
        with pytest.raises(LeaseLostError):
            await run.append("tool.observed", {"call_id": "c", "result": 1})
        with pytest.raises(InvalidEventError, match="wait_for"):
            await run.suspend("approval", "approve")
        await signal_async(conn, sid, "approve", {"by": "ann"})
        run = await lease_async(conn, sid, "w2")
        assert run.ctx.run.woken_by is not None and run.ctx.run.woken_by.payload == {"by": "ann"}
        await run.release("later")
        seen.append(run.ctx.run.status)
        run = await lease_async(conn, sid, "w3")
        await run.fail("flaky", retryable=True)
        seen.append(run.ctx.run.status)
        with pytest.raises(RunNotReadyError, match="failed"):
            await lease_async(conn, sid, "w4")
        await submit_async(conn, sid, reason="retry")  # queued again
        run = await lease_async(conn, sid, "w4")
        await run.append("tool.observed", {"call_id": "c", "result": 1})
        await run.complete({"ok": True})
        seen.append(run.ctx.run.status)
        assert run.ctx == await rebuild_context_async(conn, sid)  # payloads given as dicts too
        return seen

    statuses = _on_async(db.dsn, work)
    with db.connect() as conn:
        ctx = rebuild_context(conn, sid)
        assert ctx.run is not None and ctx.run.status == "completed"
        with pytest.raises(RunNotReadyError, match="completed"):
            lease(conn, sid, "w5")
    assert statuses == ["suspended", "pending", "failed", "completed"]


def test_retry_tool_async_refuses_a_stale_context(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid)

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        stale = await rebuild_context_async(conn, sid)
        ctx = await rebuild_context_async(conn, sid)
        await retry_tool_async(conn, ctx, "c2", "w2")
        with pytest.raises(ConcurrentAppendError):
            await retry_tool_async(conn, stale, "c2", "w3")
        with pytest.raises(Exception, match="not in flight"):
            await retry_tool_async(conn, ctx, "c1", "w2")

    _on_async(db.dsn, work)


def test_load_memo_async_loads_what_load_memo_does(db: Database) -> None:
    sid = uuid.uuid4()
    with RunningConsumer(db.dsn):
        wait_streaming(db.dsn)
        _agent_run(db, sid, finish_tool=True)
        wait_caught_up(db.dsn)
        with db.connect() as conn:
            ctx = rebuild_context(conn, sid)
            assert ctx.memo_position > 0  # the memo is left in agent_memo by a snapshot
            full = load_memo(conn, rebuild_context(conn, sid))
        got = _on_async(db.dsn, lambda c: load_memo_async(c, ctx))
    assert got == full and got.memo_position == 0
    assert set(got.completed_tools) == {"c1", "c2"} and set(got.completed_models) == {"r1"}


def test_a_held_run_folds_payloads_given_as_mappings_as_the_log_does(db: Database) -> None:
    """A held run's context advances by the same reducers as a rebuild: a payload given as a
    mapping is folded as its event type's struct (the consumer's way), not skipped."""
    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        run = lease(conn, sid, "w1")
        run.append("tool.invoked", {"call_id": "c", "tool": "t", "idempotency_key": "k"})
        assert run.ctx.pending_tools["c"].idempotency_key == "k"
        run.append("tool.observed", {"call_id": "c", "result": 1})
        run.complete({"ok": True})
        assert run.ctx == rebuild_context(conn, sid)
        assert run.ctx.ignored_events == 0 and run.ctx.completed_tools["c"].result == 1
