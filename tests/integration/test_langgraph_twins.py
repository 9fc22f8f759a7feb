"""The saver's thread-wide operations (delete a thread, hide a run's checkpoints, copy a thread,
prune), each sync method and its async twin run on the same data against a real server: each
does what it says to its threads and nothing to the others, the twins leave the same result,
and a saver that never folded the threads (its cold read from their recent events) sees the
same as one that folds them whole."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

pytest.importorskip("langgraph.checkpoint.base")

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.errors import ConfigError
from ledger_cdc.integrations.langgraph import LedgerSaver, thread_session
from tests.support.harness import Database

pytestmark = pytest.mark.server

_T = TypeVar("_T")
# (namespace, run id) of each checkpoint put, in order; a namespace's checkpoints form a line
_PLAN = [("", "r1"), ("", "r1"), ("child", "r1"), ("", "r2"), ("child", "r2"), ("", "r2")]


def _checkpoints(saver: LedgerSaver) -> list[tuple[str, Any, dict[str, str]]]:
    """One set of checkpoints for ``_PLAN`` (namespace, checkpoint, new versions), put alike
    into every thread a test compares: their ids are the same in each."""
    out: list[tuple[str, Any, dict[str, str]]] = []
    last: dict[str, Any] = {}
    for step, (ns, _) in enumerate(_PLAN):
        prev = last.get(ns)
        version = saver.get_next_version(
            prev["channel_versions"]["messages"] if prev else None, None
        )
        cp = create_checkpoint(prev or empty_checkpoint(), None, step)
        messages = prev["channel_values"]["messages"] if prev else []
        cp["channel_values"] = {"messages": [*messages, f"{ns or 'root'} {step}"]}
        cp["channel_versions"] = {"messages": version}
        out.append((ns, cp, {"messages": version}))
        last[ns] = cp
    return out


def _fill(saver: LedgerSaver, thread: str, cps: Any, runs: dict[str, str] | None = None) -> None:
    """The checkpoints put into ``thread`` (their run ids renamed by ``runs``), each with a
    pending write."""
    parents: dict[str, Any] = {}
    for (ns, cp, versions), (_, run_id) in zip(cps, _PLAN, strict=True):
        config = parents.get(ns) or {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
        meta = {"source": "loop", "step": 0, "run_id": (runs or {}).get(run_id, run_id)}
        parents[ns] = saver.put(config, cp, meta, versions)  # type: ignore[arg-type]
        saver.put_writes(parents[ns], [("messages", f"pending {cp['id']}")], "task-1")


def _view(tuples: list[Any]) -> list[tuple[Any, ...]]:
    """What a thread's listing holds, but for the thread id and the run id."""
    return [
        (
            t.config["configurable"]["checkpoint_ns"],
            t.config["configurable"]["checkpoint_id"],
            (t.parent_config or {}).get("configurable", {}).get("checkpoint_id"),
            t.checkpoint["channel_values"],
            t.pending_writes,
        )
        for t in tuples
    ]


def _listed(saver: LedgerSaver, thread: str) -> list[Any]:
    return list(saver.list({"configurable": {"thread_id": thread}}))


def _on_async(db: Database, go: Callable[[LedgerSaver], Awaitable[_T]]) -> _T:
    """``go`` on a saver of its own whose ledger is async only (its sync methods cannot run)."""

    async def run() -> _T:
        saver = LedgerSaver(None, await AsyncLedger.connect(db.dsn))
        try:
            return await go(saver)
        finally:
            await saver.aclose()

    return asyncio.run(run())


