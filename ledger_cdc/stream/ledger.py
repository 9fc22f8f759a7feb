"""Rows of ``agent_events`` in the stream → typed :class:`~ledger_cdc.events.LedgerEvent`.

The only place that knows both the pgoutput tuple and the ledger's columns. Values are loaded by
psycopg's loaders (one ``load_sequence`` per row); the jsonb payload is left as bytes by the loader
and decoded once, by msgspec, straight into the payload Struct registered for the event type.
Columns are found by name, so a ledger table with extra or reordered columns still decodes. A
Relation without some of the ledger's required columns (a publication's column list changed by
hand) stops nothing: each of its rows comes as :class:`~ledger_cdc.events.Rejected` marked
``incomplete`` with the columns it lacks (the consumer reads it whole from the table, see
``batching.items``), and the next Relation, once the publication streams them again, decodes as
before.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg.adapt import Transformer
from psycopg.pq import Format

from ledger_cdc.events import (
    MAX_TIME,
    MIN_TIME,
    PAYLOAD_DECODERS,
    READ_MAX_DEPTH,
    LedgerEvent,
    Rejected,
    admit_row,
    as_digest,
    too_deep,
    unplaced,
)
from ledger_cdc.names import STREAMED_COLUMNS
from ledger_cdc.pgoutput.messages import UNCHANGED, Relation
from ledger_cdc.stream.values import RowLoader, raw_json_adapters

__all__ = ["REQUIRED_COLUMNS", "LedgerRowDecoder"]

REQUIRED_COLUMNS = (
    "seq",
    "session_id",
    "position",
    "agent_id",
    "event_type",
    "payload",
    "created_at",
)
_OPTIONAL = ("idempotency_key", "hash")
# The ledger's columns as the publication streams them, in its order, each of its own type (by
# OID: bigint, uuid, bigint, text, text, jsonb, text, timestamptz, bytea). A row of such a
# Relation loads every value as the type the fold reads (the jsonb as its bytes, the time as
# an aware UTC datetime) or None: the shared rules' common case needs only its NULLs looked at.
_LEDGER = tuple(zip(STREAMED_COLUMNS, (20, 2950, 20, 25, 25, 3802, 25, 1184, 17), strict=True))
_ADAPTERS = raw_json_adapters()
# Columns the fast path does not load with the rest of the row: the payload's bytes are its
# value as it came (what RawLoader gives), and a session id already seen is the object kept for
# its text (one seen first is loaded then, by psycopg's uuid loader). At their places the row's
# load runs bool's loader, which looks at one byte at most and raises on none.
_TAKEN_AS_THEY_CAME = {"session_id": 16, "payload": 16}  # (16: bool)
_UUID = 2950
_SHALLOW = 2 * READ_MAX_DEPTH  # bytes of JSON too few to nest past the limit (too_deep)
_SESSIONS_KEPT = 8192  # session ids a row decoder keeps one object of, then starts over (1 MB)


class LedgerRowDecoder:
    """Decodes the tuples of one ``agent_events`` Relation (rebuild on a new Relation).

    Only the columns the fold reads are loaded: an extra column the publication streams (one a
    user added) is never loaded, so no value of it can stop a row. ``base_types`` maps a
    domain's type OID to its base type's (from the stream's Type messages): a column retyped to
    a domain over its own type loads as that type, as SQL readers see it."""

    def __init__(self, relation: Relation, base_types: Mapping[int, int] | None = None) -> None:
        names = [c.name for c in relation.columns]
        # what the stream lacks (a column list without them): every row is quarantined
        self.missing = [n for n in REQUIRED_COLUMNS if n not in names]
        self.relation = relation
        self._loader = RowLoader(relation, _ADAPTERS, base_types)
        self._ncols = len(names)
        needed = {*REQUIRED_COLUMNS, *_OPTIONAL}
        wanted = [n for n in names if n in needed]  # in the relation's order
        index = [names.index(n) for n in wanted]
        self._wanted = tuple(zip(wanted, index, strict=True))  # (name, its place)
        # the common case, the ledger's own columns in its order: the tuple as it came
        self._take: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = (
            None if index == list(range(self._ncols)) else _taker(index)
        )
        loads = Transformer(_ADAPTERS)
        loads.set_loader_types([self._loader.oids[i] for i in index], Format.TEXT)
        self._load_sequence = loads.load_sequence
        at = {n: i for i, n in enumerate(wanted)}
        self._pick = operator.itemgetter(*(at.get(n, 0) for n in REQUIRED_COLUMNS))
        # absent optional columns read as None (a publication made before hash was streamed)
        self._key_i, self._hash_i = (at.get(n) for n in _OPTIONAL)
        self._sids: dict[bytes, uuid.UUID] = {}  # a session id's text → its one object
        # the fast path (event): the columns read are the ledger's, in its order, each of its
        # own type (see _LEDGER)
        self._typed = (
            not self.missing
            and tuple((n, self._loader.oids[i]) for n, i in self._wanted) == _LEDGER
        )
        self._sid_at = names.index("session_id") if "session_id" in names else 0
        self._payload_at = names.index("payload") if "payload" in names else 0
        fast = Transformer(_ADAPTERS)
        fast.set_loader_types(
            [_TAKEN_AS_THEY_CAME.get(n, self._loader.oids[i]) for n, i in self._wanted],
            Format.TEXT,
        )
        self._load_fast = fast.load_sequence
        self._load_uuid = fast.get_loader(_UUID, Format.TEXT).load

    def load(self, values: tuple[Any, ...], wal_start: int = 0) -> tuple[Any, ...]:
        return self._loader.load(values, wal_start)

    def event(self, values: tuple[Any, ...], wal_start: int = 0) -> LedgerEvent | Rejected:
        """One row → LedgerEvent, or :class:`Rejected` with the reason when its payload or time
        cannot be read (the rule every reader shares: :func:`ledger_cdc.events.admit_row`).
        Never raises: a tuple that does not fit its Relation is a Rejected row too."""
        if self._typed and type(values) is tuple and len(values) == self._ncols:
            # the fast path: the row of a Relation of the ledger's own columns and types, its
            # values text or NULL (see _LEDGER, _TAKEN_AS_THEY_CAME); a row off it is read by
            # each rule in turn (_event), which says why one is quarantined
            take = self._take
            try:
                seq, _, pos, agent, etype, _, key, created, digest = self._load_fast(
                    values if take is None else take(values)
                )
            except (ValueError, UnicodeDecodeError, psycopg.DataError):
                return self._rejected(values, wal_start)
            raw = values[self._sid_at]
            payload = values[self._payload_at]
            if (  # every rule's common case: no NULL, a time in range
                seq is not None
                and raw is not None
                and pos is not None
                and agent is not None
                and etype is not None
                and payload is not None
                and created is not None
                and MIN_TIME <= created <= MAX_TIME
            ):
                # one object per session: the fold's dictionaries, keyed by session, then
                # find theirs by identity instead of comparing two UUIDs in Python on every
                # lookup (found by the column's text: a C hash, where a UUID's is Python's)
                sids = self._sids
                sid = sids.get(raw)
                if sid is None:
                    try:
                        sid = self._load_uuid(raw)
                    except (ValueError, UnicodeDecodeError, psycopg.DataError):
                        return self._event(values, wal_start)
                    if len(sids) >= _SESSIONS_KEPT:
                        sids.clear()
                    sids[raw] = sid
                decoder = PAYLOAD_DECODERS.get(etype)
                if decoder is not None and (
                    len(payload) <= _SHALLOW or not too_deep(payload, READ_MAX_DEPTH)
                ):
                    try:
                        return LedgerEvent(
                            seq,
                            sid,
                            pos,
                            agent,
                            etype,
                            decoder.decode(payload),
                            created,
                            key,
                            digest,
                        )
                    except Exception:  # (read again below, by each rule, to say why)
                        pass
        return self._event(values, wal_start)

    def _event(self, values: tuple[Any, ...], wal_start: int) -> LedgerEvent | Rejected:
        """:meth:`event` by each rule in turn: a row off the common path (a value NULL or out
        of range, a Relation retyped or reordered by hand, a payload type not read before)."""
        if self.missing:
            return self._rejected(
                values,
                wal_start,
                f"the stream lacks its {', '.join(self.missing)} (the "
                "publication's column list): not folded; the row stays in agent_events",
            )
        if len(values) != self._ncols:
            return self._rejected(
                values,
                wal_start,
                f"the tuple has {len(values)} columns, its Relation {self._ncols}",
            )
        if type(values) is tuple:  # text or NULL only: the common case, one C call
            try:
                row = self._load_sequence(values if self._take is None else self._take(values))
            except (ValueError, UnicodeDecodeError, psycopg.DataError):
                return self._rejected(values, wal_start)
        else:
            try:
                row = tuple(self._loader.load_one(n, values[i]) for n, i in self._wanted)
            except (ValueError, UnicodeDecodeError, psycopg.DataError):
                return self._rejected(values, wal_start)
        seq, sid, pos, agent, etype, payload, created = self._pick(row)
        raw = values[self._sid_at]
        if type(sid) is uuid.UUID and isinstance(raw, bytes):  # its one object (see event)
            sid = self._sids.setdefault(raw, sid)
            if len(self._sids) > _SESSIONS_KEPT:
                self._sids.clear()
        k, h = self._key_i, self._hash_i
        key = None if k is None else row[k]
        digest = None if h is None else row[h]
        if payload is UNCHANGED:  # not in the stream: no payload to read
            payload = None
        return admit_row(seq, sid, pos, agent, etype, payload, created, key, digest)

    def _rejected(
        self, values: tuple[Any, ...], wal_start: int, why: str | None = None
    ) -> Rejected:
        """A row some column of which cannot be loaded: load what can be of the columns the
        fold reads, one at a time (the identity columns are integers, uuids and text, which
        load unless retyped by hand)."""
        loaded: dict[str, Any] = {}
        bad: list[str] = []
        for name, i in self._wanted:
            if i >= len(values):
                continue
            try:
                loaded[name] = self._loader.load_one(name, values[i])
            except (ValueError, UnicodeDecodeError, psycopg.DataError) as e:
                bad.append(f"{name} ({_first_line(e)})")
                loaded[name] = None
        seq, sid, pos = loaded.get("seq"), loaded.get("session_id"), loaded.get("position")
        names = self._loader.names
        created = values[names.index("created_at")] if "created_at" in names else None
        raw_time = bytes(created).decode("utf-8", "replace") if isinstance(created, bytes) else None
        key = loaded.get("idempotency_key")
        return Rejected(
            seq if type(seq) is int else 0,
            sid if type(sid) is uuid.UUID else _NIL,
            pos if type(pos) is int else 0,
            str(loaded.get("agent_id") or ""),
            str(loaded.get("event_type") or ""),
            f"event seq {seq}: {why or 'cannot read ' + (', '.join(bad) or 'the row')}",
            raw_time,
            key if type(key) is str else None,
            as_digest(loaded.get("hash")),
            unplaced(sid, pos),
            bool(self.missing),
        )


def _taker(index: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    get = operator.itemgetter(*index)
    return get if len(index) > 1 else lambda values: (get(values),)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


_NIL = uuid.UUID(int=0)
