"""The OpenAI Agents SDK session on the ledger behaves as the SDK's own SQLiteSession, op for op,
and stays whole under concurrent writers: one add's items together and in order, no item popped
twice, nothing lost."""

from __future__ import annotations

import asyncio
import json
import math
import random
import uuid
from typing import Any

import pytest

pytest.importorskip("agents.memory")

from agents.memory import SessionSettings, SQLiteSession

from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.integrations.openai_agents import LedgerSession, conversation_session
from tests.support.cdc import ConsumerProcess, assert_verify_exact, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server


def _item(n: int) -> dict[str, Any]:
    role = "user" if n % 2 else "assistant"
    return {"role": role, "content": f"message {n} ✓", "meta": {"n": n, "tags": ["a", "b"]}}


def _odd_item(n: int) -> dict[str, Any]:
    """Now and then an item jsonb cannot hold (a tool's output with a NUL), or one that looks
    like how such an item is stored."""
    if n % 7 == 3:
        return {"role": "tool", "content": f"bytes \x00 {n}", "meta": {"k\x00": n}}
    if n % 11 == 5:
        return {"ledger.item.base64": "not base64 at all"}
    return _item(n)


def test_the_ledger_session_answers_as_the_sdks_sqlite_session(db: Database) -> None:
    rng = random.Random(18)

    async def go() -> None:
        ledger = await AsyncLedger.connect(db.dsn)
        ours = LedgerSession(f"conv-{uuid.uuid4()}", ledger)
        theirs = SQLiteSession("reference")
        try:
            n = 0
            for _ in range(120):
                op = rng.choice(["add", "add", "get", "get_limit", "pop", "clear"])
                if op == "add":
                    items = [_odd_item(n + i) for i in range(rng.randint(1, 4))]
                    n += len(items)
                    await ours.add_items(items)
                    await theirs.add_items(items)
                elif op == "get":
                    assert await ours.get_items() == await theirs.get_items()
                elif op == "get_limit":
                    k = rng.randint(-2, 6)  # 0: none; negative: all (SQLite's LIMIT -1)
                    assert await ours.get_items(k) == await theirs.get_items(k)
                elif op == "pop":
                    assert await ours.pop_item() == await theirs.pop_item()
                elif op == "clear" and rng.random() < 0.3:
                    await ours.clear_session()
                    await theirs.clear_session()
            assert await ours.get_items() == await theirs.get_items()
            for limit in (2, 0, -1):  # the session's settings, when no limit is given
                ours.session_settings = theirs.session_settings = SessionSettings(limit=limit)
                assert await ours.get_items() == await theirs.get_items()
        finally:
            theirs.close()
            await ledger.close()

    asyncio.run(go())


def test_session_settings_are_taken_as_the_sdks_sessions_take_them(db: Database) -> None:
    """``LedgerSession(..., session_settings=...)`` as the SDK's sessions (it was a TypeError):
    a dict is coerced, none is ``SessionSettings()``, the limit is what get_items() reads."""

    async def go() -> None:
        ledger = await AsyncLedger.connect(db.dsn)
        sid = f"conv-{uuid.uuid4()}"
        try:
            await LedgerSession(sid, ledger).add_items([_item(n) for n in range(5)])
            for settings in (None, {"limit": 2}, SessionSettings(limit=0), {"limit": -1}):
                ours = LedgerSession(sid, ledger, session_settings=settings)
                theirs = SQLiteSession("reference", session_settings=settings)
                try:
                    await theirs.add_items([_item(n) for n in range(5)])
                    assert ours.session_settings == theirs.session_settings, settings
                    assert await ours.get_items() == await theirs.get_items(), settings
                finally:
                    theirs.close()
        finally:
            await ledger.close()

    asyncio.run(go())


def test_items_jsonb_would_refuse_or_change_read_back_as_the_sdk_stores_them(db: Database) -> None:
    """The SDK's sessions store an item as ``json.dumps`` text: a lone surrogate, NaN, an
    infinity and a float of 1e16 or more come back as they were. jsonb refuses the first three
    (the add raised UnicodeEncodeError or InvalidEventError) and writes the last as an integer
    (1e16 read back as the int 10000000000000000). Compared as JSON text: NaN != NaN, and
    1e16 == 10**16."""
    items: list[Any] = [
        {"role": "tool", "content": "half a pair \ud83d"},
        {"role": "tool", "content": "scores", "meta": {"nan": float("nan"), "inf": [-math.inf]}},
        {"role": "tool", "content": "big", "meta": {"n": 1e16, "m": -2.5e300, "k": 1e15}},
        {"role": "tool", "content": "an id 1e5 that is text", "meta": {"small": 1e-7}},
    ]

    async def go() -> tuple[list[Any], list[Any], list[Any], Any]:
        ledger = await AsyncLedger.connect(db.dsn)
        sid = f"conv-{uuid.uuid4()}"
        theirs = SQLiteSession("reference")
        try:
            await LedgerSession(sid, ledger).add_items(items)
            await theirs.add_items(items)
            ours = LedgerSession(sid, ledger)  # reads what the ledger holds
            got = await ours.get_items()
            popped = await ours.pop_item()
            return got, await theirs.get_items(), await ours.get_items(), popped
        finally:
            theirs.close()
            await ledger.close()

    def exact(value: Any) -> str:  # a float stays a float, NaN equals NaN (keys: jsonb's order)
        return json.dumps(value, sort_keys=True)

    got, reference, after_pop, popped = asyncio.run(go())
    assert exact(got) == exact(reference) == exact(items)
    assert exact(popped) == exact(items[-1]) and exact(after_pop) == exact(items[:-1])


