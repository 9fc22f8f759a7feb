"""The Pydantic AI harness's step store on the ledger answers as the harness's own
InMemoryStepStore, op for op; unresolved tool effects come from the fold's calls in flight; a
real agent run with StepPersistence (a test model, no network) is stored as a ledger session the
consumer folds."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import uuid
from typing import Any, cast

import pytest

pytest.importorskip("pydantic_ai_harness.step_persistence")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.test import TestModel
from pydantic_ai_harness.step_persistence import (
    ContinuableSnapshot,
    InMemoryStepStore,
    RunRecord,
    StepEvent,
    StepPersistence,
    StepStore,
    ToolEffectRecord,
)

from ledger_cdc.client.recovery import rebuild_context
from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.integrations.pydantic_ai import LedgerStepStore, run_session
from tests.support.cdc import ConsumerProcess, assert_verify_exact, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server

T0 = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.timezone.utc)


def test_the_ledger_store_answers_as_the_harness_in_memory_store(db: Database) -> None:
    rng = random.Random(21)
    runs = [f"run-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]

    async def go() -> None:
        ledger = await AsyncLedger.connect(db.dsn)
        ours = LedgerStepStore(ledger, max_snapshots_per_run=3)
        theirs = InMemoryStepStore(max_snapshots_per_run=3)
        assert isinstance(ours, StepStore)  # the harness's runtime-checkable protocol
        try:
            for step in range(150):
                run = rng.choice(runs)
                at = T0 + dt.timedelta(seconds=step)
                op = rng.choice(["run", "event", "event", "snap", "tool", "read"])
                for store in (ours, theirs):
                    if op == "run":
                        await store.register_run(
                            RunRecord(
                                run_id=run,
                                conversation_id=rng.choice(["c1", "c2", None])
                                if store is ours
                                else None,
                                started_at=at,
                            )
                        )
                rng2 = random.Random(step)  # the same choices for both stores
                if op == "event":
                    key = rng2.choice([None, f"k{rng2.randint(0, 5)}"])
                    ev = StepEvent(
                        run_id=run,
                        kind="tool_call_started",
                        step_index=step,
                        timestamp=at,
                        tool_call_id=f"t{step}",
                        metadata={"n": str(step)},
                        idempotency_key=key,
                    )
                    await ours.append_event(ev)
                    await theirs.append_event(ev)
                elif op == "snap":
                    key = rng2.choice(
                        [None, f"{rng2.randint(0, 4)}:x{rng2.randint(0, 2)}", "plain"]
                    )
                    snap = ContinuableSnapshot(
                        run_id=run,
                        step_index=step,
                        timestamp=at,
                        messages=[
                            ModelRequest(parts=[UserPromptPart(f"hi {step}", timestamp=at)]),
                            ModelResponse(parts=[TextPart(f"ok {step}")], timestamp=at),
                        ],
                        state=rng2.choice(["complete", "interrupted"]),
                        idempotency_key=key,
                    )
                    await ours.save_snapshot(snap)
                    await theirs.save_snapshot(snap)
                elif op == "tool":
                    rec = ToolEffectRecord(
                        tool_call_id=f"call{rng2.randint(0, 4)}",
                        tool_name="search",
                        run_id=run,
                        status=rng2.choice(["started", "started", "completed", "failed"]),
                        started_at=at,
                        effect_summary=f"s{step}",
                    )
                    await ours.record_tool_effect(rec)
                    await theirs.record_tool_effect(rec)
                for r in runs:  # every answer agrees, at every step
                    assert await ours.list_events(run_id=r) == await theirs.list_events(run_id=r)
                    for inc in (False, True):
                        a = await ours.latest_snapshot(run_id=r, include_interrupted=inc)
                        b = await theirs.latest_snapshot(run_id=r, include_interrupted=inc)
                        assert a == b, (r, inc)
                    for c in range(5):
                        assert await ours.get_tool_effect(run_id=r, tool_call_id=f"call{c}") == (
                            await theirs.get_tool_effect(run_id=r, tool_call_id=f"call{c}")
                        )
                    unresolved_a = await ours.list_unresolved_tool_effects(run_id=r)
                    unresolved_b = await theirs.list_unresolved_tool_effects(run_id=r)
                    assert sorted(x.tool_call_id for x in unresolved_a) == sorted(
                        x.tool_call_id for x in unresolved_b
                    )
                    got = await ours.get_run(run_id=r)
                    assert (got is None) == (await theirs.get_run(run_id=r) is None)
            runs_listed = await ours.list_runs()
            assert [r.started_at for r in runs_listed] == sorted(r.started_at for r in runs_listed)
        finally:
            await ledger.close()

    asyncio.run(go())


def test_unresolved_effects_are_the_folds_calls_in_flight(db: Database) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"

    async def go() -> list[str]:
        ledger = await AsyncLedger.connect(db.dsn)
        store = LedgerStepStore(ledger)
        try:
            for call, status in [("a", "started"), ("b", "started"), ("a", "completed")]:
                await store.record_tool_effect(
                    ToolEffectRecord(
                        tool_call_id=call,
                        tool_name="pay",
                        run_id=run,
                        status=status,
                        idempotency_key=f"{run}:{call}",
                        effect_summary="charged",
                    )
                )
            return [r.tool_call_id for r in await store.list_unresolved_tool_effects(run_id=run)]
        finally:
            await ledger.close()

    assert asyncio.run(go()) == ["b"]
    with db.connect() as conn:
        ctx = rebuild_context(conn, run_session(run))
    assert list(ctx.pending_tools) == ["b"] and ctx.pending_tools["b"].idempotency_key == f"{run}:b"
    assert (
        ctx.memoised_tool("a").result == "charged"
    )  # a restarted agent answers "a" from the ledger


def test_an_agent_run_with_step_persistence_is_a_ledger_session(db: Database) -> None:
    async def go() -> str:
        ledger = await AsyncLedger.connect(db.dsn)
        try:
            store = LedgerStepStore(ledger)
            agent = Agent(
                TestModel(), capabilities=[StepPersistence(store=store, run_id="agent-run-1")]
            )

            @agent.tool_plain
            def lookup(city: str) -> str:
                return f"sunny in {city}"

            result = await agent.run("weather?")
            events = await store.list_events(run_id="agent-run-1")
            kinds = [e.kind for e in events]
            assert kinds[0] == "run_started" and kinds[-1] == "run_completed", kinds
            assert "tool_call_completed" in kinds
            assert await store.latest_snapshot(run_id="agent-run-1") is not None
            return str(result.output)
        finally:
            await ledger.close()

    assert asyncio.run(go())
    with ConsumerProcess(db.dsn, "--create-slot"):
        wait_caught_up(db.dsn)
    assert_verify_exact(db.dsn)  # verify --all: the projections equal a fold from zero
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone() == (0,)
        (n,) = conn.execute(  # type: ignore[misc]
            "SELECT event_count FROM agent_sessions WHERE session_id = %s",
            (run_session("agent-run-1"),),
        ).fetchone()
    assert n > 3


def test_a_stored_record_a_newer_or_broken_writer_left_is_read_or_skipped(db: Database) -> None:
    """A run record with a field this version does not declare reads back without it; one
    that cannot be made (no run_id), or nests past what the decoder takes (a RecursionError,
    which ended the call), is skipped by list_runs and get_run, not fatal to them. So is one
    nested past what the consumer reads (READ_MAX_DEPTH) but not past the decoder of every
    Python (3.11's stops near 1,000 levels, 3.13's near 10,000): skipped on each alike."""
    import json

    from ledger_cdc.integrations.pydantic_ai import run_session

    def deep(run_id: str, depth: int) -> str:
        return f'{{"run_id": "{run_id}", "x": ' + '{"k":' * depth + "1" + "}" * depth + "}"

    async def go() -> tuple[list[str], list[str | None]]:
        ledger = await AsyncLedger.connect(db.dsn)
        try:
            store = LedgerStepStore(ledger)
            async with ledger.connection() as conn:
                for run_id, record in (
                    ("newer", json.dumps({"run_id": "newer", "from_the_future": 1})),
                    ("broken", json.dumps({"not_a_run": True})),
                    ("deep", deep("deep", 600)),
                    ("deeper", deep("deeper", 3000)),
                ):
                    await conn.execute(
                        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                        "VALUES (%s, 'x', 'pydantic.run.registered', %s::jsonb)",
                        (run_session(run_id), '{"record": ' + record + "}"),
                    )
                await conn.commit()
            runs = [r.run_id for r in await store.list_runs()]
            got = [await store.get_run(run_id=r) for r in ("newer", "broken", "deep", "deeper")]
            return runs, [None if r is None else r.run_id for r in got]
        finally:
            await ledger.close()

    assert asyncio.run(go()) == (["newer"], ["newer", None, None, None])


@pytest.mark.parametrize("bound", [0, -3, 1.5, "2"])
def test_a_retention_bound_below_one_is_refused_in_the_harness_stores_words(
    bound: Any, tmp_path: Any
) -> None:
    """The harness's stores refuse a bound that is no int with one message and one below 1
    with another; the ledger's store said the first for both."""
    from pydantic_ai_harness.step_persistence import FileStepStore

    with pytest.raises(ValueError) as theirs:
        InMemoryStepStore(max_snapshots_per_run=bound)
    with pytest.raises(ValueError) as file_store:
        FileStepStore(tmp_path, max_snapshots_per_run=bound)
    with pytest.raises(ValueError) as ours:
        LedgerStepStore(cast(Any, None), max_snapshots_per_run=bound)
    assert str(ours.value) == str(theirs.value) == str(file_store.value)
