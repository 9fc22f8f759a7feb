"""Which relation is the ledger, and what its rows become: pgoutput messages built with the
grammar (``build_message``) fed to :class:`LedgerStream` as the walsender sends them."""

from __future__ import annotations

import uuid
from typing import Any

from ledger_cdc.events import LedgerEvent
from ledger_cdc.pgoutput.spec import build_message
from ledger_cdc.stream.route import Anomaly, LedgerStream, Quarantined
from tests.support.fakestream import LEDGER_COLUMNS

COLUMNS = LEDGER_COLUMNS
LEDGER, OTHER = 16384, 20000
SID = uuid.UUID(int=7)


def relation(relid: int = LEDGER, ns: str = "public", name: str = "agent_events") -> bytes:
    cols = [
        {"flags": int(n == "seq"), "name": n, "type_oid": oid, "type_modifier": -1}
        for n, oid in COLUMNS
    ]
    return build_message(
        b"R",
        {
            "xid": None,
            "relation_id": relid,
            "namespace": ns,
            "name": name,
            "replica_identity": b"d",
            "columns": cols,
        },
    )


def values(vals: list[Any]) -> dict[str, Any]:
    return {
        "columns": [
            {"kind": b"n", "data": None} if v is None else {"kind": b"t", "data": str(v).encode()}
            for v in vals
        ]
    }


def row(seq: int | None, sid: uuid.UUID | None = SID, pos: int | None = None) -> list[Any]:
    position = pos if pos is not None else seq
    return [seq, sid, position, "agent", "message.user", '{"text": "hi"}', None,
            "2026-01-01 00:00:00+00", None, "\\x00"]  # fmt: skip


def insert(vals: list[Any], relid: int = LEDGER) -> bytes:
    return build_message(b"I", {"xid": None, "relation_id": relid, "new": values(vals)})


def transaction(*msgs: bytes, stream: LedgerStream | None = None) -> list[Any]:
    """The items of one transaction made of ``msgs``."""
    s = stream or LedgerStream(skip_upto=0, memory_limit=10**8)
    body = [build_message(b"B", {"final_lsn": 500, "commit_ts": 0, "xid": 9}), *msgs]
    body.append(
        build_message(b"C", {"flags": 0, "commit_lsn": 500, "end_lsn": 508, "commit_ts": 0})
    )
    txns = [t for i, m in enumerate(body) for t in s.feed(m, 100 + i)]
    assert len(txns) == 1
    items = txns[0].items
    assert isinstance(items, list)
    return items


def test_another_schemas_table_of_the_ledgers_name_is_not_folded() -> None:
    """A publication of all tables (or of a schema) streams archive.agent_events too: with the
    ledger's schema known, only public.agent_events is folded, whatever the other's columns."""
    s = LedgerStream(skip_upto=0, memory_limit=10**8, schema="public")
    items = transaction(
        relation(),
        relation(OTHER, ns="archive"),
        insert(row(1)),
        insert(row(2), relid=OTHER),
        insert(row(3, pos=2)),
        stream=s,
    )
    assert [(type(i), i.seq) for i in items] == [(LedgerEvent, 1), (LedgerEvent, 3)]


def test_the_ledger_renamed_is_still_the_ledger() -> None:
    """ALTER TABLE … RENAME: the walsender sends the relation again under its new name, and its
    inserts keep coming (a publication follows the table): none of them is dropped."""
    items = transaction(
        relation(), insert(row(1)), relation(name="agent_events_old"), insert(row(2))
    )
    assert [(type(i), i.seq) for i in items] == [(LedgerEvent, 1), (LedgerEvent, 2)]


def test_a_null_identity_column_is_quarantined_not_folded() -> None:
    """A NULL seq, session or position (NOT NULL dropped by hand) cannot make an event: the row
    is held for the dead letters, never a LedgerEvent carrying None into the fold."""
    for vals in (row(None), row(5, sid=None), [5, SID, None, *row(5)[3:]]):
        (item,) = transaction(relation(), insert(vals))
        assert isinstance(item, Quarantined), vals
        assert "NULL" in item.rejected.reason
        assert isinstance(item.rejected.seq, int)
        assert isinstance(item.rejected.session_id, uuid.UUID)


def test_an_update_that_changed_the_key_is_described_by_its_new_row() -> None:
    """An UPDATE of seq sends the old key alone (kind 'K', every other column NULL) and the
    whole new row: the anomaly names the session from the new row."""
    old = values([1, *[None] * (len(COLUMNS) - 1)])
    upd = build_message(
        b"U",
        {"xid": None, "relation_id": LEDGER, "tag": b"K", "old": old, "new": values(row(9))},
    )
    (item,) = transaction(relation(), upd)
    assert isinstance(item, Anomaly)
    assert item.kind == "update"
    assert item.session_id == SID
    assert item.seq == 9


def _feed(s: LedgerStream, *msgs: bytes) -> list[Any]:
    """Every transaction's items that ``msgs`` complete, in order."""
    return [it for i, m in enumerate(msgs) for t in s.feed(m, 100 + i) for it in t.items]


def _in_stream(type_: bytes, body: dict[str, Any]) -> bytes:
    return build_message(type_, body, in_stream=True)


def _copy_named_ledger_in_stream(xid: int, subxid: int) -> list[bytes]:
    """A streamed block of transaction ``xid`` in which subtransaction ``subxid`` renames a
    copy table (OTHER) to agent_events and writes to it."""
    rel = build_message(b"R", {"xid": subxid, **_relation_fields(OTHER)}, in_stream=True)
    return [
        build_message(b"S", {"xid": xid, "first_segment": 1}),
        rel,
        _in_stream(b"I", {"xid": subxid, "relation_id": OTHER, "new": values(row(50))}),
        build_message(b"E", {}),
    ]


