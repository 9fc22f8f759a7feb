"""pgoutput bytes → typed messages, with a relation cache and the stream state.

:class:`Decoder` is the protocol state machine apart from any socket: feed it each XLogData
payload with its ``wal_start`` and it returns one message Struct. It tracks what the message
grammar cannot see by itself: whether we are inside a streamed transaction chunk (which adds an
``xid`` to row messages) and which relations and types the server has described.

Begin, Insert and Commit dominate a ledger stream, so they have hand-written decoders built on
precompiled ``struct`` unpackers (an Insert's text values by a parser written out once per
column count, with a loop for any other row); every other message is parsed by the grammar in
:mod:`ledger_cdc.pgoutput.spec`. Property tests check the hand-written paths against the grammar.
Whenever a fast path meets bytes it cannot read, the grammar re-parses the message to say exactly
which field failed and where. Nothing but :class:`~ledger_cdc.errors.DecodeError` leaves
:meth:`Decoder.decode`.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import Any

import construct as c

from ledger_cdc.errors import DecodeError
from ledger_cdc.pgoutput import spec
from ledger_cdc.pgoutput.messages import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Binary,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    MessageType,
    OldTupleKind,
    Origin,
    Prepare,
    Relation,
    ReplicaIdentity,
    RollbackPrepared,
    SpecialValues,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)

__all__ = ["Decoder", "from_grammar"]

# ``unpack`` (not ``unpack_from``) also checks the exact message length; "x" skips the type byte
_BEGIN = struct.Struct(">xQqI").unpack
_COMMIT = struct.Struct(">xBQQq").unpack
_U32 = struct.Struct(">I").unpack_from
_COLUMN_HEAD = struct.Struct(">BI").unpack_from  # a column's kind, and its length if it has one
_INSERT = struct.Struct(">IBH").unpack_from  # relation id, tuple tag, column count
_INSERT_IN_STREAM = struct.Struct(">IIBH").unpack_from  # the same after the xid
# A text value this long is handed over as a memoryview of its message, not copied out of it:
# the message is already one copy of a large payload in memory, and its decoded value another.
_VIEW_FROM = 1 << 20
_NAMES = {m.value: m.name.title().replace("_", " ") for m in MessageType}
_FAST_ERRORS = (IndexError, struct.error, ValueError, KeyError, TypeError)


def _tuple_at(data: bytes, pos: int, ncols: int) -> tuple[Any, ...]:
    """The ``ncols`` values of a TupleData starting at ``pos``, which must end the message (a
    text value of _VIEW_FROM bytes or more as a view of it: see _VIEW_FROM)."""
    values: list[Any] = []
    append = values.append
    special = False
    for _ in range(ncols):
        col = data[pos]
        if col == 116:  # 't'
            end = pos + 5 + _U32(data, pos + 1)[0]
            append(
                data[pos + 5 : end] if end - pos < _VIEW_FROM else memoryview(data)[pos + 5 : end]
            )
            pos = end
        elif col == 110:  # 'n'
            append(None)
            pos += 1
        elif col == 117:  # 'u'
            append(UNCHANGED)
            pos += 1
            special = True
        elif col == 98:  # 'b'
            end = pos + 5 + _U32(data, pos + 1)[0]
            append(Binary(data[pos + 5 : end]))
            pos = end
            special = True
        else:
            raise ValueError(f"unknown tuple column kind {col:#04x}")
    if pos != len(data):
        raise ValueError("the tuple does not end at the message end")
    return SpecialValues(values) if special else tuple(values)


_TextTuple = Callable[[bytes, int], "tuple[Any, ...] | None"]
_TEXT_TUPLES: dict[int, _TextTuple] = {}
_UNROLLED_UPTO = 64  # columns; a wider relation's rows take the loop


def _text_tuple(ncols: int) -> _TextTuple:
    """A parser of a TupleData of ``ncols`` text or NULL values (a ledger row's every value),
    written out column by column: the values as a tuple, or None when one is binary or
    unchanged or the tuple does not end the message (then :func:`_tuple_at` reads it, and
    says what is wrong). Straight-line code has no per-column loop to run: the Insert path
    spends most of its time here. Made once per column count, from this fixed text alone."""
    if ncols > _UNROLLED_UPTO:
        return _loop_only
    lines = ["def parse(data, pos, head=head, u32=u32):"]
    for i in range(ncols):
        # a column's kind and length in one read, where four more bytes surely follow it
        # (four more columns do): a NULL has no length, and may end the message
        if i < ncols - 4:
            lines += ["    kind, size = head(data, pos)", "    if kind == 116:"]
        else:
            lines += ["    kind = data[pos]", "    if kind == 116:"]
            lines += ["        size = u32(data, pos + 1)[0]"]
        lines += [
            f"        start = pos + 5; pos = start + size; v{i} = data[start:pos]",
            "    elif kind == 110:",
            f"        v{i} = None; pos += 1",
            "    else:",
            "        return None",
        ]
    lines += [
        "    if pos != len(data):",
        "        return None",
        f"    return ({''.join(f'v{i}, ' for i in range(ncols))})",
    ]
    scope: dict[str, Any] = {"head": _COLUMN_HEAD, "u32": _U32}
    # (text made above from the column count alone)
    exec(compile("\n".join(lines), f"<TupleData of {ncols} text values>", "exec"), scope)
    parse: _TextTuple = scope["parse"]
    _TEXT_TUPLES[ncols] = parse
    return parse


def _loop_only(data: bytes, pos: int) -> None:
    """What a relation wider than _UNROLLED_UPTO columns takes: its rows go to the loop."""
    return None


class _Tracking(io.BytesIO):
    """A stream that remembers where the last read started: the offset of the failing field."""

    last = 0

    def read(self, size: int | None = -1, /) -> bytes:
        self.last = self.tell()
        return super().read(size)


def _tuple_from(container: Any) -> tuple[Any, ...]:
    out: list[Any] = []
    special = False
    for col in container.columns:
        k = col.kind
        if k == b"t":
            out.append(bytes(col.data))
        elif k == b"b":
            out.append(Binary(col.data))
            special = True
        elif k == b"n":
            out.append(None)
        else:
            out.append(UNCHANGED)
            special = True
    return SpecialValues(out) if special else tuple(out)


def from_grammar(type_: bytes, b: Any) -> Message:
    """A message Container parsed by the grammar → its Struct (the reference for the fast paths)."""
    if type_ == b"B":
        return Begin(b.final_lsn, b.commit_ts, b.xid)
    if type_ == b"C":
        return Commit(b.flags, b.commit_lsn, b.end_lsn, b.commit_ts)
    if type_ == b"O":
        return Origin(b.commit_lsn, b.name)
    if type_ == b"R":
        cols = tuple(Column(x.flags, x.name, x.type_oid, x.type_modifier) for x in b.columns)
        return Relation(
            b.relation_id, b.namespace, b.name, ReplicaIdentity(b.replica_identity), cols, b.xid
        )
    if type_ == b"Y":
        return Type(b.type_oid, b.namespace, b.name, b.xid)
    if type_ == b"I":
        return Insert(b.relation_id, _tuple_from(b.new), b.xid)
    if type_ == b"U":
        if b.tag == b"N":
            return Update(b.relation_id, _tuple_from(b.new), None, None, b.xid)
        return Update(
            b.relation_id, _tuple_from(b.new), _tuple_from(b.old), OldTupleKind(b.tag), b.xid
        )
    if type_ == b"D":
        return Delete(b.relation_id, _tuple_from(b.old), OldTupleKind(b.tag), b.xid)
    if type_ == b"T":
        return Truncate(tuple(b.relation_ids), b.options, b.xid)
    if type_ == b"M":
        return LogicalMessage(b.flags, b.lsn, b.prefix, bytes(b.content), b.xid)
    if type_ == b"S":
        return StreamStart(b.xid, bool(b.first_segment))
    if type_ == b"E":
        return StreamStop()
    if type_ == b"c":
        return StreamCommit(b.xid, b.flags, b.commit_lsn, b.end_lsn, b.commit_ts)
    if type_ == b"A":
        abort_ts = None if b.abort_ts is None else b.abort_ts
        return StreamAbort(b.xid, b.subxid, b.abort_lsn, abort_ts)
    if type_ == b"b":
        return BeginPrepare(b.prepare_lsn, b.end_lsn, b.prepare_ts, b.xid, b.gid)
    if type_ == b"P":
        return Prepare(b.flags, b.prepare_lsn, b.end_lsn, b.prepare_ts, b.xid, b.gid)
    if type_ == b"K":
        return CommitPrepared(b.flags, b.commit_lsn, b.end_lsn, b.commit_ts, b.xid, b.gid)
    if type_ == b"r":
        return RollbackPrepared(
            b.flags,
            b.prepare_end_lsn,
            b.rollback_end_lsn,
            b.prepare_ts,
            b.rollback_ts,
            b.xid,
            b.gid,
        )
    if type_ == b"p":
        return StreamPrepare(b.flags, b.prepare_lsn, b.end_lsn, b.prepare_ts, b.xid, b.gid)
    raise ValueError(f"no message type {type_!r}")  # pragma: no cover - the grammar refuses it


def _field_of(e: c.ConstructError) -> str | None:
    path = getattr(e, "path", None) or ""
    parts = [p.strip() for p in path.replace("(parsing)", "").split("->") if p.strip()]
    parts = [p for p in parts if p != "body"]
    return ".".join(parts) or None


class Decoder:
    """Stateful pgoutput decoder for one replication stream.

    ``parallel``: whether the stream uses ``streaming 'parallel'`` (protocol 4), which adds the
    abort LSN and timestamp to Stream Abort; ``None`` decides per message by its length.
    """

    def __init__(self, *, parallel: bool | None = None) -> None:
        self.relations: dict[int, Relation] = {}
        # relation id → (its column count, the parser of its rows' text values)
        self._parsers: dict[int, tuple[int, _TextTuple]] = {}
        self.types: dict[int, Type] = {}
        self.in_stream = False
        self.stream_xid: int | None = None
        self.parallel = parallel

    # -- errors ---------------------------------------------------------------------------------

    def _error_from_grammar(
        self, data: bytes, wal_start: int, fallback: BaseException
    ) -> DecodeError:
        """Re-parse with the grammar to name the field and offset a fast path tripped on."""
        mtype = _NAMES.get(data[:1])
        try:
            self._parse_grammar(data, wal_start)
        except DecodeError as e:
            return e
        return DecodeError(
            f"malformed message: {fallback}",
            message_type=mtype,
            offset=0,
            lsn=wal_start,
            data=data,
        )

    def _parse_grammar(self, data: bytes, wal_start: int) -> Message:
        if not data:
            raise DecodeError("empty message", lsn=wal_start, data=data, offset=0)
        type_ = data[:1]
        mtype = _NAMES.get(type_)
        if mtype is None:
            raise DecodeError(
                f"unknown message type {type_!r}", field="type", offset=0, lsn=wal_start, data=data
            )
        stream = _Tracking(data)
        parallel = self.parallel
        if parallel is None:
            parallel = type_ == b"A" and len(data) == 25
        try:
            parsed = spec.MESSAGE.parse_stream(stream, in_stream=self.in_stream, parallel=parallel)
            return from_grammar(type_, parsed.body)
        except c.TerminatedError:
            raise DecodeError(
                f"{len(data) - stream.last} unexpected bytes after the last field",
                message_type=mtype,
                offset=stream.last,
                lsn=wal_start,
                data=data,
            ) from None
        except c.ConstructError as e:
            reason = str(e).splitlines()[-1].split(" (parsing)")[0]
            raise DecodeError(
                reason,
                message_type=mtype,
                field=_field_of(e),
                offset=stream.last,
                lsn=wal_start,
                data=data,
            ) from None
        except UnicodeDecodeError as e:
            raise DecodeError(
                f"string is not valid UTF-8 ({e.reason})",
                message_type=mtype,
                offset=stream.last,
                lsn=wal_start,
                data=data,
            ) from None
        except (ValueError, OverflowError) as e:
            raise DecodeError(
                f"value out of range: {e}",
                message_type=mtype,
                offset=stream.last,
                lsn=wal_start,
                data=data,
            ) from None

    # -- decoding -------------------------------------------------------------------------------

    def decode(self, data: bytes, wal_start: int = 0) -> Message:
        """Decode one message (the payload of one XLogData) received at ``wal_start``."""
        try:
            kind = data[0]
        except IndexError:
            raise DecodeError("empty message", lsn=wal_start, data=data, offset=0) from None
        try:
            if kind == 73:  # 'I'
                if self.in_stream:
                    xid, relid, tag, ncols = _INSERT_IN_STREAM(data, 1)
                    pos = 12
                else:
                    xid = None
                    relid, tag, ncols = _INSERT(data, 1)
                    pos = 8
                if tag != 78:  # 'N'
                    raise ValueError("Insert without its 'N' tuple tag")
                # TupleData, parsed in place: this is the hottest code of a ledger stream;
                # Update and Delete (rare here) go through the grammar
                known = self._parsers.get(relid)
                if known is not None and known[0] == ncols:  # a row of a relation described
                    new = known[1](data, pos) if len(data) < _VIEW_FROM else None
                    if new is None:  # a binary or unchanged value, or bytes past the tuple
                        new = _tuple_at(data, pos, ncols)
                    return Insert(relid, new, xid)
                new = _tuple_at(data, pos, ncols)
                return self._check_row(Insert(relid, new, xid), wal_start, data)
            if kind == 66:  # 'B'
                return Begin(*_BEGIN(data))
            if kind == 67:  # 'C'
                return Commit(*_COMMIT(data))
        except _FAST_ERRORS as e:
            raise self._error_from_grammar(data, wal_start, e) from None
        msg = self._parse_grammar(data, wal_start)
        return self._observe(msg, wal_start, data)

    def _observe(self, msg: Message, wal_start: int, data: bytes) -> Message:
        """Update the stream state and caches from a message parsed by the grammar."""
        if isinstance(msg, Relation):
            self.relations[msg.relation_id] = msg
            ncols = len(msg.columns)
            self._parsers[msg.relation_id] = (ncols, _TEXT_TUPLES.get(ncols) or _text_tuple(ncols))
        elif isinstance(msg, Type):
            self.types[msg.type_oid] = msg
        elif isinstance(msg, StreamStart):
            if self.in_stream:
                raise DecodeError(
                    "Stream Start inside a stream chunk (no Stream Stop before it)",
                    message_type="Stream Start",
                    lsn=wal_start,
                    data=data,
                    offset=0,
                )
            self.in_stream = True
            self.stream_xid = msg.xid
        elif isinstance(msg, StreamStop):
            self.in_stream = False
            self.stream_xid = None
        elif isinstance(msg, (Update, Delete)):
            return self._check_row(msg, wal_start, data)
        return msg

    def _check_row(self, msg: Insert | Update | Delete, wal_start: int, data: bytes) -> Message:
        mtype = _NAMES[data[:1]]
        rel = self.relations.get(msg.relation_id)
        if rel is None:
            raise DecodeError(
                f"relation id {msg.relation_id} was never announced by a Relation message "
                "(the stream must be read from the start of a session)",
                message_type=mtype,
                field="relation_id",
                offset=5 if self.in_stream else 1,
                lsn=wal_start,
                data=data,
            )
        tuples = [
            t for t in (getattr(msg, "new", None), getattr(msg, "old", None)) if t is not None
        ]
        for values in tuples:
            if len(values) != len(rel.columns):
                raise DecodeError(
                    f"tuple has {len(values)} columns but relation {rel.namespace}.{rel.name} "
                    f"has {len(rel.columns)}",
                    message_type=mtype,
                    field="tuple",
                    lsn=wal_start,
                    data=data,
                    offset=0,
                )
        return msg
