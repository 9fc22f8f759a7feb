"""The LangGraph saver on the ledger passes LangGraph's own conformance suite (every base
capability, async), its sync methods agree, and a compiled graph resumes from it: a process
that stops mid-graph leaves a thread another process continues."""

from __future__ import annotations

import asyncio
import json
import operator
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest

pytest.importorskip("langgraph.checkpoint.conformance")

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from ledger_cdc.client.recovery import rebuild_context
from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.integrations.langgraph import LedgerSaver, thread_session
from tests.support.cdc import ConsumerProcess, assert_verify_exact, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server


def test_the_saver_passes_langgraphs_conformance_suite(db: Database) -> None:
    @checkpointer_test(name="LedgerSaver")
    async def saver() -> AsyncIterator[LedgerSaver]:
        aledger = await AsyncLedger.connect(db.dsn)
        s = LedgerSaver(Ledger(db.dsn), aledger)
        try:
            yield s
        finally:
            await s.aclose()

    report = asyncio.run(validate(saver, progress=ProgressCallbacks.quiet()))
    # every base capability and every extended one (delete_for_runs, copy_thread, prune)
    assert report.passed_all_base() and report.passed_all(), report.to_dict()
    results = report.to_dict()["results"]
    for cap in ("put", "put_writes", "get_tuple", "list", "delete_thread"):
        assert results[cap]["passed"] is True, results[cap]
    for cap in ("delete_for_runs", "copy_thread", "prune"):  # detected, run and passed
        assert results[cap]["detected"] and results[cap]["passed"] is True, results[cap]
        assert results[cap]["tests_passed"] >= 7, results[cap]
    # a spec that has it (newer than PyPI's 0.0.2) runs the saver's own delta history
    if "delta_channel_history" in results:
        assert results["delta_channel_history"]["passed"] is True, results["delta_channel_history"]


def test_from_conn_string_and_setup_as_the_postgres_savers_have_them(empty_db: Database) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    from ledger_cdc.integrations.langgraph import AsyncLedgerSaver

    cp = empty_checkpoint()
    config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    with LedgerSaver.from_conn_string(empty_db.dsn) as saver:
        saver.setup()  # a database without the schema gets it
        saver.setup()  # and again: nothing to do
        out = saver.put(config, cp, {"source": "input", "step": -1}, {})
        assert saver.get_tuple(out) is not None

    async def go() -> None:
        async with AsyncLedgerSaver.from_conn_string(empty_db.dsn) as asaver:
            await asaver.setup()
            got = await asaver.aget_tuple({"configurable": {"thread_id": "t"}})
            assert got is not None and got.config == out

    asyncio.run(go())


def test_sync_methods_read_what_async_ones_wrote_and_the_ledger_holds_it(db: Database) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    saver = LedgerSaver.from_dsn(db.dsn)
    thread = f"t-{uuid.uuid4()}"
    try:
        cp = empty_checkpoint()
        cp["channel_values"] = {"messages": ["hi"]}
        cp["channel_versions"] = {"messages": saver.get_next_version(None, None)}
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}

        async def write() -> Any:
            out = await saver.aput(
                config, cp, {"source": "input", "step": -1}, cp["channel_versions"]
            )
            await saver.aput_writes(out, [("messages", "there")], "task-1")
            assert saver.aledger is not None
            await saver.aledger.close()  # its pool belongs to this event loop
            saver.aledger = None
            return out

        out = asyncio.run(write())
        got = saver.get_tuple({"configurable": {"thread_id": thread}})
        assert got is not None and got.config == out
        assert got.checkpoint["channel_values"] == {"messages": ["hi"]}
        assert got.pending_writes == [("task-1", "messages", "there")]
        assert [t.config for t in saver.list({"configurable": {"thread_id": thread}})] == [out]
        with db.connect() as conn:
            rows = conn.execute(
                "SELECT event_type FROM agent_events WHERE session_id = %s ORDER BY position",
                (thread_session(thread),),
            ).fetchall()
        assert rows == [("langgraph.checkpoint",), ("langgraph.writes",)]
        # the consumer (which never imports LangGraph) knows these events: nothing quarantined
        with ConsumerProcess(db.dsn, "--create-slot"):
            wait_caught_up(db.dsn)
        assert_verify_exact(db.dsn)  # verify --all: the projections equal a fold from zero
        with db.connect() as conn:
            assert conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone() == (0,)
            row = conn.execute(
                "SELECT event_count, context->>'ignored_events' FROM agent_sessions "
                "WHERE session_id = %s",
                (thread_session(thread),),
            ).fetchone()
        assert row == (2, "2")
        saver.delete_thread(thread)
        assert saver.get_tuple({"configurable": {"thread_id": thread}}) is None
        with db.connect() as conn:  # append-only: the deletion is one more event
            (n,) = conn.execute(  # type: ignore[misc]
                "SELECT count(*) FROM agent_events WHERE session_id = %s",
                (thread_session(thread),),
            ).fetchone()
        assert n == 3
    finally:
        saver.close()