def _relation_fields(relid: int, name: str = "agent_events") -> dict[str, Any]:
    cols = [
        {"flags": int(n == "seq"), "name": n, "type_oid": oid, "type_modifier": -1}
        for n, oid in COLUMNS
    ]
    return {
        "relation_id": relid,
        "namespace": "public",
        "name": name,
        "replica_identity": b"d",
        "columns": cols,
    }


def _abort(xid: int, subxid: int) -> bytes:
    return build_message(b"A", {"xid": xid, "subxid": subxid, "abort_lsn": None, "abort_ts": None})


def test_a_table_named_the_ledger_in_an_aborted_stream_is_not_the_ledger() -> None:
    """A rename to agent_events tried in a streamed transaction and rolled back (the whole
    transaction, or the subtransaction that did it): the copy's later rows are not folded."""
    for xid, subxid, abort_sub in ((50, 50, 50), (50, 51, 51), (50, 51, 50)):
        s = LedgerStream(skip_upto=0, memory_limit=10**8)
        assert _feed(s, relation(), *transaction_msgs(insert(row(1)))) != []
        msgs = _copy_named_ledger_in_stream(xid, subxid)
        got = _feed(s, *msgs, _abort(xid, abort_sub), *transaction_msgs(insert(row(7), OTHER)))
        assert got == [], (xid, subxid, abort_sub)
        # the ledger is still the ledger
        (item,) = _feed(s, *transaction_msgs(insert(row(2))))
        assert isinstance(item, LedgerEvent) and item.seq == 2


def test_a_table_renamed_to_the_ledger_in_a_committed_stream_is_the_ledger() -> None:
    """The same rename committed: the table is the ledger from then on (a relation id is the
    table's), its rows in the stream and after it folded."""
    s = LedgerStream(skip_upto=0, memory_limit=10**8)
    commit = build_message(
        b"c", {"xid": 50, "flags": 0, "commit_lsn": 900, "end_lsn": 908, "commit_ts": 0}
    )
    items = _feed(s, *_copy_named_ledger_in_stream(50, 51), commit)
    assert [type(i) for i in items] == [LedgerEvent]
    (item,) = _feed(s, *transaction_msgs(insert(row(7), OTHER)))
    assert isinstance(item, LedgerEvent) and item.seq == 7


def test_a_table_named_the_ledger_in_a_prepared_transaction_rolled_back_is_not() -> None:
    """Two-phase: the prepared transaction's changes are sent at PREPARE, its fate later."""
    s = LedgerStream(skip_upto=0, memory_limit=10**8)
    ts = {"prepare_ts": 0, "xid": 60, "gid": "g"}
    lsns = {"prepare_lsn": 800, "end_lsn": 808}
    msgs = [
        build_message(b"b", {**lsns, **ts}),
        build_message(b"R", {"xid": None, **_relation_fields(OTHER)}),
        insert(row(50), OTHER),
        build_message(b"P", {"flags": 0, **lsns, **ts}),
        build_message(
            b"r",
            {"flags": 0, "prepare_end_lsn": 808, "rollback_end_lsn": 900, "rollback_ts": 0, **ts},
        ),
    ]
    assert _feed(s, *msgs, *transaction_msgs(insert(row(7), OTHER))) == []


def test_a_column_of_a_domain_over_a_builtin_type_loads_as_that_type() -> None:
    """The server sends a Type message for a user-defined column type, naming a domain's base
    type (pg_catalog as an empty namespace): the domain's values load as the base type's."""
    domain = 70000
    cols = dict(COLUMNS)
    typ = build_message(
        b"Y", {"xid": None, "type_oid": domain, "namespace": "", "name": "timestamptz"}
    )
    fields = _relation_fields(LEDGER)
    for col in fields["columns"]:
        if col["name"] == "created_at":
            assert col["type_oid"] == cols["created_at"]
            col["type_oid"] = domain
    rel = build_message(b"R", {"xid": None, **fields})
    (item,) = transaction(typ, rel, insert(row(1)))
    assert isinstance(item, LedgerEvent), item
    assert item.created_at.year == 2026


def transaction_msgs(*msgs: bytes) -> list[bytes]:
    return [
        build_message(b"B", {"final_lsn": 500, "commit_ts": 0, "xid": 9}),
        *msgs,
        build_message(b"C", {"flags": 0, "commit_lsn": 500, "end_lsn": 508, "commit_ts": 0}),
    ]


def test_rows_of_one_session_carry_one_session_id_object(monkeypatch: Any) -> None:
    # the fold's dictionaries, keyed by session, find theirs by identity instead of comparing
    # two UUIDs in Python on every lookup; the decoder keeps a bounded number of them
    import ledger_cdc.stream.ledger as ledger

    other = uuid.UUID(int=8)
    s = LedgerStream(skip_upto=0, memory_limit=10**8)
    first = transaction(relation(), insert(row(1)), insert(row(2, other, 1)), stream=s)
    later = transaction(insert(row(3, pos=2)), insert(row(4, other, 2)), stream=s)
    assert [e.session_id for e in first] == [SID, other] == [e.session_id for e in later]
    assert first[0].session_id is later[0].session_id
    assert first[1].session_id is later[1].session_id
    monkeypatch.setattr(ledger, "_SESSIONS_KEPT", 1)  # over it: kept ones forgotten, all equal
    third = uuid.UUID(int=9)
    again = transaction(insert(row(5, third, 1)), insert(row(6, pos=3)), stream=s)
    assert [e.session_id for e in again] == [third, SID]
    assert all(type(e) is LedgerEvent for e in [*first, *later, *again])