def test_concurrent_writers_keep_the_history_whole(db: Database) -> None:
    sid = f"conv-{uuid.uuid4()}"

    async def go() -> tuple[list[Any], list[Any]]:
        ledger = await AsyncLedger.connect(db.dsn, pool_size=8)
        try:
            sessions = [LedgerSession(sid, ledger) for _ in range(6)]

            async def writer(w: int) -> None:
                for k in range(10):
                    await sessions[w].add_items([{"w": w, "k": k, "part": p} for p in range(3)])

            popped: list[Any] = []

            async def popper(s: LedgerSession) -> None:
                for _ in range(15):
                    item = await s.pop_item()
                    if item is not None:
                        popped.append(item)

            await asyncio.gather(
                *(writer(w) for w in range(4)), popper(sessions[4]), popper(sessions[5])
            )
            return await sessions[0].get_items(), popped
        finally:
            await ledger.close()

    left, popped = asyncio.run(go())
    keys = [(x["w"], x["k"], x["part"]) for x in left + popped]
    assert len(keys) == len(set(keys)) == 4 * 10 * 3  # nothing lost, nothing popped twice
    # what is left keeps each add's items together and in order, and each writer's adds in order
    seen: dict[tuple[int, int], list[int]] = {}
    for x in left:
        seen.setdefault((x["w"], x["k"]), []).append(x["part"])
    for parts in seen.values():
        assert parts == sorted(parts)
    for w in range(4):
        ks = [x["k"] for x in left if x["w"] == w]
        assert ks == sorted(ks)
    # the consumer folds the conversation like any session (standard event types)
    with ConsumerProcess(db.dsn, "--create-slot"):
        wait_caught_up(db.dsn)
    assert_verify_exact(db.dsn)  # verify --all: the projections equal a fold from zero
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone() == (0,)
        row = conn.execute(
            "SELECT event_count FROM agent_sessions WHERE session_id = %s",
            (conversation_session(sid),),
        ).fetchone()
    assert row is not None and row[0] == 40 + len(popped)


def test_a_row_that_does_not_fit_is_skipped_and_pops_stay_linear(db: Database) -> None:
    """A malformed row, or one nested too deep, is skipped (the rest of the history reads);
    many pops of a long history are applied by key, not by rebuilding the list per pop."""

    async def go() -> tuple[list[Any], Any]:
        ledger = await AsyncLedger.connect(db.dsn)
        ours = LedgerSession(f"conv-{uuid.uuid4()}", ledger)
        try:
            await ours.add_items([_item(n) for n in range(3000)])
            for _ in range(2990):
                await ours.pop_item()
            async with ledger.connection() as conn:
                await conn.execute(
                    "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                    "VALUES (%s, 'x', 'openai.items.added', %s::jsonb)",
                    (ours.ledger_session, json.dumps({"items": "abc"})),
                )
                # nested past what the decoder takes (a RecursionError ended get_items), and
                # past what the consumer reads (READ_MAX_DEPTH) but not past 3.11's decoder:
                # skipped on every Python, as the consumer quarantines it
                for depth in (3000, 600):
                    deep = '{"items": [' + '{"k":' * depth + "1" + "}" * depth + "]}"
                    await conn.execute(
                        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                        "VALUES (%s, 'x', 'openai.items.added', %s::jsonb)",
                        (ours.ledger_session, deep),
                    )
                await conn.commit()
            await ours.add_items([_item(9999)])
            return await ours.get_items(), await ours.pop_item()
        finally:
            await ledger.close()

    items, last = asyncio.run(go())
    assert items == [*[_item(n) for n in range(10)], _item(9999)]
    assert last == _item(9999)


def test_a_session_made_in_sync_code_opens_lazily_and_closes(db: Database) -> None:
    """SDK users make sessions in sync code (``SQLiteSession(...)``) and call ``close()``:
    ``LedgerSession.from_url`` opens its pool at first use, in the loop that uses it, and
    ``close()`` works from sync code and awaited (it was async-only, with no close at all)."""
    sid = f"conv-{uuid.uuid4()}"
    session = LedgerSession.from_url(sid, url=db.dsn)  # no event loop here
    loop = asyncio.new_event_loop()  # as Runner.run_sync: the thread's one loop, kept
    try:
        loop.run_until_complete(session.add_items([_item(0), _item(1)]))
        pool = session.ledger._pool
        assert pool is not None and not pool.closed
        assert loop.run_until_complete(session.get_items()) == [_item(0), _item(1)]
        session.close()  # sync code, after the loop ran
        assert pool.closed
        # used again, in another loop (asyncio.run each time): it opens again, and awaited
        # close() closes what that loop opened

        async def again() -> list[Any]:
            await session.add_items([_item(2)])
            items = await session.get_items()
            await session.close()
            return items

        assert asyncio.run(again()) == [_item(0), _item(1), _item(2)]
        assert asyncio.run(again())[-1] == _item(2)
    finally:
        loop.close()
    with pytest.raises(Exception, match="has not opened its ledger"):
        session.ledger  # noqa: B018 - closed: nothing open
