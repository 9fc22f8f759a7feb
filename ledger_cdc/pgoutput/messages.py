"""Typed pgoutput messages: one frozen msgspec Struct per message type, and enums for wire codes.

Messages that may appear inside a streamed transaction (Relation, Type, Insert, Update, Delete,
Truncate, Message) carry that transaction's ``xid`` in the same type, ``None`` outside a stream.
Tuple values stay raw here: ``bytes`` for a text-format column, :class:`Binary` for a
binary-format one, ``None`` for NULL and :data:`UNCHANGED` for an unchanged TOASTed value (which the
server does not send). Converting them to Python values is :mod:`ledger_cdc.stream.values`' job.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any, Final, TypeAlias

import msgspec

__all__ = [
    "UNCHANGED",
    "Begin",
    "BeginPrepare",
    "Binary",
    "Column",
    "ColumnFlag",
    "Commit",
    "CommitPrepared",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Message",
    "MessageType",
    "OldTupleKind",
    "Origin",
    "Prepare",
    "Relation",
    "ReplicaIdentity",
    "RollbackPrepared",
    "SpecialValues",
    "StreamAbort",
    "StreamCommit",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TruncateOption",
    "TupleKind",
    "Type",
    "UnchangedToast",
    "Update",
]


class MessageType(bytes, enum.Enum):
    """The first byte of every pgoutput message."""

    BEGIN = b"B"
    """Start of a (non-streamed) transaction; carries its final LSN, commit time and xid."""
    COMMIT = b"C"
    """End of a transaction: commit LSN, end LSN, commit time."""
    ORIGIN = b"O"
    """The transaction was replicated here from the named replication origin."""
    RELATION = b"R"
    """Describes a table before its first row change in the session (and after ALTER TABLE)."""
    TYPE = b"Y"
    """Describes a non-built-in data type used by a Relation's columns."""
    INSERT = b"I"
    """A new row."""
    UPDATE = b"U"
    """A changed row, with the old key or old row under REPLICA IDENTITY DEFAULT/INDEX/FULL."""
    DELETE = b"D"
    """A removed row: its key or, under REPLICA IDENTITY FULL, the whole old row."""
    TRUNCATE = b"T"
    """TRUNCATE of one or more tables, with the CASCADE / RESTART IDENTITY options."""
    MESSAGE = b"M"
    """A ``pg_logical_emit_message`` message, transactional or not."""
    STREAM_START = b"S"
    """Start of a chunk of an in-progress (streamed) transaction (protocol 2+)."""
    STREAM_STOP = b"E"
    """End of a chunk of a streamed transaction."""
    STREAM_COMMIT = b"c"
    """A streamed transaction committed."""
    STREAM_ABORT = b"A"
    """A streamed (sub)transaction aborted; with parallel streaming also its LSN and time."""
    BEGIN_PREPARE = b"b"
    """Start of a prepared transaction (two-phase, protocol 3+)."""
    PREPARE = b"P"
    """The transaction was prepared (PREPARE TRANSACTION)."""
    COMMIT_PREPARED = b"K"
    """COMMIT PREPARED of an earlier prepared transaction."""
    ROLLBACK_PREPARED = b"r"
    """ROLLBACK PREPARED of an earlier prepared transaction."""
    STREAM_PREPARE = b"p"
    """A streamed transaction was prepared."""


class TupleKind(bytes, enum.Enum):
    """The kind byte of each column in TupleData."""

    NULL = b"n"
    """The value is NULL."""
    UNCHANGED_TOAST = b"u"
    """An unchanged TOASTed value; the server does not send it."""
    TEXT = b"t"
    """Text-format value follows, Int32 length first."""
    BINARY = b"b"
    """Binary-format value follows (``binary 'true'``), Int32 length first."""


class OldTupleKind(bytes, enum.Enum):
    """What an Update or Delete sends of the old row."""

    KEY = b"K"
    """The replica identity key columns (others NULL)."""
    OLD = b"O"
    """The whole old row (REPLICA IDENTITY FULL)."""


class ReplicaIdentity(bytes, enum.Enum):
    """``pg_class.relreplident`` as sent in a Relation message."""

    DEFAULT = b"d"
    """The primary key."""
    NOTHING = b"n"
    """No old values."""
    FULL = b"f"
    """Every column."""
    INDEX = b"i"
    """The columns of a chosen unique index."""


class ColumnFlag(enum.IntFlag):
    """Flags of a Relation column."""

    KEY = 1
    """The column is part of the replica identity key."""


class TruncateOption(enum.IntFlag):
    """Option bits of a Truncate message."""

    CASCADE = 1
    """TRUNCATE … CASCADE."""
    RESTART_IDENTITY = 2
    """TRUNCATE … RESTART IDENTITY."""


class UnchangedToast:
    """The marker for an unchanged TOASTed value: present in the row, value not sent."""

    _instance: UnchangedToast | None = None

    def __new__(cls) -> UnchangedToast:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = UnchangedToast()


class SpecialValues(tuple):  # type: ignore[type-arg]
    """Tuple values holding an :data:`UNCHANGED` marker or :class:`Binary` values.

    The decoder returns a plain ``tuple`` for the common all-text row and this subclass otherwise,
    so value loading can take its one-call fast path by checking the type alone.
    """

    __slots__ = ()


