"""The fold is total (no server): whatever a row of agent_events holds, every reader turns it into
an event or a quarantine, never an exception, and every path reaches the same context.

Rows are generated for every registered event type (and for types no one registered): payloads
of the right shape, of the wrong shape, with fields no type declares, numbers at and past the
limits of every integer and float, nesting past READ_MAX_DEPTH, strings of any content, and
created_at anywhere PostgreSQL can put it (year 20000, infinity). Each row goes through the two
readers the code has — the stream's (pgoutput text values, ``LedgerRowDecoder``) and SQL's
(``row_event`` over ``_COLUMNS``) — which must agree, then through ``fold_one``; the contexts
folded in one pass, from a snapshot onward, and after a round trip through JSON with its object
keys reordered (what jsonb does to a projection) must be equal, and encode to the same bytes.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_cdc.client.recovery import row_event
from ledger_cdc.events import (
    EVENT_TYPES,
    MAX_TIME,
    MIN_TIME,
    READ_MAX_DEPTH,
    LedgerEvent,
    Rejected,
    json_depth,
    too_deep,
)
from ledger_cdc.fold import (
    SessionContext,
    decode_context,
    encode_context,
    encode_snapshot,
    fold_one,
    register_reducer,
    unregister_reducer,
)
from ledger_cdc.pgoutput.messages import Column, Relation, ReplicaIdentity
from ledger_cdc.stream.ledger import LedgerRowDecoder
from tests.support.refs import attach_from

_TYPES = [*sorted(EVENT_TYPES), "app.unknown", "x.y"]
_SID = uuid.UUID("6b1f8c0e-2f6e-4d49-8a4b-3c1d2e0f9a77")

# the ledger's streamed columns, as the server describes them (type OIDs of PostgreSQL)
_RELATION = Relation(
    16400,
    "public",
    "agent_events",
    ReplicaIdentity.DEFAULT,
    tuple(
        Column(0, name, oid, -1)
        for name, oid in (
            ("seq", 20),
            ("session_id", 2950),
            ("position", 20),
            ("agent_id", 25),
            ("event_type", 25),
            ("payload", 3802),
            ("idempotency_key", 25),
            ("created_at", 1184),
            ("hash", 17),
        )
    ),
)

_LIMIT_NUMBERS = [
    0,
    -1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**30,
    10**400,
    -(10**400),
    1e308,
    -1e308,
    5e-324,
    0.1,
    1e-7,
]


def _deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _deep_text(depth: int) -> str:
    """JSON nested ``depth`` deep, written without recursion (json.dumps cannot go that deep)."""
    opening = "".join('{"k": ' if i % 2 == 0 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))
    return opening + "1" + closing


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_LIMIT_NUMBERS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(exclude_characters="\x00", exclude_categories=["Cs"])),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
deep_value = st.integers(READ_MAX_DEPTH - 3, READ_MAX_DEPTH + 40).map(_deep_text)


def _fields(event_type: str) -> list[str]:
    typ = EVENT_TYPES.get(event_type)
    return list(getattr(typ, "__struct_fields__", ()))


@st.composite
def payloads(draw: st.DrawFn, event_type: str) -> str:
    """JSON text of a payload for ``event_type``: right, wrong, or hostile."""
    kind = draw(st.sampled_from(["fields", "fields", "not_object", "deep", "extra"]))
    if kind == "not_object":
        return json.dumps(draw(json_value))
    body: dict[str, Any] = {}
    for name in _fields(event_type):
        if draw(st.booleans()) or name in ("call_id", "request_id", "worker", "error"):
            body[name] = draw(
                st.one_of(
                    json_value,
                    st.text(max_size=10),
                    st.sampled_from(_LIMIT_NUMBERS),
                    st.just([{"role": "user", "content": "hi"}]),
                    st.just({"input_tokens": 2**64, "output_tokens": -5}),
                )
            )
    if kind == "extra":
        body["misspelled"] = draw(json_value)
    text = json.dumps(body)
    if kind == "deep":  # a field (declared or not) holding JSON nested past the readers' limit
        name = json.dumps(draw(st.sampled_from([*_fields(event_type), "zz"])))
        text = text[:-1] + ("," if body else "") + f"{name}: {draw(deep_value)}}}"
    return text


times = st.one_of(
    st.datetimes(
        min_value=dt.datetime(1, 1, 3),
        max_value=dt.datetime(9999, 12, 29),
        timezones=st.just(dt.timezone.utc),
    ).map(lambda t: t.isoformat(sep=" ")),
    st.sampled_from(
        [
            "infinity",
            "-infinity",
            "20000-01-01 00:00:00+00",
            "294276-12-31 23:59:59+00",
            "4713-01-01 00:00:00+00 BC",
            "0001-01-01 00:00:00+00",
            "9999-12-31 23:59:59.999999+00",
            "2026-12-03 10:00:00+14",
            "2026-12-03 10:00:00-12",
        ]
    ),
)


@st.composite
def rows(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """A session's rows: (event_type, payload JSON, created_at text)."""
    n = draw(st.integers(1, 8))
    out = []
    for _ in range(n):
        etype = draw(st.sampled_from(_TYPES))
        out.append((etype, draw(payloads(etype)), draw(times)))
    return out


