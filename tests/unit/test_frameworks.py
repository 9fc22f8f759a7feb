"""Framework events read without the frameworks (no server): LangGraph values decoded as its
serializer wrote them, a real graph's checkpoints folded into where the graph is, OpenAI Agents
items and Pydantic AI records by role and kind, two threads compared, and the total-fold rule
for all of them (a malformed payload is quarantined, never an exception)."""

from __future__ import annotations

import base64
import datetime as dt
import operator
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, TypedDict

import msgspec
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import START, StateGraph
from langgraph.types import Command, Interrupt, Send, interrupt

from ledger_cdc.admin.readable import describe, diff_threads, readable_timeline
from ledger_cdc.client.frameworks import KINDS, parse_name, session_of
from ledger_cdc.events import CheckpointSaved, LedgerEvent, Rejected, Typed, load_payload
from ledger_cdc.fold import SessionContext, default_reducers, fold, fold_one
from ledger_cdc.fold.frameworks import (
    FRAMEWORK_PROJECTION,
    Instance,
    Opaque,
    decode_typed,
    graph_status,
    item_view,
    plain,
    record_view,
    render,
)
from ledger_cdc.integrations.langgraph import LedgerSaver

T0 = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)


class Recorder(InMemorySaver):
    """LangGraph's in-memory saver that also makes the ledger events LedgerSaver appends (its
    own event builders), so a real graph's events are folded here without a server."""

    def __init__(self) -> None:
        super().__init__()
        self.lg = LedgerSaver(None, None)
        self.events: dict[str, list[tuple[str, bytes]]] = {}

    def _add(self, thread: str, event_type: str, ev: Any) -> None:
        self.events.setdefault(thread, []).append((event_type, msgspec.json.encode(ev)))

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        thread, ev, _, stored = self.lg._checkpoint_event(
            config, checkpoint, metadata, new_versions
        )
        stored()
        self._add(thread, "langgraph.checkpoint", ev)
        return super().put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        thread, ev = self.lg._writes_event(config, writes, task_id, task_path)
        self._add(thread, "langgraph.writes", ev)
        super().put_writes(config, writes, task_id, task_path)

    def ledger(self, thread: str) -> list[LedgerEvent | Rejected]:
        sid = session_of("thread", thread)
        return [_event(sid, i + 1, et, text) for i, (et, text) in enumerate(self.events[thread])]


def _event(sid: uuid.UUID, pos: int, event_type: str, text: bytes | str) -> LedgerEvent:
    return LedgerEvent(
        pos, sid, pos, "langgraph", event_type, load_payload(event_type, text), T0, None, b""
    )


class Ticket(TypedDict):
    messages: Annotated[list[Any], operator.add]
    done: Annotated[list[str], operator.add]
    approved: bool


def _graph(saver: Recorder, fail_once: list[int]) -> Any:
    def triage(s: Ticket) -> dict[str, Any]:
        return {"messages": [AIMessage("refund?")], "done": ["triaged"]}

    def lookup(s: Ticket) -> dict[str, Any]:
        if fail_once:
            fail_once.pop()
            raise RuntimeError("db down")
        return {"done": ["looked up"], "messages": [ToolMessage("order 7: $40", tool_call_id="t")]}

    def approve(s: Ticket) -> dict[str, Any]:
        return {"approved": interrupt({"question": "Refund $40?"}) == "yes"}

    def finish(s: Ticket) -> dict[str, Any]:
        return {"done": ["refunded" if s["approved"] else "declined"]}

    b = StateGraph(Ticket)
    for name, fn in (("triage", triage), ("lookup", lookup), ("approve", approve)):
        b.add_node(name, fn)
    b.add_node("finish", finish)
    b.add_edge(START, "triage")
    b.add_edge("triage", "lookup")
    b.add_edge("lookup", "approve")
    b.add_edge("approve", "finish")
    return b.compile(checkpointer=saver)