class Binary(bytes):
    """A binary-format column value (``binary 'true'``), as opposed to text-format ``bytes``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Binary({bytes(self)!r})"


TupleValues: TypeAlias = tuple[Any, ...]

_EPOCH: Final = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


def pg_timestamp(us: int) -> dt.datetime:
    """Microseconds since 2000-01-01 UTC (PostgreSQL's epoch) → aware datetime.

    Message timestamps (``commit_ts``, ``prepare_ts``…) are kept as these raw integers — the
    exact wire value, cheap to decode — and each message has a ``*_time`` property for the
    datetime. Raises OverflowError outside datetime's range.
    """
    return _EPOCH + dt.timedelta(microseconds=us)


def pg_micros(t: dt.datetime) -> int:
    """An aware datetime → microseconds since 2000-01-01 UTC (the inverse of pg_timestamp)."""
    return (t - _EPOCH) // dt.timedelta(microseconds=1)


class Begin(msgspec.Struct, frozen=True, gc=False, tag="begin"):
    final_lsn: int
    commit_ts: int
    xid: int

    @property
    def commit_time(self) -> dt.datetime:
        return pg_timestamp(self.commit_ts)


class Commit(msgspec.Struct, frozen=True, gc=False, tag="commit"):
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int

    @property
    def commit_time(self) -> dt.datetime:
        return pg_timestamp(self.commit_ts)


class Origin(msgspec.Struct, frozen=True, gc=False, tag="origin"):
    commit_lsn: int
    name: str


class Column(msgspec.Struct, frozen=True, gc=False):
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & ColumnFlag.KEY)


class Relation(msgspec.Struct, frozen=True, gc=False, tag="relation"):
    relation_id: int
    namespace: str
    name: str
    replica_identity: ReplicaIdentity
    columns: tuple[Column, ...]
    xid: int | None = None


class Type(msgspec.Struct, frozen=True, gc=False, tag="type"):
    type_oid: int
    namespace: str
    name: str
    xid: int | None = None


class Insert(msgspec.Struct, frozen=True, gc=False, tag="insert"):
    relation_id: int
    new: TupleValues
    xid: int | None = None


class Update(msgspec.Struct, frozen=True, gc=False, tag="update"):
    relation_id: int
    new: TupleValues
    old: TupleValues | None = None
    old_kind: OldTupleKind | None = None
    xid: int | None = None


class Delete(msgspec.Struct, frozen=True, gc=False, tag="delete"):
    relation_id: int
    old: TupleValues
    old_kind: OldTupleKind
    xid: int | None = None


class Truncate(msgspec.Struct, frozen=True, gc=False, tag="truncate"):
    relation_ids: tuple[int, ...]
    options: int
    xid: int | None = None

    @property
    def cascade(self) -> bool:
        return bool(self.options & TruncateOption.CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TruncateOption.RESTART_IDENTITY)


class LogicalMessage(msgspec.Struct, frozen=True, gc=False, tag="message"):
    flags: int
    lsn: int
    prefix: str
    content: bytes
    xid: int | None = None

    @property
    def transactional(self) -> bool:
        return bool(self.flags & 1)


class StreamStart(msgspec.Struct, frozen=True, gc=False, tag="stream_start"):
    xid: int
    first_segment: bool


class StreamStop(msgspec.Struct, frozen=True, gc=False, tag="stream_stop"):
    pass


class StreamCommit(msgspec.Struct, frozen=True, gc=False, tag="stream_commit"):
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int

    @property
    def commit_time(self) -> dt.datetime:
        return pg_timestamp(self.commit_ts)


class StreamAbort(msgspec.Struct, frozen=True, gc=False, tag="stream_abort"):
    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_ts: int | None = None

    @property
    def is_subtransaction(self) -> bool:
        return self.subxid != self.xid

    @property
    def abort_time(self) -> dt.datetime | None:
        return None if self.abort_ts is None else pg_timestamp(self.abort_ts)


class BeginPrepare(msgspec.Struct, frozen=True, gc=False, tag="begin_prepare"):
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> dt.datetime:
        return pg_timestamp(self.prepare_ts)


class Prepare(msgspec.Struct, frozen=True, gc=False, tag="prepare"):
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> dt.datetime:
        return pg_timestamp(self.prepare_ts)


class CommitPrepared(msgspec.Struct, frozen=True, gc=False, tag="commit_prepared"):
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int
    gid: str

    @property
    def commit_time(self) -> dt.datetime:
        return pg_timestamp(self.commit_ts)


class RollbackPrepared(msgspec.Struct, frozen=True, gc=False, tag="rollback_prepared"):
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> dt.datetime:
        return pg_timestamp(self.prepare_ts)

    @property
    def rollback_time(self) -> dt.datetime:
        return pg_timestamp(self.rollback_ts)


class StreamPrepare(msgspec.Struct, frozen=True, gc=False, tag="stream_prepare"):
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> dt.datetime:
        return pg_timestamp(self.prepare_ts)


Message: TypeAlias = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