def _parse_time(text: str) -> dt.datetime | None:
    """What psycopg gives for a timestamptz column on the SQL path, where _COLUMNS selects it
    only inside MIN_TIME..MAX_TIME (else NULL, and the text beside it)."""
    if text.endswith(("BC",)) or "infinity" in text:
        return None
    if text[-3:-2] in ("+", "-") and text[-2:].isdigit():
        text += ":00"  # an offset of whole hours, as Python 3.10's fromisoformat needs it
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value if MIN_TIME <= value <= MAX_TIME else None


def _read_both(i: int, etype: str, payload: str, created: str) -> LedgerEvent | Rejected:
    digest = bytes([i % 256]) * 32
    text_values = (
        str(i).encode(),
        str(_SID).encode(),
        str(i).encode(),
        b"agent",
        etype.encode(),
        payload.encode(),
        None,
        created.encode(),
        b"\\x" + digest.hex().encode(),
    )
    from_stream = LedgerRowDecoder(_RELATION).event(text_values)
    when = _parse_time(created)
    from_sql = row_event(
        (i, _SID, i, "agent", etype, payload, when, None, digest, None if when else created)
    )
    # the two readers agree on what to fold and what to quarantine, and on the event itself
    assert type(from_stream) is type(from_sql), (etype, payload[:80], created)
    if isinstance(from_sql, LedgerEvent):
        assert from_stream == from_sql
    return from_sql


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON with every object's keys in another order (what jsonb does)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def _fold_and_check(events: list[LedgerEvent | Rejected], seed: int) -> SessionContext:
    whole = SessionContext(_SID)
    for ev in events:
        fold_one(whole, ev)  # never raises
        # the context stays what JSON can carry
        encode_context(whole)
    # from a snapshot cut anywhere, with the tail folded on top: the same context
    cut = seed % (len(events) + 1)
    part = SessionContext(_SID)
    for ev in events[:cut]:
        fold_one(part, ev)
    resumed = decode_context(encode_snapshot(part))
    attach_from(resumed, events)  # what it references read back from the events
    resumed.completed_tools, resumed.completed_models, resumed.memo_position = (
        part.completed_tools,
        part.completed_models,
        0,
    )
    for ev in events[cut:]:
        fold_one(resumed, ev)
    assert resumed == whole
    # canonical bytes, however the context was loaded
    data = encode_context(whole)
    reordered = json.dumps(_shuffled(json.loads(data), random.Random(seed))).encode()
    again = decode_context(reordered)
    assert again == whole
    assert encode_context(again) == data
    return whole


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(rows(), st.integers(0, 10_000))
def test_every_row_folds_or_is_quarantined_alike_on_every_path(
    session: list[tuple[str, str, str]], seed: int
) -> None:
    events = [_read_both(i, *row) for i, row in enumerate(session, 1)]
    ctx = _fold_and_check(events, seed)
    assert ctx.last_position == len(events)
    assert ctx.event_count + ctx.quarantined == len(events)


def _explode(state: Any, ev: LedgerEvent) -> Any:
    if isinstance(ev.payload, dict) and ev.payload.get("explode"):
        raise RuntimeError("boom")
    if isinstance(ev.payload, dict) and ev.payload.get("tuple"):
        return {1: ("not", "json", "keys")}  # JSON turns it into {"1": ["not", "json", "keys"]}
    return {"n": state.get("n", 0) + 1}


