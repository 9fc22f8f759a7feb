"""A replication stream of prepared pgoutput bytes, for running the whole consumer loop without a
server (with :class:`ledger_cdc.sink.memory.MemorySink`).

:class:`Wal` builds the messages a walsender would send for ledger transactions, with the
declarative grammar (``ledger_cdc.pgoutput.spec.build_message``) and the ``agent_events``
relation as a real server describes it (columns and type OIDs as captured in
``tests/data/pgoutput_pg15.txt``). :class:`FakeSlot` plays the slot: it remembers the confirmed
position, and each :class:`FakeTransport` started on it replays, as the server does, every
transaction that commits after that position. Faults: ``drops`` ends connections with a
:class:`~ledger_cdc.stream.transport.TransportError` after so many messages.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ledger_cdc.errors import ConfigError
from ledger_cdc.names import HEARTBEAT_PREFIX
from ledger_cdc.pgoutput.spec import build_message
from ledger_cdc.stream.transport import TransportError

LEDGER_RELID = 16393
# (name, type oid) of agent_events as pgoutput describes it (seq is the replica identity key)
LEDGER_COLUMNS = (
    ("seq", 20),
    ("session_id", 2950),
    ("position", 20),
    ("agent_id", 25),
    ("event_type", 25),
    ("payload", 3802),
    ("idempotency_key", 25),
    ("created_at", 1184),
    ("prev_hash", 17),
    ("hash", 17),
)
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class XLog:
    data_start: int
    wal_end: int
    payload: bytes
    send_time: dt.datetime = field(default_factory=dt.datetime.now)


def _col(value: str | bytes | None) -> dict[str, Any]:
    if value is None:
        return {"kind": b"n", "data": None}
    return {"kind": b"t", "data": value.encode() if isinstance(value, str) else value}


@dataclass
class Row:
    """One ledger row as text columns (any of them may be made hostile)."""

    seq: int
    session_id: str
    position: int
    event_type: str
    payload: str  # jsonb text
    agent_id: str = "agent"
    created_at: str = "2026-12-03 10:00:00+00"
    idempotency_key: str | None = None

    def columns(self) -> list[dict[str, Any]]:
        values = {
            "seq": str(self.seq),
            "session_id": self.session_id,
            "position": str(self.position),
            "agent_id": self.agent_id,
            "event_type": self.event_type,
            "payload": self.payload,
            "idempotency_key": self.idempotency_key,
            "created_at": self.created_at,
            "prev_hash": None,
            "hash": None,
        }
        return [_col(values[name]) for name, _ in LEDGER_COLUMNS]


@dataclass
class Wal:
    """The WAL of one database as pgoutput messages, appended transaction by transaction."""

    lsn: int = 0x1_000_000
    xid: int = 700
    seq: int = 0
    messages: list[XLog] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)  # end LSN of every transaction, in order
    positions: dict[str, int] = field(default_factory=dict)

    def _put(self, payload: bytes, step: int = 0x40) -> int:
        at = self.lsn
        self.lsn += step
        self.messages.append(XLog(at, at, payload))
        return at

    def relation(self) -> bytes:
        """The Relation message of the ledger table. As pgoutput does, a connection sends it
        before its first change of the table (:class:`FakeTransport`), not the WAL."""
        return build_message(
            b"R",
            {
                "xid": None,
                "relation_id": LEDGER_RELID,
                "namespace": "public",
                "name": "agent_events",
                "replica_identity": b"d",
                "columns": [
                    {
                        "flags": 1 if name == "seq" else 0,
                        "name": name,
                        "type_oid": oid,
                        "type_modifier": -1,
                    }
                    for name, oid in LEDGER_COLUMNS
                ],
            },
        )

    def row(self, session: uuid.UUID, event_type: str, payload: Any, **kw: Any) -> Row:
        """The next row of ``session`` (seq and position assigned as the trigger would)."""
        self.seq += 1
        sid = str(session)
        self.positions[sid] = self.positions.get(sid, 0) + 1
        text = payload if isinstance(payload, str) else json.dumps(payload)
        return Row(self.seq, sid, self.positions[sid], event_type, text, **kw)

    def transaction(self, rows: list[Row], *, extra: list[bytes] = ()) -> int:  # type: ignore[assignment]
        """One committed transaction of these inserts (and ``extra`` raw messages after them);
        returns its end LSN."""
        self.xid += 1
        commit_ts = int((dt.datetime.now(dt.timezone.utc) - _PG_EPOCH).total_seconds() * 1e6)
        size = 0x40 * (len(rows) + len(extra) + 3)
        commit_lsn = self.lsn + size - 0x40
        self._put(
            build_message(b"B", {"final_lsn": commit_lsn, "commit_ts": commit_ts, "xid": self.xid})
        )
        for r in rows:
            self._put(
                build_message(
                    b"I",
                    {"xid": None, "relation_id": LEDGER_RELID, "new": {"columns": r.columns()}},
                )
            )
        for raw in extra:
            self._put(raw)
        self.lsn = max(self.lsn, commit_lsn)
        end = commit_lsn + 0x30
        self._put(
            build_message(
                b"C",
                {"flags": 0, "commit_lsn": commit_lsn, "end_lsn": end, "commit_ts": commit_ts},
            ),
            step=0x40,
        )
        self.commits.append(end)
        return end

    def outside(self, payload: bytes) -> None:
        """A message outside any transaction (a non-transactional logical message, or bytes of
        a kind this decoder does not know)."""
        self._put(payload)

    def heartbeat(self, nonce: str, ts: float) -> None:
        self.outside(logical(HEARTBEAT_PREFIX, json.dumps({"nonce": nonce, "ts": ts}).encode()))

    def update(self, row: Row) -> bytes:
        """An UPDATE of a ledger row (the append-only guard bypassed), to pass as ``extra``."""
        return build_message(
            b"U",
            {
                "xid": None,
                "relation_id": LEDGER_RELID,
                "tag": b"N",
                "old": None,
                "new_tag": None,
                "new": {"columns": row.columns()},
            },
        )

    def truncate(self) -> bytes:
        return build_message(
            b"T", {"xid": None, "relation_count": 1, "options": 0, "relation_ids": [LEDGER_RELID]}
        )


def logical(prefix: str, content: bytes, *, transactional: bool = False) -> bytes:
    return build_message(
        b"M",
        {
            "xid": None,
            "flags": 1 if transactional else 0,
            "lsn": 0,
            "prefix": prefix,
            "content": content,
        },
    )


class FakeSlot:
    """The server side of the slot: the WAL, and the position the consumer confirmed."""

    def __init__(self, wal: Wal) -> None:
        self.wal = wal
        self.confirmed = 0
        self.connections = 0
        self.active = False
        # each connection in turn ends after this many messages (a dropped connection)
        self.drops: list[int] = []
        self.lock = threading.Condition()

    def transport(self) -> FakeTransport:
        return FakeTransport(self)


class FakeTransport:
    """One connection to a :class:`FakeSlot` (the consumer's ``transport``)."""

    def __init__(self, slot: FakeSlot) -> None:
        self.slot = slot
        self.confirmed = 0
        self.adopted: tuple[float, int] | None = None
        self._queue: list[XLog] = []
        self._next = 0
        self._sent = 0
        self._drop_after: int | None = None
        self._open = False
        self._relation_sent = False

    def create_slot_exported(self) -> tuple[int, str]:
        raise ConfigError("a fake slot has no exported snapshot")

    def start(self, start_lsn: int, *, reuse: bool = False) -> None:
        slot = self.slot
        with slot.lock:
            slot.connections += 1
            self._open = True
            self._drop_after = slot.drops.pop(0) if slot.drops else None
            self._sent = 0
            self._relation_sent = False
            self.confirmed = max(start_lsn, slot.confirmed)
            # as the server does: resend from the first transaction not confirmed (whole
            # transactions; what a consumer already committed it skips by its checkpoint)
            begin = 0
            msgs = slot.wal.messages
            for i, m in enumerate(msgs):
                if m.payload[:1] == b"C" and m.data_start + 0x30 <= slot.confirmed:
                    begin = i + 1
            self._next = begin

    def read_many(self, limit: int) -> list[XLog]:
        if not self._open:
            raise TransportError("the fake connection is closed")
        msgs = self.slot.wal.messages
        out: list[XLog] = []
        while self._next < len(msgs) and len(out) < limit:
            if self._drop_after is not None and self._sent >= self._drop_after:
                if out:
                    break
                self._open = False
                raise TransportError("connection dropped (fake)")
            m = msgs[self._next]
            if not self._relation_sent and m.payload[:1] in b"IUDT":
                self._relation_sent = True  # pgoutput: once per session, before first use
                out.append(XLog(m.data_start, m.wal_end, self.slot.wal.relation()))
            out.append(m)
            self._next += 1
            self._sent += 1
        return out

    def wait(self, timeout: float, *also: int) -> None:
        with self.slot.lock:
            if self._next >= len(self.slot.wal.messages):
                self.slot.lock.wait(min(timeout, 0.01))

    @property
    def wal_end(self) -> int:
        msgs = self.slot.wal.messages
        return msgs[self._next - 1].wal_end if self._next else self.confirmed

    def confirm(self, lsn: int, *, force: bool = True) -> None:
        if lsn > self.confirmed:
            self.confirmed = lsn
        with self.slot.lock:
            self.slot.confirmed = max(self.slot.confirmed, self.confirmed)

    def keepalive_during(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        self._open = False


@contextlib.contextmanager
def running(consumer: Any) -> Iterator[threading.Thread]:
    """Run a consumer's loop in a thread; stop and join it on the way out."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            consumer.run()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        yield t
    finally:
        consumer.stop()
        t.join(30)
        assert not t.is_alive(), "the consumer loop did not stop"
    if errors and not isinstance(errors[0], _Crash):
        raise errors[0]


class _Crash(BaseException):
    """Raised into a consumer to end it as a crash would (nothing after it runs)."""
