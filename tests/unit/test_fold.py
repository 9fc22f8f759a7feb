"""Reducers: what they derive, and that they are deterministic — folding a log in one pass equals
folding it from any snapshot point onward (through the stored JSON form)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_cdc.errors import MemoNotLoadedError
from ledger_cdc.events import LedgerEvent, decode_payload, encode_payload
from ledger_cdc.fold import (
    CompletedTool,
    SessionContext,
    apply,
    completion,
    decode_context,
    encode_context,
    encode_snapshot,
    fold,
    reducer_version,
    references,
    register_reducer,
    unregister_reducer,
)
from tests.support.refs import attach_from

SID = uuid.UUID(int=7)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def ev(
    pos: int, etype: str, payload: dict[str, Any], agent: str = "a", key: str | None = None
) -> LedgerEvent:
    value = (
        decode_payload(etype, encode_payload(etype, payload)) if etype != "x.unknown" else payload
    )
    return LedgerEvent(pos * 10, SID, pos, agent, etype, value, T0, key)


def test_reducers_derive_the_session_state() -> None:
    log = [
        ev(1, "context.loaded", {"messages": [{"role": "user", "content": "hi"}], "task": "t"}),
        ev(2, "model.requested", {"request_id": "r1", "model": "m", "prompt_hash": "ph"}),
        ev(
            3,
            "model.responded",
            {
                "request_id": "r1",
                "model": "m",
                "content": "calling",
                "usage": {"input_tokens": 10, "output_tokens": 3},
            },
        ),
        ev(4, "tool.invoked", {"call_id": "c1", "tool": "search", "arguments": {"q": 1}}, key="k1"),
        ev(5, "tool.invoked", {"call_id": "c2", "tool": "fetch"}),
        ev(6, "tool.observed", {"call_id": "c1", "result": {"rows": 2}}),
        ev(7, "x.unknown", {"anything": True}),
        ev(8, "handoff.emitted", {"handoff_id": "h", "to_agent": "b"}),
        ev(9, "handoff.received", {"handoff_id": "h", "from_agent": "a"}, agent="b"),
        ev(10, "task.failed", {"error": "boom", "retryable": True}, agent="b"),
    ]
    ctx = fold(log)
    assert ctx.task == "t" and ctx.status == "failed" and ctx.error == "boom" and ctx.retryable
    assert list(ctx.pending_tools) == ["c2"]
    assert ctx.completed_tools["c1"].result == {"rows": 2}
    assert ctx.completed_tools["c1"].idempotency_key == "k1"
    assert (
        ctx.completed_tools["c1"].invoked_seq == 40 and ctx.completed_tools["c1"].observed_seq == 60
    )
    assert ctx.completed_models["r1"].prompt_hash == "ph" and ctx.pending_models == {}
    assert (ctx.usage.input_tokens, ctx.usage.output_tokens, ctx.usage.model_calls) == (10, 3, 1)
    assert [m.role for m in ctx.messages] == ["user", "assistant", "tool"]
    assert ctx.handoffs_emitted[0].agent == "b" and ctx.handoffs_received[0].agent == "a"
    assert ctx.agents == ["a", "b"] and ctx.ignored_events == 1
    assert (ctx.event_count, ctx.last_seq, ctx.last_position) == (10, 100, 10)


def test_retry_of_a_pending_tool_keeps_its_first_seq_and_counts_attempts() -> None:
    ctx = fold(
        [
            ev(1, "tool.invoked", {"call_id": "c", "tool": "t", "idempotency_key": "k"}),
            ev(2, "tool.invoked", {"call_id": "c", "tool": "t", "idempotency_key": "k"}),
        ]
    )
    assert ctx.pending_tools["c"].attempts == 2 and ctx.pending_tools["c"].invoked_seq == 10


def test_fold_does_not_touch_its_starting_context() -> None:
    start = fold([ev(1, "tool.invoked", {"call_id": "c", "tool": "t"})])
    before = encode_context(start)
    fold([ev(2, "tool.observed", {"call_id": "c", "result": 1})], start)
    assert encode_context(start) == before


def test_custom_reducer_and_version() -> None:
    def count(state: dict[str, int], e: LedgerEvent) -> dict[str, int]:
        return {**state, e.event_type: state.get(e.event_type, 0) + 1}

    register_reducer("counts", count, event_types=["tool.invoked"], version="2")
    try:
        assert reducer_version().endswith("+counts-2")
        ctx = fold(
            [ev(1, "tool.invoked", {"call_id": "c", "tool": "t"}), ev(2, "task.completed", {})]
        )
        assert ctx.extra["counts"] == {"tool.invoked": 1}
    finally:
        unregister_reducer("counts")


event_strategy = st.one_of(
    st.builds(
        lambda c, t: ("tool.invoked", {"call_id": f"c{c}", "tool": t, "arguments": {"n": c}}),
        st.integers(0, 5),
        st.sampled_from(["a", "b"]),
    ),
    st.builds(
        lambda c, r: ("tool.observed", {"call_id": f"c{c}", "result": r}),
        st.integers(0, 5),
        st.one_of(
            st.integers(),
            # (no NUL, no lone surrogate: a writer refuses both, and these events are written)
            st.text(
                st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=5
            ),
            st.none(),
        ),
    ),
    st.builds(
        lambda r: ("model.requested", {"request_id": f"r{r}", "model": "m"}), st.integers(0, 3)
    ),
    st.builds(
        lambda r, i, o: (
            "model.responded",
            {
                "request_id": f"r{r}",
                "model": "m",
                "content": "x",
                "usage": {"input_tokens": i, "output_tokens": o},
            },
        ),
        st.integers(0, 3),
        st.integers(0, 100),
        st.integers(0, 100),
    ),
    st.just(("context.loaded", {"messages": [{"role": "system", "content": "s"}]})),
    st.just(("task.completed", {"result": 1})),
    st.just(("task.failed", {"error": "e"})),
    st.just(("x.unknown", {"z": 1})),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(event_strategy, min_size=1, max_size=40), st.data())
def test_one_pass_equals_fold_from_any_snapshot(
    raw: list[tuple[str, dict[str, Any]]], data: st.DataObject
) -> None:
    log = [ev(i + 1, t, p, agent="a" if i % 2 else "b") for i, (t, p) in enumerate(raw)]
    whole = fold(log)
    cut = data.draw(st.integers(0, len(log)))
    snapshot = decode_context(encode_context(fold(log[:cut], session_id=SID)))  # as stored
    resumed = fold(log[cut:], snapshot)
    assert resumed == whole
    assert encode_context(resumed) == encode_context(whole)
    again = SessionContext(SID)
    for e in log:
        apply(again, e)
    assert again == whole


def test_run_state_machine_suspend_signal_lease() -> None:
    log = [
        ev(1, "run.queued", {}),
        ev(2, "run.leased", {"worker": "w1", "ttl": 30}),
        ev(3, "signal.received", {"name": "early", "payload": 1}),  # before anyone waits for it
        ev(4, "run.suspended", {"reason": "needs approval", "wait_for": ["approve", "reject"]}),
    ]
    ctx = fold(log)
    run = ctx.run
    assert run is not None and run.status == "suspended" and run.lease is None
    assert run.wait_for == ["approve", "reject"] and [s.name for s in run.inbox] == ["early"]
    ctx = fold([ev(5, "signal.received", {"name": "other"})], ctx)
    assert ctx.run is not None and ctx.run.status == "suspended"  # not one it waits for
    ctx = fold([ev(6, "signal.received", {"name": "approve", "payload": {"by": "ann"}})], ctx)
    run = ctx.run
    assert run is not None and run.status == "pending"
    assert run.woken_by is not None and run.woken_by.payload == {"by": "ann"}
    ctx = fold([ev(7, "run.leased", {"worker": "w2", "ttl": 10})], ctx)
    run = ctx.run
    assert run is not None and run.status == "running" and run.lease is not None
    assert run.lease.worker == "w2" and run.lease.until == T0 + dt.timedelta(seconds=10)
    assert run.lease.seq == 70 and run.leases == 2
    done = fold([ev(8, "task.completed", {"result": 1})], ctx)
    assert done.run is not None and done.run.status == "completed" and done.run.lease is None


def test_a_signal_that_came_first_wakes_the_suspension_at_once() -> None:
    ctx = fold(
        [
            ev(1, "run.queued", {}),
            ev(2, "signal.received", {"name": "approve"}),
            ev(3, "run.leased", {"worker": "w", "ttl": 5}),
            ev(4, "run.suspended", {"reason": "r", "wait_for": ["approve"]}),
        ]
    )
    assert ctx.run is not None and ctx.run.status == "pending" and ctx.run.inbox == []
    released = fold(
        [ev(5, "run.leased", {"worker": "w", "ttl": 5}), ev(6, "run.released", {"worker": "x"})],
        ctx,
    )
    assert released.run is not None and released.run.status == "running"  # not x's lease
    released = fold([ev(7, "run.released", {"worker": "w"})], released)
    assert released.run is not None and released.run.status == "pending"


@settings(max_examples=150, deadline=None)
@given(st.lists(event_strategy, min_size=1, max_size=40), st.data())
def test_a_snapshot_plus_its_completions_equals_the_fold(
    raw: list[tuple[str, dict[str, Any]]], data: st.DataObject
) -> None:
    """What a snapshot stores (no memo) plus the completions the consumer writes to agent_memo
    (one per completing event, by ``completion``) give back the whole context."""
    log = [ev(i + 1, t, p) for i, (t, p) in enumerate(raw)]
    whole = fold(log)
    cut = data.draw(st.integers(1, len(log)))
    prefix = fold(log[:cut], session_id=SID)
    stored = decode_context(encode_snapshot(prefix))
    assert stored.memo_position == prefix.last_position
    assert stored.completed_tools == {} and stored.completed_models == {}
    # the window's messages and the long ones taken from events are left in those events
    at, positions = references(stored)
    if at is not None:
        loaded = next(e for e in log if e.position == at)
        assert loaded.event_type == "context.loaded"
        assert len(stored.messages) == len(prefix.messages) - len(loaded.payload.messages)
    omitted = [s for s in stored.sources if s.omitted]
    assert positions == [s.position for s in omitted]
    base = prefix.window.length if at is not None and prefix.window is not None else 0
    assert all(stored.messages[s.index - base].content == "" for s in omitted)
    attach_from(stored, log)
    memo: dict[tuple[str, str], Any] = {}  # agent_memo: the latest completion of each call
    ctx = SessionContext(SID)
    for e in log[:cut]:
        apply(ctx, e)
        done = completion(ctx, e)
        if isinstance(done, CompletedTool):
            memo["tool", done.call_id] = done
        elif done is not None:
            memo["model", done.request_id] = done
    assert {k for k in memo if k[0] == "tool"} == {("tool", c) for c in prefix.completed_tools}
    assert {k for k in memo if k[0] == "model"} == {("model", r) for r in prefix.completed_models}
    assert all(memo["tool", c] == t for c, t in prefix.completed_tools.items())
    assert all(memo["model", r] == m for r, m in prefix.completed_models.items())
    resumed = fold(log[cut:], stored)
    tail_tools = {c: t for c, t in whole.completed_tools.items() if t.observed_seq > cut * 10}
    assert resumed.completed_tools == tail_tools
    assert msgspec.structs.replace(
        resumed, completed_tools={}, completed_models={}, memo_position=0
    ) == (msgspec.structs.replace(whole, completed_tools={}, completed_models={}))


def test_a_long_tool_result_is_stored_by_reference_unless_a_float_is_in_it() -> None:
    """A result whose text readers give back as the fold wrote it (a string, or a value with no
    float) is left in its event by a stored context; one holding a float is copied."""
    rows = [{"id": 2**70, "title": 'a "quoted" \\ title, é'} for _ in range(8)]
    log = [
        ev(1, "tool.invoked", {"call_id": "c1", "tool": "t"}),
        ev(2, "tool.observed", {"call_id": "c1", "result": {"rows": rows}}),
        ev(3, "tool.invoked", {"call_id": "c2", "tool": "t"}),
        ev(4, "tool.observed", {"call_id": "c2", "result": {"rows": rows, "score": 0.5}}),
        ev(5, "tool.invoked", {"call_id": "c3", "tool": "t"}),
        ev(6, "tool.observed", {"call_id": "c3", "result": "x" * 300}),
    ]
    ctx = fold(log)
    assert [(s.index, s.position) for s in ctx.sources] == [(0, 2), (2, 6)]
    stored = decode_context(encode_snapshot(ctx))
    assert [m.content == "" for m in stored.messages] == [True, False, True]
    assert references(stored) == (None, [2, 6])
    assert attach_from(stored, log).messages == ctx.messages


def test_a_stored_context_leaves_out_the_fields_at_their_default() -> None:
    ctx = fold([ev(1, "tool.invoked", {"call_id": "c", "tool": "t"})])
    stored = msgspec.json.decode(encode_snapshot(ctx))
    assert set(stored) == {
        "session_id",
        "pending_tools",
        "memo_position",
        "usage",
        "agents",
        "event_count",
        "last_seq",
        "last_position",
    }
    assert decode_context(encode_snapshot(ctx)) == msgspec.structs.replace(ctx, memo_position=1)


def test_a_context_without_its_memo_refuses_to_say_not_completed() -> None:
    log = [
        ev(1, "tool.invoked", {"call_id": "c1", "tool": "t", "idempotency_key": "k1"}),
        ev(2, "tool.observed", {"call_id": "c1", "result": 1}),
        ev(3, "tool.invoked", {"call_id": "c2", "tool": "t", "idempotency_key": "k2"}),
        ev(4, "tool.observed", {"call_id": "c2", "result": 2}),
    ]
    stored = decode_context(encode_snapshot(fold(log[:2])))
    ctx = fold(log[2:], stored)
    assert ctx.memoised_tool("c2") is ctx.completed_tools["c2"]
    assert ctx.memoised_tool(idempotency_key="k2") is ctx.completed_tools["c2"]
    with pytest.raises(MemoNotLoadedError, match="c1"):
        ctx.memoised_tool("c1")
    with pytest.raises(MemoNotLoadedError):
        ctx.memoised_model("r1")
    assert ctx.memoised_tool() is None and fold(log).memoised_tool("c9") is None