def _cold(db: Database, thread: str, configs: list[Any]) -> list[list[Any]]:
    """The tuples at ``configs`` and the latest of each namespace, as a sync and an async saver
    that never folded the thread read them (from its recent events)."""
    asked = [
        *configs,
        {"configurable": {"thread_id": thread, "checkpoint_ns": ""}},
        {"configurable": {"thread_id": thread, "checkpoint_ns": "child"}},
    ]
    sync = LedgerSaver(Ledger(db.dsn))
    try:
        got = [sync.get_tuple(c) for c in asked]
    finally:
        sync.close()

    async def aread(saver: LedgerSaver) -> list[Any]:
        return [await saver.aget_tuple(c) for c in asked]

    return [got, _on_async(db, aread)]


def _assert_reads(db: Database, thread: str, expected: list[tuple[Any, ...]]) -> None:
    """A saver folding the whole thread lists ``expected``; one reading it cold (sync and async)
    reads each listed checkpoint, and the latest of each namespace, as it."""
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        listed = _listed(saver, thread)
    finally:
        saver.close()
    assert _view(listed) == expected
    latest = [
        next((t for t in listed if t.config["configurable"]["checkpoint_ns"] == ns), None)
        for ns in ("", "child")
    ]
    for got in _cold(db, thread, [t.config for t in listed]):
        assert got == [*listed, *latest]


def _events(db: Database, thread: str) -> int:
    with db.connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM agent_events WHERE session_id = %s", (thread_session(thread),)
        ).fetchone()
    assert row is not None
    (n,) = row
    assert isinstance(n, int)
    return n


def _threads(n: int) -> list[str]:
    base = f"t-{uuid.uuid4()}"
    return [f"{base}-{i}" for i in range(n)]


def test_delete_thread_and_adelete_thread_hide_their_thread_only(db: Database) -> None:
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        a, b, other = _threads(3)
        cps = _checkpoints(saver)
        for thread in (a, b, other):
            _fill(saver, thread, cps)
        before = _view(_listed(saver, other))
        assert len(before) == len(_PLAN)
        assert saver.get_tuple({"configurable": {"thread_id": a}}) is not None  # folded, kept
        saver.delete_thread(a)
        assert saver.get_tuple({"configurable": {"thread_id": a}}) is None
        assert _listed(saver, a) == []

        async def adelete(asaver: LedgerSaver) -> tuple[Any, Any, list[Any]]:
            config: RunnableConfig = {"configurable": {"thread_id": b}}
            seen = await asaver.aget_tuple(config)  # read (cold) before the deletion
            await asaver.adelete_thread(b)
            return seen, await asaver.aget_tuple(config), [t async for t in asaver.alist(config)]

        seen, after, alisted = _on_async(db, adelete)
        assert seen is not None and after is None and alisted == []
        for thread in (a, b):
            _assert_reads(db, thread, [])
            assert all(t is None for got in _cold(db, thread, []) for t in got)
        _assert_reads(db, other, before)
        assert _view(_listed(saver, other)) == before
    finally:
        saver.close()


