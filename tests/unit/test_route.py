"""Which relation is the ledger, and what its rows become: pgoutput messages built with the
grammar (``build_message``) fed to :class:`LedgerStream` as the walsender sends them."""

from __future__ import annotations

import uuid
from typing import Any

from ledger_cdc.events import LedgerEvent
from ledger_cdc.pgoutput.spec import build_message
from ledger_cdc.stream.route import Anomaly, Held, LedgerStream
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
        assert isinstance(item, Held), vals
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