def _run(saver: Recorder, thread: str, answer: str | None) -> Iterator[str]:
    """Run the ticket graph: crash in lookup, resume, stop at the approval, resume with
    ``answer``; yields the graph's state (as the fold says) after each stage."""
    g = _graph(saver, [1])
    config: Any = {"configurable": {"thread_id": thread}}
    with pytest.raises(RuntimeError):
        g.invoke({"messages": [HumanMessage("I want a refund")], "done": []}, config)
    yield _status(saver, thread)
    g.invoke(None, config)
    yield _status(saver, thread)
    if answer is not None:
        g.invoke(Command(resume=answer), config)
        yield _status(saver, thread)


def _status(saver: Recorder, thread: str) -> str:
    ctx = fold(saver.ledger(thread))
    assert ctx.quarantined == 0
    st = graph_status(ctx.extra[FRAMEWORK_PROJECTION]["langgraph"])
    assert st is not None
    return st.text


def test_decoding_agrees_with_the_savers_serializer() -> None:
    """Every value as JsonPlusSerializer reads it back, as plain data: objects by class and
    fields (nothing imported), the rest as themselves."""
    serde = JsonPlusSerializer()
    values: list[Any] = [
        {"a": [1, 2.5, None, True, "x"]},
        AIMessage("hi", tool_calls=[{"name": "t", "args": {"n": 1}, "id": "c1"}]),
        HumanMessage("hello"),
        Interrupt(value={"q": "ok?"}, id="i1"),
        Send("node", {"arg": 1}),
        uuid.UUID(int=7),
        T0,
        {1, 2},
        b"raw",
    ]
    for v in values:
        got = decode_typed(Typed.of(serde.dumps_typed(v)))
        back = serde.loads_typed(serde.dumps_typed(v))
        if isinstance(back, (AIMessage, HumanMessage)):
            assert isinstance(got, Instance) and got.name == type(back).__name__
            assert plain(got.fields) == plain(back.model_dump())
        elif isinstance(back, Interrupt):
            assert isinstance(got, Instance) and got.fields["value"] == back.value
        elif isinstance(back, Send):
            assert isinstance(got, Instance) and got.fields == [back.node, back.arg]
        elif isinstance(back, (uuid.UUID, dt.datetime, set)):
            assert isinstance(got, Instance) and got.name == type(back).__name__
        else:
            assert got == back
    assert render(decode_typed(Typed.of(serde.dumps_typed(AIMessage("hi"))))) == (
        "AIMessage(content='hi')"
    )
    assert decode_typed(Typed("pickle", base64.b64encode(b"\x80\x04").decode())) == Opaque(
        "pickle", 2
    )


def test_a_crashed_interrupted_and_resumed_graph_is_told_as_it_went() -> None:
    saver = Recorder()
    stages = list(_run(saver, "ticket-7", "yes"))
    assert stages[0] == "failed at node lookup: RuntimeError('db down')"
    assert stages[1] == "interrupted at node approve waiting for {'question': 'Refund $40?'}"
    assert stages[2] == "done"
    rows = readable_timeline(saver.ledger("ticket-7"))
    text = "\n".join(f"{r.agent_id} {r.mark} {r.summary}" for r in rows)
    assert "step 1 (loop) · ran triage" in text
    assert "langgraph/lookup failed lookup ✗ RuntimeError('db down')" in text
    assert "interrupt approve interrupt: {'question': 'Refund $40?'}" in text
    assert "(input) resume: 'yes'" in text
    assert "next approve" in text and "parent …" in text
    # each row's summary is cut to a line's worth, whole on request
    long = [r.summary for r in readable_timeline(saver.ledger("ticket-7"), None)]
    assert max(map(len, long)) >= max(len(r.summary) for r in rows)


def test_a_value_stored_compressed_is_told_as_it_was_written() -> None:
    """A message list of 2 KiB or more is stored as a Zstandard frame (its tag ``zstd:``);
    the fold and the timeline read it as they read any other value."""
    saver = Recorder()
    request = "I want a refund for " + " ".join(f"order-{i}" for i in range(600))
    g = _graph(saver, [])
    g.invoke(
        {"messages": [HumanMessage(request)], "done": []}, {"configurable": {"thread_id": "z"}}
    )
    events = saver.ledger("z")
    packed = [
        b.value
        for ev in events
        if isinstance(ev, LedgerEvent) and isinstance(ev.payload, CheckpointSaved)
        for b in ev.payload.blobs
        if b.channel == "messages" and b.value.type == "zstd:msgpack"
    ]
    assert packed and all(len(v.data) < len(request) for v in packed)
    messages = decode_typed(packed[0])
    assert isinstance(messages, list) and isinstance(messages[0], Instance)
    assert messages[0].fields["content"] == request
    assert (
        _status(saver, "z") == "interrupted at node approve waiting for {'question': 'Refund $40?'}"
    )
    text = "\n".join(r.summary for r in readable_timeline(events, None))
    assert "order-599" in text


