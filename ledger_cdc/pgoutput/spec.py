"""The pgoutput wire format, protocol versions 1–4, as one declarative ``construct`` grammar.

This module is the single statement of the format: field names follow the PostgreSQL
documentation ("Logical Replication Message Formats"), every integer has the width and signedness
the server writes (LSNs, xids and OIDs unsigned; timestamps and type modifiers signed), and every
message ends with ``Terminated`` so trailing bytes are an error, never ignored. The grammar parses
and builds; tests generate streams with it and the hot-path decoder is checked against it.

Two facts come from the stream, not the message: whether the message sits inside a streamed
transaction (between Stream Start and Stream Stop, protocol 2+), which adds a leading ``xid`` to
Relation, Type, Insert, Update, Delete, Truncate and Message; and, for Stream Abort, whether
parallel streaming (protocol 4) added the abort LSN and timestamp. Both are passed as parse/build
keywords: ``in_stream`` and ``parallel``.
"""

from __future__ import annotations

from typing import Any

import construct as c

__all__ = [
    "MESSAGE",
    "TUPLE_DATA",
    "build_message",
    "parse_message",
]

LSN = c.Int64ub
Xid = c.Int32ub
Oid = c.Int32ub
Timestamp = c.Int64sb  # microseconds since 2000-01-01 00:00 UTC


class _Text(c.Adapter):  # type: ignore[misc]
    """A NUL-terminated string. Names come in the database's encoding, which need not be UTF-8
    (SQL_ASCII admits any bytes, in a table name or a logical message's prefix): bytes that are
    not UTF-8 are kept as backslash escapes rather than failing the message."""

    def _decode(self, obj: bytes, context: Any, path: Any) -> str:
        return obj.decode("utf-8", "backslashreplace")

    def _encode(self, obj: str, context: Any, path: Any) -> bytes:
        return obj.encode("utf-8")


String = _Text(c.NullTerminated(c.GreedyBytes))
StreamXid = c.If(c.this._params.in_stream, Xid)

# TupleData: Int16 column count, then per column a kind byte (and Int32 length + bytes for t/b).
TUPLE_COLUMN = c.Struct(
    "kind" / c.Bytes(1),
    "data"
    / c.Switch(
        c.this.kind,
        {
            b"n": c.Pass,  # NULL
            b"u": c.Pass,  # unchanged TOASTed value (the actual value is not sent)
            b"t": c.Prefixed(c.Int32ub, c.GreedyBytes),  # text format
            b"b": c.Prefixed(c.Int32ub, c.GreedyBytes),  # binary format
        },
        default=c.Error,
    ),
)
TUPLE_DATA = c.Struct("columns" / c.PrefixedArray(c.Int16ub, TUPLE_COLUMN))

