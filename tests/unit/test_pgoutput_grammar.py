"""The grammar parses and builds every message type; the fast paths equal the grammar.

Property tests: generate field values, build the bytes with the construct grammar, decode them
with the :class:`Decoder` (fast paths for Begin/Insert/Commit, grammar otherwise) and compare with
the Struct made from the grammar's own parse. The two can never drift.
"""

from __future__ import annotations

from typing import Any

import construct
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_cdc.pgoutput import (
    UNCHANGED,
    Begin,
    Binary,
    Column,
    Commit,
    Decoder,
    Insert,
    Relation,
    ReplicaIdentity,
    StreamAbort,
)
from ledger_cdc.pgoutput.decode import from_grammar
from ledger_cdc.pgoutput.spec import MESSAGE, build_message, parse_message

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
u8 = st.integers(0, 255)
ts = st.integers(-(2**55), 2**57)  # inside datetime's range around 2000-01-01
name = st.text(
    st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=20
)

column_value = st.one_of(
    st.builds(lambda b: {"kind": b"t", "data": b}, st.binary(max_size=40)),
    st.builds(lambda b: {"kind": b"b", "data": b}, st.binary(max_size=40)),
    st.just({"kind": b"n", "data": None}),
    st.just({"kind": b"u", "data": None}),
)
tuple_data = st.builds(lambda cols: {"columns": cols}, st.lists(column_value, max_size=12))


def _relation_for(relid: int, ncols: int, xid: int | None = None) -> Relation:
    cols = tuple(Column(0, f"c{i}", 25, -1) for i in range(ncols))
    return Relation(relid, "public", "t", ReplicaIdentity.DEFAULT, cols, xid)


def grammar_struct(data: bytes, *, in_stream: bool = False, parallel: bool | None = None) -> Any:
    parsed = parse_message(data, in_stream=in_stream, parallel=parallel)
    return from_grammar(parsed.type, parsed.body)


@settings(max_examples=300, deadline=None)
@given(lsn=u64, t=ts, xid=u32)
def test_begin_fast_path_equals_grammar(lsn: int, t: int, xid: int) -> None:
    data = build_message(b"B", {"final_lsn": lsn, "commit_ts": t, "xid": xid})
    fast = Decoder().decode(data, 0)
    assert isinstance(fast, Begin)
    assert fast == grammar_struct(data)
    assert fast.final_lsn == lsn and fast.xid == xid


@settings(max_examples=300, deadline=None)
@given(flags=u8, lsn=u64, end=u64, t=ts)
def test_commit_fast_path_equals_grammar(flags: int, lsn: int, end: int, t: int) -> None:
    data = build_message(b"C", {"flags": flags, "commit_lsn": lsn, "end_lsn": end, "commit_ts": t})
    fast = Decoder().decode(data, 0)
    assert isinstance(fast, Commit) and fast == grammar_struct(data)


@settings(max_examples=500, deadline=None)
@given(relid=u32, new=tuple_data, xid=u32, in_stream=st.booleans())
def test_insert_fast_path_equals_grammar(relid: int, new: Any, xid: int, in_stream: bool) -> None:
    body = {"xid": xid if in_stream else None, "relation_id": relid, "new": new}
    data = build_message(b"I", body, in_stream=in_stream)
    d = Decoder()
    d.relations[relid] = _relation_for(relid, len(new["columns"]))
    d.in_stream = in_stream
    fast = d.decode(data, 0)
    ref = grammar_struct(data, in_stream=in_stream)
    assert isinstance(fast, Insert) and fast == ref
    for col, v in zip(new["columns"], fast.new, strict=True):
        if col["kind"] == b"t":
            assert v == col["data"] and type(v) is bytes
        elif col["kind"] == b"b":
            assert v == col["data"] and type(v) is Binary
        elif col["kind"] == b"n":
            assert v is None
        else:
            assert v is UNCHANGED


MESSAGES: dict[bytes, Any] = {
    b"O": st.fixed_dictionaries({"commit_lsn": u64, "name": name}),
    b"R": st.fixed_dictionaries(
        {
            "xid": st.none(),
            "relation_id": u32,
            "namespace": name,
            "name": name,
            "replica_identity": st.sampled_from([b"d", b"n", b"f", b"i"]),
            "columns": st.lists(
                st.fixed_dictionaries(
                    {
                        "flags": st.integers(0, 1),
                        "name": name,
                        "type_oid": u32,
                        "type_modifier": st.integers(-(2**31), 2**31 - 1),
                    }
                ),
                max_size=8,
            ),
        }
    ),
    b"Y": st.fixed_dictionaries(
        {"xid": st.none(), "type_oid": u32, "namespace": name, "name": name}
    ),
    b"T": st.lists(u32, max_size=5).flatmap(
        lambda ids: st.fixed_dictionaries(
            {
                "xid": st.none(),
                "relation_count": st.just(len(ids)),
                "options": st.integers(0, 3),
                "relation_ids": st.just(ids),
            }
        )
    ),
    b"M": st.fixed_dictionaries(
        {
            "xid": st.none(),
            "flags": st.integers(0, 1),
            "lsn": u64,
            "prefix": name,
            "content": st.binary(max_size=50),
        }
    ),
    b"S": st.fixed_dictionaries({"xid": u32, "first_segment": st.integers(0, 1)}),
    b"E": st.just({}),
    b"c": st.fixed_dictionaries(
        {"xid": u32, "flags": u8, "commit_lsn": u64, "end_lsn": u64, "commit_ts": ts}
    ),
    b"b": st.fixed_dictionaries(
        {"prepare_lsn": u64, "end_lsn": u64, "prepare_ts": ts, "xid": u32, "gid": name}
    ),
    b"P": st.fixed_dictionaries(
        {"flags": u8, "prepare_lsn": u64, "end_lsn": u64, "prepare_ts": ts, "xid": u32, "gid": name}
    ),
    b"K": st.fixed_dictionaries(
        {"flags": u8, "commit_lsn": u64, "end_lsn": u64, "commit_ts": ts, "xid": u32, "gid": name}
    ),
    b"r": st.fixed_dictionaries(
        {
            "flags": u8,
            "prepare_end_lsn": u64,
            "rollback_end_lsn": u64,
            "prepare_ts": ts,
            "rollback_ts": ts,
            "xid": u32,
            "gid": name,
        }
    ),
    b"p": st.fixed_dictionaries(
        {"flags": u8, "prepare_lsn": u64, "end_lsn": u64, "prepare_ts": ts, "xid": u32, "gid": name}
    ),
}


