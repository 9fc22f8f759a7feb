"""A fast-ingest batch's state follows the server's answers (no server: the answers as bytes)."""

from __future__ import annotations

import json

import pytest

from ledger_cdc.errors import JetStreamError
from ledger_cdc.sink.jetstream_fast import FastBatch


def _answer(st: FastBatch, **body: object) -> None:
    st.answer(json.dumps(body).encode())


def test_flow_acks_move_the_window_and_the_final_ack_counts_the_batch() -> None:
    st = FastBatch(b"b1")
    _answer(st, type="ack", seq=1, msgs=2)
    assert st.started and (st.acked, st.flow) == (1, 2)
    st.sent = 1 + 2 * 4
    assert st.room()  # four acknowledgements outstanding at most
    st.sent += 1
    assert not st.room()
    _answer(st, type="ack", seq=7, msgs=100_000)  # the flow is capped
    assert (st.acked, st.flow) == (7, 500) and st.room()
    _answer(st, type="ack", seq=3, msgs=1)  # an older acknowledgement never moves it back
    assert st.acked == 7
    _answer(st, batch="b1", count=12, seq=99, stream="LEDGER")
    assert st.final == 12 and st.error is None
    st.check()


def test_a_refused_start_stores_nothing_and_says_whether_batching_is_off() -> None:
    st = FastBatch(b"b1")
    _answer(st, error={"code": 400, "err_code": 10205, "description": "batch publish disabled"})
    assert st.started and st.disabled and st.error is None
    assert st.refused == "batch publish disabled (code 10205)"
    busy = FastBatch(b"b2")
    _answer(busy, type="err", error={"err_code": 10206, "description": "too many batches"})
    assert busy.refused and not busy.disabled


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"type": "gap", "last_seq": 4, "seq": 6}', "expected message 4 of a batch and got 6"),
        (b'{"error": {"err_code": 1, "description": "no"}}', "refused a message of a batch"),
        (b"not json", "answered a batch with"),
        (b"[1, 2]", "answered a batch with"),
        (b'{"type": "ack", "seq": "x", "msgs": 1}', "answered a batch with"),
        (b'{"count": null}', "answered a batch with"),
    ],
)
def test_a_gap_an_error_or_an_answer_that_is_no_answer_ends_the_batch(
    body: bytes, why: str
) -> None:
    st = FastBatch(b"b1")
    _answer(st, type="ack", seq=1, msgs=1)
    st.answer(body)
    assert st.error is not None and why in st.error and st.room()
    with pytest.raises(JetStreamError, match=why.split()[0]):
        st.check()
    st.answer(b'{"type": "gap", "last_seq": 1, "seq": 9}')
    assert why in st.error  # the first reason stays
