"""What a stored context references is read back by SQL's ``ledger_message`` as the fold wrote
it: for a ``tool.observed`` result that is not a string, jsonb's text made compact must equal,
byte for byte, the message the fold made of the result (msgspec's compact JSON of the value as
decoded) whenever ``fold.codec.referable`` says the message may be left in its event: any
object or array without a float, whatever its strings hold and however large its integers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ledger_cdc.client.read import load_events
from ledger_cdc.client.writer import Ledger
from ledger_cdc.fold import fold
from ledger_cdc.fold.codec import referable
from tests.support.harness import Database

pytestmark = [pytest.mark.server, pytest.mark.one_server]

# (no NUL, no lone surrogate: a writer refuses both) quotes, backslashes, commas and colons with
# spaces, control characters, characters past the BMP
_chars = st.characters(exclude_characters="\x00", exclude_categories=["Cs"])
_text = st.one_of(
    st.text(_chars, max_size=12), st.sampled_from(['", "', '": "', "\\", '\\"', ", ", ": "])
)
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    _text,
    st.floats(allow_nan=False, allow_infinity=False),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=24,
)
_result = st.one_of(st.lists(_value, max_size=5), st.dictionaries(_text, _value, max_size=5))

_TRICKY: list[Any] = [
    {"a, b": ": ", "c": ['", "', '\\"', "\\"], "d": {"e": {}, "f": []}},
    [1, [2, [3, {"": ""}]], 123456789012345678901234567890, True, None],
    {"rows": ["é😀\t\n\x01\x1f\x7f" * 3, {"x": -0}]},
]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(_result, min_size=1, max_size=8))
@example(_TRICKY)
def test_ledger_message_gives_back_a_referable_result_as_the_fold_wrote_it(
    db: Database, results: list[Any]
) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        for i, result in enumerate(results):
            ledger.append(sid, "a", "tool.observed", {"call_id": f"c{i}", "result": result})
    with db.connect() as conn:
        ctx = fold(load_events(conn, sid), session_id=sid)
        said = conn.execute(
            "SELECT array_agg(ledger_message(session_id, position) ORDER BY position) "
            "FROM agent_events WHERE session_id = %s",
            (sid,),
        ).fetchone()
    assert said is not None
    folded = [m.content for m in ctx.messages]
    assert len(folded) == len(said[0]) == len(results)
    for result, wrote, sql in zip(results, folded, said[0], strict=True):
        if referable(result):
            assert sql == wrote, (result, wrote, sql)
        else:  # (a float: jsonb keeps the number's own digits)
            assert any(type(v) is float for v in _leaves(result))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]