def test_the_graph_state_is_the_same_folded_in_one_pass_or_from_a_snapshot() -> None:
    saver = Recorder()
    list(_run(saver, "t", "no"))
    events = saver.ledger("t")
    whole = fold(events)
    for cut in range(1, len(events)):
        part = fold(events[:cut])
        again = fold(events[cut:], part)
        assert again.extra == whole.extra
    assert whole.ignored_events == whole.extra[FRAMEWORK_PROJECTION]["events"] == len(events)


def test_two_threads_diverge_at_the_step_and_channel_of_the_approval() -> None:
    saver = Recorder()
    list(_run(saver, "yes", "yes"))
    list(_run(saver, "no", "no"))
    d = diff_threads(saver.ledger("yes"), saver.ledger("no"))
    assert (d.step, d.channel, d.a, d.b) == (3, "approved", True, False)
    same = diff_threads(saver.ledger("yes"), saver.ledger("yes"))
    assert same.reason == "same" and same.step is None
    # ids and times are not compared: two runs with the same answers agree
    list(_run(saver, "yes-again", "yes"))
    assert diff_threads(saver.ledger("yes"), saver.ledger("yes-again")).reason == "same"


def _typed(data: bytes, t: str = "msgpack") -> list[str]:
    return [t, base64.b64encode(data).decode()]


_BOMB = zstandard.ZstdCompressor().compress(bytes(200 << 20))  # 6 kB stored


@pytest.mark.parametrize(
    "payload",
    [
        {"checkpoint": ["msgpack", "!!not base64"]},
        {"checkpoint": _typed(b"\xc1")},  # never-used msgpack byte
        {"metadata": _typed(msgspec.msgpack.encode([1, 2]))},  # not a mapping
        {"checkpoint": _typed(b"\xc7\x03\x05" + b"\x93\xa1a")},  # a truncated object
        {"checkpoint": _typed(b"\x91" * 5000 + b"\xc0")},  # nested past any stack
        {"checkpoint": _typed(b"\x28\xb5\x2f\xfd garbage", "zstd:msgpack")},  # broken frame
        {"checkpoint": _typed(_BOMB, "zstd:msgpack")},  # a frame of 200 MiB of zeros
    ],
)
def test_a_malformed_checkpoint_is_quarantined_never_raised(payload: dict[str, Any]) -> None:
    good = {
        "thread_id": "t",
        "ns": "",
        "checkpoint_id": "1",
        "parent_id": None,
        "checkpoint": _typed(msgspec.msgpack.encode({"channel_versions": {}})),
        "metadata": _typed(msgspec.msgpack.encode({"source": "input", "step": -1})),
        "blobs": [],
    }
    ev = _event(uuid.uuid4(), 1, "langgraph.checkpoint", msgspec.json.encode({**good, **payload}))
    ctx = SessionContext(ev.session_id)
    reason = fold_one(ctx, ev)
    assert reason is not None and "agent_framework" not in ctx.extra
    assert (ctx.quarantined, ctx.event_count, ctx.last_position) == (1, 0, 1)
    assert describe(ev).startswith("unreadable")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.sampled_from(["msgpack", "json", "bytes", "x", "zstd:msgpack"]))
def test_any_bytes_in_a_write_fold_or_quarantine(data: bytes, kind: str) -> None:
    sid = uuid.uuid4()
    cp = {
        "thread_id": "t",
        "ns": "",
        "checkpoint_id": "1",
        "parent_id": None,
        "checkpoint": _typed(msgspec.msgpack.encode({})),
        "metadata": _typed(msgspec.msgpack.encode({})),
    }
    writes = {
        "thread_id": "t",
        "ns": "",
        "checkpoint_id": "1",
        "task_id": "x",
        "task_path": "~__pregel_pull, n",
        "writes": [[-3, "__interrupt__", _typed(data, kind)], [0, "c", _typed(data, kind)]],
    }
    events = [
        _event(sid, 1, "langgraph.checkpoint", msgspec.json.encode(cp)),
        _event(sid, 2, "langgraph.writes", msgspec.json.encode(writes)),
    ]
    ctx = SessionContext(sid)
    for ev in events:
        fold_one(ctx, ev, default_reducers())  # never raises
    assert ctx.event_count + ctx.quarantined == 2
    describe(events[1])
    readable_timeline(events)


