"""Rows of ``agent_events`` as readers admit them: a :class:`LedgerEvent`, or a
:class:`Rejected` with the reason.

One rule for every reader, stream or table (:func:`admit_row`): a row whose identity columns
are NULL or retyped by hand is in no session's history (:func:`unidentified`,
:func:`unplaced`); one whose payload does not load (:func:`ledger_cdc.events.load_payload`) or
whose ``created_at`` is out of range (:func:`admit_time`) is quarantined. Never an exception.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import msgspec

from ledger_cdc.errors import InvalidEventError
from ledger_cdc.events.payload import load_payload

__all__ = [
    "MAX_TIME",
    "MIN_TIME",
    "LedgerEvent",
    "Rejected",
    "admit_row",
    "admit_time",
    "as_digest",
    "unidentified",
    "unplaced",
]

MIN_TIME = dt.datetime(1, 1, 2, tzinfo=dt.timezone.utc)
MAX_TIME = dt.datetime(9999, 12, 30, tzinfo=dt.timezone.utc)
"""``created_at`` outside this range (PostgreSQL admits years up to 294276 and ``infinity``;
Python's datetime stops at 9999) quarantines its event. A day inside Python's limits on each
side, so that no time-zone offset can carry a value in the range out of it."""


def admit_time(value: Any) -> dt.datetime:
    """A row's ``created_at`` as a UTC datetime, or :class:`InvalidEventError` when it is not a
    time inside [:data:`MIN_TIME`, :data:`MAX_TIME`] (the same rule on every path)."""
    if type(value) is not dt.datetime or value.tzinfo is None:
        raise InvalidEventError(f"created_at {value!r} is not a time this reader can hold")
    if not MIN_TIME <= value <= MAX_TIME:
        raise InvalidEventError(
            f"created_at {value.isoformat()} is outside {MIN_TIME.date()}..{MAX_TIME.date()}"
        )
    if value.tzinfo is _UTC or value.utcoffset() == _ZERO:
        return value
    return value.astimezone(_UTC)


_ZERO = dt.timedelta(0)
_UTC = dt.timezone.utc


class LedgerEvent(msgspec.Struct, frozen=True, gc=False):
    """One committed row of ``agent_events``, with its payload decoded to its registered type
    (or left as a dict for event types this process does not know)."""

    seq: int
    session_id: uuid.UUID
    position: int
    agent_id: str
    event_type: str
    payload: Any
    created_at: dt.datetime
    idempotency_key: str | None = None
    hash: bytes | None = None
    prev_hash: bytes | None = None


class Rejected(msgspec.Struct, frozen=True, gc=False):
    """A row of ``agent_events`` that cannot become a :class:`LedgerEvent` (its payload does
    not fit its type, nests too deep, or its ``created_at`` is out of range). Every reader turns
    such a row into this, never an exception; folding it quarantines it (see
    ``ledger_cdc.fold.fold_one``)."""

    seq: int
    session_id: uuid.UUID
    position: int
    agent_id: str
    event_type: str
    reason: str
    created_at: str | None = None  # as stored, when it could not be read as a time
    idempotency_key: str | None = None
    hash: bytes | None = None
    # its session or position could not be read (NULL, retyped by hand, left out of the stream):
    # it is in no session's history, so every fold quarantines it without moving a session
    unplaced: bool = False
    # the stream lacked some of its columns (a publication's column list): the row itself is
    # whole in agent_events, and a reader that can reads it there
    incomplete: bool = False


_NIL = uuid.UUID(int=0)


def as_digest(value: object) -> bytes | None:
    """A row's hash as bytes. A ``hash`` column retyped by hand (text, or a domain over bytea
    read where its type is not known) gives ``\\x…`` text: read as the bytes it spells; any
    other value is no hash (None), never a value a sink cannot write."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if type(value) is str and value.startswith("\\x"):
        try:
            return bytes.fromhex(value[2:])
        except ValueError:
            return None
    return None


def unplaced(sid: Any, pos: Any) -> bool:
    """Whether a row whose session id and position read as these is in no session's history
    (NULL, retyped by hand, left out of the stream): the rule every reader shares."""
    return type(sid) is not uuid.UUID or type(pos) is not int or pos < 1


def unidentified(
    seq: Any, sid: Any, pos: Any, agent: Any, etype: Any, key: Any, digest: Any
) -> Rejected | None:
    """A row an identity column of which is NULL or not of the ledger's type (dropped NOT NULL,
    ALTER TABLE by hand) as :class:`Rejected`, under what could be read of it; None for a row
    whose identity columns are all there. Every reader, stream or table, applies this rule."""
    if (
        type(seq) is int
        and type(sid) is uuid.UUID
        and type(pos) is int
        and type(agent) is str
        and type(etype) is str
    ):  # every row but a hand-altered table's: one check
        return None
    odd = [
        name
        for name, value, kind in (
            ("seq", seq, int),
            ("session_id", sid, uuid.UUID),
            ("position", pos, int),
            ("agent_id", agent, str),
            ("event_type", etype, str),
        )
        if type(value) is not kind
    ]
    return Rejected(
        seq if type(seq) is int else 0,
        sid if type(sid) is uuid.UUID else _NIL,
        pos if type(pos) is int else 0,
        agent if type(agent) is str else "",
        etype if type(etype) is str else "",
        f"event seq {seq}: {', '.join(odd)} NULL or not of the ledger's column type",
        None,
        key if type(key) is str else None,
        digest if type(digest) is bytes else None,
        unplaced(sid, pos),
    )


def admit_row(
    seq: Any,
    sid: Any,
    pos: Any,
    agent: Any,
    etype: Any,
    payload: bytes | str | memoryview | None,
    created: Any,
    key: Any,
    digest: Any,
    stored_time: str | None = None,
) -> LedgerEvent | Rejected:
    """A row's columns, as a reader loaded them, → :class:`LedgerEvent`, or :class:`Rejected`
    with the reason: the rule every reader, stream or table, applies. Never raises.

    ``payload`` is the stored JSON, None when the row has none (NULL, or not in the stream);
    ``stored_time`` is ``created_at`` as text when the reader could not load it as a time (then
    ``created`` is None): kept on the Rejected row."""
    digest = as_digest(digest)
    rejected = unidentified(seq, sid, pos, agent, etype, key, digest)
    if rejected is not None:  # NULL or retyped by hand (ALTER TABLE): no event of it
        return rejected
    try:
        if payload is None:
            raise InvalidEventError("payload is NULL or not in the stream")
        if created is None and stored_time is not None:
            raise InvalidEventError(f"created_at {stored_time} is outside what readers can hold")
        created = admit_time(created)
        value = load_payload(etype, payload)
    except InvalidEventError as e:
        reason = f"event seq {seq}: {e}"
        return Rejected(seq, sid, pos, agent, etype, reason, stored_time, key, digest)
    return LedgerEvent(seq, sid, pos, agent, etype, value, created, key, digest)
