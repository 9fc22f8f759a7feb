"""Recovery on a real server: rebuild_context from snapshots, retries, fork, verify, inspect, diff."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_cdc import ConcurrentAppendError, register_event_type
from ledger_cdc.admin.verify import verify
from ledger_cdc.client.recovery import (
    fork,
    load_events,
    memoised_model,
    memoised_model_async,
    memoised_tool,
    memoised_tool_async,
    rebuild_context,
    rebuild_context_async,
    retry_tool,
    retry_tool_async,
)
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer import Consumer, ConsumerConfig, build_consumer
from ledger_cdc.errors import InvalidEventError, MemoNotLoadedError
from ledger_cdc.fold import SessionContext, encode_context, fold
from tests.support.cdc import wait_caught_up, wait_streaming
from tests.support.cli import run_cli_process
from tests.support.harness import Database
from tests.unit.test_fold import event_strategy

register_event_type("x.unknown")  # free-form: kept in the log, ignored by the core reducers


class RunningConsumer:
    def __init__(self, dsn: str, snapshot_every: int = 3) -> None:
        self.consumer = build_consumer(
            ConsumerConfig(
                dsn=dsn, create_slot=True, snapshot_every=snapshot_every, max_delay=0.005
            )
        )
        self.thread = threading.Thread(target=self.consumer.run, daemon=True)

    def __enter__(self) -> Consumer:
        self.thread.start()
        return self.consumer

    def __exit__(self, *exc: object) -> None:
        self.consumer.stop()
        self.thread.join(30)


@pytest.fixture
def consumed(db: Database) -> Iterator[Database]:
    """A database whose consumer is streaming (slot created before the test writes anything)."""
    with RunningConsumer(db.dsn):
        wait_streaming(db.dsn)
        yield db


def _prefix_fold(conn: psycopg.Connection[Any], sid: uuid.UUID, upto_seq: int) -> SessionContext:
    evs = [
        e for e in load_events(conn, sid, upto_seq=upto_seq) if not isinstance(e, InvalidEventError)
    ]
    return fold(evs, session_id=sid)


def _without_memo(ctx: SessionContext) -> bytes:
    return encode_context(
        msgspec.structs.replace(ctx, completed_tools={}, completed_models={}, memo_position=0)
    )


def _check_rebuild(
    conn: psycopg.Connection[Any],
    sid: uuid.UUID,
    truth: SessionContext,
    upto_seq: int | None = None,
    later: SessionContext | None = None,
) -> SessionContext:
    """rebuild_context at upto_seq against ``truth`` (a fold from zero to the same point): the
    same state; in memory the calls completed after its snapshot, the others from agent_memo;
    with memo=True the whole memo. ``later`` (a fold to the head): what completed after
    ``upto_seq`` is not memoised as of it."""
    lazy = rebuild_context(conn, sid, upto_seq)
    assert _without_memo(lazy) == _without_memo(truth)
    pos = dict(conn.execute("SELECT seq, position FROM agent_events WHERE session_id = %s", (sid,)))
    assert lazy.completed_tools == {
        k: v for k, v in truth.completed_tools.items() if pos[v.observed_seq] > lazy.memo_position
    }
    assert lazy.completed_models == {
        k: v for k, v in truth.completed_models.items() if pos[v.responded_seq] > lazy.memo_position
    }
    for call_id, tool in truth.completed_tools.items():
        assert memoised_tool(conn, lazy, call_id) == tool
    for request_id, model in truth.completed_models.items():
        assert memoised_model(conn, lazy, request_id) == model
    for call_id in (later.completed_tools if later else {}).keys() - truth.completed_tools:
        assert memoised_tool(conn, lazy, call_id) is None
    full = rebuild_context(conn, sid, upto_seq, memo=True)
    assert full == truth and full.memo_position == 0
    return lazy


def _write_turns(
    db: Database, sid: uuid.UUID, turns: list[list[tuple[str, dict[str, Any]]]]
) -> None:
    with Ledger(db.dsn) as ledger:
        for turn in turns:
            with ledger.transaction() as tx:
                for i, (etype, payload) in enumerate(turn):
                    tx.append(sid, "a" if i % 2 else "b", etype, payload)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(event_strategy, min_size=1, max_size=4), min_size=1, max_size=12))
def test_rebuild_from_snapshot_equals_fold_from_zero_for_every_prefix(
    consumed: Database, turns: list[list[tuple[str, dict[str, Any]]]]
) -> None:
    sid = uuid.uuid4()
    _write_turns(consumed, sid, turns)
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        seqs = [
            int(s)
            for (s,) in conn.execute(
                "SELECT seq FROM agent_events WHERE session_id = %s ORDER BY position", (sid,)
            )
        ]
        (snaps,) = conn.execute(  # type: ignore[misc]
            "SELECT count(*) FROM agent_snapshots WHERE session_id = %s", (sid,)
        ).fetchone()
        if len(seqs) >= 3:
            assert snaps >= 1  # the consumer snapshots every 3 events: some prefixes use one
        head = _prefix_fold(conn, sid, seqs[-1])
        for seq in seqs:
            _check_rebuild(conn, sid, _prefix_fold(conn, sid, seq), seq, later=head)
        _check_rebuild(conn, sid, head)


def _agent_run(db: Database, sid: uuid.UUID, *, finish_tool: bool = False) -> None:
    """A session that dies with one tool call in flight (c2) and one completed (c1)."""
    with Ledger(db.dsn) as ledger:
        ledger.append(
            sid,
            "w1",
            "context.loaded",
            {"messages": [{"role": "user", "content": "go"}], "task": "t"},
        )
        with ledger.transaction() as tx:
            tx.append(
                sid,
                "w1",
                "model.requested",
                {"request_id": "r1", "model": "m", "prompt_hash": "p1", "idempotency_key": "mk1"},
            )
            tx.append(
                sid,
                "w1",
                "model.responded",
                {
                    "request_id": "r1",
                    "model": "m",
                    "content": "use tools",
                    "usage": {"input_tokens": 10, "output_tokens": 2},
                },
            )
            tx.append(
                sid,
                "w1",
                "tool.invoked",
                {
                    "call_id": "c1",
                    "tool": "search",
                    "arguments": {"q": 1},
                    "idempotency_key": f"{sid}:c1",
                },
            )
            tx.append(
                sid,
                "w1",
                "tool.invoked",
                {
                    "call_id": "c2",
                    "tool": "fetch",
                    "arguments": {"u": "x"},
                    "idempotency_key": f"{sid}:c2",
                },
            )
        ledger.append(sid, "w1", "tool.observed", {"call_id": "c1", "result": {"hits": 3}})
        if finish_tool:
            ledger.append(sid, "w1", "tool.observed", {"call_id": "c2", "result": "page"})


def test_rebuild_reports_in_flight_calls_and_memoises_completed_ones(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid)
    with db.connect() as conn:
        ctx = rebuild_context(conn, sid)
    assert (
        list(ctx.pending_tools) == ["c2"] and ctx.pending_tools["c2"].idempotency_key == f"{sid}:c2"
    )
    memo = ctx.memoised_tool("c1")
    assert memo is not None and memo.result == {"hits": 3}
    assert ctx.memoised_tool(idempotency_key=f"{sid}:c1") is memo
    assert ctx.memoised_tool("c2") is None
    model = ctx.memoised_model(prompt_hash="p1")
    assert model is not None and model.content == "use tools" and model.idempotency_key == "mk1"
    assert ctx.memoised_model(idempotency_key="mk1") is model


def test_memo_before_the_snapshot_is_read_from_agent_memo(consumed: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(consumed, sid)
    wait_caught_up(consumed.dsn)
    with Ledger(consumed.dsn) as ledger:  # past the next snapshot (every 3 events)
        for i in range(4):
            ledger.append(sid, "w1", "tool.invoked", {"call_id": f"x{i}", "tool": "t"})
        ledger.append(sid, "w1", "tool.observed", {"call_id": "x3", "result": "late"})
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        (c1_seq,) = conn.execute(  # type: ignore[misc]
            "SELECT seq FROM agent_events WHERE session_id = %s AND event_type = 'tool.observed' "
            "ORDER BY seq LIMIT 1",
            (sid,),
        ).fetchone()
        ctx = rebuild_context(conn, sid)
        (c1_pos,) = conn.execute(  # type: ignore[misc]
            "SELECT position FROM agent_events WHERE seq = %s", (c1_seq,)
        ).fetchone()
        assert ctx.memo_position > c1_pos  # c1 and r1 completed before the snapshot it used
        assert set(ctx.completed_tools) == {"x3"} and ctx.completed_models == {}
        with pytest.raises(MemoNotLoadedError, match="memoised_tool"):
            ctx.memoised_tool("c1")
        with pytest.raises(MemoNotLoadedError):
            ctx.memoised_model(prompt_hash="p1")
        c1 = memoised_tool(conn, ctx, "c1")
        assert c1 is not None and c1.result == {"hits": 3} and c1.observed_seq == c1_seq
        assert memoised_tool(conn, ctx, idempotency_key=f"{sid}:c1") == c1
        late = memoised_tool(conn, ctx, "x3")
        assert late is not None and late is ctx.completed_tools["x3"]  # from memory
        assert memoised_tool(conn, ctx, "c2") is None and memoised_tool(conn, ctx, "nope") is None
        r1 = memoised_model(conn, ctx, prompt_hash="p1")
        assert r1 is not None and r1.content == "use tools" and r1.idempotency_key == "mk1"
        assert memoised_model(conn, ctx, idempotency_key="mk1") == r1
        assert memoised_model(conn, ctx, "r1", prompt_hash="zz") == r1
        assert memoised_model(conn, ctx, idempotency_key="zz", prompt_hash="p1") == r1
        # as of a point before c1 completed: not memoised, though agent_memo has the row
        early = rebuild_context(conn, sid, upto_seq=c1_seq - 1)
        assert memoised_tool(conn, early, "c1") is None and "c1" in early.pending_tools
        full = rebuild_context(conn, sid, memo=True)
        assert set(full.completed_tools) == {"c1", "x3"} and full.memoised_tool("c1") == c1

        async def lookups() -> tuple[Any, Any]:
            async with await psycopg.AsyncConnection.connect(consumed.dsn) as aconn:
                actx = await rebuild_context_async(aconn, sid)
                assert actx == ctx
                return (
                    await memoised_tool_async(aconn, actx, "c1"),
                    await memoised_model_async(aconn, actx, "r1"),
                )

        assert asyncio.run(lookups()) == (c1, r1)


def test_memo_is_bounded_by_position_when_seq_and_position_disagree(
    consumed: Database,
) -> None:
    """Two appends racing on a session can take seq and position in opposite orders (a seq is
    drawn before the position). The memo bound is the snapshot's position, so a call completed
    at position 8 with a seq above the snapshot's last seq is still found."""
    sid = uuid.uuid4()
    with consumed.connect() as conn:
        (low,) = conn.execute("SELECT nextval('agent_events_seq_seq')").fetchone()  # type: ignore[misc]
    with Ledger(consumed.dsn) as ledger:
        for i in range(3):
            ledger.append(sid, "w", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
            ledger.append(sid, "w", "tool.observed", {"call_id": f"c{i}", "result": i})
        ledger.append(sid, "w", "tool.invoked", {"call_id": "c3", "tool": "t"})
        ledger.append(sid, "w", "tool.observed", {"call_id": "c3", "result": 3})  # position 8
    with consumed.connect() as conn:
        conn.execute(  # position 9, with a seq drawn before all the others
            "INSERT INTO agent_events (seq, session_id, agent_id, event_type, payload) "
            'VALUES (%s, %s, \'w\', \'tool.invoked\', \'{"call_id": "c4", "tool": "t"}\')',
            (low, sid),
        )
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        ctx = rebuild_context(conn, sid)
        assert ctx.memo_position == 9 and ctx.last_seq == low and ctx.completed_tools == {}
        c3 = memoised_tool(conn, ctx, "c3")
        assert c3 is not None and c3.result == 3 and c3.observed_seq > ctx.last_seq
        assert list(ctx.pending_tools) == ["c4"]
        assert rebuild_context(conn, sid, memo=True) == _prefix_fold(conn, sid, 2**62)
        # time travel from a snapshot below position 9, to position 8's seq: position 9 is
        # within the bound but outside the seq range after the snapshot; the rebuild re-reads
        seq6, seq8 = (
            int(r[0])
            for r in conn.execute(
                "SELECT seq FROM agent_events WHERE session_id = %s AND position IN (6, 8) "
                "ORDER BY position",
                (sid,),
            )
        )
        conn.execute(
            "DELETE FROM agent_snapshots WHERE session_id = %s AND upto_position > 6", (sid,)
        )
        back = rebuild_context(conn, sid, upto_seq=seq8, memo=True)
        assert back == _prefix_fold(conn, sid, seq8) and "c4" in back.pending_tools
        # to position 6's seq: the log as of it, in position order, ends at 6
        six = rebuild_context(conn, sid, upto_seq=seq6)
        assert six.last_position == 6 and six.pending_tools == {}


def test_retry_tool_records_the_same_key_and_refuses_a_stale_context(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid)
    with db.connect() as conn:
        ctx = rebuild_context(conn, sid)
        stale = rebuild_context(conn, sid)
        res = retry_tool(conn, ctx, "c2", "w2")
        assert not res.duplicate and ctx.last_position == res.position
        assert ctx.pending_tools["c2"].attempts == 2
        row = conn.execute(
            "SELECT agent_id, payload->>'idempotency_key', payload->>'call_id' FROM agent_events "
            "WHERE seq = %s",
            (res.seq,),
        ).fetchone()
        assert row == ("w2", f"{sid}:c2", "c2")
        # the retry is part of the log: a fresh rebuild sees it, equal to the advanced context
        assert rebuild_context(conn, sid) == ctx
        # another worker that rebuilt before the retry loses the race
        with pytest.raises(ConcurrentAppendError):
            retry_tool(conn, stale, "c2", "w3")
        with pytest.raises(Exception, match="not in flight"):
            retry_tool(conn, ctx, "c1", "w2")


def test_async_rebuild_and_retry(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid)

    async def go() -> SessionContext:
        async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as conn:
            ctx = await rebuild_context_async(conn, sid)
            await retry_tool_async(conn, ctx, "c2", "w2")
            return await rebuild_context_async(conn, sid)

    ctx = asyncio.run(go())
    with db.connect() as conn:
        assert ctx == rebuild_context(conn, sid)
    assert ctx.pending_tools["c2"].attempts == 2


@pytest.mark.parametrize("upto", ["5", 5.0, True, b"5"])
def test_an_upto_seq_that_is_no_whole_number_is_refused_by_name(db: Database, upto: object) -> None:
    """Not a driver error from deep in a query (``invalid input syntax for type bigint``): the
    argument is named before anything is read, by rebuild, its async twin and fork."""
    sid = uuid.uuid4()
    _agent_run(db, sid)
    with db.connect() as conn:
        with pytest.raises(InvalidEventError, match="upto_seq"):
            rebuild_context(conn, sid, upto)  # type: ignore[arg-type]
        with pytest.raises(InvalidEventError, match="upto_seq"):
            fork(conn, sid, upto)  # type: ignore[arg-type]
        assert rebuild_context(conn, sid, 10**30).last_position > 0  # a whole number: any

    async def go() -> None:
        async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as conn:
            with pytest.raises(InvalidEventError, match="upto_seq"):
                await rebuild_context_async(conn, sid, upto)  # type: ignore[arg-type]

    asyncio.run(go())


def test_snapshot_of_another_format_or_corrupted_is_skipped(consumed: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(consumed, sid)
    wait_caught_up(consumed.dsn)  # one snapshot per batch at most: two batches, two snapshots
    with Ledger(consumed.dsn) as ledger:
        for i in range(3):
            ledger.append(sid, "w1", "tool.invoked", {"call_id": f"x{i}", "tool": "t"})
    wait_caught_up(consumed.dsn)
    with consumed.connect() as conn:
        truth = _prefix_fold(conn, sid, 2**62)
        snaps = conn.execute(
            "SELECT upto_seq FROM agent_snapshots WHERE session_id = %s ORDER BY upto_seq", (sid,)
        ).fetchall()
        assert len(snaps) >= 2
        # garbage under an old format version and an unknown reducer version: never used
        last_seq = truth.last_seq
        conn.execute(
            "INSERT INTO agent_snapshots (session_id, upto_seq, upto_position, format_version, "
            "reducer_version, content_hash, data) VALUES (%s, %s, %s, 0, 'core-0', '\\x00', %s)",
            (sid, last_seq + 1, truth.last_position, b'{"not": "a context"}'),
        )
        _check_rebuild(conn, sid, truth)
        # the latest current snapshot corrupted in place: skipped, an older one is used
        conn.execute("ALTER TABLE agent_snapshots DISABLE TRIGGER ALL")
        conn.execute(
            "UPDATE agent_snapshots SET data = convert_to(replace(convert_from(data, 'UTF8'), "
            '\'"task":"t"\', \'"task":"u"\'), \'UTF8\') '
            "WHERE session_id = %s AND upto_seq = %s",
            (sid, snaps[-1][0]),
        )
        (changed,) = conn.execute(  # type: ignore[misc]
            "SELECT count(*) FROM agent_snapshots WHERE session_id = %s "
            "AND convert_from(data, 'UTF8') LIKE '%%\"task\":\"u\"%%'",
            (sid,),
        ).fetchone()
        assert changed == 1  # the corruption took
        _check_rebuild(conn, sid, truth)
        # … and edited to nest past what the decoder takes, its content hash recomputed to
        # match: a RecursionError broke the rebuild; skipped like any unreadable snapshot
        deep = b'{"extra":' + b'{"k":' * 5000 + b"1" + b"}" * 5000 + b"}"
        conn.execute(
            "UPDATE agent_snapshots SET data = %s, content_hash = sha256(%s) "
            "WHERE session_id = %s AND upto_seq = %s",
            (deep, deep, sid, snaps[-1][0]),
        )
        _check_rebuild(conn, sid, truth)


def test_fork_copies_the_prefix_and_diff_starts_at_the_fork_point(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid, finish_tool=True)
    with db.connect() as conn:
        seqs = [
            int(s)
            for (s,) in conn.execute(
                "SELECT seq FROM agent_events WHERE session_id = %s ORDER BY position", (sid,)
            )
        ]
        res = fork(conn, sid, seqs[4], reason="try another tool")  # both calls in flight
        assert res.events == 5 and res.upto_position == 5
        forked = rebuild_context(conn, res.session_id)
        assert forked.forked_from is not None and forked.forked_from.session_id == sid
        assert forked.last_position == 6  # the marker, then the 5 copies
        origin_prefix = _prefix_fold(conn, sid, seqs[4])

        # the same state as the origin at the fork point (seqs are the fork's own)
        def calls(c: SessionContext) -> dict[str, Any]:
            return {k: (v.tool, v.arguments, v.idempotency_key) for k, v in c.pending_tools.items()}

        assert (
            calls(forked)
            == calls(origin_prefix)
            == {"c1": ("search", {"q": 1}, f"{sid}:c1"), "c2": ("fetch", {"u": "x"}, f"{sid}:c2")}
        )
        assert forked.messages == origin_prefix.messages
        assert list(forked.completed_models) == list(origin_prefix.completed_models) == ["r1"]
        # outbox rows are not copied; the fork's hash chain is intact
        (n,) = conn.execute(
            "SELECT count(*) FROM agent_outbox WHERE session_id = %s", (res.session_id,)
        ).fetchone()  # type: ignore[misc]
        assert n == 0
    # no consumer here: the chain alone, the fork's missing projection only noted
    report = verify(db.dsn, [res.session_id], consumer_wait=-1)
    assert report.ok and report.chained_events == 6
    out = _cli(db, "diff", str(sid), str(res.session_id), "--json")
    assert out.returncode == 1
    d = json.loads(out.stdout)
    assert d["common_steps"] == 5 and d["step"] == 6 and d["seq_b"] is None


def _cli(db: Database, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli_process(
        *args,
        "--dsn",
        db.dsn,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_verify_catches_edited_projection_columns_and_an_unreadable_context(
    consumed: Database,
) -> None:
    """The columns readers filter on (status, run_status, …) hold what the context says, and a
    context edited into something no reader can decode is a difference, not a crash."""
    a, b = uuid.uuid4(), uuid.uuid4()
    _agent_run(consumed, a, finish_tool=True)
    _agent_run(consumed, b)
    wait_caught_up(consumed.dsn)
    assert verify(consumed.dsn).ok
    with consumed.connect() as conn:
        conn.execute(
            "UPDATE agent_sessions SET status = 'failed', run_status = 'pending', "
            "event_count = event_count + 5 WHERE session_id = %s",
            (a,),
        )
        conn.execute("UPDATE agent_sessions SET context = '\"x\"' WHERE session_id = %s", (b,))
    report = verify(consumed.dsn)
    found = {(d.session_id, d.field) for d in report.differences}
    assert {(a, "column status"), (a, "column run_status"), (a, "column event_count")} <= found
    assert any(
        d.session_id == b and "projection is unreadable" in d.detail for d in report.differences
    )
    out = _cli(consumed, "verify", "--all")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr


def test_verify_catches_corrupted_projection_snapshot_and_chain(consumed: Database) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    _agent_run(consumed, a, finish_tool=True)
    _agent_run(consumed, b)
    wait_caught_up(consumed.dsn)
    consumer_dsn = consumed.dsn
    assert verify(consumer_dsn).ok
    ok = _cli(consumed, "verify", "--all")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    with consumed.connect() as conn:
        conn.execute(
            "UPDATE agent_sessions SET context = jsonb_set(context, '{usage,input_tokens}', '999') "
            "WHERE session_id = %s",
            (a,),
        )
        (snap_seq,) = conn.execute(  # type: ignore[misc]
            "SELECT min(upto_seq) FROM agent_snapshots WHERE session_id = %s", (b,)
        ).fetchone()
        # (a running session's snapshot leaves its status out: it holds the default)
        conn.execute(
            "UPDATE agent_snapshots SET data = convert_to(replace(convert_from(data, 'UTF8'), "
            '\'{"session_id"\', \'{"status":"completed","session_id"\'), \'UTF8\'), '
            "content_hash = sha256(convert_to(replace(convert_from(data, 'UTF8'), "
            '\'{"session_id"\', \'{"status":"completed","session_id"\'), \'UTF8\')) '
            "WHERE session_id = %s AND upto_seq = %s",
            (b, snap_seq),
        )
    report = verify(consumer_dsn)
    found = {(d.session_id, d.kind, d.field) for d in report.differences}
    assert (a, "projection", "usage.input_tokens") in found
    assert (b, "snapshot", "status") in found
    diff_a = next(d for d in report.differences if d.session_id == a)
    assert diff_a.expected == 10 and diff_a.actual == 999 and diff_a.seq is not None
    assert not any(d.kind == "chain" for d in report.differences)
    assert not any(d.kind == "memo" for d in report.differences)
    # the memo table: a result edited, a row lost
    with consumed.connect() as conn:
        conn.execute(
            "UPDATE agent_memo SET entry = jsonb_set(entry, '{result}', '\"edited\"') "
            "WHERE session_id = %s AND call_id = 'c2'",
            (a,),
        )
        conn.execute("DELETE FROM agent_memo WHERE session_id = %s AND call_id = 'r1'", (b,))
    memo = {
        (d.session_id, d.field): (d.expected, d.actual)
        for d in verify(consumer_dsn).differences
        if d.kind == "memo"
    }
    assert memo == {
        (a, "completed_tools.c2.result"): ("page", "edited"),
        (b, "completed_models.r1"): ("row", None),
    }
    # a row edited behind the guard's back: the chain walk names it
    with consumed.connect() as conn:
        conn.execute("ALTER TABLE agent_events DISABLE TRIGGER agent_events_append_only")
        (seq,) = conn.execute(  # type: ignore[misc]
            "UPDATE agent_events SET payload = jsonb_set(payload, '{result}', '\"forged\"') "
            "WHERE session_id = %s AND event_type = 'tool.observed' RETURNING seq",
            (b,),
        ).fetchone()
        conn.execute("ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_append_only")
    out = _cli(consumed, "verify", "--all", "--json")
    assert out.returncode == 1, out.stderr
    rep = json.loads(out.stdout)
    chain = [d for d in rep["differences"] if d["kind"] == "chain"]
    assert (
        chain == [{**chain[0], "session_id": str(b), "seq": seq}]
        and "contents" in chain[0]["detail"]
    )


def test_replay_and_inspect_commands(db: Database) -> None:
    sid = uuid.uuid4()
    _agent_run(db, sid)
    out = _cli(db, "replay", str(sid), "--json")
    assert out.returncode == 0, out.stderr
    ctx = json.loads(out.stdout)
    assert list(ctx["pending_tools"]) == ["c2"] and ctx["completed_tools"]["c1"]["result"] == {
        "hits": 3
    }
    human = _cli(db, "replay", str(sid))
    assert "in flight" in human.stdout and f"{sid}:c2" in human.stdout
    out = _cli(db, "inspect", str(sid), "--json")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    marks = {
        r["summary"].split(" · ")[-1]: (r["mark"], r["pair_seq"])
        for r in rows
        if r["event_type"] == "tool.invoked"
    }
    observed_seq = next(r["seq"] for r in rows if r["event_type"] == "tool.observed")
    assert marks == {"c1": (None, observed_seq), "c2": ("in flight", None)}
    assert "in flight" in _cli(db, "inspect", str(sid)).stdout
    missing = _cli(db, "replay", str(uuid.uuid4()))
    assert missing.returncode == 1 and "has no events" in missing.stderr
    bad = _cli(db, "replay", "not-a-uuid")  # looked up as a framework's name: unknown
    assert bad.returncode == 1 and "is neither a session id" in bad.stderr
