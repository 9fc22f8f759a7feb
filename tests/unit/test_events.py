"""Event type registry and payload validation (no server)."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from ledger_cdc.errors import InvalidEventError, UnknownEventTypeError
from ledger_cdc.events import (
    EVENT_TYPES,
    MAX_TIME,
    MIN_TIME,
    ModelResponded,
    ToolCall,
    Usage,
    decode_payload,
    encode_payload,
    register_event_type,
)

STANDARD = [
    "context.loaded",
    "model.requested",
    "model.responded",
    "tool.invoked",
    "tool.observed",
    "handoff.emitted",
    "handoff.received",
    "task.completed",
    "task.failed",
]


def test_standard_types_are_registered() -> None:
    assert set(STANDARD) <= set(EVENT_TYPES)


def test_round_trip_of_a_typed_payload() -> None:
    p = ModelResponded("r1", "m", "hi", Usage(10, 2), [ToolCall("c", "search", {"q": 1})])
    data = encode_payload("model.responded", p)
    assert decode_payload("model.responded", data) == p


def test_dict_payload_is_converted_and_checked() -> None:
    data = encode_payload("tool.observed", {"call_id": "c", "result": [1, 2]})
    assert msgspec.json.decode(data) == {"call_id": "c", "result": [1, 2], "error": None}
    with pytest.raises(InvalidEventError, match=r"\$.call_id"):
        encode_payload("tool.observed", {"call_id": 3})


def test_unknown_type() -> None:
    with pytest.raises(UnknownEventTypeError, match="register_event_type"):
        encode_payload("nope.never", {})
    with pytest.raises(UnknownEventTypeError) as e:  # a careless writer's type: one short line
        encode_payload("x" * 10_000, {})
    assert len(str(e.value)) < 400 and "10,000 characters" in str(e.value)
    assert e.value.event_type == "x" * 10_000


def test_decode_rejects_payload_of_wrong_shape() -> None:
    with pytest.raises(InvalidEventError, match=r"task\.failed payload is invalid"):
        decode_payload("task.failed", b'{"retryable": true}')


def test_register_rules() -> None:
    with pytest.raises(ValueError, match="invalid event type"):
        register_event_type("NoDots")
    with pytest.raises(ValueError, match="standard event type"):
        register_event_type("task.failed", dict)
    register_event_type("unit.custom")
    register_event_type("unit.custom")  # same pair again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_event_type("unit.custom", Usage)
    register_event_type("unit.custom", Usage, replace=True)
    assert decode_payload("unit.custom", b'{"input_tokens": 3}') == Usage(3, 0)


def test_a_nul_character_is_refused_with_a_clear_error() -> None:
    """jsonb cannot store U+0000: the writer says so instead of passing the server's error on."""
    with pytest.raises(InvalidEventError, match="NUL character"):
        encode_payload("tool.observed", {"call_id": "c", "result": "a\x00b"})
    with pytest.raises(InvalidEventError, match="NUL character"):
        encode_payload("tool.observed", {"call_id": "c", "result": {"k\x00": 1}})
    with pytest.raises(InvalidEventError, match="NUL character"):
        encode_payload("tool.observed", {"call_id": "c", "result": "\\\x00"})
    # a backslash followed by the text u0000 is not a NUL
    data = encode_payload("tool.observed", {"call_id": "c", "result": "\\u0000 and \\\\u0000"})
    assert decode_payload("tool.observed", data).result == "\\u0000 and \\\\u0000"


@pytest.mark.parametrize(
    ("etype", "payload", "says"),
    [
        ("run.leased", {"worker": "w", "ttl": float("nan")}, "NaN or an infinity"),
        ("run.leased", {"worker": "w", "ttl": float("inf")}, "NaN or an infinity"),
        ("tool.observed", {"call_id": "c", "result": [1, {"x": -float("inf")}]}, "NaN or an"),
        ("tool.observed", {"call_id": "c", "result": "lone \ud800 surrogate"}, "surrogate"),
        ("tool.observed", {"call_id": "c", "result": {"\udfff": 1}}, "surrogate"),
        ("tool.observed", {"call_id": "c", "result": 10**5000}, "digits"),
    ],
)
def test_what_json_cannot_hold_is_refused_by_the_writer(
    etype: str, payload: dict[str, object], says: str
) -> None:
    """The encoder would write NaN as null (which readers quarantine) or raise an error of its
    own: the writer refuses with InvalidEventError."""
    with pytest.raises(InvalidEventError, match=says):
        encode_payload(etype, payload)
    # null written on purpose is still a value
    assert encode_payload("tool.observed", {"call_id": "c", "result": None}).count(b"null") == 2


