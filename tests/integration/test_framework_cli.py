"""The morning-after commands on framework sessions, against a real server: inspect, replay,
diff, tail, verify and fork name a LangGraph thread, an OpenAI Agents session and a Pydantic AI
run as their frameworks do; a name the ledger lacks is one red line with the exit status of an
unknown session; what they show is the graph's story decoded."""

from __future__ import annotations

import json
import uuid

import pytest

from ledger_cdc.client.frameworks import session_of
from ledger_cdc.client.writer import Ledger
from tests.integration.test_ui import _ticket_thread
from tests.support.cdc import ConsumerProcess, assert_clean_exit, run_cli, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server


@pytest.fixture
def threads(db: Database) -> Database:
    _ticket_thread(db.dsn, "ticket-7", "yes")
    _ticket_thread(db.dsn, "ticket-8", "no")
    with Ledger(db.dsn) as ledger:
        ledger.append(
            session_of("openai", "user-42"),
            "openai-agents",
            "openai.items.added",
            {"items": [{"role": "user", "content": "refund please"}]},
        )
    return db


def test_inspect_names_a_thread_and_tells_what_the_graph_did(threads: Database) -> None:
    dsn = threads.dsn
    for how in (["--thread", "ticket-7"], ["thread:ticket-7"], ["ticket-7"]):
        r = run_cli("inspect", *how, "--dsn", dsn, "--json")
        assert_clean_exit(r)
        rows = [json.loads(line) for line in r.output.splitlines()]
        summaries = "\n".join(x["summary"] for x in rows)
        assert "lookup ✗ RuntimeError('orders db down')" in summaries
        assert "approve interrupt: {'question': 'Refund $40?'}" in summaries
        assert "(input) resume: 'yes'" in summaries
        assert "ran lookup" in summaries and "next approve" in summaries
        assert {x["mark"] for x in rows} >= {"failed", "interrupt"}
        assert "langgraph/approve" in {x["agent_id"] for x in rows}
    r = run_cli("inspect", "openai:user-42", "--dsn", dsn, "--json")
    assert_clean_exit(r)
    assert json.loads(r.output)["summary"] == "1 item(s) · user: refund please"
    r = run_cli("inspect", "--thread", "ticket-7", "--checkpoint-ns", "sub", "--dsn", dsn, "--json")
    assert_clean_exit(r)
    assert not [x for x in map(json.loads, r.output.splitlines()) if "step" in x["summary"]]


def test_replay_reports_where_the_graph_is_and_folds_its_events(threads: Database) -> None:
    r = run_cli("replay", "--thread", "ticket-7", "--dsn", threads.dsn)
    assert_clean_exit(r)
    assert "graph done" in r.output
    assert "of types no reducer folds" not in r.output
    r = run_cli("replay", "--thread", "ticket-7", "--dsn", threads.dsn, "--json")
    ctx = json.loads(r.output)
    lg = ctx["extra"]["agent_framework"]["langgraph"]
    assert lg["thread"] == "ticket-7" and ctx["quarantined"] == 0
    assert ctx["extra"]["agent_framework"]["events"] == ctx["event_count"]


def test_replay_of_an_interrupted_graph_says_what_it_waits_for(db: Database) -> None:
    from langgraph.graph import START, StateGraph
    from langgraph.types import interrupt

    from ledger_cdc.integrations.langgraph import LedgerSaver
    from tests.integration.test_ui import Ticket

    b = StateGraph(Ticket)
    b.add_node("approve", lambda s: {"approved": interrupt({"question": "Ship it?"}) == "y"})
    b.add_edge(START, "approve")
    with LedgerSaver.from_conn_string(db.dsn) as saver:
        b.compile(checkpointer=saver).invoke({"done": []}, {"configurable": {"thread_id": "w"}})
    r = run_cli("replay", "w", "--dsn", db.dsn)
    assert_clean_exit(r)
    assert "graph interrupted at node approve waiting for {'question': 'Ship it?'}" in r.output


def test_diff_names_the_step_and_channel_where_two_threads_part(threads: Database) -> None:
    r = run_cli(
        "diff", "--thread", "ticket-7", "--thread", "ticket-8", "--dsn", threads.dsn, "--json"
    )
    assert_clean_exit(r, 1)
    d = json.loads(r.output)
    assert (d["channel"], d["a"], d["b"], d["diverged"]) == ("approved", True, False, True)
    assert d["step"] == 2  # the approval's checkpoint: lookup (1) ran, then approve (2)
    r = run_cli("diff", "ticket-7", "thread:ticket-7", "--dsn", threads.dsn)
    assert_clean_exit(r)
    assert "same" in r.output
    r = run_cli("diff", "ticket-7", "thread:ticket-7", "--dsn", threads.dsn, "--json")
    assert_clean_exit(r)  # exit 1 only when they diverge, as without --json
    assert json.loads(r.output)["diverged"] is False


def test_an_unknown_name_is_one_red_line(threads: Database) -> None:
    for args in (
        ["inspect", "--thread", "no-such"],
        ["replay", "nope"],
        ["diff", "ticket-7", "openai:nobody"],
        ["tail", "pydantic:no-run"],
        ["verify", "--thread", "no-such"],
        ["fork", "--thread", "no-such", "--upto-seq", "1"],
    ):
        r = run_cli(*args, "--dsn", threads.dsn)
        assert_clean_exit(r, 1)
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    # a UUID unknown to the ledger: the same status
    assert_clean_exit(run_cli("inspect", str(uuid.uuid4()), "--dsn", threads.dsn), 1)


def test_verify_fork_and_tail_take_names(threads: Database) -> None:
    dsn = threads.dsn
    with ConsumerProcess(dsn, "--create-slot"):
        wait_caught_up(dsn)
        r = run_cli("verify", "ticket-7", "--thread", "ticket-8", "openai:user-42", "--dsn", dsn)
        assert_clean_exit(r)
        assert "verified: 3 sessions" in " ".join(r.output.split())
        r = run_cli("tail", "--thread", "ticket-7", "--count", "3", "--dsn", dsn)
        assert_clean_exit(r)
        assert len(r.output.strip().splitlines()) == 3 and "langgraph" in r.output
    r = run_cli("fork", "ticket-7", "--upto-seq", "999999", "--dsn", dsn)
    assert_clean_exit(r)
    assert str(session_of("thread", "ticket-7")) in r.output