def test_openai_items_and_pydantic_records_by_role_and_kind() -> None:
    assert item_view({"role": "user", "content": "I want a refund"}) == ("user", "I want a refund")
    assert item_view(
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
    ) == ("assistant", "ok")
    assert item_view(
        {"type": "function_call", "name": "lookup", "arguments": '{"n": 7}', "call_id": "c"}
    ) == ("tool call", 'lookup({"n": 7}) · c')
    assert item_view({"type": "function_call_output", "call_id": "c", "output": "$40"}) == (
        "tool result",
        "c → $40",
    )
    assert record_view(
        "pydantic.step",
        {
            "kind": "tool_call_failed",
            "step_index": 2,
            "tool_name": "t",
            "tool_call_id": "c",
            "error": "boom",
        },
    ) == ("tool call failed", "step 2 · t · c · ✗ boom")
    snap = {
        "state": "complete",
        "step_index": 3,
        "messages": [{"kind": "response", "parts": [{"part_kind": "text", "content": "done"}]}],
    }
    assert record_view("pydantic.snapshot", snap) == (
        "snapshot",
        "complete at step 3 · 1 message(s) · last text: done",
    )
    sid = session_of("openai", "user-42")
    added = _event(sid, 1, "openai.items.added", b'{"items": [{"role": "user", "content": "hi"}]}')
    ctx = fold([added])
    assert ctx.extra[FRAMEWORK_PROJECTION]["openai_agents"]["roles"] == {"user": 1}
    assert describe(added) == "1 item(s) · user: hi"


def test_names_are_the_integrations_sessions() -> None:
    from ledger_cdc.integrations.langgraph import thread_session
    from ledger_cdc.integrations.openai_agents import conversation_session

    assert session_of("thread", "ticket-7") == thread_session("ticket-7")
    assert session_of("openai", "u") == conversation_session("u")
    try:
        from ledger_cdc.integrations.pydantic_ai import run_session
    except ImportError:  # (the harness needs Python 3.11)
        pass
    else:
        assert session_of("pydantic", "r") == run_session("r")
    assert set(KINDS) == {"thread", "openai", "pydantic"}
    sid = uuid.uuid4()
    assert parse_name(str(sid)).session_id == sid
    assert parse_name("thread:a:b").name == "a:b"
    assert parse_name("ticket-7").kind == "name"
    assert parse_name("x", "openai").session_id == session_of("openai", "x")


def test_writes_saved_before_their_checkpoint_are_folded_with_it() -> None:
    """A saver appends a run's checkpoints and writes from concurrent threads: the writes of a
    checkpoint may reach the ledger before the checkpoint itself. The fold keeps them until it
    comes, so the interrupt is told whatever the order."""
    saver = Recorder()
    g = _graph(saver, [])
    g.invoke(
        {"messages": [HumanMessage("I want a refund")], "done": []},
        {"configurable": {"thread_id": "t-order"}},
    )
    in_order = saver.events["t-order"]
    # the interrupt's writes moved before the checkpoint they belong to
    last_cp = max(i for i, (et, _) in enumerate(in_order) if et == "langgraph.checkpoint")
    moved = [e for i, e in enumerate(in_order) if i > last_cp]
    assert moved and all(et == "langgraph.writes" for et, _ in moved)
    saver.events["t-order"] = in_order[:last_cp] + moved + [in_order[last_cp]]
    assert _status(saver, "t-order") == (
        "interrupted at node approve waiting for {'question': 'Refund $40?'}"
    )
    saver.events["t-order"] = in_order
    assert _status(saver, "t-order") == (
        "interrupted at node approve waiting for {'question': 'Refund $40?'}"
    )