def test_a_lease_of_nan_seconds_saturates_in_the_fold() -> None:
    """An in-process payload (the writer's own fold of what it appended) may hold NaN."""
    from ledger_cdc.fold.reducers import _lease_until

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    assert _lease_until(now, float("nan")) in (MAX_TIME, MIN_TIME)
    assert _lease_until(now, 1e300) == MAX_TIME and _lease_until(now, -1e300) == MIN_TIME


def test_json_depth_of_shapes_that_take_either_path() -> None:
    """Deep chains (summed by runs), wide leafy data (peeled a level at a time) and mixes of the
    two, with strings holding brackets, give their true depth, capped at stop_at + 1."""
    from ledger_cdc.events import json_depth

    def chain(d: int, inner: bytes = b"1") -> bytes:
        return b"[" * d + inner + b"]" * d

    assert json_depth(chain(100_000)) == 257
    assert json_depth(chain(256)) == 256
    assert json_depth(b"[" + b",".join([chain(20)] * 5000) + b"]") == 21
    assert json_depth(b"[" + b",".join([chain(300)] * 50) + b"]", 400) == 301
    assert json_depth(b"[" + b",".join([b"[1,2]"] * 10_000) + b"]") == 2
    comb = b"".join(b'{"k": [' + b"[], " * 40 for _ in range(50)) + b"0" + b"]}" * 50
    assert json_depth(comb) == 101  # 50 × ({ and [), and the empty arrays in the last
    assert json_depth(b'{"a": "[[[[\\"{{{", "b": [{"c": "]]]"}]}') == 3
    assert json_depth(chain(10), 5) == 6
    # strings side by side, empty or holding brackets, escaped quotes and backslashes
    assert json_depth(b'["", "[", "", "]]", "", {"": ""}]') == 2
    assert json_depth(b'[["a", "[[", ""], [""], "\\", "\\"[", "x\\"]') == 2
    assert json_depth(b'{"k": "\\"}') == 1 and json_depth(b'["]\\", ["["]]') == 2


def test_a_struct_built_with_the_wrong_types_is_refused_by_the_writer() -> None:
    """A msgspec Struct's constructor checks no type: the writer reads the bytes back as every
    reader will, so what it stores is never quarantined."""
    from ledger_cdc.events import RunLeased, RunSuspended, SignalReceived

    for etype, payload in (
        ("run.leased", RunLeased("w", True)),  # type: ignore[arg-type]
        ("signal.received", SignalReceived(123)),  # type: ignore[arg-type]
        ("run.suspended", RunSuspended(None)),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidEventError, match="as built by"):
            encode_payload(etype, payload)
    assert encode_payload("run.leased", RunLeased("w", 30)) == b'{"worker":"w","ttl":30}'


@pytest.mark.parametrize("text", [False, True])
def test_what_is_read_does_not_depend_on_the_pythons_decoder(text: bool) -> None:
    """decode_bounded reads JSON up to its limit and refuses deeper JSON with a DecodeError,
    whether the decoder would have gone on (3.11's stops near 1,000 levels, 3.13's near
    10,000: 600 levels decode on both) or not (a RecursionError, which no reader expected
    beside a DecodeError); bytes and str alike, strings holding brackets not counted."""
    from ledger_cdc.events import DOC_MAX_DEPTH, READ_MAX_DEPTH, decode_bounded

    def doc(depth: int) -> bytes | str:
        body = '{"s": "[[[{{{", "k": ' * depth + "1" + "}" * depth
        return body if text else body.encode()

    dec = msgspec.json.decode
    assert msgspec.json.decode(doc(600)) is not None  # the decoder alone takes it
    for limit in (READ_MAX_DEPTH, DOC_MAX_DEPTH):
        value = decode_bounded(dec, doc(limit), limit)
        for _ in range(limit - 1):
            value = value["k"]
        assert value == {"s": "[[[{{{", "k": 1}
        for depth in (limit + 1, 600, 3000, 20_000):
            with pytest.raises(msgspec.DecodeError, match=f"deeper than {limit} levels"):
                decode_bounded(dec, doc(depth), limit)
    assert decode_bounded(dec, "[" * 9 + "]" * 9, 9) == [[[[[[[[[]]]]]]]]]
    with pytest.raises(msgspec.DecodeError, match="deeper than 8"):
        decode_bounded(dec, "[" * 9 + "]" * 9, 8)