BEGIN = c.Struct("final_lsn" / LSN, "commit_ts" / Timestamp, "xid" / Xid)
COMMIT = c.Struct("flags" / c.Int8ub, "commit_lsn" / LSN, "end_lsn" / LSN, "commit_ts" / Timestamp)
ORIGIN = c.Struct("commit_lsn" / LSN, "name" / String)
RELATION_COLUMN = c.Struct(
    "flags" / c.Int8ub,  # 1: part of the replica identity key
    "name" / String,
    "type_oid" / Oid,
    "type_modifier" / c.Int32sb,
)
RELATION = c.Struct(
    "xid" / StreamXid,
    "relation_id" / Oid,
    "namespace" / String,
    "name" / String,
    "replica_identity" / c.Bytes(1),
    "columns" / c.PrefixedArray(c.Int16ub, RELATION_COLUMN),
)
TYPE = c.Struct("xid" / StreamXid, "type_oid" / Oid, "namespace" / String, "name" / String)
INSERT = c.Struct("xid" / StreamXid, "relation_id" / Oid, c.Const(b"N"), "new" / TUPLE_DATA)
UPDATE = c.Struct(
    "xid" / StreamXid,
    "relation_id" / Oid,
    "tag" / c.Bytes(1),  # 'K' old key, 'O' old full row, or 'N': no old tuple
    "old" / c.If(c.this.tag != b"N", TUPLE_DATA),
    "new_tag" / c.If(c.this.tag != b"N", c.Const(b"N")),
    "new" / TUPLE_DATA,
)
DELETE = c.Struct(
    "xid" / StreamXid,
    "relation_id" / Oid,
    "tag" / c.Bytes(1),  # 'K' old key or 'O' old full row
    "old" / TUPLE_DATA,
)
TRUNCATE = c.Struct(
    "xid" / StreamXid,
    "relation_count" / c.Int32ub,
    "options" / c.Int8ub,  # 1: CASCADE, 2: RESTART IDENTITY
    "relation_ids" / c.Array(c.this.relation_count, Oid),
)
LOGICAL_MESSAGE = c.Struct(
    "xid" / StreamXid,
    "flags" / c.Int8ub,  # 1: transactional
    "lsn" / LSN,
    "prefix" / String,
    "content" / c.Prefixed(c.Int32ub, c.GreedyBytes),
)
STREAM_START = c.Struct("xid" / Xid, "first_segment" / c.Int8ub)
STREAM_STOP = c.Struct()
STREAM_COMMIT = c.Struct(
    "xid" / Xid, "flags" / c.Int8ub, "commit_lsn" / LSN, "end_lsn" / LSN, "commit_ts" / Timestamp
)
STREAM_ABORT = c.Struct(
    "xid" / Xid,
    "subxid" / Xid,
    "abort_lsn" / c.If(c.this._params.parallel, LSN),
    "abort_ts" / c.If(c.this._params.parallel, Timestamp),
)
BEGIN_PREPARE = c.Struct(
    "prepare_lsn" / LSN, "end_lsn" / LSN, "prepare_ts" / Timestamp, "xid" / Xid, "gid" / String
)
PREPARE = c.Struct(
    "flags" / c.Int8ub,
    "prepare_lsn" / LSN,
    "end_lsn" / LSN,
    "prepare_ts" / Timestamp,
    "xid" / Xid,
    "gid" / String,
)
COMMIT_PREPARED = c.Struct(
    "flags" / c.Int8ub,
    "commit_lsn" / LSN,
    "end_lsn" / LSN,
    "commit_ts" / Timestamp,
    "xid" / Xid,
    "gid" / String,
)
ROLLBACK_PREPARED = c.Struct(
    "flags" / c.Int8ub,
    "prepare_end_lsn" / LSN,
    "rollback_end_lsn" / LSN,
    "prepare_ts" / Timestamp,
    "rollback_ts" / Timestamp,
    "xid" / Xid,
    "gid" / String,
)
STREAM_PREPARE = PREPARE

BODIES: dict[bytes, c.Construct] = {
    b"B": BEGIN,
    b"C": COMMIT,
    b"O": ORIGIN,
    b"R": RELATION,
    b"Y": TYPE,
    b"I": INSERT,
    b"U": UPDATE,
    b"D": DELETE,
    b"T": TRUNCATE,
    b"M": LOGICAL_MESSAGE,
    b"S": STREAM_START,
    b"E": STREAM_STOP,
    b"c": STREAM_COMMIT,
    b"A": STREAM_ABORT,
    b"b": BEGIN_PREPARE,
    b"P": PREPARE,
    b"K": COMMIT_PREPARED,
    b"r": ROLLBACK_PREPARED,
    b"p": STREAM_PREPARE,
}

MESSAGE = c.Struct(
    "type" / c.Bytes(1),
    "body" / c.Switch(c.this.type, BODIES, default=c.Error),
    c.Terminated,
)


def parse_message(data: bytes, *, in_stream: bool = False, parallel: bool | None = None) -> Any:
    """Parse one message with the grammar (a ``construct`` Container).

    ``parallel`` None means: for Stream Abort, decide by the message length (the abort LSN and
    timestamp are there exactly when the message is 16 bytes longer).
    """
    if parallel is None:
        parallel = data[:1] == b"A" and len(data) == 25
    return MESSAGE.parse(data, in_stream=in_stream, parallel=parallel)


def build_message(
    type_: bytes, body: dict[str, Any], *, in_stream: bool = False, parallel: bool = False
) -> bytes:
    """Build one message's bytes from its fields (``type_`` is the one-byte message type)."""
    data: bytes = MESSAGE.build(
        {"type": type_, "body": body}, in_stream=in_stream, parallel=parallel
    )
    return data
