"""diff aligns two runs of one task and finds the first divergence; the timeline pairs calls."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_cdc.admin.timeline import diff_runs, timeline
from ledger_cdc.events import LedgerEvent, decode_payload, encode_payload

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def run(
    session: uuid.UUID,
    steps: list[tuple[str, dict[str, Any]]],
    seq0: int = 0,
    unique_calls_given: bool = False,
) -> list[LedgerEvent]:
    """A run as the ledger would hold it: ids, keys and times differ from one run to another."""
    out = []
    for i, (etype, payload) in enumerate(steps):
        p = dict(payload)
        if etype == "tool.invoked" and not unique_calls_given:
            p["call_id"] = f"c-step{i}"  # one call per invocation (a repeated id is a retry)
        for idf in ("call_id", "request_id", "handoff_id"):
            if idf in p:
                p[idf] = f"{session.hex[:6]}-{p[idf]}"  # per-run ids
        value = decode_payload(etype, encode_payload(etype, p))
        out.append(
            LedgerEvent(
                seq0 + i * 7 + 1,
                session,
                i + 1,
                "planner",
                etype,
                value,
                T0 + dt.timedelta(seconds=i),
                f"{session}:{i}",
            )
        )
    return out


step = st.one_of(
    st.builds(
        lambda h, r: ("model.requested", {"request_id": f"r{r}", "model": "m", "prompt_hash": h}),
        st.sampled_from(["aa", "bb", "cc"]),
        st.integers(0, 3),
    ),
    st.builds(
        lambda c, r: ("model.responded", {"request_id": f"r{r}", "model": "m", "content": c}),
        st.sampled_from(["ok", "try again", "done"]),
        st.integers(0, 3),
    ),
    st.builds(
        lambda a, c: (
            "tool.invoked",
            {"call_id": f"c{c}", "tool": "search", "arguments": {"q": a}},
        ),
        st.integers(0, 3),
        st.integers(0, 1000),
    ),
    st.builds(
        lambda r, c: ("tool.observed", {"call_id": f"c{c}", "result": r}),
        st.integers(0, 5),
        st.integers(0, 1000),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=30), st.data())
def test_diff_finds_the_first_divergence_of_two_generated_runs(
    steps: list[tuple[str, dict[str, Any]]], data: st.DataObject
) -> None:
    a = run(uuid.uuid4(), steps)
    same = diff_runs(a, run(uuid.uuid4(), steps, seq0=5000))
    assert same.divergence is None and same.common == len(steps)  # ids, keys, seqs ignored
    k = data.draw(st.integers(0, len(steps) - 1))
    other = data.draw(
        step.filter(
            lambda s: (
                s[0] != steps[k][0]
                or {x: y for x, y in s[1].items() if x not in ("call_id", "request_id")}
                != {x: y for x, y in steps[k][1].items() if x not in ("call_id", "request_id")}
            )
        )
    )
    changed = [*steps[:k], other, *steps[k + 1 :]]
    res = diff_runs(a, run(uuid.uuid4(), changed))
    assert res.divergence is not None and res.common == k and res.divergence.step == k + 1
    if other[0] == steps[k][0] == "model.requested":
        assert res.divergence.reason == "different prompt hash"
    if other[0] == steps[k][0] == "tool.invoked":
        assert res.divergence.reason == "different tool arguments"
        assert res.divergence.fields[0][0] == "arguments.q"
    if other[0] == steps[k][0] == "model.responded":
        assert res.divergence.reason == "different model output"
    # a shorter run: the divergence is where it ends
    short = diff_runs(a, run(uuid.uuid4(), steps[:k]))
    assert short.common == k and short.divergence is not None and short.divergence.b is None


def test_retries_and_the_fork_marker_are_not_steps() -> None:
    s = uuid.uuid4()
    steps = [
        ("tool.invoked", {"call_id": "c1", "tool": "t", "arguments": {"q": 1}}),
        ("tool.observed", {"call_id": "c1", "result": 2}),
    ]
    a = run(s, steps, unique_calls_given=True)
    retried = run(uuid.uuid4(), [steps[0], steps[0], steps[1]], unique_calls_given=True)  # a retry
    assert diff_runs(a, retried).divergence is None
    fork = run(
        uuid.uuid4(),
        [
            (
                "session.forked",
                {"origin_session_id": str(s), "upto_seq": 1, "upto_position": 1, "events": 1},
            ),
            *steps,
        ],
    )
    assert diff_runs(a, fork).divergence is None


def test_timeline_pairs_calls_and_marks_the_ones_in_flight() -> None:
    rows = timeline(
        run(
            uuid.uuid4(),
            [
                ("model.requested", {"request_id": "r1", "model": "m"}),
                ("model.responded", {"request_id": "r1", "model": "m", "content": "go"}),
                ("tool.invoked", {"call_id": "c1", "tool": "t"}),
                ("tool.invoked", {"call_id": "c2", "tool": "t"}),
                ("tool.observed", {"call_id": "c1", "error": "boom"}),
                ("model.requested", {"request_id": "r2", "model": "m"}),
            ],
            unique_calls_given=True,
        )
    )
    marks = [(r.event_type, r.mark, r.pair) for r in rows]
    assert marks == [
        ("model.requested", "", rows[1].seq),
        ("model.responded", "", rows[0].seq),
        ("tool.invoked", "", rows[4].seq),
        ("tool.invoked", "in flight", None),
        ("tool.observed", "failed", rows[2].seq),
        ("model.requested", "in flight", None),
    ]
