"""Rows of ``agent_events`` in the stream → typed :class:`~ledger_cdc.events.LedgerEvent`.

The only place that knows both the pgoutput tuple and the ledger's columns. Values are loaded by
psycopg's loaders (one ``load_sequence`` per row); the jsonb payload is left as bytes by the loader
and decoded once, by msgspec, straight into the payload Struct registered for the event type.
Columns are found by name, so a ledger table with extra or reordered columns still decodes. A
Relation without some of the ledger's required columns (a publication's column list changed by
hand) stops nothing: each of its rows is quarantined with the columns it lacks, and the next
Relation, once the publication streams them again, decodes as before.
"""

from __future__ import annotations

import operator
import uuid
from typing import Any

import psycopg

from ledger_cdc.errors import DecodeError, InvalidEventError
from ledger_cdc.events import LedgerEvent, Rejected, admit_time, load_payload, unidentified
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
_ADAPTERS = raw_json_adapters()


class LedgerRowDecoder:
    """Decodes the tuples of one ``agent_events`` Relation (rebuild on a new Relation)."""

    def __init__(self, relation: Relation) -> None:
        names = [c.name for c in relation.columns]
        # what the stream lacks (a column list without them): every row is quarantined
        self.missing = [n for n in REQUIRED_COLUMNS if n not in names]
        self.relation = relation
        self._loader = RowLoader(relation, _ADAPTERS)
        self._ncols = len(names)
        self._load_sequence = self._loader._text.load_sequence
        self._pick = operator.itemgetter(
            *(names.index(n) if n in names else 0 for n in REQUIRED_COLUMNS)
        )
        # absent optional columns read as None (a publication made before hash was streamed)
        self._key_i, self._hash_i = (names.index(n) if n in names else None for n in _OPTIONAL)

    def load(self, values: tuple[Any, ...], wal_start: int = 0) -> tuple[Any, ...]:
        return self._loader.load(values, wal_start)

    def event(self, values: tuple[Any, ...], wal_start: int = 0) -> LedgerEvent | Rejected:
        """One row → LedgerEvent, or :class:`Rejected` with the reason when its payload or time
        cannot be read (the rule every reader shares: :func:`ledger_cdc.events.load_payload`,
        :func:`~ledger_cdc.events.admit_time`). Raises only DecodeError, for a tuple that does
        not fit the relation at all."""
        if self.missing:
            return self._rejected(
                values,
                wal_start,
                f"the stream lacks its {', '.join(self.missing)} (the "
                "publication's column list): not folded; the row stays in agent_events",
            )
        if type(values) is tuple and len(values) == self._ncols:
            try:
                row = self._load_sequence(values)  # the common case: one C call
            except (ValueError, UnicodeDecodeError, psycopg.DataError):
                return self._rejected(values, wal_start)
        else:
            try:
                row = self._loader.load(values, wal_start)
            except DecodeError:
                return self._rejected(values, wal_start)
        seq, sid, pos, agent, etype, payload, created = self._pick(row)
        k, h = self._key_i, self._hash_i
        key = None if k is None else row[k]
        digest = None if h is None else _digest(row[h])
        rejected = unidentified(seq, sid, pos, agent, etype, key, digest)
        if rejected is not None:  # NULL or retyped by hand (ALTER TABLE): no event of it
            return rejected
        try:
            if payload is None or payload is UNCHANGED:
                raise InvalidEventError("payload is missing from the stream")
            created = admit_time(created)
            value = load_payload(etype, payload)
        except InvalidEventError as e:
            return Rejected(seq, sid, pos, agent, etype, f"event seq {seq}: {e}", None, key, digest)
        return LedgerEvent(seq, sid, pos, agent, etype, value, created, key, digest)

    def _rejected(
        self, values: tuple[Any, ...], wal_start: int, why: str | None = None
    ) -> Rejected:
        """A row some column of which cannot be loaded: load what can be, one column at a time
        (the identity columns are NOT NULL integers, uuids and text, which always load)."""
        loaded: dict[str, Any] = {}
        bad: list[str] = []
        for name, raw in zip(self._loader.names, values, strict=False):
            try:
                loaded[name] = self._loader.load_one(name, raw)
            except (ValueError, UnicodeDecodeError, psycopg.DataError) as e:
                bad.append(f"{name} ({_first_line(e)})")
                loaded[name] = None
        seq, pos = loaded.get("seq"), loaded.get("position")
        names = self._loader.names
        created = values[names.index("created_at")] if "created_at" in names else None
        raw_time = bytes(created).decode("utf-8", "replace") if isinstance(created, bytes) else None
        return Rejected(
            seq if isinstance(seq, int) else 0,
            loaded.get("session_id") or _NIL,
            pos if isinstance(pos, int) else 0,
            str(loaded.get("agent_id") or ""),
            str(loaded.get("event_type") or ""),
            f"event seq {seq}: {why or 'cannot read ' + (', '.join(bad) or 'the row')}",
            raw_time,
            loaded.get("idempotency_key"),
            loaded.get("hash") if isinstance(loaded.get("hash"), bytes) else None,
        )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


_NIL = uuid.UUID(int=0)


def _digest(value: object) -> bytes | None:
    """The row's hash as bytes. A ``hash`` column retyped by hand (text, or a domain over
    bytea, whose values come as text) gives ``\\x…`` text: read as the bytes it spells; any
    other value is no hash (None), never a value the sink cannot write."""
    if type(value) is bytes:
        return value
    if type(value) is str and value.startswith("\\x"):
        try:
            return bytes.fromhex(value[2:])
        except ValueError:
            return None
    return None