@pytest.fixture
def exploding_reducer() -> Any:
    register_reducer("explode", _explode, event_types=["app.unknown"])
    yield
    unregister_reducer("explode")


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.sampled_from(['{"explode": true}', '{"tuple": 1}', "{}"]), min_size=1))
def test_a_reducer_that_raises_quarantines_its_event(
    exploding_reducer: Any, bodies: list[str]
) -> None:
    events = [
        _read_both(i, "app.unknown", body, "2026-12-03 10:00:00+00")
        for i, body in enumerate(bodies, 1)
    ]
    ctx = _fold_and_check(events, len(bodies))
    assert ctx.quarantined == sum(1 for b in bodies if "explode" in b)
    if any("tuple" in b for b in bodies[-1:]):
        assert ctx.extra["explode"] == {"1": ["not", "json", "keys"]}


def test_named_hostile_rows() -> None:
    """The inputs that used to stop the consumer, each quarantined or folded without raising."""
    cases = [
        ("run.leased", '{"worker": "w", "ttl": 1e12}', "2026-12-03 10:00:00+00", LedgerEvent),
        ("run.leased", '{"worker": "w", "ttl": -1e308}', "2026-12-03 10:00:00+00", LedgerEvent),
        (
            "tool.observed",
            '{"call_id": "c", "result": ' + _deep_text(1000) + "}",
            "2026-12-03",
            Rejected,
        ),
        ("tool.invoked", '{"call_id": "c", "tool": "t"}', "20000-01-01 00:00:00+00", Rejected),
        ("tool.invoked", '{"call_id": "c", "tool": "t"}', "infinity", Rejected),
        ("tool.invoked", '{"call_id": "c", "tool": "t", "args": {}}', "2026-12-03", LedgerEvent),
        ("tool.observed", '{"call_id": 42}', "2026-12-03", Rejected),
        ("task.completed", "[]", "2026-12-03", Rejected),
        ("app.unknown", '"just a string"', "2026-12-03", LedgerEvent),
    ]
    events = []
    for i, (etype, payload, created, kind) in enumerate(cases, 1):
        ev = _read_both(i, etype, payload, created)
        assert type(ev) is kind, (etype, payload[:60], created)
        events.append(ev)
    ctx = _fold_and_check(events, 3)
    assert ctx.run is not None and ctx.run.lease is not None
    assert ctx.run.lease.until == MIN_TIME  # the last lease, ttl -1e308: expired at once
    assert ctx.quarantined == 5 and ctx.last_position == len(cases)


def test_json_depth_is_exact_and_needs_no_recursion() -> None:
    assert json_depth(b'{"a": "[[[[", "b": [{"c": "]]}"}]}') == 3
    assert json_depth(b'["\\\\", ["\\"[["]]') == 2
    assert json_depth(b"[" * 100_000 + b"]" * 100_000, 300) == 301
    rng = random.Random(3)
    for _ in range(300):
        depth = rng.randint(0, 40)
        value = _deep(depth, rng.choice(["[{", "\\", 1, '"]']))
        assert json_depth(json.dumps(value).encode()) == depth
    assert json_depth(_deep_text(READ_MAX_DEPTH + 1).encode()) == READ_MAX_DEPTH + 1
    assert msgspec.json.encode({"a": 1}) == b'{"a":1}'


def test_too_deep_is_exact_at_the_limit_however_many_brackets() -> None:
    """Many shallow objects (a long context window) are not deep; a chain one level over is,
    and a bracket inside a string counts for nothing."""
    shallow = json.dumps({"messages": [{"role": "u", "content": "x{[" * 3}] * 5000}).encode()
    assert len(shallow) > 2 * READ_MAX_DEPTH and not too_deep(shallow, READ_MAX_DEPTH)
    for depth in (READ_MAX_DEPTH, READ_MAX_DEPTH + 1):
        text = json.dumps({"pad": "p" * 600, "v": _deep(depth - 1, 1)}).encode()
        assert json_depth(text, READ_MAX_DEPTH) == depth
        assert too_deep(text, READ_MAX_DEPTH) is (depth > READ_MAX_DEPTH)
