"""Rows of ``agent_events`` in the stream → typed :class:`~ledger_cdc.events.LedgerEvent`.

The only place that knows both the pgoutput tuple and the ledger's columns. Values are loaded by
psycopg's loaders (one ``load_sequence`` per row); the jsonb payload is left as bytes by the loader
and decoded once, by msgspec, straight into the payload Struct registered for the event type.
Columns are found by name, so a ledger table with extra or reordered columns still decodes; a
Relation without the ledger's required columns is refused.
"""

from __future__ import annotations

import operator
from typing import Any

import msgspec
import psycopg

from ..errors import DecodeError, InvalidEventError
from ..events import EVENT_TYPES, LedgerEvent
from ..pgoutput.messages import UNCHANGED, Relation
from ..pgoutput.values import RowLoader, raw_json_adapters

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
_OPTIONAL = ("idempotency_key", "hash", "prev_hash")
_ADAPTERS = raw_json_adapters()


class LedgerRowDecoder:
    """Decodes the tuples of one ``agent_events`` Relation (rebuild on a new Relation)."""

    def __init__(self, relation: Relation) -> None:
        names = [c.name for c in relation.columns]
        missing = [n for n in REQUIRED_COLUMNS if n not in names]
        if missing:
            raise DecodeError(
                f"relation {relation.namespace}.{relation.name} lacks ledger columns "
                f"{', '.join(missing)}",
                message_type="Relation",
            )
        self.relation = relation
        self._loader = RowLoader(relation, _ADAPTERS)
        self._ncols = len(names)
        self._load_sequence = self._loader._text.load_sequence
        self._pick = operator.itemgetter(*(names.index(n) for n in REQUIRED_COLUMNS))
        # absent optional columns read as None (hash / prev_hash are not streamed by default)
        self._key_i, self._hash_i, self._prev_i = (
            names.index(n) if n in names else None for n in _OPTIONAL
        )
        self._decoders: dict[str, msgspec.json.Decoder[Any]] = {}

    def load(self, values: tuple[Any, ...], wal_start: int = 0) -> tuple[Any, ...]:
        return self._loader.load(values, wal_start)

    def event(self, values: tuple[Any, ...], wal_start: int = 0) -> LedgerEvent:
        """One row → LedgerEvent; raises InvalidEventError when the payload fails its type."""
        if type(values) is tuple and len(values) == self._ncols:
            try:
                row = self._load_sequence(values)  # the common case: one C call
            except (ValueError, UnicodeDecodeError, psycopg.DataError):
                row = self._loader.load(values, wal_start)  # raises a DecodeError that says why
        else:
            row = self._loader.load(values, wal_start)
        seq, sid, pos, agent, etype, payload, created = self._pick(row)
        if payload is None or payload is UNCHANGED:
            raise InvalidEventError(f"event seq {seq}: payload is missing")
        dec = self._decoders.get(etype)
        if dec is None:
            dec = self._decoder_for(etype)
        try:
            value = dec.decode(payload)
        except msgspec.DecodeError as e:
            raise InvalidEventError(f"event seq {seq} ({etype}): payload is invalid: {e}") from e
        k, h, p = self._key_i, self._hash_i, self._prev_i
        return LedgerEvent(
            seq,
            sid,
            pos,
            agent,
            etype,
            value,
            created,
            None if k is None else row[k],
            None if h is None else row[h],
            None if p is None else row[p],
        )

    def _decoder_for(self, event_type: str) -> msgspec.json.Decoder[Any]:
        # unknown types are kept as plain JSON: folded by nobody by default, never dropped
        typ = EVENT_TYPES.get(event_type, Any)
        dec: msgspec.json.Decoder[Any] = msgspec.json.Decoder(typ)
        self._decoders[event_type] = dec
        return dec
