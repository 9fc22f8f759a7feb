"""Building a sink's batches from committed transactions (pure: no I/O, no clock).

:class:`BatchBuilder` folds transactions into the sessions' contexts with the reducers it is
given, in commit order, and shapes what one sink transaction writes (:class:`Batch`): the changed
projections, the memo rows of the calls completed, the snapshots that came due
(:class:`SnapshotPolicy`, always between two transactions, never inside one), the dead letters,
the runs that became ready to lease and the change notices. Contexts come from a bounded
:class:`SessionCache`; those it lacks are asked of the sink through the ``load`` callable.

Memory is bounded by the consumer's limit M: the session cache takes 15 % of M (least recently
used contexts evicted, by their estimated size), a batch 15 % (a batch ends at the transaction
where it would pass it). A single transaction over it is folded in parts (:meth:`BatchBuilder.
big`): the sink writes each part inside one database transaction that ends with the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from ledger_cdc.errors import SpillError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import (
    REFERENCE_MIN,
    RUN_PENDING,
    CompletedModel,
    CompletedTool,
    Reducers,
    SessionContext,
    SessionStatus,
    completion,
    decode_context,
    encode_stored,
)
from ledger_cdc.lsn import format_lsn
from ledger_cdc.names import RUNS_CHANNEL
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Anomaly, Base, Held, Item, rejected_row, session_of

__all__ = [
    "Batch",
    "BatchBuilder",
    "BigRun",
    "DeadLetter",
    "SessionCache",
    "SnapshotPolicy",
    "SnapshotRow",
    "Tail",
    "context_size",
    "frozen",
]

log = logging.getLogger("ledger_cdc.consumer")

LOAD_AT_ONCE = 512  # sessions whose contexts are loaded by one query
CONTEXT_FACTOR = 3  # a decoded context's Python objects for each byte of its JSON (bench/memory.py)
_ENDED = (SessionStatus.COMPLETED, SessionStatus.FAILED)


@dataclass(frozen=True)
class DeadLetter:
    seq: int | None
    session_id: uuid.UUID | None
    lsn: int
    kind: str  # quarantined | update | delete | truncate | gap
    reason: str
    row: dict[str, Any] | None = None


@dataclass(frozen=True)
class SnapshotRow:
    session_id: uuid.UUID
    upto_seq: int
    upto_position: int
    reducer_version: str
    content_hash: bytes
    context: bytes  # canonical JSON of the snapshot (fold.encode_stored)
    upto_hash: bytes | None = None  # chain hash of the event at upto_position, as streamed


@dataclass
class Batch:
    """What one sink transaction writes."""

    end_lsn: int
    # session → (context, its stored JSON (fold.encode_stored), commit LSN, hash of its last event
    # as streamed)
    sessions: dict[uuid.UUID, tuple[SessionContext, bytes, int, bytes | None]] = field(
        default_factory=dict
    )
    snapshots: list[SnapshotRow] = field(default_factory=list)
    # (session, position of the completing event, the call it completed): agent_memo rows
    memo: list[tuple[uuid.UUID, int, CompletedTool | CompletedModel]] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    heartbeat_at: float | None = None
    transactions: int = 0
    events: int = 0
    last_commit_ts: int | None = None  # of the last transaction, µs since 2000-01-01
    commit_times: list[int] = field(default_factory=list)  # each transaction's commit_ts
    committed_at: float | None = None  # Unix time the sink transaction committed
    epoch: int | None = None  # set the checkpoint's epoch (None: leave it)
    notify: list[uuid.UUID] = field(default_factory=list)  # runs that became ready to lease
    channel: str = RUNS_CHANNEL
    session_notices: list[str] = field(default_factory=list)  # '<session>:<position>' changed
    max_seq: int | None = None  # the highest seq this batch folded or quarantined
    # a chunk of a big transaction: (session, event count, status, run status, leases) of each
    # session it touched first, as they were before (commit_chunked)
    touched: list[tuple[uuid.UUID, int, str, str | None, int | None]] = field(default_factory=list)
    published: list[tuple[Any, int]] = field(default_factory=list)  # (event, commit LSN) to fan out

    def freeze(self) -> None:
        """Its contexts replaced by copies that later folds do not change (:func:`frozen`):
        for a batch the sink writes on its own thread while the loop folds the next one into
        the same cached contexts."""
        self.sessions = {
            sid: (frozen(ctx), data, lsn, head)
            for sid, (ctx, data, lsn, head) in self.sessions.items()
        }

    def stored_size(self) -> int:
        """Bytes of the stored JSON this batch writes: its projections and snapshots."""
        return sum(len(data) for _, data, _, _ in self.sessions.values()) + sum(
            len(s.context) for s in self.snapshots
        )


_S = TypeVar("_S", bound=msgspec.Struct)


def frozen(ctx: SessionContext) -> SessionContext:
    """A copy of ``ctx`` that folding on does not change: its lists and dicts are its own, and
    so are its mutable parts (the run and its lease and inbox, the usage), copied the same way;
    what those hold is shared (the reducers replace such values rather than change them; a
    custom reducer's state in ``extra`` is its own affair). The batch's stored JSON holds the
    whole state as sealed."""
    return _own(ctx)


def _own(struct: _S) -> _S:
    copy = msgspec.structs.replace(struct)
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        kind = type(value)
        if kind is list:
            setattr(copy, name, list(value))
        elif kind is dict:
            setattr(copy, name, dict(value))
        elif isinstance(value, msgspec.Struct) and not value.__struct_config__.frozen:
            setattr(copy, name, _own(value))
    return copy


class Tail(Protocol):
    """What the last part of a big transaction reads, inside the sink's transaction."""

    def due_snapshots(
        self, every: int, size: int = 200
    ) -> Iterator[list[tuple[uuid.UUID, str, bytes | None]]]: ...

    def notify(self, channel: str, sessions: bool) -> None: ...


@dataclass(frozen=True)
class SnapshotPolicy:
    """When a session's snapshot is due: its event count crossed a multiple of ``every`` in the
    transaction, or the transaction ended the session (completed or failed). Decided at the end
    of a transaction, from what the session was at its start."""

    every: int = 100

    def due(self, count_before: int, status_before: str, ctx: SessionContext) -> bool:
        return self.crossed(count_before, status_before, ctx.event_count, ctx.status)

    def crossed(self, count_before: int, status_before: str, count: int, status: str) -> bool:
        """The rule on the bare figures (a sink that holds only a projection's columns)."""
        every = self.every
        if every > 0 and count // every != count_before // every:
            return True
        return status != status_before and status in _ENDED


def context_size(ctx: SessionContext, stored: bytes | str) -> int:
    """Estimated bytes a context takes in memory, from its stored JSON (and the messages that
    leaves in their events: its window's, the long ones taken from events)."""
    w = ctx.window
    extra = 0 if w is None else w.chars + 48 * w.length
    extra += sum(s.chars for s in ctx.sources if s.chars >= REFERENCE_MIN)
    return CONTEXT_FACTOR * (len(stored) + extra)


class SessionCache:
    """Contexts by session, least recently used first, bounded by their estimated bytes
    (CONTEXT_FACTOR × their JSON: what the Python objects take)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._ctx: OrderedDict[uuid.UUID, SessionContext] = OrderedDict()
        self._size: dict[uuid.UUID, int] = {}

    def __len__(self) -> int:
        return len(self._ctx)

    def __contains__(self, sid: object) -> bool:
        return sid in self._ctx

    def get(self, sid: uuid.UUID) -> SessionContext | None:
        return self._ctx.get(sid)  # recency is marked once per batch (touch), not per event

    def touch(self, sid: uuid.UUID, size: int) -> None:
        """A session the batch changed: most recently used now, at its new size."""
        if sid in self._ctx:
            self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def put(self, sid: uuid.UUID, ctx: SessionContext, size: int) -> None:
        self._ctx[sid] = ctx
        self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def resize(self, sid: uuid.UUID, size: int) -> None:
        self.bytes += size - self._size.get(sid, 0)
        self._size[sid] = size

    def evict(self) -> None:
        while self.bytes > self.budget and len(self._ctx) > 1:
            sid, _ = self._ctx.popitem(last=False)
            self.bytes -= self._size.pop(sid, 0)

    def clear(self) -> None:
        self._ctx.clear()
        self._size.clear()
        self.bytes = 0


@dataclass
class _Part:
    """What a batch (or a part of a big transaction) has folded so far."""

    batch: Batch
    # session → (context, commit LSN, hash of its last event as streamed)
    changed: dict[uuid.UUID, tuple[SessionContext, int, bytes | None]] = field(default_factory=dict)
    runs_before: dict[uuid.UUID, tuple[str, int] | None] = field(default_factory=dict)
    max_seq: int = 0
    used: int = 0  # estimated bytes held: the changes folded


class BigRun:
    """One big transaction folded in parts: what its parts counted, once committed."""

    def __init__(self, txn: Transaction[Item], epoch: int | None) -> None:
        self.txn = txn
        self.epoch = epoch
        self.events = 0
        self.dead = 0
        self.max_seq = 0
        self.last = self.part()

    def part(self) -> _Part:
        return _Part(Batch(end_lsn=self.txn.end_lsn))

    def count(self, chunk: Batch) -> None:
        self.events += chunk.events
        self.dead += len(chunk.dead_letters)
        self.max_seq = max(self.max_seq, chunk.max_seq or 0)


_BUCKETS = 64
_HELD = 32  # changes a bucket holds in memory before they are written out
_LEVELS = 6  # times a bucket over the budget is spread again
# odd 128-bit multipliers, one per level: the top bits of sid × M (mod 2**128) depend on every
# bit of the id, so ids that differ only in their high or only in their low bits still spread
_MIX = tuple(
    int.from_bytes(hashlib.sha256(b"ledger-cdc by_session %d" % n).digest()[:16], "big") | 1
    for n in range(_LEVELS + 1)
)
_MASK = (1 << 128) - 1


def by_session(
    sized: Iterable[tuple[Item, int]],
    directory: str | None,
    budget: int,
    *,
    level: int = 0,
    buckets: int = _BUCKETS,
) -> Iterator[tuple[Item, int]]:
    """The same changes, grouped by session: each session's together and in their order, so
    that a fold loads each context once. Spread by session over ``buckets`` parts of one
    temporary file (a few dozen changes per bucket in memory at a time); a bucket whose changes
    fit ``budget`` bytes is read back whole and grouped in memory, a larger one is spread again,
    by other bits of the session id, over as many buckets as it takes to fit (a bucket of one
    session is read back as it is). A change is written once per level: one level for a
    transaction of up to 64 budgets, two up to thousands."""
    file: Any = None
    at: list[list[int]] = [[] for _ in range(buckets)]  # where each bucket's parts start
    held: list[list[tuple[Item, int]]] = [[] for _ in range(buckets)]
    sizes = [0] * buckets
    first: list[uuid.UUID | None] = [None] * buckets  # the bucket's first session
    mixed = [False] * buckets  # whether it holds more than one session (or a change of none)
    mix = _MIX[level]

    def spill(k: int) -> None:
        nonlocal file
        try:
            if file is None:
                file = tempfile.TemporaryFile(prefix="ledger-cdc-group-", dir=directory)  # noqa: SIM115
            at[k].append(file.tell())
            pickle.dump(held[k], file, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as e:  # (full, gone, not writable: said with its path, not a bug)
            raise SpillError(directory, e, "sorting a large transaction by session") from e
        held[k] = []

    def read_back(k: int) -> Iterator[tuple[Item, int]]:
        """Bucket ``k``'s changes in the order they came: what was written, then what is held."""
        for offset in at[k]:
            try:
                file.seek(offset)  # (writes what is still buffered: the disk may be full now)
            except OSError as e:
                raise SpillError(directory, e, "sorting a large transaction by session") from e
            chunk: list[tuple[Item, int]] = pickle.load(file)
            yield from chunk
        yield from held[k]
        held[k] = []

    try:
        for pair in sized:
            sid = session_of(pair[0])
            k = 0 if sid is None else (((sid.int * mix) & _MASK) * buckets) >> 128
            held[k].append(pair)
            sizes[k] += pair[1]
            if not mixed[k]:
                if first[k] is None:
                    first[k] = sid
                mixed[k] = sid is None or sid != first[k]
            if len(held[k]) >= _HELD:
                spill(k)
        for k in range(buckets):
            if not mixed[k]:
                yield from read_back(k)
            elif sizes[k] <= budget or level >= _LEVELS:
                yield from _grouped(read_back(k))
            else:
                parts = min(_BUCKETS, 2 + 2 * sizes[k] // max(1, budget))  # (room for skew)
                yield from by_session(
                    read_back(k), directory, budget, level=level + 1, buckets=parts
                )
    finally:
        if file is not None:
            with contextlib.suppress(OSError):  # (a full disk refuses its last write)
                file.close()


def _grouped(pairs: Iterable[tuple[Item, int]]) -> Iterator[tuple[Item, int]]:
    """The changes, each session's together in their order, sessions in the order of their
    first change (held in memory: the caller gives no more than it can hold)."""
    groups: dict[uuid.UUID | None, list[tuple[Item, int]]] = {}
    for pair in pairs:
        sid = session_of(pair[0])
        group = groups.get(sid)
        if group is None:
            groups[sid] = [pair]
        else:
            group.append(pair)
    for group in groups.values():
        yield from group
        group.clear()  # (let go of each session's changes once handed on)


Loader = Callable[[list[uuid.UUID]], dict[uuid.UUID, tuple[SessionContext, int]]]


GapReader = Callable[[uuid.UUID, int, int], list[LedgerEvent | Rejected]]


class BatchBuilder:
    """Folds committed transactions into batches (see the module docstring).

    ``load(session_ids)`` gives the projected context (and its estimated size) of each session
    that has one; ``on_anomaly`` is told of each UPDATE / DELETE / TRUNCATE met."""

    def __init__(
        self,
        *,
        load: Loader,
        cache: SessionCache,
        budget: int,
        reducers: Reducers,
        snapshots: SnapshotPolicy,
        channel: str = RUNS_CHANNEL,
        notify_sessions: bool = True,
        publish: bool = False,
        spill_dir: str | None = None,
        on_anomaly: Callable[[Anomaly], None] | None = None,
        by_reference: bool = True,
        folds: bool = True,
        fill_gap: GapReader | None = None,
    ) -> None:
        self.load_contexts = load
        # (session, first, last) → that session's rows at those positions, read from the
        # ledger table: what the stream never sent (see _fill); None: recorded as a gap only
        self.fill_gap = fill_gap
        # False: a relay (consume --publish-only) that only hands the events on to the
        # publishers, in commit order, quarantined ones included; fold workers build the
        # projections from the stream
        self.folds = folds
        # stored contexts reference the ledger's events instead of copying them (the sink reads
        # them back: see fold.encode_stored)
        self.by_reference = by_reference
        self.cache = cache
        self.budget = max(1, budget)
        self.reducers = reducers
        self.version = reducers.version
        self.snapshots = snapshots
        self.channel = channel
        self.notify_sessions = notify_sessions
        self.publish = publish
        self.spill_dir = spill_dir
        self.on_anomaly = on_anomaly
        self._loaded_bytes = 0  # contexts loaded since the part in hand began (_Part.used)
        self._ahead: _Part | None = None  # the next batch, folded ahead of time (fold_ahead)
        # sessions the loader rebuilt from the ledger (their stored projection unusable), with
        # the memo rows of every call they completed: the next batch that has one of their
        # events writes them (even an event already folded), and those rows (agent_memo keeps
        # the ones it has)
        self.rebuilt: dict[uuid.UUID, list[tuple[uuid.UUID, int, Any]]] = {}

    # -- a batch of whole transactions -----------------------------------------------------------

    def fold(self, txns: list[Transaction[Item]]) -> tuple[Batch, list[Transaction[Item]]]:
        """Fold committed transactions into one batch, as many as fit its byte budget (at least
        one), after those :meth:`fold_ahead` folded into it already: the batch, and the
        transactions left for the next."""
        f, self._ahead = self._ahead, None
        if f is None:
            f = _Part(Batch(end_lsn=0))
        rest: list[Transaction[Item]] = []
        loaded_upto = 0
        for i, txn in enumerate(txns):
            if f.batch.transactions and f.used > self.budget:
                rest = txns[i:]
                break
            if i >= loaded_upto and self.folds:
                loaded_upto = self._load_for(txns, i)
            self._fold_transaction(f, txn)
        self.seal(f)
        return f.batch, rest

    def fold_ahead(self, txns: list[Transaction[Item]]) -> int:
        """Fold the first of ``txns`` into the next batch before it is due: as many as need no
        load (every session they touch is in the cache: the sink's connection may be busy)
        and fit the batch's budget. The loop does this while the sink writes the previous
        batch, so that handing the next one over costs only its sealing. Returns how many it
        folded: the caller drops them from its list, and :meth:`fold` goes on after them."""
        f = self._ahead
        done = 0
        for txn in txns:
            if f is not None and f.used > self.budget:
                break
            items = txn.items
            assert isinstance(items, list)
            if self.folds and any(self._uncached(items)):
                return done
            if f is None:
                f = self._ahead = _Part(Batch(end_lsn=0))
            self._fold_transaction(f, txn)
            done += 1
        return done

    @property
    def folded_ahead(self) -> int:
        """Transactions :meth:`fold_ahead` folded into the next batch (0: none)."""
        return 0 if self._ahead is None else self._ahead.batch.transactions

    def drop_ahead(self) -> None:
        """Forget what :meth:`fold_ahead` folded (the stream starts again from the
        checkpoint): the cached contexts it folded into are dropped with it."""
        if self._ahead is not None:
            self._ahead = None
            self.cache.clear()

    def _fold_transaction(self, f: _Part, txn: Transaction[Item]) -> None:
        before: dict[uuid.UUID, tuple[int, str]] = {}
        items = txn.items
        assert isinstance(items, list)
        f.used += self._loaded_bytes
        self._loaded_bytes = 0
        for it in items:
            self._fold_item(f, it, txn, before)
        self._cut_snapshots(f, before)
        batch = f.batch
        batch.transactions += 1
        batch.end_lsn = txn.end_lsn
        batch.commit_times.append(txn.commit_ts)
        batch.last_commit_ts = txn.commit_ts
        f.used += txn.size

    def _load_for(self, txns: list[Transaction[Item]], i: int) -> int:
        """Load the contexts that the transactions from ``i`` on need and the cache lacks, up to
        a few hundred sessions in one query; returns the index of the first transaction not
        covered."""
        missing: dict[uuid.UUID, None] = {}
        j = i
        while j < len(txns) and len(missing) < LOAD_AT_ONCE:
            items = txns[j].items
            assert isinstance(items, list)
            missing.update(dict.fromkeys(self._uncached(items)))
            j += 1
        self._load(list(missing))
        return j

    def _uncached(self, items: list[Item]) -> Iterator[uuid.UUID]:
        """The sessions of these changes whose contexts the cache lacks."""
        cache = self.cache
        for it in items:
            sid = session_of(it)
            if sid is not None and sid not in cache:
                yield sid

    def _load(self, missing: list[uuid.UUID]) -> None:
        """Bring these sessions into the cache: their projected context, or a new one for a
        session without a projection (so that a session missing from the cache later was
        evicted, and is read back)."""
        if missing:
            found = self.load_contexts(missing)
            for sid in missing:
                ctx, size = found.get(sid) or (SessionContext(sid), 0)
                self.cache.put(sid, ctx, size)
                self._loaded_bytes += size

    def _fold_item(
        self,
        f: _Part,
        it: Item,
        txn: Transaction[Item],
        before: dict[uuid.UUID, tuple[int, str]] | None,
    ) -> None:
        """One change into the batch: an event folded (or quarantined) into its session, or an
        anomaly reported. ``before`` collects what each session was at the transaction's start
        (the snapshot rule); None in a chunked transaction, whose chunks record it instead."""
        kind = type(it)
        if kind is Base:
            assert isinstance(it, Base)
            if not self.folds:
                return  # a bootstrap's folded start: the fold workers have its events
            base: SessionContext = it.ctx
            self.cache.put(base.session_id, base, 0)
            f.changed[base.session_id] = (base, txn.commit_lsn, None)
            return
        if kind is Anomaly:
            assert isinstance(it, Anomaly)
            if self.on_anomaly is not None:
                self.on_anomaly(it)
            log.error(
                "ledger %s seen at %s (seq %s): the append-only guard was bypassed; not folded",
                it.kind.upper(),
                format_lsn(it.lsn),
                it.seq,
            )
            f.batch.dead_letters.append(
                DeadLetter(
                    it.seq,
                    it.session_id,
                    it.lsn,
                    it.kind,
                    f"{it.kind.upper()} on the append-only ledger",
                    it.row,
                )
            )
            return
        ev: LedgerEvent | Rejected = it if kind is LedgerEvent else it.rejected  # type: ignore[assignment,union-attr]
        if kind is Held and ev.incomplete and not ev.unplaced and self.fill_gap is not None:  # type: ignore[union-attr]
            # the stream lacked some of its columns: the row, whole, from the ledger table
            # (a relay publishes it whole too)
            whole = self.fill_gap(ev.session_id, ev.position, ev.position)
            if len(whole) == 1 and whole[0].position == ev.position:
                ev = whole[0]
                it = ev if type(ev) is LedgerEvent else Held(it.lsn, ev)  # type: ignore[union-attr,arg-type]
                kind = type(it)
        if not self.folds:
            f.batch.events += 1
            if ev.seq > f.max_seq:
                f.max_seq = ev.seq
            f.batch.published.append((ev, txn.commit_lsn if txn.xid else 0))
            return
        sid = ev.session_id
        if kind is Held and it.rejected.unplaced:  # type: ignore[union-attr]
            # its session or position could not be read: in no session's history, so no
            # projection is touched (nor a nil session's made); dead-lettered, each one
            r: Rejected = it.rejected  # type: ignore[union-attr]
            row = rejected_row(r)
            lsn: int = it.lsn  # type: ignore[union-attr]
            sid_or_none = sid if sid.int else None
            f.batch.dead_letters.append(
                DeadLetter(r.seq, sid_or_none, lsn, "quarantined", r.reason, row)
            )
            return
        ctx = self.cache.get(sid)
        if ctx is None:  # evicted since it was loaded: its projection has what it had
            self._load([sid])
            ctx = self.cache.get(sid)
            assert ctx is not None
        changed = f.changed
        if ev.position <= ctx.last_position:  # already folded (a projection ahead of a lost
            if sid in self.rebuilt:  # checkpoint, or one rebuilt from the ledger: written)
                self._touch(f, sid, ctx, before)
                prev = changed.get(sid)
                head = ev.hash if ev.position == ctx.last_position else None
                changed[sid] = (ctx, txn.commit_lsn, head or (prev[2] if prev else None))
            return
        if ev.position > ctx.last_position + 1 and not self._fill(f, txn, ctx, ev, before):
            self._gap(f, it, txn, ctx, ev)
        self._touch(f, sid, ctx, before)
        reason = self.reducers.fold_one(ctx, ev)
        changed[sid] = (ctx, txn.commit_lsn, ev.hash)
        if ev.seq > f.max_seq:
            f.max_seq = ev.seq
        if reason is not None:
            lsn = it.lsn if kind is Held else txn.commit_lsn  # type: ignore[union-attr]
            row = rejected_row(ev) if kind is Held else {"seq": ev.seq}  # type: ignore[arg-type]
            f.batch.dead_letters.append(DeadLetter(ev.seq, sid, lsn, "quarantined", reason, row))
            return
        done = completion(ctx, ev)  # type: ignore[arg-type]
        if done is not None:
            f.batch.memo.append((sid, ev.position, done))
        f.batch.events += 1
        if self.publish:
            # a bootstrap (xid 0) folds rows read from the table, not a streamed commit: their
            # LSN is unknown (0), so the fan-out looks up what the stream already holds of them
            f.batch.published.append((ev, txn.commit_lsn if txn.xid else 0))

    def _fill(
        self,
        f: _Part,
        txn: Transaction[Item],
        ctx: SessionContext,
        ev: LedgerEvent | Rejected,
        before: dict[uuid.UUID, tuple[int, str]] | None,
    ) -> bool:
        """A session's positions the stream skipped (a publication that left its rows out for a
        while), read from the ledger table and folded in order, before ``ev``: the log is the
        source of truth, and what it holds below a committed position was committed before it
        (each position is taken in the order of the session's commits). False when they cannot
        all be read as positions (then recorded as a gap, as without a reader)."""
        if self.fill_gap is None:
            return False
        first, last = ctx.last_position + 1, ev.position - 1
        rows = self.fill_gap(ev.session_id, first, last)
        if [r.position for r in rows] != list(range(first, last + 1)) or any(
            type(r) is Rejected and r.unplaced for r in rows
        ):
            return False
        log.warning(
            "positions %d..%d of session %s never came through the stream before position %d "
            "(was the ledger left out of the publication for a while?): read from the ledger "
            "table and folded in order",
            first,
            last,
            ev.session_id,
            ev.position,
        )
        for r in rows:
            self._fold_item(
                f, Held(txn.commit_lsn, r) if isinstance(r, Rejected) else r, txn, before
            )
        return True

    @staticmethod
    def _gap(
        f: _Part,
        it: Item,
        txn: Transaction[Item],
        ctx: SessionContext,
        ev: LedgerEvent | Rejected,
    ) -> None:
        """A session's positions skipped in the stream (a publication that left its rows out for
        a while: rows the ledger holds and the stream never sent): recorded and logged, and the
        fold goes on (`verify` shows what the projection lacks; a resync folds it)."""
        first, last = ctx.last_position + 1, ev.position - 1
        why = (
            f"positions {first}..{last} of session {ev.session_id} never came through the "
            f"stream before position {ev.position} (was the ledger left out of the publication "
            "for a while?): folded on without them"
        )
        log.warning("%s", why)
        lsn = it.lsn if type(it) is Held else txn.commit_lsn
        f.batch.dead_letters.append(
            DeadLetter(ev.seq, ev.session_id, lsn, "gap", why, {"seq": ev.seq})
        )

    @staticmethod
    def _touch(
        f: _Part,
        sid: uuid.UUID,
        ctx: SessionContext,
        before: dict[uuid.UUID, tuple[int, str]] | None,
    ) -> None:
        """What a session was before the batch (its run, for notifications; in a chunk, its
        counters) and before the transaction (the snapshot rule), recorded once each."""
        if sid not in f.changed:
            r = ctx.run
            f.runs_before[sid] = None if r is None else (r.status, r.leases)
            if before is None:  # a chunk records what the session was before the transaction
                f.batch.touched.append(
                    (
                        sid,
                        ctx.event_count,
                        ctx.status,
                        None if r is None else r.status,
                        None if r is None else r.leases,
                    )
                )
        if before is not None and sid not in before:
            before[sid] = (ctx.event_count, ctx.status)

    def _cut_snapshots(self, f: _Part, before: dict[uuid.UUID, tuple[int, str]]) -> None:
        """Snapshots are cut here, between transactions, never inside one."""
        due = self.snapshots.due
        for sid, (count_before, status_before) in before.items():
            ctx = f.changed[sid][0]
            if due(count_before, status_before, ctx):
                f.batch.snapshots.append(self.snapshot(ctx, f.changed[sid][2]))

    def snapshot(self, ctx: SessionContext, head: bytes | None) -> SnapshotRow:
        data = encode_stored(ctx, reference=self.by_reference)
        return SnapshotRow(
            ctx.session_id,
            ctx.last_seq,
            ctx.last_position,
            self.version,
            hashlib.sha256(data).digest(),
            data,
            head,
        )

    def seal(self, f: _Part, *, notices: bool = True) -> Batch:
        """The batch's projections (each changed context, encoded), runs that became ready,
        change notices; the cache brought back within its budget."""
        batch = f.batch
        for sid, (ctx, commit_lsn, head) in f.changed.items():
            memo = self.rebuilt.pop(sid, None) if self.rebuilt else None
            if memo:
                batch.memo.extend(memo)
            data = encode_stored(ctx, reference=self.by_reference)
            batch.sessions[sid] = (ctx, data, commit_lsn, head)
            # the cached context is now what a load of this projection gives: its completed
            # calls are in this batch's memo rows, no longer held here
            if ctx.completed_tools or ctx.completed_models:
                ctx.completed_tools, ctx.completed_models = {}, {}
            ctx.memo_position = ctx.last_position
            self.cache.touch(sid, context_size(ctx, data))
            if not notices:
                continue
            run = ctx.run
            if run is not None and run.status == RUN_PENDING:
                was = f.runs_before.get(sid)
                if was is None or was != (RUN_PENDING, run.leases):
                    batch.notify.append(sid)  # became ready to lease in this batch
        batch.channel = self.channel
        if notices and self.notify_sessions:
            batch.session_notices = [
                f"{sid}:{c.last_position}" for sid, (c, _, _) in f.changed.items()
            ]
        batch.max_seq = f.max_seq or None
        self.cache.evict()
        return batch

    # -- one transaction too big for a batch ------------------------------------------------------

    def big(
        self,
        txn: Transaction[Item],
        sized: Iterable[tuple[Item, int]],
        *,
        epoch: int | None,
        grouped: bool,
        write_part: Callable[[Batch], None],
    ) -> tuple[BigRun, Iterator[Batch], Callable[[Tail], Batch]]:
        """A transaction too big for one batch (spilled, over the batch budget, or a bootstrap),
        folded as its changes are read — from the spill file, or the table. Gives the run (what
        it counted), the parts to write, and ``finish``, which writes the last part (with
        ``write_part``, in the sink's transaction), the snapshots that came due and the
        notifications, and returns the batch that commits it with its checkpoint.

        Sessions are independent of one another and a session's changes keep their order, so
        unless they come ``grouped`` by session already (a bootstrap reads them so), the changes
        are first sorted into files by session: each session's context is then loaded once,
        not once per part, however many sessions the transaction touches."""
        run = BigRun(txn, epoch)

        def chunks() -> Iterator[Batch]:
            f = run.part()
            ahead: list[tuple[Item, int]] = []
            held = 0  # bytes of the changes in ahead
            for pair in sized if grouped else by_session(sized, self.spill_dir, self.budget):
                ahead.append(pair)
                held += pair[1]
                if len(ahead) >= LOAD_AT_ONCE or held > self.budget:
                    f = yield from self._fold_ahead(run, f, ahead)
                    ahead, held = [], 0
            run.last = yield from self._fold_ahead(run, f, ahead)

        def finish(tail: Tail) -> Batch:
            rest = self.seal(run.last, notices=False)
            run.count(rest)
            write_part(rest)  # in the projections before the tail reads them
            for rows in tail.due_snapshots(self.snapshots.every):
                # a projection read back is already in stored form (its window not attached)
                snaps = [
                    self.snapshot(self.cache.get(sid) or decode_context(text), head)
                    for sid, text, head in rows
                ]
                write_part(Batch(end_lsn=txn.end_lsn, snapshots=snaps))
            tail.notify(self.channel, self.notify_sessions)
            final = Batch(end_lsn=txn.end_lsn, epoch=epoch, max_seq=run.max_seq or None)
            if txn.commit_ts:
                final.last_commit_ts = txn.commit_ts
                final.commit_times = [txn.commit_ts]
            return final

        return run, chunks(), finish

    def _fold_ahead(
        self, run: BigRun, f: _Part, ahead: list[tuple[Item, int]]
    ) -> Generator[Batch, None, _Part]:
        """Fold a run of a big transaction's changes (the contexts they lack loaded in one
        query); each time the part in hand passes the batch budget, hand it over as a chunk and
        go on with a new part. Returns the part in hand."""
        self._load_missing(ahead)
        for i, (it, size) in enumerate(ahead):
            self._fold_item(f, it, run.txn, None)
            f.used += size + self._loaded_bytes  # the changes, and the contexts they pin
            self._loaded_bytes = 0
            if f.used > self.budget:
                chunk = self.seal(f, notices=False)
                run.count(chunk)
                yield chunk
                f = run.part()  # what was written is in the projections (same transaction)
                self._load_missing(ahead[i + 1 :])  # what the seal evicted, read back at once
        return f

    def _load_missing(self, ahead: list[tuple[Item, int]]) -> None:
        if not self.folds:
            return
        cache = self.cache
        wanted = dict.fromkeys(map(session_of, (it for it, _ in ahead)))
        self._load([s for s in wanted if s is not None and s not in cache])
