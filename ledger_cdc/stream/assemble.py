"""pgoutput messages → committed transactions, in commit order.

The assembler is the transaction state machine of the protocol, with no I/O but its spill files:

- Begin … Commit: a transaction that arrives whole, after its commit (commit order).
- Stream Start / Stop chunks (protocol 2+): an in-progress transaction's changes, interleaved with
  others, buffered per top-level xid until Stream Commit; dropped on Stream Abort of the top xid;
  on Stream Abort of a subtransaction only the changes of that subxid are dropped.
- Begin Prepare … Prepare (two-phase, protocol 3+): kept until Commit Prepared (then emitted,
  at the COMMIT PREPARED position) or dropped at Rollback Prepared. Stream Prepare moves a
  streamed transaction to the prepared set.

Buffered changes are bounded in memory: past ``memory_limit`` bytes (estimated from the sizes fed
in: what a decoded change costs, ``2 × wire size + 512``) the largest buffer is spilled to a
temporary file. A transaction that was spilled is handed over as :class:`SpilledItems`, read back
from its file chunk by chunk while it is folded, never whole. Items are opaque to the assembler
(the consumer feeds decoded ledger events and anomalies); they must be picklable to spill.

Transactions that end at or below ``skip_upto`` (the stored checkpoint) are dropped, whatever the
server resends: the checkpoint decides, not the server's memory of what was confirmed.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Generic, TypeVar

from ledger_cdc.errors import DecodeError, SpillError
from ledger_cdc.lsn import format_lsn
from ledger_cdc.pgoutput.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Message,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
)

__all__ = ["Assembler", "SpilledItems", "Transaction", "estimate"]

T = TypeVar("T")


def estimate(size: int) -> int:
    """Bytes a decoded change of ``size`` wire bytes holds in memory: about twice its wire size
    (bench/memory.py measures it), plus the event's own fields."""
    return 2 * size + 512


class SpilledItems(Generic[T]):
    """The changes of a transaction that was spilled to disk: ``len()`` is known, iteration
    reads them back in the chunks they were written in (once; the file is closed after)."""

    def __init__(self, buffer: _Buffer[T]) -> None:
        self._buffer = buffer
        self._count = buffer.count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[T]:
        for item, _ in self.sized():
            yield item

    def sized(self) -> Iterator[tuple[T, int]]:
        """(item, its estimated bytes), read back in order; the file is closed after."""
        buf = self._buffer
        try:
            for t in buf.iter_items():
                yield t[1], t[2]
        finally:
            buf.close()

    def close(self) -> None:
        self._buffer.close()


