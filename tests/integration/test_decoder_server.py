"""Every pgoutput message type, produced by a real server (PostgreSQL 15 and 18) and decoded.

Assertions are on field values, not only on "no error". Messages come from
``pg_logical_slot_get_binary_changes``: the bytes the walsender sends as XLogData payloads.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from ledger_cdc.pgoutput import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Binary,
    Commit,
    CommitPrepared,
    Decoder,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    OldTupleKind,
    Origin,
    Prepare,
    Relation,
    ReplicaIdentity,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from ledger_cdc.stream.values import RowLoader
from tests.support.harness import Database
from tests.support.pgcapture import StreamWatch, capture, decode_all, live_capture, make_slot

pytestmark = pytest.mark.server

ITEMS = """
CREATE TYPE mood AS ENUM ('calm', 'busy');
CREATE DOMAIN short_text AS text CHECK (length(VALUE) < 100);
CREATE TABLE items (
    id     integer PRIMARY KEY,
    name   text NOT NULL,
    price  numeric(10, 2),
    tags   text[],
    data   jsonb,
    at     timestamptz,
    uid    uuid,
    big    text,
    m      mood,
    note   short_text
);
CREATE TABLE items_full (id integer, name text);
ALTER TABLE items_full REPLICA IDENTITY FULL;
CREATE PUBLICATION tpub FOR TABLE items, items_full;
"""


@pytest.fixture
def conn(empty_db: Database) -> Iterator[psycopg.Connection[Any]]:
    with empty_db.connect() as c:
        c.execute(ITEMS)
        yield c


def of(msgs: list[Message], kind: type[Any]) -> list[Any]:
    return [m for m in msgs if isinstance(m, kind)]


def rows(
    decoder: Decoder, msgs: list[Message], kind: type[Any], attr: str = "new"
) -> list[dict[str, Any]]:
    out = []
    for m in of(msgs, kind):
        loader = RowLoader(decoder.relations[m.relation_id])
        out.append(loader.as_dict(getattr(m, attr)))
    return out


def test_insert_update_delete_default_identity(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    u = uuid.uuid4()
    with conn.transaction():
        conn.execute(
            "INSERT INTO items (id, name, price, tags, data, at, uid, m, note) VALUES "
            "(1, 'a', 12.50, '{x,y}', '{\"k\": [1, 2]}', '2026-01-02 03:04:05.123456+00', %s, "
            "'busy', 'hi')",
            (u,),
        )
    conn.execute("UPDATE items SET name = 'b' WHERE id = 1")
    conn.execute("UPDATE items SET id = 2 WHERE id = 1")  # key change: old key sent
    conn.execute("DELETE FROM items WHERE id = 2")
    d = Decoder()
    msgs = decode_all(capture(conn, "s", "tpub"), d)
    begins, commits = of(msgs, Begin), of(msgs, Commit)
    assert len(begins) == len(commits) == 4
    for b, cm in zip(begins, commits, strict=True):
        assert b.final_lsn == cm.commit_lsn and cm.end_lsn > cm.commit_lsn
        assert b.commit_ts == cm.commit_ts and b.xid > 0
    (rel,) = [r for r in of(msgs, Relation) if r.name == "items"]
    assert rel.namespace == "public" and rel.replica_identity is ReplicaIdentity.DEFAULT
    assert [c.name for c in rel.columns] == [
        "id",
        "name",
        "price",
        "tags",
        "data",
        "at",
        "uid",
        "big",
        "m",
        "note",
    ]
    assert [c.is_key for c in rel.columns] == [True] + [False] * 9
    assert rel.columns[2].type_modifier == (10 << 16 | 2) + 4  # numeric(10,2)
    types = {t.name: t for t in of(msgs, Type)}
    assert "mood" in types and types["mood"].namespace == "public"
    (ins,) = rows(d, msgs, Insert)
    assert ins == {
        "id": 1,
        "name": "a",
        "price": decimal.Decimal("12.50"),
        "tags": ["x", "y"],
        "data": {"k": [1, 2]},
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.timezone.utc),
        "uid": u,
        "big": None,
        "m": "busy",
        "note": "hi",
    }
    up1, up2 = of(msgs, Update)
    assert up1.old is None and up1.old_kind is None
    assert RowLoader(rel).as_dict(up1.new)["name"] == "b"
    assert up2.old_kind is OldTupleKind.KEY
    old_key = RowLoader(rel).as_dict(up2.old)
    assert old_key["id"] == 1 and old_key["name"] is None
    (dele,) = of(msgs, Delete)
    assert dele.old_kind is OldTupleKind.KEY and RowLoader(rel).as_dict(dele.old)["id"] == 2


def test_update_delete_replica_identity_full(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    conn.execute("INSERT INTO items_full VALUES (1, 'a')")
    conn.execute("UPDATE items_full SET name = 'b'")
    conn.execute("DELETE FROM items_full")
    d = Decoder()
    msgs = decode_all(capture(conn, "s", "tpub"), d)
    (rel,) = of(msgs, Relation)
    assert rel.replica_identity is ReplicaIdentity.FULL
    (up,) = of(msgs, Update)
    assert up.old_kind is OldTupleKind.OLD
    assert RowLoader(rel).as_dict(up.old) == {"id": 1, "name": "a"}
    assert RowLoader(rel).as_dict(up.new) == {"id": 1, "name": "b"}
    (de,) = of(msgs, Delete)
    assert de.old_kind is OldTupleKind.OLD and RowLoader(rel).as_dict(de.old) == {
        "id": 1,
        "name": "b",
    }


def test_unchanged_toast_is_its_own_marker(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    big = uuid.uuid4().hex * 8000  # 256 kB, TOASTed out of line
    conn.execute("ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL")
    conn.execute("INSERT INTO items (id, name, big) VALUES (1, 'a', %s)", (big,))
    conn.execute("UPDATE items SET name = 'b' WHERE id = 1")
    d = Decoder()
    msgs = decode_all(capture(conn, "s", "tpub"), d)
    (ins,) = of(msgs, Insert)
    (up,) = of(msgs, Update)
    rel = d.relations[up.relation_id]
    assert RowLoader(rel).as_dict(ins.new)["big"] == big
    assert up.new[7] is UNCHANGED and up.new[9] is None
    loaded = RowLoader(rel).as_dict(up.new)
    assert loaded["big"] is UNCHANGED and loaded["name"] == "b" and loaded["note"] is None


def test_truncate_cascade_restart_identity(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE parent (id serial PRIMARY KEY); "
        "CREATE TABLE child (id serial PRIMARY KEY, p int REFERENCES parent); "
        "CREATE PUBLICATION trunc FOR TABLE parent, child"
    )
    make_slot(conn, "s")
    conn.execute("INSERT INTO parent DEFAULT VALUES; INSERT INTO child (p) VALUES (1)")
    conn.execute("TRUNCATE parent CASCADE")
    conn.execute("TRUNCATE parent, child RESTART IDENTITY")
    conn.execute("TRUNCATE child")
    oids = dict(
        conn.execute(
            "SELECT relname, oid::int8 FROM pg_class WHERE relname IN ('parent', 'child')"
        ).fetchall()
    )
    msgs = decode_all(capture(conn, "s", "trunc"))
    t1, t2, t3 = of(msgs, Truncate)
    assert t1.cascade and not t1.restart_identity
    assert set(t1.relation_ids) == {oids["parent"], oids["child"]}
    assert t2.restart_identity and not t2.cascade
    assert set(t2.relation_ids) == {oids["parent"], oids["child"]}
    assert t3.options == 0 and t3.relation_ids == (oids["child"],)


def test_logical_messages_both_ways(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    with conn.transaction():
        conn.execute("SELECT pg_logical_emit_message(true, 'ledger', 'in txn')")
        conn.execute("INSERT INTO items (id, name) VALUES (1, 'a')")
    conn.execute("SELECT pg_logical_emit_message(false, 'heartbeat', '\\x00ff'::bytea)")
    conn.execute("INSERT INTO items (id, name) VALUES (2, 'b')")  # something after it
    msgs = decode_all(capture(conn, "s", "tpub", messages="true"))
    tx, nontx = of(msgs, LogicalMessage)
    assert tx.transactional and tx.prefix == "ledger" and tx.content == b"in txn"
    assert tx.xid is None and tx.lsn > 0
    assert not nontx.transactional and nontx.prefix == "heartbeat" and nontx.content == b"\x00\xff"
    # the transactional one sits inside its transaction
    kinds = [type(m).__name__ for m in msgs]
    i = kinds.index("LogicalMessage")
    assert "Begin" in kinds[:i] and kinds[i + 1 :].count("Commit") >= 1


def test_origin(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    conn.execute("SELECT pg_replication_origin_create('upstream_a')")
    with conn.transaction():
        conn.execute("SELECT pg_replication_origin_session_setup('upstream_a')")
        conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
        conn.execute("INSERT INTO items (id, name) VALUES (1, 'from upstream')")
    conn.execute("SELECT pg_replication_origin_session_reset()")
    opts = {"origin": "any"} if conn.info.server_version >= 160000 else {}
    msgs = decode_all(capture(conn, "s", "tpub", **opts))
    (o,) = of(msgs, Origin)
    assert o.name == "upstream_a" and o.commit_lsn == 0xABCDEF
    kinds = [type(m).__name__ for m in msgs]
    assert kinds.index("Begin") < kinds.index("Origin") < kinds.index("Insert")


def test_binary_format(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    u = uuid.uuid4()
    conn.execute(
        "INSERT INTO items (id, name, price, data, at, uid) VALUES "
        "(7, 'bin', 3.25, '{\"a\": 1}', '2026-05-06 07:08:09+00', %s)",
        (u,),
    )
    d = Decoder()
    msgs = decode_all(capture(conn, "s", "tpub", binary="true"), d)
    (ins,) = of(msgs, Insert)
    assert type(ins.new[0]) is Binary and ins.new[0] == b"\x00\x00\x00\x07"
    row = RowLoader(d.relations[ins.relation_id]).as_dict(ins.new)
    assert row["id"] == 7 and row["name"] == "bin" and row["price"] == decimal.Decimal("3.25")
    assert row["data"] == {"a": 1} and row["uid"] == u
    assert row["at"] == dt.datetime(2026, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc)


def _big_txn(conn: psycopg.Connection[Any], start: int, n: int = 3000) -> None:
    conn.execute(
        "INSERT INTO items (id, name, big) SELECT g, 'n' || g, repeat('x', 200) "
        "FROM generate_series(%s::int, %s::int) g",
        (start, start + n - 1),
    )


def _stream_actions(conn: psycopg.Connection[Any], seen: StreamWatch) -> None:
    with conn.transaction():
        _big_txn(conn, 1)  # committed, larger than logical_decoding_work_mem (64kB)
    with pytest.raises(RuntimeError), conn.transaction():
        _big_txn(conn, 10_000)
        # abort only once the server has streamed it: PostgreSQL 17+ does not stream a
        # transaction it already knows to be aborted
        assert seen.wait_streamed(conn)
        raise RuntimeError("abort")
    with conn.transaction():
        _big_txn(conn, 20_000)
        assert seen.wait_streamed(conn)
        with pytest.raises(RuntimeError), conn.transaction():  # savepoint, rolled back
            _big_txn(conn, 30_000)
            # a row of the subtransaction streamed: more than the 3,000 of the transaction's own
            assert seen.wait_rows(conn, more_than=3000)
            raise RuntimeError("abort the subtransaction")
        _big_txn(conn, 40_000, 10)


def test_streamed_transactions_committed_aborted_and_subtransaction(
    conn: psycopg.Connection[Any], empty_db: Database
) -> None:
    make_slot(conn, "s")
    raw = live_capture(
        empty_db.dsn, "s", "tpub", _stream_actions, proto_version="2", streaming="on"
    )
    d = Decoder()
    msgs = decode_all(raw, d)
    starts = of(msgs, StreamStart)
    assert starts and starts[0].first_segment
    assert len(starts) == len(of(msgs, StreamStop))
    for xid in {s.xid for s in starts}:
        mine = [s for s in starts if s.xid == xid]
        assert mine[0].first_segment and not any(s.first_segment for s in mine[1:])
    inserts = of(msgs, Insert)
    streamed = [i for i in inserts if i.xid is not None]
    (sc1, sc2) = of(msgs, StreamCommit)
    aborts = of(msgs, StreamAbort)
    top_abort = [a for a in aborts if not a.is_subtransaction]
    sub_abort = [a for a in aborts if a.is_subtransaction]
    assert len(top_abort) == 1 and len(sub_abort) == 1, (aborts, starts, of(msgs, StreamCommit))
    assert sc1.xid != top_abort[0].xid and sub_abort[0].xid == sc2.xid
    # rows of a subtransaction carry the subtransaction's xid
    assert len(streamed) >= 3000
    assert {i.xid for i in streamed} <= {s.xid for s in starts} | {a.subxid for a in aborts}
    assert sc1.end_lsn > sc1.commit_lsn and sc2.commit_lsn > sc1.commit_lsn
    assert all(a.abort_lsn is None and a.abort_ts is None for a in aborts)
    loader = RowLoader(d.relations[streamed[0].relation_id])
    ids = [loader.as_dict(i.new)["id"] for i in streamed if i.xid == sc1.xid]
    assert ids[:3] == [1, 2, 3] and ids[-1] == 3000


def _abort_streamed(conn: psycopg.Connection[Any], seen: StreamWatch) -> None:
    with pytest.raises(RuntimeError), conn.transaction():
        _big_txn(conn, 1)
        assert seen.wait_streamed(conn)
        raise RuntimeError("abort")


@pytest.mark.min_server(16)  # streaming 'parallel' (protocol 4)
def test_parallel_streaming_abort_has_lsn_and_time(
    conn: psycopg.Connection[Any], empty_db: Database
) -> None:
    make_slot(conn, "s")
    raw = live_capture(
        empty_db.dsn, "s", "tpub", _abort_streamed, proto_version="4", streaming="parallel"
    )
    msgs = decode_all(raw)
    (a,) = of(msgs, StreamAbort)
    assert a.abort_lsn is not None and a.abort_lsn > 0 and not a.is_subtransaction
    assert a.abort_ts is not None
    assert a.abort_time is not None
    assert abs(a.abort_time - dt.datetime.now(dt.timezone.utc)) < dt.timedelta(minutes=5)


def test_two_phase_prepare_commit_and_rollback(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s2", two_phase=True)
    conn.execute(
        "BEGIN; INSERT INTO items (id, name) VALUES (1, 'a'); PREPARE TRANSACTION 'gid-commit'"
    )
    conn.execute("COMMIT PREPARED 'gid-commit'")
    conn.execute(
        "BEGIN; INSERT INTO items (id, name) VALUES (2, 'b'); PREPARE TRANSACTION 'gid-roll'"
    )
    conn.execute("ROLLBACK PREPARED 'gid-roll'")
    msgs = decode_all(capture(conn, "s2", "tpub", proto_version="3", two_phase="on"))
    bp1, bp2 = of(msgs, BeginPrepare)
    p1, p2 = of(msgs, Prepare)
    (cp,) = of(msgs, CommitPrepared)
    (rp,) = of(msgs, RollbackPrepared)
    assert (bp1.gid, p1.gid, cp.gid) == ("gid-commit",) * 3
    assert (bp2.gid, p2.gid, rp.gid) == ("gid-roll",) * 3
    assert bp1.xid == p1.xid == cp.xid and bp2.xid == p2.xid == rp.xid
    assert bp1.prepare_lsn == p1.prepare_lsn and bp1.end_lsn == p1.end_lsn
    assert cp.commit_lsn >= p1.end_lsn and cp.end_lsn > cp.commit_lsn
    assert rp.prepare_end_lsn == p2.end_lsn and rp.rollback_end_lsn > rp.prepare_end_lsn
    assert rp.prepare_ts == p2.prepare_ts and rp.rollback_ts >= rp.prepare_ts
    assert not of(msgs, Commit)  # prepared transactions end with COMMIT PREPARED, not Commit


def test_streamed_prepare(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s3", two_phase=True)
    conn.execute("BEGIN")
    _big_txn(conn, 1)
    conn.execute("PREPARE TRANSACTION 'big-gid'")
    conn.execute("COMMIT PREPARED 'big-gid'")
    msgs = decode_all(
        capture(conn, "s3", "tpub", proto_version="3", two_phase="on", streaming="on")
    )
    (sp,) = of(msgs, StreamPrepare)
    (cp,) = of(msgs, CommitPrepared)
    assert sp.gid == cp.gid == "big-gid" and sp.xid == cp.xid
    assert of(msgs, StreamStart) and sp.end_lsn > sp.prepare_lsn


def test_alter_table_mid_stream_sends_a_fresh_relation(conn: psycopg.Connection[Any]) -> None:
    make_slot(conn, "s")
    conn.execute("INSERT INTO items_full VALUES (1, 'a')")
    conn.execute("ALTER TABLE items_full ADD COLUMN extra int DEFAULT 5")
    conn.execute("INSERT INTO items_full VALUES (2, 'b', 9)")
    d = Decoder()
    msgs = decode_all(capture(conn, "s", "tpub"), d)
    r1, r2 = of(msgs, Relation)
    assert r1.relation_id == r2.relation_id
    assert [c.name for c in r1.columns] == ["id", "name"]
    assert [c.name for c in r2.columns] == ["id", "name", "extra"]
    i1, i2 = of(msgs, Insert)
    assert len(i1.new) == 2 and len(i2.new) == 3
    assert RowLoader(r2).as_dict(i2.new) == {"id": 2, "name": "b", "extra": 9}
    assert d.relations[r1.relation_id] is r2


def test_every_message_type_seen_on_this_server(conn: psycopg.Connection[Any]) -> None:
    """A guard for the suite itself: each message kind above really came from this server."""
    make_slot(conn, "all2", two_phase=True)
    conn.execute("INSERT INTO items (id, name, m) VALUES (1, 'a', 'calm')")
    conn.execute("UPDATE items SET name = 'b'")
    conn.execute("DELETE FROM items")
    conn.execute("TRUNCATE items")
    conn.execute("SELECT pg_logical_emit_message(false, 'p', 'x')")
    conn.execute("BEGIN; INSERT INTO items (id, name) VALUES (5, 'x'); PREPARE TRANSACTION 'g'")
    conn.execute("ROLLBACK PREPARED 'g'")
    msgs = decode_all(
        capture(conn, "all2", "tpub", proto_version="3", two_phase="on", messages="true")
    )
    seen = {type(m) for m in msgs}
    assert {
        Begin,
        Commit,
        Relation,
        Type,
        Insert,
        Update,
        Delete,
        Truncate,
        LogicalMessage,
        BeginPrepare,
        Prepare,
        RollbackPrepared,
    } <= seen
