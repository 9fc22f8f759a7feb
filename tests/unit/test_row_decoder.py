"""The stream's row decoder reads a row of the ledger's own Relation on a fast path (its values'
types known from the column types, the payload decoded in one step) and any other row by each
shared rule in turn: the two must give the same event, or the same quarantine with the same
reason, for any row. And the Insert fast path of the pgoutput decoder (a TupleData of text and
NULL values, written out per column count) reads what the general loop reads."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_cdc.events import LedgerEvent, Rejected, too_deep
from ledger_cdc.pgoutput import Decoder, Insert
from ledger_cdc.pgoutput.decode import _UNROLLED_UPTO, _text_tuple, _tuple_at
from ledger_cdc.pgoutput.messages import Column, Relation, ReplicaIdentity
from ledger_cdc.pgoutput.spec import build_message
from ledger_cdc.stream.ledger import LedgerRowDecoder
from tests.support.fakestream import LEDGER_COLUMNS

COLUMNS = tuple(c for c in LEDGER_COLUMNS if c[0] != "prev_hash")  # as the publication has them


def relation(columns: tuple[tuple[str, int], ...] = COLUMNS) -> Relation:
    cols = tuple(Column(0, name, oid, -1) for name, oid in columns)
    return Relation(16400, "public", "agent_events", ReplicaIdentity.DEFAULT, cols)


def text(values: list[str | None]) -> tuple[bytes | None, ...]:
    return tuple(None if v is None else v.encode() for v in values)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_payload(depth: int) -> str:
    return json.dumps({"text": "x", "deep": json.loads(nested(depth))})


# a valid row, then at most one value off the common path (each fault is met often)
VALID = {
    "seq": "7",
    "session_id": "6b1f8c0e-2f6e-4d49-8a4b-3c1d2e0f9a77",
    "position": "3",
    "agent_id": "agent",
    "event_type": "tool.invoked",
    "payload": '{"call_id": "c", "tool": "search", "arguments": {"q": "x"}}',
    "idempotency_key": None,
    "created_at": "2026-06-01 12:30:00.123456+02",
    "hash": "\\x00ff",
}
FAULTS: list[dict[str, Any]] = [
    {},
    {"idempotency_key": "k1"},
    {"hash": None},
    {"hash": "\\xzz"},
    {"seq": "x"},
    {"seq": None},
    {"session_id": None},
    {"session_id": "not a uuid"},
    {"position": None},
    {"position": "0"},
    {"agent_id": None},
    {"payload": None},
    {"payload": '{"call_id": 5}'},  # the wrong shape
    {"payload": "[1, 2]"},
    {"payload": "{}"},
    {"event_type": "message.user", "payload": '{"text": "hi"}'},
    {"event_type": "tool.observed", "payload": '{"call_id": "c", "result": {"rows": [1]}}'},
    {"event_type": "app.unknown", "payload": '{"any": [1]}'},
    {"event_type": "x.y", "payload": "[]"},
    {"event_type": None},
    {"created_at": None},
    {"created_at": "0001-01-01 00:00:00+00"},
    {"created_at": "0001-01-02 00:00:00+00"},
    {"created_at": "9999-12-30 00:00:00+00"},
    {"created_at": "9999-12-31 00:00:00+00"},
    {"created_at": "infinity"},
    {"created_at": "20000-01-01 00:00:00+00"},
]
row = st.one_of(
    st.sampled_from(FAULTS).map(lambda fault: {**VALID, **fault}),
    st.integers(1, 300).map(
        lambda n: {**VALID, "event_type": "message.user", "payload": nested_payload(n)}
    ),
    st.text(max_size=700).map(
        lambda t: {**VALID, "event_type": "message.user", "payload": json.dumps({"text": t})}
    ),
    st.uuids().map(lambda u: {**VALID, "session_id": str(u)}),
)


@settings(max_examples=400, deadline=None)
@given(row, st.booleans())
def test_the_fast_path_reads_any_row_as_the_rules_do(
    values: dict[str, Any], reordered: bool
) -> None:
    columns = COLUMNS
    if reordered:  # a column the fold does not read, streamed too: still the fast path
        columns = LEDGER_COLUMNS
        values = {**values, "prev_hash": None}
    raw = text([values[name] for name, _ in columns])
    LedgerRowDecoder(relation(columns))._event(raw, 0)  # (a type read once: its decoder made)
    dec = LedgerRowDecoder(relation(columns))
    assert dec._typed
    fast, slow = dec.event(raw), LedgerRowDecoder(relation(columns))._event(raw, 0)
    assert type(fast) is type(slow)
    assert fast == slow
    if isinstance(fast, LedgerEvent):  # one object per session, whichever path reads it
        again = dec.event(raw)
        assert isinstance(again, LedgerEvent) and again.session_id is fast.session_id
        assert dec._event(raw, 0).session_id is fast.session_id


def test_a_relation_retyped_by_hand_is_read_by_each_rule() -> None:
    retyped = tuple((n, 25 if n == "position" else oid) for n, oid in COLUMNS)
    dec = LedgerRowDecoder(relation(retyped))
    assert not dec._typed
    got = dec.event(text(["1", str(uuid.uuid4()), "1", "a", "message.user", '{"text": "hi"}',
                          None, "2026-01-01 00:00:00+00", None]))  # fmt: skip
    assert isinstance(got, Rejected) and "position" in got.reason


column = st.one_of(
    st.builds(lambda b: {"kind": b"t", "data": b}, st.binary(max_size=30)),
    st.just({"kind": b"n", "data": None}),
    st.builds(lambda b: {"kind": b"b", "data": b}, st.binary(max_size=5)),
    st.just({"kind": b"u", "data": None}),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(column, max_size=70), st.binary(max_size=3))
def test_the_written_out_tuple_reads_as_the_loop(cols: list[dict[str, Any]], tail: bytes) -> None:
    data = build_message(b"I", {"xid": None, "relation_id": 1, "new": {"columns": cols}})
    fast = _text_tuple(len(cols))(data + tail, 8)
    plain = all(c["kind"] in (b"t", b"n") for c in cols)
    if plain and not tail and len(cols) <= _UNROLLED_UPTO:
        assert fast == _tuple_at(data, 8, len(cols)) and type(fast) is tuple
    else:
        assert fast is None  # the loop reads it (and says what is wrong, if anything is)
    d = Decoder()
    d.relations[1] = Relation(1, "public", "t", ReplicaIdentity.DEFAULT,
                              tuple(Column(0, f"c{i}", 25, -1) for i in range(len(cols))))  # fmt: skip
    msg = d.decode(data, 0)
    assert isinstance(msg, Insert) and msg.new == _tuple_at(data, 8, len(cols))


def test_a_long_value_is_a_view_of_its_message_and_reads_as_its_bytes() -> None:
    """A text value of a megabyte or more is not copied out of its message: the Insert holds a
    memoryview of it, which the row decoder reads as it reads bytes (the fast path, and each
    rule in turn)."""
    payload = json.dumps({"call_id": "c", "result": "x" * (1 << 20)})
    values = dict(VALID, event_type="tool.observed", payload=payload)
    cols = [{"kind": b"n", "data": None} if v is None else {"kind": b"t", "data": v}
            for v in text([values[name] for name, _ in COLUMNS])]  # fmt: skip
    data = build_message(b"I", {"xid": None, "relation_id": 1, "new": {"columns": cols}})
    d = Decoder()
    d.decode(build_message(b"R", _relation_body(1)), 0)
    msg = d.decode(data, 0)
    assert isinstance(msg, Insert)
    payload = msg.new[5]
    assert type(payload) is memoryview and payload.obj is data
    assert all(type(v) is bytes for i, v in enumerate(msg.new) if i != 5 and v is not None)
    as_bytes = tuple(bytes(v) if type(v) is memoryview else v for v in msg.new)
    dec = LedgerRowDecoder(relation())
    fast, slow = dec.event(msg.new), dec._event(msg.new, 0)
    assert isinstance(fast, LedgerEvent) and fast == slow == dec.event(as_bytes)
    assert fast.payload.result == "x" * (1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='[]{}"\\ax,:', max_size=900), st.integers(1, 300))
def test_the_depth_rule_reads_a_view_as_its_bytes(doc: str, limit: int) -> None:
    data = doc.encode()
    assert too_deep(memoryview(data), limit) == too_deep(data, limit)


def _relation_body(relid: int) -> dict[str, Any]:
    return {
        "xid": None,
        "relation_id": relid,
        "namespace": "public",
        "name": "agent_events",
        "replica_identity": b"d",
        "columns": [
            {"flags": 0, "name": n, "type_oid": oid, "type_modifier": -1} for n, oid in COLUMNS
        ],
    }