class State(TypedDict):
    steps: Annotated[list[str], operator.add]


def test_a_graph_stopped_mid_run_resumes_from_the_ledger(db: Database) -> None:
    graph_mod = pytest.importorskip("langgraph.graph")
    from langgraph.types import interrupt

    def plan(state: State) -> dict[str, Any]:
        return {"steps": ["planned"]}

    def approve(state: State) -> dict[str, Any]:
        answer = interrupt("approve?")  # the process stops here, waiting for a human
        return {"steps": [f"approved:{answer}"]}

    def act(state: State) -> dict[str, Any]:
        return {"steps": ["acted"]}

    def build(saver: LedgerSaver) -> Any:
        g = graph_mod.StateGraph(State)
        g.add_node("plan", plan)
        g.add_node("approve", approve)
        g.add_node("act", act)
        g.add_edge(graph_mod.START, "plan")
        g.add_edge("plan", "approve")
        g.add_edge("approve", "act")
        g.add_edge("act", graph_mod.END)
        return g.compile(checkpointer=saver)

    from langgraph.types import Command

    config = {"configurable": {"thread_id": f"run-{uuid.uuid4()}"}}
    first = LedgerSaver.from_dsn(db.dsn)
    build(first).invoke({"steps": []}, config)
    first.close()  # the worker goes away while the graph waits
    second = LedgerSaver.from_dsn(db.dsn)  # another worker, another process in real life
    try:
        out = build(second).invoke(Command(resume="yes"), config)
        assert out["steps"] == ["planned", "approved:yes", "acted"]
        history = list(second.list(config))
        assert len(history) >= 4 and history[0].metadata["step"] > history[-1].metadata["step"]
    finally:
        second.close()


def _talk_graph(saver: Any, steps: int) -> Any:
    """A graph whose one node appends a message per step until ``steps`` messages."""
    graph_mod = pytest.importorskip("langgraph.graph")

    def talk(state: State) -> dict[str, Any]:
        n = len(state["steps"])
        return {"steps": [f"message {n}: " + "x" * 200]}

    g = graph_mod.StateGraph(State)
    g.add_node("talk", talk)
    g.add_edge(graph_mod.START, "talk")
    g.add_conditional_edges("talk", lambda s: graph_mod.END if len(s["steps"]) >= steps else "talk")
    return g.compile(checkpointer=saver)