@pytest.mark.parametrize("type_", list(MESSAGES), ids=lambda t: t.decode())
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_build_parse_round_trip(type_: bytes, data: st.DataObject) -> None:
    body = data.draw(MESSAGES[type_])
    raw = build_message(type_, body)
    parsed = MESSAGE.parse(raw, in_stream=False, parallel=False)
    assert parsed.type == type_
    for k, v in body.items():
        got = parsed.body[k]
        if isinstance(v, list):
            got = [
                dict((kk, vv) for kk, vv in x.items() if not kk.startswith("_"))
                if hasattr(x, "items")
                else x
                for x in got
            ]
        assert got == v, k
    assert MESSAGE.build(parsed, in_stream=False, parallel=False) == raw
    decoded = Decoder().decode(raw, 0)
    assert decoded == from_grammar(type_, parsed.body)


@settings(max_examples=200, deadline=None)
@given(xid=u32, sub=u32, lsn=u64, t=ts, parallel=st.booleans())
def test_stream_abort_v2_and_v4(xid: int, sub: int, lsn: int, t: int, parallel: bool) -> None:
    body = {
        "xid": xid,
        "subxid": sub,
        "abort_lsn": lsn if parallel else None,
        "abort_ts": t if parallel else None,
    }
    raw = build_message(b"A", body, parallel=parallel)
    assert len(raw) == (25 if parallel else 9)
    for d in (Decoder(), Decoder(parallel=parallel)):
        m = d.decode(raw, 0)
        assert isinstance(m, StreamAbort) and m.xid == xid and m.subxid == sub
        assert (m.abort_lsn == lsn) if parallel else (m.abort_lsn is None and m.abort_ts is None)


@settings(max_examples=200, deadline=None)
@given(
    relid=u32,
    old=tuple_data,
    new=tuple_data,
    tag=st.sampled_from([b"K", b"O", b"N"]),
    xid=u32,
    in_stream=st.booleans(),
)
def test_update_with_and_without_old_tuple(
    relid: int, old: Any, new: Any, tag: bytes, xid: int, in_stream: bool
) -> None:
    n = len(new["columns"])
    null = {"kind": b"n", "data": None}
    old = {"columns": (old["columns"] + [null] * n)[:n]}
    body = {
        "xid": xid if in_stream else None,
        "relation_id": relid,
        "tag": tag,
        "old": None if tag == b"N" else old,
        "new": new,
    }
    raw = build_message(b"U", body, in_stream=in_stream)
    d = Decoder()
    d.in_stream = in_stream
    d.relations[relid] = _relation_for(relid, n)
    m = d.decode(raw, 0)
    assert m == grammar_struct(raw, in_stream=in_stream)
    assert (m.old is None) == (tag == b"N")  # type: ignore[union-attr]


def test_in_stream_messages_carry_xid() -> None:
    d = Decoder()
    d.decode(build_message(b"S", {"xid": 77, "first_segment": 1}), 0)
    rel = d.decode(
        build_message(
            b"R",
            {
                "xid": 77,
                "relation_id": 5,
                "namespace": "public",
                "name": "t",
                "replica_identity": b"d",
                "columns": [{"flags": 1, "name": "a", "type_oid": 23, "type_modifier": -1}],
            },
            in_stream=True,
        ),
        0,
    )
    assert isinstance(rel, Relation) and rel.xid == 77
    ins = d.decode(
        build_message(
            b"I",
            {"xid": 78, "relation_id": 5, "new": {"columns": [{"kind": b"t", "data": b"1"}]}},
            in_stream=True,
        ),
        0,
    )
    assert isinstance(ins, Insert) and ins.xid == 78 and ins.new == (b"1",)
    d.decode(build_message(b"E", {}), 0)
    assert not d.in_stream
    ins2 = d.decode(
        build_message(
            b"I",
            {"xid": None, "relation_id": 5, "new": {"columns": [{"kind": b"n", "data": None}]}},
        ),
        0,
    )
    assert isinstance(ins2, Insert) and ins2.xid is None


def test_grammar_refuses_trailing_bytes() -> None:
    raw = build_message(b"E", {})
    with pytest.raises(construct.TerminatedError):
        MESSAGE.parse(raw + b"\x00", in_stream=False, parallel=False)


def test_pg_micros_is_the_inverse_of_pg_timestamp_to_the_microsecond() -> None:
    import datetime as dt

    from ledger_cdc.pgoutput.messages import pg_micros, pg_timestamp

    for us in (0, 1, -1, 815_000_123_456_789, 2**53 + 7):
        assert pg_micros(pg_timestamp(us)) == us
    later = dt.datetime(2026, 12, 3, 19, 33, 0, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert pg_timestamp(pg_micros(later)) == later
