"""pgoutput messages → committed ledger transactions: routing, dead-letter shaping, heartbeats.

:class:`LedgerStream` is the stage between the replication connection and the fold. It decodes
each message, keeps the relations it has seen, turns a ledger INSERT into a
:class:`~ledger_cdc.events.LedgerEvent` (or a :class:`Quarantined` row no reader can fold), an
UPDATE / DELETE / TRUNCATE of the ledger into an :class:`Anomaly`, believes only its own
heartbeats, and hands every change to the :class:`~ledger_cdc.stream.assemble.Assembler`, which
gives back whole transactions in commit order. It reads no clock and does no I/O (beyond the
assembler's spill files), so it is tested from bytes alone.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger_cdc.errors import DecodeError, LedgerError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.names import HEARTBEAT_PREFIX, LEDGER_TABLE
from ledger_cdc.pgoutput import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Decoder,
    Delete,
    Insert,
    LogicalMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from ledger_cdc.pgoutput.messages import MessageType, OldTupleKind
from ledger_cdc.stream.assemble import Assembler, Transaction
from ledger_cdc.stream.ledger import LedgerRowDecoder

__all__ = [
    "Anomaly",
    "ArchiveStart",
    "Item",
    "LedgerStream",
    "Quarantined",
    "bounded",
    "heartbeat_body",
    "rejected_row",
    "session_of",
]

log = logging.getLogger(__name__)

_BUILTIN_TYPES = psycopg.adapters.types

_KNOWN_KINDS = frozenset(bytes(m.value) for m in MessageType)
# the messages that open or end a streamed or prepared transaction: a Relation inside one is
# the ledger's only if that transaction commits
_TXN_KINDS = frozenset(
    {
        StreamStart,
        StreamStop,
        StreamCommit,
        StreamAbort,
        BeginPrepare,
        Prepare,
        CommitPrepared,
        RollbackPrepared,
    }
)


@dataclass(frozen=True)
class Anomaly:
    """An UPDATE, DELETE or TRUNCATE of the append-only ledger (its guard was bypassed)."""

    kind: str
    lsn: int
    seq: int | None
    session_id: uuid.UUID | None
    row: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A ledger row no reader can fold (see :class:`~ledger_cdc.events.Rejected`), with the LSN
    of its insert: quarantined by the fold, recorded as a dead letter."""

    lsn: int
    rejected: Rejected


@dataclass(frozen=True, slots=True)
class ArchiveStart:
    """A session's starting point other than empty: its archive snapshot (a bootstrap over
    archived history). Folding it puts the context in place, as the projection to write."""

    ctx: Any  # a fold.SessionContext (fold is not a layer below this one)


Item = LedgerEvent | Quarantined | Anomaly | ArchiveStart


def session_of(it: Item) -> uuid.UUID | None:
    match it:
        case LedgerEvent():
            return it.session_id
        case Quarantined():
            return it.rejected.session_id
        case ArchiveStart():
            sid: uuid.UUID = it.ctx.session_id
            return sid
    return None


def heartbeat_body(content: bytes) -> tuple[str, float] | None:
    """(nonce, sent-at) of a heartbeat's JSON body, or None for anything else (total)."""
    if len(content) > 512:
        return None
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    nonce, ts = body.get("nonce"), body.get("ts")
    if not isinstance(nonce, str) or isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return None
    if not math.isfinite(ts) or not 0 < ts < 1e11:
        return None
    return nonce, float(ts)


_DEAD_TEXT = 4096


def bounded(value: Any) -> Any:
    """A value as a dead letter keeps it: JSON-safe, and strings cut at 4 kB (the row itself
    stays in the ledger; the dead letter only has to name it)."""
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    text = value if isinstance(value, str) else str(value)
    if len(text) > _DEAD_TEXT:
        return f"{text[:_DEAD_TEXT]}… ({len(text):,} characters)"
    return text


def rejected_row(r: Rejected) -> dict[str, Any]:
    """What a dead letter records of a row no reader can fold."""
    return {
        "seq": r.seq,
        "session_id": str(r.session_id),
        "position": r.position,
        "agent_id": bounded(r.agent_id),
        "event_type": bounded(r.event_type),
        "idempotency_key": bounded(r.idempotency_key),
        "created_at": r.created_at,
    }