def test_a_growing_list_is_stored_by_its_increments_and_every_checkpoint_reads_whole(
    db: Database,
) -> None:
    from langgraph.checkpoint.memory import InMemorySaver

    steps = 70  # past two full values (one every 32 versions)
    config = {"configurable": {"thread_id": f"talk-{uuid.uuid4()}"}, "recursion_limit": 500}
    reference = InMemorySaver()
    _talk_graph(reference, steps).invoke({"steps": []}, config)
    saver = LedgerSaver.from_dsn(db.dsn)
    try:
        _talk_graph(saver, steps).invoke({"steps": []}, config)
        ours = [t.checkpoint["channel_values"] for t in saver.list(config)]
        theirs = [t.checkpoint["channel_values"] for t in reference.list(config)]
        assert ours == theirs and len(ours) > steps
        # a new saver (no memory of earlier versions) reads the same
        fresh = LedgerSaver.from_dsn(db.dsn)
        assert [t.checkpoint["channel_values"] for t in fresh.list(config)] == theirs
        fresh.close()
    finally:
        saver.close()
    # storage grows with what changed: twice the steps, about twice the bytes (not four times)
    half = {"configurable": {"thread_id": f"talk-{uuid.uuid4()}"}, "recursion_limit": 500}
    saver = LedgerSaver.from_dsn(db.dsn)
    try:
        _talk_graph(saver, steps // 2).invoke({"steps": []}, half)
    finally:
        saver.close()

    def stored(cfg: dict[str, Any]) -> int:
        with db.connect() as conn:
            row = conn.execute(
                "SELECT sum(octet_length(payload::text)) FROM agent_events WHERE session_id = %s",
                (thread_session(cfg["configurable"]["thread_id"]),),
            ).fetchone()
        assert row is not None
        return int(row[0])

    ratio = stored(config) / stored(half)
    assert ratio < 2.5, ratio


def test_a_worker_killed_after_its_call_is_resumed_without_calling_again(
    db: Database, tmp_path: Any
) -> None:
    """LangGraph re-runs a node whose writes were not saved; the node's external call goes
    through ``call_once``, so the resumed node is answered from the ledger's memo."""
    import json
    import signal
    import subprocess
    import sys

    from tests.support.cdc import ROOT, until
    from tests.support.httptarget import Target

    thread, marks = f"order-{uuid.uuid4()}", tmp_path / "marks"
    with Target() as target:
        argv = [
            sys.executable,
            "-m",
            "tests.support.lgworker",
            db.dsn,
            thread,
            target.url,
            str(marks),
        ]
        first = subprocess.Popen([*argv, "--hold"], cwd=ROOT)
        try:
            until(lambda: marks.exists() and "charge ran" in marks.read_text(), 60)
        finally:
            first.send_signal(signal.SIGKILL)  # the call was made; the node never returned
            first.wait(30)
        second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr[-3000:]
        assert json.loads(second.stdout.strip().splitlines()[-1]) == ["charged 200", "receipt sent"]
        assert marks.read_text().count("charge ran") == 2  # LangGraph ran the node again …
        assert len(target.requests) == 1  # … and the payment was made once
    with db.connect() as conn:
        ctx = rebuild_context(conn, thread_session(thread))
    assert ctx.completed_tools["charge"].idempotency_key == f"{thread}:charge"


def test_an_unreadable_row_spoils_only_its_checkpoint(db: Database) -> None:
    """A checkpoint whose stored value cannot be read back (bad base64 here), and an event type
    of a newer version: get_tuple says which checkpoint with a library error, list skips it,
    every other checkpoint and thread reads as before."""
    import json

    from langgraph.checkpoint.base import empty_checkpoint

    from ledger_cdc.errors import InvalidEventError

    saver = LedgerSaver.from_dsn(db.dsn)
    a, b = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    try:
        good = {}
        for thread in (a, b):
            cp = empty_checkpoint()
            cp["channel_values"] = {"messages": ["hi"]}
            cp["channel_versions"] = {"messages": saver.get_next_version(None, None)}
            config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
            good[thread] = saver.put(
                config, cp, {"source": "input", "step": -1}, cp["channel_versions"]
            )
        with db.connect() as owner:
            (payload,) = owner.execute(  # type: ignore[misc]
                "SELECT payload::text FROM agent_events WHERE session_id = %s",
                (thread_session(a),),
            ).fetchone()
            bad = json.loads(payload)
            bad["checkpoint_id"] = "~" + bad["checkpoint_id"]  # sorts after: the latest
            bad["checkpoint"] = ["json", "!!not base64"]
            # … and one nested past what the decoder takes (a RecursionError ended every read)
            deep = '{"checkpoint_id": "x", "v": ' + '{"k":' * 3000 + "1" + "}" * 3000 + "}"
            for etype, body in (
                ("langgraph.checkpoint", json.dumps(bad)),
                ("langgraph.from_the_future", json.dumps({"x": 1})),
                ("langgraph.checkpoint", deep),
            ):
                owner.execute(
                    "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                    "VALUES (%s, 'langgraph', %s, %s::jsonb)",
                    (thread_session(a), etype, body),
                )
            owner.commit()
        fresh = LedgerSaver.from_dsn(db.dsn)
        try:
            with pytest.raises(InvalidEventError, match="cannot be read back"):
                fresh.get_tuple({"configurable": {"thread_id": a}})
            assert [t.config for t in fresh.list({"configurable": {"thread_id": a}})] == [good[a]]
            assert {t.config["configurable"]["thread_id"] for t in fresh.list(None)} >= {a, b}
            got = fresh.get_tuple({"configurable": {"thread_id": b}})
            assert got is not None and got.checkpoint["channel_values"] == {"messages": ["hi"]}
            fresh.put_writes(good[b], [("messages", "there")], "task-1")  # still writes
        finally:
            fresh.close()
    finally:
        saver.close()


def _next_checkpoint(saver: LedgerSaver, prev: Any, messages: list[str], step: int) -> Any:
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

    old = prev["channel_versions"].get("messages") if prev else None
    version = saver.get_next_version(old, None)
    cp = create_checkpoint(prev or empty_checkpoint(), None, step)
    cp["channel_values"] = {"messages": list(messages)}
    cp["channel_versions"] = {"messages": version}
    return cp, {"messages": version}


def _messages(db: Database, config: Any) -> Any:
    """The messages a new saver (no memory of this process's writes) reads at ``config``."""
    fresh = LedgerSaver(Ledger(db.dsn))
    try:
        got = fresh.get_tuple(config)
    finally:
        fresh.close()
    assert got is not None
    return got.checkpoint["channel_values"].get("messages")


def test_a_put_that_failed_and_was_retried_stores_the_whole_channel(db: Database) -> None:
    """A put whose append fails (a lost connection) is retried by LangGraph with a new
    checkpoint from the same parent. The saver remembered the failed put's list as stored, and
    the retry wrote only a delta against it: the channel read back empty."""
    saver = LedgerSaver(Ledger(db.dsn))
    try:
        root = {"configurable": {"thread_id": f"t-{uuid.uuid4()}", "checkpoint_ns": ""}}
        cp1, v1 = _next_checkpoint(saver, None, ["a"], 0)
        c1 = saver.put(root, cp1, {"step": 0}, v1)
        real, calls = saver._sync_ledger().append, [0]

        def flaky(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise ConnectionError("the connection was lost")
            return real(*args, **kwargs)

        saver._sync_ledger().append = flaky  # type: ignore[method-assign]
        cp2, v2 = _next_checkpoint(saver, cp1, ["a", "b"], 1)
        with pytest.raises(ConnectionError):
            saver.put(c1, cp2, {"step": 1}, v2)
        cp2b, v2b = _next_checkpoint(saver, cp1, ["a", "b"], 1)
        c2 = saver.put(c1, cp2b, {"step": 1}, v2b)
        cp3, v3 = _next_checkpoint(saver, cp2b, ["a", "b", "c"], 2)
        c3 = saver.put(c2, cp3, {"step": 2}, v3)
    finally:
        saver.close()
    assert _messages(db, c2) == ["a", "b"]
    assert _messages(db, c3) == ["a", "b", "c"]


def test_a_thread_deleted_by_another_saver_starts_again_whole(db: Database) -> None:
    """Another process deletes the thread; this saver still remembered its last list and wrote
    the new thread's first checkpoint as a delta against a value the deletion hid."""
    a, b = LedgerSaver(Ledger(db.dsn)), LedgerSaver(Ledger(db.dsn))
    try:
        thread = f"t-{uuid.uuid4()}"
        root = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        cp1, v1 = _next_checkpoint(a, None, ["sys"], 0)
        a.put(root, cp1, {}, v1)
        b.delete_thread(thread)
        cp2, v2 = _next_checkpoint(a, None, ["sys", "hello"], 0)
        c2 = a.put(root, cp2, {}, v2)
    finally:
        a.close()
        b.close()
    assert _messages(db, c2) == ["sys", "hello"]


def test_a_graph_running_on_while_another_saver_deletes_its_thread_keeps_its_values(
    db: Database,
) -> None:
    """The graph goes on from the checkpoint this saver stored (its parent), but another
    process deleted the thread meanwhile: the delta against the parent's value (hidden by the
    deletion) read back as no channel at all. The delta's base is read through the deletion,
    and a copy of the thread carries it."""
    a, b = LedgerSaver(Ledger(db.dsn)), LedgerSaver(Ledger(db.dsn))
    try:
        thread = f"t-{uuid.uuid4()}"
        root = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        cp1, v1 = _next_checkpoint(a, None, ["sys"], 0)
        c1 = a.put(root, cp1, {}, v1)
        b.delete_thread(thread)
        cp2, v2 = _next_checkpoint(a, cp1, ["sys", "hello"], 1)
        c2 = a.put(c1, cp2, {}, v2)
        cp3, v3 = _next_checkpoint(a, cp2, ["sys", "hello", "again"], 2)
        c3 = a.put(c2, cp3, {}, v3)
        assert b.get_tuple(c1) is None  # what the deletion hid stays hidden
        copy = f"{thread}-copy"
        b.copy_thread(thread, copy)
    finally:
        a.close()
        b.close()
    assert _messages(db, c2) == ["sys", "hello"]
    assert _messages(db, c3) == ["sys", "hello", "again"]
    copied = {"configurable": {**c3["configurable"], "thread_id": copy}}
    assert _messages(db, copied) == ["sys", "hello", "again"]


def test_list_with_a_limit_of_zero_or_less_lists_nothing_as_the_in_memory_saver(
    db: Database,
) -> None:
    """LangGraph's in-memory saver lists nothing for a limit of 0 or less; this saver listed
    one checkpoint (the limit was checked after the first was taken)."""
    from langgraph.checkpoint.memory import InMemorySaver

    saver, reference = LedgerSaver(Ledger(db.dsn)), InMemorySaver()
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4()}", "checkpoint_ns": ""}}

    async def alisted(limit: int) -> list[Any]:
        aledger = await AsyncLedger.connect(db.dsn)
        try:
            return [t async for t in LedgerSaver(None, aledger).alist(config, limit=limit)]
        finally:
            await aledger.close()

    try:
        prev, ours, theirs = None, config, config
        for step in range(3):
            cp, versions = _next_checkpoint(saver, prev, ["m"] * step, step)
            ours = saver.put(ours, cp, {"step": step}, versions)
            theirs = reference.put(theirs, cp, {"step": step}, versions)
            prev = cp
        for limit in (-1, 0, 1, 2, 5):
            got = [t.config for t in saver.list(config, limit=limit)]
            assert got == [t.config for t in reference.list(config, limit=limit)], limit
            assert len(got) == max(0, min(limit, 3))
            assert [t.config for t in asyncio.run(alisted(limit))] == got
    finally:
        saver.close()


def test_one_saver_serves_threads_that_read_while_another_writes(db: Database) -> None:
    """Reads of a thread iterate its folded state while another thread of the process folds
    new events into it: under the saver's lock (it raised 'dictionary changed size')."""
    saver = LedgerSaver(Ledger(db.dsn))
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4()}", "checkpoint_ns": ""}}
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:
        prev, conf = None, config
        try:
            for i in range(400):
                if stop.is_set():
                    return
                cp, versions = _next_checkpoint(saver, prev, [f"m{j}" for j in range(i % 5)], i)
                conf = saver.put(conf, cp, {"step": i}, versions)
                saver.put_writes(conf, [("messages", f"w{i}")], f"task-{i}")
                prev = cp
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    def read() -> None:
        try:
            while not stop.is_set():
                list(saver.list(config, limit=50))
                saver.get_tuple(config)
        except BaseException as e:
            errors.append(e)
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # thread switches inside the reads' loops
    try:
        threads = [threading.Thread(target=f) for f in (write, read, read)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
        saver.close()
    assert not any(t.is_alive() for t in threads)
    assert not errors, repr(errors[0])


def test_call_once_gives_the_call_its_key_and_the_result_back_in_its_order(db: Database) -> None:
    """The call is handed its idempotency key (users rebuilt ``thread:call_id`` by hand to pass
    it to the service), and a result answered from the ledger keeps its keys' order (jsonb had
    put shorter keys first, so a resumed run's tool message differed from the first run's)."""
    thread = f"t-{uuid.uuid4()}"
    config = {"configurable": {"thread_id": thread}}
    result = {"zeta": 1, "id": "ch_1", "amount": {"value": 42, "currency": "EUR"}, "a": [3, 1]}
    keys: list[str] = []

    def charge(*, idempotency_key: str) -> dict[str, Any]:
        keys.append(idempotency_key)
        return result

    def plain() -> str:  # one that takes no argument is called as it was
        keys.append("plain")
        return "done"

    first, second = LedgerSaver(Ledger(db.dsn)), LedgerSaver(Ledger(db.dsn))
    try:
        got = first.call_once(config, "charge", "payments.charge", charge)
        again = second.call_once(config, "charge", "payments.charge", charge)  # a new worker
        assert first.call_once(config, "mail", "mail.send", plain) == "done"
        assert second.call_once(config, "mail", "mail.send", plain) == "done"
    finally:
        first.close()
        second.close()
    assert keys == [f"{thread}:charge", "plain"]  # each called once
    assert got == again == result
    assert json.dumps(again) == json.dumps(result)  # in order, nested objects too
    with db.connect() as conn:
        ctx = rebuild_context(conn, thread_session(thread))
    assert ctx.completed_tools["charge"].result == result  # the ledger's memo has it too


class Topic(TypedDict):
    topic: str  # set by the input only: its value is stored once, at the start
    steps: Annotated[list[str], operator.add]


_WINDOW = "SELECT event_position, event_type, payload FROM ledger_langgraph_checkpoint(%s, '', %s)"


def test_a_saver_that_never_saw_a_thread_reads_a_checkpoint_from_its_recent_events(
    db: Database,
) -> None:
    """A new saver (a process resuming after a crash) reads the latest checkpoint, and one asked
    for by id, from the thread's last few dozen events: the same tuple as the whole thread's fold
    gives, a channel set only at the start included (it is stored again with every channel's
    full value, at least every 32 checkpoints, compressed when large), pending writes
    included."""
    graph_mod = pytest.importorskip("langgraph.graph")
    steps = 90

    def talk(state: Topic) -> dict[str, Any]:
        return {"steps": [f"{state['topic']} {len(state['steps'])}: " + "y" * 100]}

    g = graph_mod.StateGraph(Topic)
    g.add_node("talk", talk)
    g.add_edge(graph_mod.START, "talk")
    g.add_conditional_edges("talk", lambda s: graph_mod.END if len(s["steps"]) >= steps else "talk")
    thread = f"topic-{uuid.uuid4()}"
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 500}
    saver = LedgerSaver.from_dsn(db.dsn)
    try:
        g.compile(checkpointer=saver).invoke({"topic": "tides", "steps": []}, config)
        history = list(saver.list(config))  # the whole thread folded, as before
        middle = history[len(history) // 2].config
        saver.put_writes(middle, [("steps", ["pending"])], "task-1")
        for asked in ({"configurable": {"thread_id": thread}}, middle):
            folded = saver.get_tuple(asked)
            fresh = LedgerSaver.from_dsn(db.dsn)
            try:
                got = fresh.get_tuple(asked)
            finally:
                fresh.close()
            assert got is not None and folded is not None
            assert got.checkpoint["channel_values"]["topic"] == "tides"
            assert len(got.checkpoint["channel_values"]["steps"]) == len(
                folded.checkpoint["channel_values"]["steps"]
            )
            assert got == folded
        assert ("task-1", "steps", ["pending"]) in got.pending_writes
        with db.connect() as conn:  # the walk stopped well short of the thread's start
            latest = conn.execute(_WINDOW, (thread_session(thread), None)).fetchall()
            (count,) = conn.execute(  # type: ignore[misc]
                "SELECT count(*) FROM agent_events WHERE session_id = %s",
                (thread_session(thread),),
            ).fetchone()
            (packed,) = conn.execute(  # type: ignore[misc]
                "SELECT count(*) FROM agent_events, jsonb_array_elements(payload -> 'blobs') b "
                "WHERE session_id = %s AND b #>> '{2,0}' = 'zstd:msgpack'",
                (thread_session(thread),),
            ).fetchone()
        assert latest[-1][1:] == ("langgraph.window", "part")
        assert min(r[0] for r in latest) > count // 2 and count > 2 * steps
        assert packed >= 2  # the list's full values (every 32 checkpoints), stored compressed
    finally:
        saver.close()
