"""The idle confirm rule (consumer.policy.idle_confirm): the slot is confirmed to the server's
WAL end only when everything handed to the sink is settled and durable and nothing is begun
or in hand; any one of those missing keeps the confirmed position where it is."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_cdc.consumer.policy import Idle, idle_confirm

SETTLED = Idle(
    sink_busy=False,
    submitted=100,
    confirmed=100,
    unsettled=False,
    in_flight=False,
    in_hand=False,
    wal_end=200,
)


def test_settled_and_idle_confirms_the_wal_end() -> None:
    assert idle_confirm(SETTLED) == 200


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"sink_busy": True}, "a batch is being written"),
        ({"submitted": 150}, "a batch was handed over and not yet confirmed"),
        ({"unsettled": True}, "a committed batch not yet known durable"),
        ({"in_flight": True}, "a transaction begun in the stream"),
        ({"in_hand": True}, "transactions taken but not handed to the sink"),
        ({"wal_end": 100}, "nothing past what is confirmed"),
        ({"wal_end": 90}, "a WAL end behind the confirmed position (a new connection)"),
    ],
)
def test_any_one_thing_not_done_keeps_the_slot_where_it_is(
    change: dict[str, object], why: str
) -> None:
    assert idle_confirm(dataclasses.replace(SETTLED, **change)) is None, why  # type: ignore[arg-type]


def test_a_submitted_batch_already_confirmed_does_not_hold_it() -> None:
    assert idle_confirm(dataclasses.replace(SETTLED, submitted=80)) == 200