def test_delete_for_runs_and_adelete_for_runs_hide_those_runs_checkpoints_and_writes(
    db: Database,
) -> None:
    """Every thread's checkpoints of the runs named go, with their writes; those of other runs,
    in the same threads or others, stay as they were."""
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        a, a2, b, b2 = _threads(4)
        cps = _checkpoints(saver)
        tag = uuid.uuid4().hex  # run ids of this test only: the operation reads every thread
        sync_runs = {"r1": f"{tag}-a1", "r2": f"{tag}-a2"}
        async_runs = {"r1": f"{tag}-b1", "r2": f"{tag}-b2"}
        _fill(saver, a, cps, sync_runs)
        _fill(saver, a2, cps, {"r1": f"{tag}-a1", "r2": f"{tag}-other"})
        _fill(saver, b, cps, async_runs)
        _fill(saver, b2, cps, {"r1": f"{tag}-b1", "r2": f"{tag}-other"})
        whole = _view(_listed(saver, a))
        run_of = {c["id"]: run for (_, c, _), (_, run) in zip(cps, _PLAN, strict=True)}
        kept = [row for row in whole if run_of[row[1]] == "r2"]
        assert 0 < len(kept) < len(whole)
        saver.delete_for_runs([sync_runs["r1"]])
        for thread in (a, a2):  # both threads of the run, folded as they were and cold
            assert _view(_listed(saver, thread)) == kept
            _assert_reads(db, thread, kept)
        for thread in (b, b2):  # the other runs' threads: untouched
            _assert_reads(db, thread, whole)
        hidden: list[RunnableConfig] = [  # not read by id either, folded or cold
            {"configurable": {"thread_id": a, "checkpoint_ns": ns, "checkpoint_id": c["id"]}}
            for (ns, c, _), (_, run) in zip(cps, _PLAN, strict=True)
            if run == "r1"
        ]
        assert all(saver.get_tuple(config) is None for config in hidden)
        for got in _cold(db, a, hidden):
            assert got[: len(hidden)] == [None] * len(hidden)

        async def adelete(asaver: LedgerSaver) -> list[Any]:
            await asaver.adelete_for_runs([async_runs["r1"]])
            return [t async for t in asaver.alist({"configurable": {"thread_id": b}})]

        assert _view(_on_async(db, adelete)) == kept
        for thread in (b, b2):
            _assert_reads(db, thread, kept)
        _assert_reads(db, a, kept)  # the async twin hid nothing more of the sync one's threads
    finally:
        saver.close()


def test_copy_thread_and_acopy_thread_give_the_target_the_sources_checkpoints(
    db: Database,
) -> None:
    """The target lists what the source lists (every namespace, values and pending writes,
    its parents), each under its own thread id; the source stays as it was."""
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        source, to_sync, to_async = _threads(3)
        _fill(saver, source, _checkpoints(saver))
        whole = _view(_listed(saver, source))
        saver.copy_thread(source, to_sync)

        async def acopy(asaver: LedgerSaver) -> list[Any]:
            await asaver.acopy_thread(source, to_async)
            return [t async for t in asaver.alist({"configurable": {"thread_id": to_async}})]

        assert _view(_on_async(db, acopy)) == whole
        for thread in (source, to_sync, to_async):
            _assert_reads(db, thread, whole)
            for t in _listed(saver, thread):
                assert t.config["configurable"]["thread_id"] == thread
                assert (
                    t.parent_config is None
                    or t.parent_config["configurable"]["thread_id"] == thread
                )
    finally:
        saver.close()


def test_prune_and_aprune_keep_the_latest_checkpoint_of_each_namespace(db: Database) -> None:
    """``keep_latest`` leaves each namespace's latest checkpoint (its values and writes whole);
    ``delete`` deletes the thread; another thread is untouched; a strategy neither knows is
    refused by both."""
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        a, b, gone_a, gone_b, other = _threads(5)
        cps = _checkpoints(saver)
        for thread in (a, b, gone_a, gone_b, other):
            _fill(saver, thread, cps)
        whole = _view(_listed(saver, a))
        latest = [next(row for row in whole if row[0] == ns) for ns in ("", "child")]
        saver.prune([a])
        saver.prune([gone_a], strategy="delete")
        with pytest.raises(ConfigError, match="unknown prune strategy"):
            saver.prune([other], strategy="keep_none")

        async def aprune(asaver: LedgerSaver) -> None:
            await asaver.aprune([b])
            await asaver.aprune([gone_b], strategy="delete")
            with pytest.raises(ConfigError, match="unknown prune strategy"):
                await asaver.aprune([other], strategy="keep_none")

        _on_async(db, aprune)
        for thread in (a, b):
            _assert_reads(db, thread, sorted(latest, key=lambda row: row[0]))
        for thread in (gone_a, gone_b):
            _assert_reads(db, thread, [])
        _assert_reads(db, other, whole)
        events = _events(db, a)
        saver.prune([a])  # nothing left to hide: nothing appended
        assert _events(db, a) == events
    finally:
        saver.close()
