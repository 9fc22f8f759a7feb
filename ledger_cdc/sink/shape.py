"""The rows the sinks store, declared once: ``agent_sessions``, ``agent_memo``, ``agent_snapshots``.

Each table's row is a typed tuple whose fields are the columns the sink writes, in table order,
each annotated with its PostgreSQL type (``Annotated[int, Pg("bigint")]``): the field is the
column, its Python type what the row holds, its :class:`Pg` what the table holds. Everything
else follows from these three classes: the PostgreSQL sink's staging tables, its COPY statements
(text and binary) and the binary form of each value, its merge statements and the keys and value
forms of the JSON document ``ledger_apply_batch`` reads (``sink.postgres``); the in-memory sink
stores the very same rows (``sink.memory``), built by the same functions (:func:`session_row`,
:func:`memo_row`, :func:`snapshot_row`).

The SQL side (the tables and ``ledger_apply_batch``'s record types) is not generated from here:
a migration is applied once and checksummed, so SQL that followed this module would change
migrations databases already ran. A server test (``tests/integration/test_storage_shape.py``)
compares it with these declarations column by column instead, and the rows both sinks store
value by value. No I/O here.
"""

from __future__ import annotations

import datetime as dt
import functools
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

from ledger_cdc.batching import SnapshotRow
from ledger_cdc.fold import (
    FORMAT_VERSION,
    PROJECTION_FORMAT,
    CompletedModel,
    CompletedTool,
    SessionContext,
    encode_memo_entry,
    memo_key,
)
from ledger_cdc.lsn import format_lsn

__all__ = [
    "MEMO",
    "SESSIONS",
    "SNAPSHOTS",
    "TABLES",
    "AgentMemoRow",
    "AgentSessionRow",
    "AgentSnapshotRow",
    "Column",
    "Pg",
    "Table",
    "memo_row",
    "run_columns",
    "session_row",
    "snapshot_row",
]


@dataclass(frozen=True)
class Pg:
    """A column's type in its table, as ``format_type()`` names it. ``utf8``: a ``bytea`` whose
    bytes are UTF-8 text (the canonical JSON a content hash was taken of, kept byte for byte)."""

    type: str
    utf8: bool = False


# What the staging tables hold of a stored type, when not that type: the text COPY and the binary
# COPY both send it as text, and the merge casts it (binary jsonb would need a version byte first,
# binary pg_lsn an int8; a context streamed from its bytes needs neither).
_STAGED = {"jsonb": "text", "pg_lsn": "text"}


@dataclass(frozen=True)
class Column:
    """One column the sink writes."""

    name: str
    pgtype: str  # in its table (format_type's spelling)
    utf8: bool = False

    @property
    def staged(self) -> str:
        """Its type in the staging table and the COPY statements."""
        return _STAGED.get(self.pgtype, self.pgtype)

    @property
    def in_document(self) -> str:
        """Its type in ``ledger_apply_batch``'s record (``jsonb_to_recordset(...) AS x(...)``):
        JSON has no bytes, so a ``bytea`` travels as text (hex, or the UTF-8 string itself)."""
        return "text" if self.pgtype == "bytea" else self.pgtype

    @property
    def json(self) -> bool:
        """Whether it holds JSON (a context, a memo entry, a snapshot's bytes)."""
        return self.pgtype == "jsonb" or self.utf8


@dataclass(frozen=True)
class Table:
    """A table the sink writes, its row type and what it leaves to the server."""

    name: str
    row: type[tuple[Any, ...]]
    key: tuple[str, ...]  # the unique key a write conflicts on
    # columns of the table the sink sends no value for, and why
    unwritten: Mapping[str, str]

    @property
    def short(self) -> str:
        """Its name without ``agent_``: its rows' key in ledger_apply_batch's document, and the
        name of its staging table after ``stage_``."""
        return self.name.removeprefix("agent_")

    @functools.cached_property
    def columns(self) -> tuple[Column, ...]:
        return _columns(self.row)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def _columns(row: type[tuple[Any, ...]]) -> tuple[Column, ...]:
    hints = typing.get_type_hints(row, include_extras=True)
    out = []
    for name in row._fields:  # type: ignore[attr-defined]
        pg = next((m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, Pg)), None)
        if pg is None:
            raise TypeError(f"{row.__name__}.{name}: no column type (Annotated[..., Pg(...)])")
        out.append(Column(name, pg.type, pg.utf8))
    return tuple(out)


class AgentSessionRow(NamedTuple):
    """A row of ``agent_sessions``: a session's projection."""

    session_id: Annotated[uuid.UUID, Pg("uuid")]
    status: Annotated[str, Pg("text")]
    last_seq: Annotated[int, Pg("bigint")]
    last_position: Annotated[int, Pg("bigint")]
    event_count: Annotated[int, Pg("bigint")]
    format_version: Annotated[int, Pg("integer")]
    context: Annotated[bytes, Pg("jsonb")]  # the stored context (fold.encode_stored)
    commit_lsn: Annotated[str, Pg("pg_lsn")]
    run_status: Annotated[str | None, Pg("text")]
    lease_worker: Annotated[str | None, Pg("text")]
    lease_until: Annotated[dt.datetime | None, Pg("timestamp with time zone")]
    last_hash: Annotated[bytes | None, Pg("bytea")]  # chain hash of its last event