@dataclass
class Transaction(Generic[T]):
    """A committed transaction: its changes in order, and where it ends in the WAL."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int  # microseconds since 2000-01-01 UTC
    items: list[T] | SpilledItems[T]
    gid: str | None = None
    streamed: bool = False
    size: int = 0  # estimated bytes its changes hold in memory (see estimate())

    @property
    def spilled(self) -> bool:
        return isinstance(self.items, SpilledItems)


@dataclass
class _Buffer(Generic[T]):
    """Changes of one open transaction: in memory, or spilled past the memory bound."""

    xid: int
    first_lsn: int
    items: list[tuple[int, T, int]] = field(default_factory=list)  # (subxid, item, size)
    size: int = 0  # bytes held in memory (estimated)
    spill: BinaryIO | None = None
    count: int = 0  # items, in memory and spilled
    total: int = 0  # estimated bytes of all items, in memory and spilled

    def add(self, subxid: int, item: T, size: int) -> None:
        self.items.append((subxid, item, size))
        self.size += size
        self.total += size
        self.count += 1

    _dir: str | None = None

    def spill_out(self, directory: str | None) -> int:
        """Move the in-memory items to the spill file; returns the bytes freed."""
        self._dir = directory
        try:
            if self.spill is None:
                # closed in close() / all_items(): it lives as long as its transaction
                self.spill = tempfile.TemporaryFile(prefix="ledger-cdc-spill-", dir=directory)  # noqa: SIM115
            self.spill.seek(0, 2)
            pickle.dump(self.items, self.spill, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as e:  # (full, gone, not writable: said with its path, not a bug)
            raise SpillError(directory, e, "buffering a transaction past the memory limit") from e
        freed, self.items, self.size = self.size, [], 0
        return freed

    def _read_spill(self) -> Iterator[tuple[int, T, int]]:
        assert self.spill is not None
        try:
            self.spill.seek(0)  # (writes what is still buffered: the disk may be full now)
        except OSError as e:
            raise SpillError(self._dir, e, "buffering a transaction past the memory limit") from e
        while True:
            try:
                chunk: list[tuple[int, T, int]] = pickle.load(self.spill)
            except EOFError:
                return
            yield from chunk

    def drop_subxact(self, subxid: int) -> int:
        """Discard the changes of an aborted subtransaction; returns the bytes freed."""
        if self.spill is not None:
            # rewritten chunk by chunk through a second file: never the whole spill in memory
            old, self.spill = self.spill, None
            old.seek(0)
            kept = count = total = 0
            self.spill = tempfile.TemporaryFile(prefix="ledger-cdc-spill-", dir=self._dir)  # noqa: SIM115
            while True:
                try:
                    chunk: list[tuple[int, T, int]] = pickle.load(old)
                except EOFError:
                    break
                chunk = [t for t in chunk if t[0] != subxid]
                kept += len(chunk)
                total += sum(t[2] for t in chunk)
                pickle.dump(chunk, self.spill, protocol=pickle.HIGHEST_PROTOCOL)
            old.close()
            count, self.total = kept, total
        else:
            count, self.total = 0, 0
        before = self.size
        self.items = [t for t in self.items if t[0] != subxid]
        self.size = sum(t[2] for t in self.items)
        self.count = count + len(self.items)
        self.total += self.size
        return before - self.size

    def iter_items(self) -> Iterator[tuple[int, T, int]]:
        """Every item in order: the spilled chunks, then what is in memory."""
        if self.spill is not None:
            yield from self._read_spill()
        yield from self.items

    def all_items(self) -> list[T]:
        out = [t[1] for t in self.iter_items()]
        self.close()
        return out

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


class Assembler(Generic[T]):
    """Feed every message (and, for row messages, the item it stands for); collect transactions.

    >>> asm = Assembler(skip_upto=checkpoint)
    >>> for txn in asm.feed(msg, item, size, wal_start): ...
    """

    def __init__(
        self,
        *,
        skip_upto: int = 0,
        memory_limit: int = 64 * 1024 * 1024,
        spill_dir: str | None = None,
    ) -> None:
        self.skip_upto = skip_upto
        self.memory_limit = memory_limit
        self.spill_dir = spill_dir
        self._current: _Buffer[T] | None = None  # inside Begin … Commit or Begin Prepare … Prepare
        self._current_begin: Begin | BeginPrepare | None = None
        self._streams: dict[int, _Buffer[T]] = {}
        self._stream_xid: int | None = None
        self._prepared: dict[str, tuple[_Buffer[T], int]] = {}  # gid → (changes, xid)
        self._memory = 0
        self.skipped = 0
        self.spills = 0
        self.streamed_aborts = 0

    # -- what is in flight ----------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """True while any transaction has started but not ended (stream, prepare, or Begin)."""
        return bool(self._current or self._streams or self._prepared)

    def oldest_prepared_lsn(self) -> int | None:
        """The first LSN of the oldest transaction prepared and not yet committed or rolled
        back. No confirmation may pass it: with a two-phase slot, the server takes a confirmed
        position past a PREPARE for "applied", and after a restart sends only its COMMIT
        PREPARED, while its changes were held here, in memory, and are gone."""
        return min((b.first_lsn for b, _ in self._prepared.values()), default=None)

    def oldest_in_flight_lsn(self) -> int | None:
        """The lowest LSN of a change held for a transaction not yet committed."""
        lsns = [b.first_lsn for b in self._streams.values()]
        lsns += [b.first_lsn for b, _ in self._prepared.values()]
        if self._current is not None:
            lsns.append(self._current.first_lsn)
        return min(lsns) if lsns else None

    @property
    def memory(self) -> int:
        return self._memory

    # -- feeding --------------------------------------------------------------------------------

    def feed(
        self, msg: Message, item: T | None = None, size: int = 0, lsn: int = 0
    ) -> list[Transaction[T]]:
        """One message in stream order; returns the transactions it completed (0 or 1)."""
        kind = type(msg)
        if kind is Begin:
            assert isinstance(msg, Begin)
            self._open(msg, lsn)
            return []
        if kind is Commit:
            assert isinstance(msg, Commit)
            return self._commit(msg, lsn)
        if item is not None:
            self._add(msg, item, size, lsn)
            return []
        if kind is StreamStart:
            assert isinstance(msg, StreamStart)
            self._stream_xid = msg.xid
            if msg.xid not in self._streams:
                self._streams[msg.xid] = _Buffer(msg.xid, lsn)
            return []
        if kind is StreamStop:
            self._stream_xid = None
            return []
        if kind is StreamCommit:
            assert isinstance(msg, StreamCommit)
            buf = self._streams.pop(msg.xid, None)
            if buf is None:
                buf = _Buffer(msg.xid, lsn)  # a streamed transaction without changes for us
            return self._emit(buf, msg.xid, msg.commit_lsn, msg.end_lsn, msg.commit_ts, None, True)
        if kind is StreamAbort:
            assert isinstance(msg, StreamAbort)
            self._abort(msg)
            return []
        if kind is BeginPrepare:
            assert isinstance(msg, BeginPrepare)
            self._open(msg, lsn)
            return []
        if kind is Prepare:
            assert isinstance(msg, Prepare)
            self._prepare(msg.gid, msg.xid, lsn)
            return []
        if kind is StreamPrepare:
            assert isinstance(msg, StreamPrepare)
            buf = self._streams.pop(msg.xid, None) or _Buffer(msg.xid, lsn)
            self._prepared[msg.gid] = (buf, msg.xid)
            return []
        if kind is CommitPrepared:
            assert isinstance(msg, CommitPrepared)
            held = self._prepared.pop(msg.gid, None)
            if held is None:
                # prepared before a restart that confirmed it: its changes are not resent. No
                # confirmation passes an open prepare (oldest_prepared_lsn), so this only
                # happens for a transaction with no changes for us (or one already applied).
                return []
            buf, xid = held
            return self._emit(buf, xid, msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.gid, False)
        if kind is RollbackPrepared:
            assert isinstance(msg, RollbackPrepared)
            held = self._prepared.pop(msg.gid, None)
            if held is not None:
                self._memory -= held[0].size
                held[0].close()
            return []
        return []  # Relation, Type, Origin, non-transactional Message: no transaction state

    def _open(self, msg: Begin | BeginPrepare, lsn: int) -> None:
        if self._current is not None:
            raise DecodeError(
                f"{type(msg).__name__} of xid {msg.xid} while xid {self._current.xid} is open",
                message_type=type(msg).__name__,
                lsn=lsn,
            )
        self._current = _Buffer(msg.xid, lsn)
        self._current_begin = msg

    def _add(self, msg: Message, item: T, size: int, lsn: int) -> None:
        if self._stream_xid is not None:
            buf = self._streams[self._stream_xid]
            subxid = getattr(msg, "xid", None) or self._stream_xid
        elif self._current is not None:
            buf = self._current
            subxid = buf.xid
        else:
            raise DecodeError(
                f"a {type(msg).__name__} change outside any transaction",
                message_type=type(msg).__name__,
                lsn=lsn,
            )
        cost = estimate(size)
        buf.add(subxid, item, cost)
        self._memory += cost
        if self._memory > self.memory_limit:
            self._spill_largest()

    def _spill_largest(self) -> None:
        buffers = [*self._streams.values(), *(b for b, _ in self._prepared.values())]
        if self._current is not None:
            buffers.append(self._current)
        # a buffer holding one change is not spilled: it would only be read back whole
        buffers = [b for b in buffers if len(b.items) > 1]
        while self._memory > self.memory_limit // 2 and buffers:
            big = max(buffers, key=lambda b: b.size)
            if big.size == 0:
                break
            buffers.remove(big)
            self._memory -= big.spill_out(self.spill_dir)
            self.spills += 1

    def _commit(self, msg: Commit, lsn: int) -> list[Transaction[T]]:
        buf = self._current
        begin = self._current_begin
        if buf is None or not isinstance(begin, Begin):
            raise DecodeError(
                f"Commit at {format_lsn(msg.commit_lsn)} without its Begin",
                message_type="Commit",
                lsn=lsn,
            )
        self._current = None
        self._current_begin = None
        return self._emit(buf, buf.xid, msg.commit_lsn, msg.end_lsn, msg.commit_ts, None, False)

    def _prepare(self, gid: str, xid: int, lsn: int) -> None:
        buf = self._current
        if buf is None or not isinstance(self._current_begin, BeginPrepare):
            raise DecodeError(
                f"Prepare of {gid!r} without its Begin Prepare", message_type="Prepare", lsn=lsn
            )
        self._current = None
        self._current_begin = None
        self._prepared[gid] = (buf, xid)

    def _abort(self, msg: StreamAbort) -> None:
        buf = self._streams.get(msg.xid)
        if buf is None:
            return
        self.streamed_aborts += 1
        if msg.subxid == msg.xid:
            del self._streams[msg.xid]
            self._memory -= buf.size
            buf.close()
        else:
            self._memory -= buf.drop_subxact(msg.subxid)

    def _emit(
        self,
        buf: _Buffer[T],
        xid: int,
        commit_lsn: int,
        end_lsn: int,
        commit_ts: int,
        gid: str | None,
        streamed: bool,
    ) -> list[Transaction[T]]:
        self._memory -= buf.size
        if end_lsn <= self.skip_upto:
            buf.close()
            self.skipped += 1
            return []
        if buf.spill is not None:  # read back while it is folded, not here
            items: list[T] | SpilledItems[T] = SpilledItems(buf)
        else:
            items = [t[1] for t in buf.items]
        return [Transaction(xid, commit_lsn, end_lsn, commit_ts, items, gid, streamed, buf.total)]

    def reset(self) -> None:
        """Forget everything in flight (after a reconnect the server resends it)."""
        for b in self._streams.values():
            b.close()
        for b, _ in self._prepared.values():
            b.close()
        if self._current is not None:
            self._current.close()
        self._streams.clear()
        self._prepared.clear()
        self._current = None
        self._current_begin = None
        self._stream_xid = None
        self._memory = 0
