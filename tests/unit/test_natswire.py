"""The ledger's NATS wire format (ledger_cdc.natswire): what the publisher builds, every reader
reads back the same; what no publisher builds is refused cleanly, never folded."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import uuid

import msgspec
import pytest

from ledger_cdc.events import LedgerEvent, Rejected, ToolInvoked
from ledger_cdc.natswire import (
    HIGH_LSN,
    MSG_ID,
    OMITTED,
    HeaderBlock,
    WireFormatError,
    check_storable,
    commit_lsn,
    events_subject,
    high_lsn,
    left_out,
    messages,
    msg_id_position,
    published_by,
    read_event,
    read_headers,
    status_of,
    stream_subjects,
    subject_byte,
    wire_event,
)

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.timezone.utc)
SID = uuid.UUID("0b7e6c36-4f5e-4a4e-9a55-5a0d3e7a91c3")


def _event(position: int, **kw: object) -> LedgerEvent:
    fields: dict[str, object] = {"idempotency_key": None}
    fields.update(kw)
    return LedgerEvent(
        100 + position,
        SID,
        position,
        "agent-1",
        "tool.invoked",
        ToolInvoked(f"c{position}", "search"),
        NOW,
        fields["idempotency_key"],  # type: ignore[arg-type]
    )


def _read_back(body: bytes) -> LedgerEvent | Rejected:
    """What a reader of the stream gets from one message's body."""
    w = read_event(body)
    assert not left_out(w)
    return wire_event(w, bytes(w.payload))


def test_an_event_built_then_read_back_is_the_same_event() -> None:
    events = [(_event(1, idempotency_key="k1"), 0x16B3A40), (_event(2), 0)]
    msgs = messages("ledger", "agent_slot", events, [(SID, 2, b'{"turns": 2}', 0x16B3A40)])
    block = HeaderBlock(high=0x16B3A40, max_payload=1 << 20)
    framed = [block.frame(subject, msg_id, body) for subject, body, msg_id, _, _ in msgs]

    for (ev, lsn), (subject, headers, body) in zip(events, framed, strict=False):
        assert subject == events_subject("ledger", SID).encode()
        assert _read_back(body) == ev
        assert commit_lsn(read_event(body)) == lsn
        got = read_headers(headers)
        assert got[MSG_ID] == f"agent_slot:ev:{SID}:{ev.position}"
        assert msg_id_position(got[MSG_ID]) == ev.position
        assert published_by(got[MSG_ID], "agent_slot")
        assert not published_by(got[MSG_ID], "agent")
        assert high_lsn(got) == 0x16B3A40
        assert OMITTED not in got and status_of(headers) == b""

    subject, headers, body = framed[2]  # the projection: its context JSON as given
    assert subject == f"ledger.sessions.{SID}".encode() and body == b'{"turns": 2}'
    assert msg_id_position(read_headers(headers)[MSG_ID]) == 2
    assert [m[3:] for m in msgs] == [(1, 0x16B3A40), (2, 0), (2, 0x16B3A40)]


def test_a_rejected_row_is_read_back_as_rejected_and_one_of_no_session_is_never_a_head() -> None:
    placed = Rejected(7, SID, 3, "a", "tool.invoked", "payload does not fit", None, "k")
    nowhere = Rejected(8, uuid.UUID(int=0), 0, "a", "x", "no session", unplaced=True)
    msgs = messages("p", "s", [(placed, 0x10), (nowhere, 0x11)], [])
    assert [(m[2], m[3]) for m in msgs] == [
        (f"s:ev:{SID}:3".encode(), 3),
        (f"s:ev:{uuid.UUID(int=0)}:seq8".encode(), 0),
    ]
    assert msg_id_position(msgs[1][2].decode()) == 0
    for (ev, _), (_, body, _, _, _) in zip([(placed, 0), (nowhere, 0)], msgs, strict=True):
        got = wire_event(read_event(body), b"null")
        assert isinstance(got, Rejected)
        assert (got.seq, got.reason, got.unplaced) == (ev.seq, ev.reason, ev.unplaced)


def test_a_message_over_max_payload_goes_without_its_body_and_says_so() -> None:
    ev = LedgerEvent(1, SID, 1, "a", "tool.observed", {"result": "x" * 5000}, NOW)
    ((subject, body, msg_id, _, _), ctx) = messages(
        "ledger", "s", [(ev, 0x20)], [(SID, 1, b'{"big": "' + b"y" * 5000 + b'"}')]
    )
    block = HeaderBlock(high=None, max_payload=4096)

    _, headers, small = block.frame(subject, msg_id, body)
    got = read_headers(headers)
    assert int(got[OMITTED]) == len(body) and high_lsn(got) is None and got[HIGH_LSN] == ""
    w = read_event(small)
    assert left_out(w) and w.omitted == len(body) and bytes(w.payload) == b"null"
    assert (w.seq, w.session_id, w.position, commit_lsn(w)) == (1, SID, 1, 0x20)

    _, headers, empty = block.frame(ctx[0], ctx[2], ctx[1])
    assert empty == b"{}" and int(read_headers(headers)[OMITTED]) == len(ctx[1])