def _describe_row(
    rows: LedgerRowDecoder, values: tuple[Any, ...], lsn: int
) -> tuple[int | None, uuid.UUID | None, dict[str, Any] | None]:
    """(seq, session id, JSON-safe row) of a ledger tuple, for a dead letter; what cannot be
    loaded is left out rather than failing the stream."""
    try:
        loaded = rows._loader.as_dict(values, lsn)
    except LedgerError:
        return None, None, None
    seq, sid = loaded.get("seq"), loaded.get("session_id")
    row = {k: bounded(v) for k, v in loaded.items()}
    return (
        seq if isinstance(seq, int) else None,
        sid if isinstance(sid, uuid.UUID) else None,
        row,
    )


class LedgerStream:
    """Decodes, routes and assembles one replication stream (a new one after a reconnect).

    ``feed(payload, lsn)`` returns the transactions that message completed. Counters:
    ``unknown_messages`` (kinds this version does not know, skipped), ``foreign_heartbeats``
    (heartbeat-prefixed messages without this consumer's nonce, ignored); ``on_heartbeat(lsn,
    sent_at)`` is called for each of this consumer's own heartbeats."""

    def __init__(
        self,
        *,
        skip_upto: int,
        memory_limit: int,
        spill_dir: str | None = None,
        table: str = LEDGER_TABLE,
        schema: str | None = None,
        nonce: str = "",
        on_heartbeat: Callable[[int, float], None] | None = None,
        on_count: Callable[[str], None] | None = None,
    ) -> None:
        self.decoder = Decoder()
        self.assembler: Assembler[Item] = Assembler(
            skip_upto=skip_upto, memory_limit=memory_limit, spill_dir=spill_dir
        )
        self.table = table
        # the ledger's schema (None: any): a publication of all tables, or of a schema, also
        # streams other schemas' tables, one of which may have the ledger's name
        self.schema = schema
        self.nonce = nonce
        self.on_heartbeat = on_heartbeat
        self.on_count = on_count  # told "unknown_messages_total" / "foreign_heartbeats_total"
        self.unknown_messages = 0
        self.foreign_heartbeats = 0
        self._decode = self.decoder.decode
        self._feed = self.assembler.feed
        self._rows: dict[int, LedgerRowDecoder] = {}
        self._ledger_relids: set[int] = set()
        # relation ids named the ledger in a transaction not committed yet (streamed or
        # prepared): (sub)transaction xid → (top-level xid, relation ids); an abort forgets them
        self._tentative: dict[int, tuple[int, set[int]]] = {}
        self._stream_top: int | None = None  # the streamed transaction whose block is open
        self._prepare_xid: int | None = None  # the prepared transaction being sent
        # a domain's type OID → its base type's: the server sends a Type message for each
        # user-defined column type, with the base type's name
        self._base_types: dict[int, int] = {}
        self._unknown_seen: set[bytes] = set()

    def feed(self, payload: bytes, lsn: int) -> list[Transaction[Item]]:
        try:
            msg = self._decode(payload, lsn)
        except DecodeError as e:
            if payload[:1] in _KNOWN_KINDS:
                raise  # the framing of a message we know is broken: nothing after it is sure
            self._unknown_kind(payload, e)
            return []
        kind = type(msg)
        if kind is Begin or kind is Commit:  # two of a one-row transaction's three messages
            return self._feed(msg, None, 0, lsn)
        item: Item | None = None
        if kind is Insert:
            rows = self._rows.get(msg.relation_id)  # type: ignore[union-attr]
            if rows is None:
                return []
            ev = rows.event(msg.new, lsn)  # type: ignore[union-attr]
            item = Quarantined(lsn, ev) if isinstance(ev, Rejected) else ev
        elif kind is Relation:
            assert isinstance(msg, Relation)
            self._relation(msg)
            return []
        elif kind is Type:
            assert isinstance(msg, Type)
            self._type(msg)
            return []
        elif kind is Update or kind is Delete:
            assert isinstance(msg, (Update, Delete))
            if msg.relation_id in self._ledger_relids:
                item = self._anomaly("update" if kind is Update else "delete", msg, lsn)
        elif kind is Truncate:
            assert isinstance(msg, Truncate)
            if self._ledger_relids.intersection(msg.relation_ids):
                item = Anomaly("truncate", lsn, None, None, None)
        elif kind is LogicalMessage:
            assert isinstance(msg, LogicalMessage)
            if not msg.transactional and msg.prefix == HEARTBEAT_PREFIX:
                self._heartbeat(msg, lsn)
            return []
        elif kind in _TXN_KINDS:
            self._transaction(msg)
        return self._feed(msg, item, len(payload), lsn)

    def _relation(self, msg: Relation) -> None:
        """The ledger is the relation with the ledger's name, and stays so renamed (a relation
        id is the table's). A name seen in a streamed or prepared transaction counts only once
        that transaction commits: a rename tried and rolled back makes no table the ledger."""
        rid = msg.relation_id
        named = msg.name == self.table and (self.schema is None or msg.namespace == self.schema)
        tentative = any(rid in rids for _, rids in self._tentative.values())
        if not (named or rid in self._ledger_relids or tentative):
            self._rows.pop(rid, None)
            return
        self._rows[rid] = LedgerRowDecoder(msg, self._base_types)
        if rid in self._ledger_relids or not named:
            return
        owner = msg.xid if msg.xid is not None else self._prepare_xid
        if owner is None:  # a transaction decoded at its commit
            self._ledger_relids.add(rid)
        else:
            top = self._stream_top if msg.xid is not None and self._stream_top else owner
            self._tentative.setdefault(owner, (top, set()))[1].add(rid)

    def _type(self, msg: Type) -> None:
        """A user-defined column type: for a domain, the server names its base type, whose
        loader its values take (a domain over timestamptz loads as timestamptz). pg_catalog is
        sent as an empty namespace."""
        if msg.namespace in ("", "pg_catalog"):
            info = _BUILTIN_TYPES.get(msg.name)
            if info is not None and info.oid != msg.type_oid:
                self._base_types[msg.type_oid] = info.oid

    def _transaction(self, msg: Any) -> None:
        """Keeps the relation ids a streamed or prepared transaction named the ledger until it
        commits (then they are the ledger's) or aborts (then forgotten)."""
        kind = type(msg)
        if kind is StreamStart:
            self._stream_top = msg.xid
        elif kind is StreamStop:
            self._stream_top = None
        elif kind is BeginPrepare:
            self._prepare_xid = msg.xid
        elif kind is Prepare:
            self._prepare_xid = None
        elif kind is StreamCommit or kind is CommitPrepared:
            for owner, (top, rids) in list(self._tentative.items()):
                if top == msg.xid:
                    del self._tentative[owner]
                    self._ledger_relids |= rids
        elif kind is StreamAbort or kind is RollbackPrepared:
            whole = kind is RollbackPrepared or msg.subxid == msg.xid
            dropped: set[int] = set()
            for owner, (top, rids) in list(self._tentative.items()):
                if (whole and top == msg.xid) or (not whole and owner == msg.subxid):
                    del self._tentative[owner]
                    dropped |= rids
            still = set().union(*(rids for _, rids in self._tentative.values()))
            for rid in dropped - self._ledger_relids - still:
                self._rows.pop(rid, None)

    def _unknown_kind(self, payload: bytes, e: DecodeError) -> None:
        """A message kind this decoder does not know (a newer server or protocol): not ours to
        fold, and no reason to stop. Logged once per kind, counted, skipped."""
        self.unknown_messages += 1
        if self.on_count is not None:
            self.on_count("unknown_messages_total")
        kind = payload[:1]
        if kind not in self._unknown_seen:
            self._unknown_seen.add(kind)
            log.warning("skipping a message of a kind this version does not know: %s", e)

    def _anomaly(self, kind: str, msg: Update | Delete, lsn: int) -> Anomaly:
        rows = self._rows.get(msg.relation_id)
        # an old tuple of the key alone (the key changed) has every other column NULL: the new
        # row says more; the whole old row (REPLICA IDENTITY FULL) says what was changed
        values = msg.old
        if isinstance(msg, Update) and (values is None or msg.old_kind is OldTupleKind.KEY):
            values = msg.new
        if rows is None or values is None:
            return Anomaly(kind, lsn, None, None, None)
        return Anomaly(kind, lsn, *_describe_row(rows, values, lsn))

    def _heartbeat(self, msg: LogicalMessage, lsn: int) -> None:
        """Any role can emit a message with this prefix (pg_logical_emit_message is PUBLIC), so
        only a well-formed one carrying this consumer's nonce is believed."""
        body = heartbeat_body(msg.content)
        if body is None or body[0] != self.nonce:
            self.foreign_heartbeats += 1
            if self.on_count is not None:
                self.on_count("foreign_heartbeats_total")
            return
        if self.on_heartbeat is not None:
            self.on_heartbeat(lsn, body[1])
