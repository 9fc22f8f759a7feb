"""Agent histories generated to need every kind of reference a stored context or memo row makes
to the ledger's events (a context window left in its ``context.loaded`` event, long replies and
results left in theirs, memo entries without their result, call ids past what ``agent_memo``
keeps verbatim), and the in-memory sink's reader on them: ``MemoryStore.context`` gives back the
fold from zero. ``tests/integration/test_full_context.py`` runs the same histories through
PostgreSQL and its two readers.
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ledger_cdc import register_event_type
from ledger_cdc.consumer import Consumer
from ledger_cdc.consumer.server import NoLedgerServer
from ledger_cdc.fold import REFERENCE_MIN
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from tests.support.fakestream import FakeSlot, Wal, running
from tests.unit.test_fold import event_strategy
from tests.unit.test_loop import assert_matches, config, until

register_event_type("x.unknown")  # (in event_strategy) free-form: kept, ignored by the fold

Event = tuple[str, dict[str, Any]]

# (no NUL, no lone surrogate: a writer refuses both); quotes, backslashes, accents and characters
# past the BMP, whose lengths Python and PostgreSQL must count alike
_chars = st.characters(exclude_characters="\x00", exclude_categories=["Cs"])
_short = st.text(_chars, max_size=6)
# a string around REFERENCE_MIN characters: kept in the context below it, referenced from it on
_long = st.builds(
    lambda unit, n: (unit * n)[:n],
    st.text(_chars, min_size=1, max_size=4),
    st.integers(REFERENCE_MIN - 3, REFERENCE_MIN + 40),
)
_text = st.one_of(_short, _long)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text},
    optional={"name": _short, "tool_call_id": st.sampled_from(["c0", "c1"])},
)
_loaded = st.builds(
    lambda msgs, task: ("context.loaded", {"messages": msgs, **task}),
    st.lists(_message, max_size=3),
    st.one_of(st.just({}), st.builds(lambda t: {"task": t}, _short)),
)
# call ids from a few, so that calls complete again; one past what agent_memo keeps verbatim
# (fold.memo_key stores its digest)
_ids = st.sampled_from(["0", "1", "2" * 600])
_key = st.one_of(st.just({}), st.builds(lambda k: {"idempotency_key": k}, _ids))
_model = st.builds(
    lambda r, content, hashed: [
        ("model.requested", {"request_id": f"r{r}", "model": "m", **hashed}),
        ("model.responded", {"request_id": f"r{r}", "model": "m", "content": content}),
    ],
    _ids,
    _text,
    st.one_of(_key, st.just({"prompt_hash": "h"})),
)
_result = st.one_of(
    _text,
    st.integers(-5, 5),
    st.none(),
    # long, not a string: a message source unless a float is in it (fold.codec.referable)
    st.builds(
        lambda s, n: {"rows": [s, s], "n": n},
        _long,
        st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([1.5, 0.1, 1e-07, -0.0])),
    ),
)
_tool = st.builds(
    lambda c, key, result, error: [
        ("tool.invoked", {"call_id": f"c{c}", "tool": "t", "arguments": {"n": c}, **key}),
        ("tool.observed", {"call_id": f"c{c}", "result": result, **error}),
    ],
    _ids,
    _key,
    _result,
    st.one_of(st.just({}), st.builds(lambda e: {"error": e}, _text)),
)
# a turn: one writer transaction
_turn = st.one_of(
    st.lists(_loaded, min_size=1, max_size=1),
    st.lists(st.one_of(event_strategy, _loaded), min_size=1, max_size=2),
    _model,
    _tool,
)
histories = st.lists(st.lists(_turn, min_size=1, max_size=5), min_size=1, max_size=2)

_WINDOW = "be brief; " * 40
KNOWN = [  # one history with every kind of reference, whatever else is drawn
    [
        [("context.loaded", {"messages": [{"role": "system", "content": _WINDOW}]})],
        [
            ("model.requested", {"request_id": "r0", "model": "m"}),
            ("model.responded", {"request_id": "r0", "model": "m", "content": "é😀" * 200}),
        ],
        [
            ("tool.invoked", {"call_id": "c0", "tool": "t"}),
            ("tool.observed", {"call_id": "c0", "result": "row;" * 100}),
        ],
        [("tool.invoked", {"call_id": "c0", "tool": "t"})],  # again: the latest completion counts
        [("tool.observed", {"call_id": "c0", "result": {"rows": ["x" * 300]}})],
        [
            ("tool.invoked", {"call_id": "c1", "tool": "t"}),
            ("tool.observed", {"call_id": "c1", "result": {"rows": ['"é"' * 100], "p": 0.5}}),
        ],
    ]
]


@settings(max_examples=25, deadline=None)
@given(histories)
@example(KNOWN)
def test_the_memory_store_makes_the_whole_context_from_references(
    drawn: list[list[list[Event]]],
) -> None:
    wal = Wal()
    for turns in drawn:
        sid = uuid.uuid4()
        for turn in turns:
            wal.transaction([wal.row(sid, etype, payload) for etype, payload in turn])
    store = MemoryStore()
    c = Consumer(
        config(snapshot_every=3),
        sink=MemorySink(store),
        transport=FakeSlot(wal).transport(),
        server=NoLedgerServer(),
    )
    with running(c):
        until(lambda: store.checkpoint == wal.commits[-1])
    assert_matches(store, wal)