def test_the_header_block_fits_max_payload_exactly() -> None:
    block = HeaderBlock(high=12345, max_payload=200)
    body = b"x" * 100
    _, headers, data = block.frame(b"ledger.sessions.a", b"id", body)
    room = 200 - len(headers) - len(data)
    fits = block.frame(b"ledger.sessions.a", b"id", body + b"x" * room)
    assert fits[2] == body + b"x" * room and len(fits[1]) + len(fits[2]) == 200
    over = block.frame(b"ledger.sessions.a", b"id", body + b"x" * (room + 1))
    assert over[2] == b"{}"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b'{"seq": 1}',
        json.dumps({"seq": 2**64, "session_id": str(SID), "position": 1}).encode(),
        b'{"seq": -1, "session_id": "x", "position": 1, "agent_id": "a", "event_type": "t",'
        b' "payload": null, "created_at": "2026-01-01T00:00:00Z"}',
        b'{"seq": 1, "session_id": "' + str(SID).encode() + b'", "position": 1, '
        b'"agent_id": "a", "event_type": "t", "payload": ' + b"[" * 2000 + b"]" * 2000 + b", "
        b'"created_at": "2026-01-01T00:00:00Z"}',
        b"\xff\xfe",
    ],
)
def test_a_body_that_is_no_event_is_refused_with_a_decode_error(body: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        read_event(body)


def _body(**change: object) -> bytes:
    fields: dict[str, object] = {
        "seq": 1,
        "session_id": str(SID),
        "position": 1,
        "agent_id": "a",
        "event_type": "tool.invoked",
        "payload": {"call_id": "c", "tool": "t"},
        "created_at": "2026-01-01T00:00:00Z",
    }
    fields.update(change)
    return json.dumps(fields).encode()


def test_a_body_an_event_cannot_be_made_of_is_rejected_with_its_reason() -> None:
    for change in ({"payload": {"call_id": 5}}, {"created_at": "0001-01-01T00:00:00Z"}):
        w = read_event(_body(**change))
        got = wire_event(w, bytes(w.payload))
        assert isinstance(got, Rejected) and got.reason and got.position == 1


def test_what_no_ledger_row_can_hold_is_refused_before_folding() -> None:
    for change, what in (
        ({"agent_id": "a\x00b"}, "agent_id"),
        ({"payload": {"call_id": "c\x00", "tool": "t"}}, "payload"),
    ):
        w = read_event(_body(**change))
        with pytest.raises(ValueError, match=what):
            check_storable(w, bytes(w.payload))
    w = read_event(_body(payload={"call_id": "c\\u0000", "tool": "t"}))  # an escaped backslash
    check_storable(w, bytes(w.payload))
    with pytest.raises(ValueError, match="not an LSN"):
        commit_lsn(read_event(_body(commit_lsn="0/XYZ")))


def test_hostile_headers_subjects_and_ids_are_refused_or_read_as_nothing() -> None:
    for block in (
        b"",
        b"HTTP/1.1 200 OK\r\n",
        b"NATS/1.0\r\n: no name\r\n\r\n",
        b"NATS/1.0\r\n\xff",
    ):
        with pytest.raises(WireFormatError):
            read_headers(block)
    assert status_of(b"NATS/1.0 503\r\n\r\n") == b"503"
    assert status_of(b"NATS/1.0 404 No Messages\r\n\r\n") == b"404"
    assert status_of(b"") == b""
    assert high_lsn({HIGH_LSN: "²"}) is None and high_lsn({HIGH_LSN: "-5"}) is None
    assert high_lsn(None) is None
    assert msg_id_position("s:ev:x:²") == 0 and msg_id_position("s:ev:x:seq3") == 0
    assert msg_id_position("") == 0
    assert subject_byte(f"ledger.events.{SID}".encode()) == SID.bytes[15]
    for subject in (b"", b"x", b"ledger.events.-1", b"ledger.events.+f", b"ledger.events. f"):
        assert subject_byte(subject) is None
    assert stream_subjects("p") == ["p.events.*", "p.sessions.*"]


def test_the_wire_format_imports_no_io_library() -> None:
    code = (
        "import sys\n"
        "import ledger_cdc.natswire\n"
        "io = ('nats', 'psycopg', 'psycopg2', 'psycopg_pool', 'prometheus_client')\n"
        "print(sorted(m for m in io if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["[]"]
