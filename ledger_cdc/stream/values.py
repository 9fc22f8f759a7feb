"""Tuple values → Python values, by column type OID, with psycopg 3's loaders.

Conversion is not written by hand: a psycopg ``Transformer`` per relation is given the relation's
column OIDs and loads a row of text values in one ``load_sequence`` call (C-accelerated with
``psycopg[binary]``). json and jsonb are decoded by msgspec. Binary-format columns (``binary
'true'``) go through psycopg's binary loaders. Two values are not loaded: ``None`` (NULL) stays
``None`` and :data:`~ledger_cdc.pgoutput.messages.UNCHANGED` (an unchanged TOASTed value, which the
server did not send) stays itself — it is never confused with NULL.

Types psycopg does not know (a custom enum, a domain whose base type the caller did not map)
load as ``str`` in text format and as ``bytes`` in binary format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import psycopg
from psycopg.abc import Buffer
from psycopg.abc import Transformer as TransformerProto
from psycopg.adapt import AdaptersMap, Loader, Transformer
from psycopg.pq import Format
from psycopg.types.json import set_json_loads

from ledger_cdc.errors import DecodeError
from ledger_cdc.pgoutput.messages import Binary, Relation, UnchangedToast

__all__ = ["RowLoader", "adapters_with_msgspec_json", "raw_json_adapters"]


def adapters_with_msgspec_json() -> AdaptersMap:
    """A copy of psycopg's global adapters whose json/jsonb loaders use msgspec."""
    am = AdaptersMap(psycopg.adapters)
    set_json_loads(msgspec.json.decode, am)
    return am


class RawLoader(Loader):
    """A value's bytes as they came, not copied (bytes, or the view of the message the decoder
    gives a long value as): json/jsonb text that the caller decodes once, straight into a typed
    Struct — no str in between, which for a large payload would be another copy of it."""

    def load(self, data: Buffer) -> bytes | memoryview:
        if isinstance(data, memoryview) or type(data) is bytes:
            return data
        return bytes(data)


def raw_json_adapters() -> AdaptersMap:
    """Adapters that leave json/jsonb as the bytes of its text, for callers that decode it
    once, straight into a typed Struct."""
    am = AdaptersMap(psycopg.adapters)
    am.register_loader("json", RawLoader)
    am.register_loader("jsonb", RawLoader)
    return am


_DEFAULT: AdaptersMap | None = None


def _default_adapters() -> AdaptersMap:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = adapters_with_msgspec_json()
    return _DEFAULT


class RowLoader:
    """Loads the tuples of one relation (rebuild it when a new Relation message arrives)."""

    def __init__(
        self,
        relation: Relation,
        adapters: AdaptersMap | None = None,
        base_types: Mapping[int, int] | None = None,
    ) -> None:
        self.relation = relation
        self.names = tuple(col.name for col in relation.columns)
        # a domain's values load as its base type's (SQL readers see the base type too)
        bases = base_types or {}
        self.oids = [bases.get(col.type_oid, col.type_oid) for col in relation.columns]
        self._adapters = adapters or _default_adapters()
        self._text = Transformer(self._adapters)
        self._text.set_loader_types(self.oids, Format.TEXT)
        self._binary: TransformerProto | None = None

    def load(self, values: tuple[Any, ...], wal_start: int = 0) -> tuple[Any, ...]:
        """Raw tuple values → Python values (None and UNCHANGED kept as they are)."""
        if len(values) != len(self.oids):
            raise DecodeError(
                f"tuple has {len(values)} columns, relation {self.relation.name} has "
                f"{len(self.oids)}",
                message_type="Tuple",
                lsn=wal_start,
            )
        try:
            if type(values) is tuple:  # all text or NULL (see SpecialValues)
                return self._text.load_sequence(values)
            return tuple(self._load_one(i, v) for i, v in enumerate(values))
        except (psycopg.DataError, ValueError, UnicodeDecodeError) as e:
            raise DecodeError(
                f"cannot load a value of relation {self.relation.name}: {e}",
                message_type="Tuple",
                lsn=wal_start,
            ) from e

    def _load_one(self, i: int, v: Any) -> Any:
        if v is None or isinstance(v, UnchangedToast):
            return v
        if type(v) is Binary:
            if self._binary is None:
                self._binary = Transformer(self._adapters)
            return self._binary.get_loader(self.oids[i], Format.BINARY).load(bytes(v))
        return self._text.get_loader(self.oids[i], Format.TEXT).load(v)

    def load_one(self, name: str, value: Any) -> Any:
        """One column's raw value → Python (raises psycopg.DataError / ValueError when it
        cannot be loaded)."""
        return self._load_one(self.names.index(name), value)

    def as_dict(self, values: tuple[Any, ...], wal_start: int = 0) -> dict[str, Any]:
        return dict(zip(self.names, self.load(values, wal_start), strict=True))