class AgentMemoRow(NamedTuple):
    """A row of ``agent_memo``: a completed call; its keys in their stored form (memo_key)."""

    session_id: Annotated[uuid.UUID, Pg("uuid")]
    kind: Annotated[str, Pg("text")]  # tool | model
    call_id: Annotated[str, Pg("text")]
    completed_seq: Annotated[int, Pg("bigint")]
    completed_position: Annotated[int, Pg("bigint")]
    idempotency_key: Annotated[str | None, Pg("text")]
    prompt_hash: Annotated[str | None, Pg("text")]
    entry: Annotated[bytes, Pg("jsonb")]  # fold.encode_memo_entry


class AgentSnapshotRow(NamedTuple):
    """A row of ``agent_snapshots``: a session's stored context at a point between two of its
    transactions."""

    session_id: Annotated[uuid.UUID, Pg("uuid")]
    upto_seq: Annotated[int, Pg("bigint")]
    upto_position: Annotated[int, Pg("bigint")]
    format_version: Annotated[int, Pg("integer")]
    reducer_version: Annotated[str, Pg("text")]
    content_hash: Annotated[bytes, Pg("bytea")]
    data: Annotated[bytes, Pg("bytea", utf8=True)]  # canonical JSON, the bytes hashed
    upto_hash: Annotated[bytes | None, Pg("bytea")]


SESSIONS = Table(
    "agent_sessions",
    AgentSessionRow,
    ("session_id",),
    {"updated_at": "the server's clock at each write (now())"},
)
MEMO = Table(
    "agent_memo",
    AgentMemoRow,
    ("session_id", "kind", "call_id", "completed_position"),
    {},
)
SNAPSHOTS = Table(
    "agent_snapshots",
    AgentSnapshotRow,
    ("session_id", "upto_seq"),
    {
        "context": "the JSON form of snapshots written by older versions: the sink writes data "
        "(the exact bytes hashed) and clears context when it replaces such a row",
        "created_at": "the server's clock at insert (its default)",
    },
)
TABLES = (SESSIONS, MEMO, SNAPSHOTS)


def run_columns(ctx: SessionContext) -> tuple[str | None, str | None, dt.datetime | None]:
    """A projection's run_status, lease_worker and lease_until, as its context says."""
    run = ctx.run
    lease = None if run is None else run.lease
    return (
        None if run is None else str(run.status),
        None if lease is None else lease.worker,
        None if lease is None else lease.until,
    )


def session_row(
    sid: uuid.UUID, ctx: SessionContext, data: bytes, commit_lsn: int, head: bytes | None
) -> AgentSessionRow:
    """The projection row of a batch's session (``Batch.sessions``: context, its stored JSON,
    commit LSN, last hash)."""
    run = ctx.run  # (run_columns, inline: this is the hot path's)
    lease = None if run is None else run.lease
    # (by position, in field order: keywords cost the hot path as much as the rest of the row;
    # tests/integration/test_storage_shape.py checks each field by name)
    return AgentSessionRow(
        sid,
        ctx.status,
        ctx.last_seq,
        ctx.last_position,
        ctx.event_count,
        PROJECTION_FORMAT,
        data,
        format_lsn(commit_lsn),
        None if run is None else str(run.status),
        None if lease is None else lease.worker,
        None if lease is None else lease.until,
        head,
    )


def memo_row(
    sid: uuid.UUID, position: int, done: CompletedTool | CompletedModel, by_reference: bool
) -> AgentMemoRow:
    """The memo row of a call completed at ``position``; its keys in their stored form
    (fold.memo_key: an index entry is bounded, a payload's strings are not)."""
    entry = encode_memo_entry(done, by_reference=by_reference)
    key = None if done.idempotency_key is None else memo_key(done.idempotency_key)
    if isinstance(done, CompletedTool):
        return AgentMemoRow(
            sid, "tool", memo_key(done.call_id), done.observed_seq, position, key, None, entry
        )
    prompt = None if done.prompt_hash is None else memo_key(done.prompt_hash)
    return AgentMemoRow(
        sid, "model", memo_key(done.request_id), done.responded_seq, position, key, prompt, entry
    )


def snapshot_row(snap: SnapshotRow) -> AgentSnapshotRow:
    """The row of a snapshot the batch cut."""
    return AgentSnapshotRow(
        snap.session_id,
        snap.upto_seq,
        snap.upto_position,
        FORMAT_VERSION,
        snap.reducer_version,
        snap.content_hash,
        snap.context,
        snap.upto_hash,
    )
