"""One change of a committed transaction into the batch in hand (:class:`ItemFolder`): an event
folded, or quarantined, into its session's context; an archive start put in place; an anomaly
reported. Positions the stream skipped are read from the ledger table (the ``fill_gap``
callable: a query) when it is given, else recorded as a gap; both are logged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ledger_cdc.batching.batch import Batch, DeadLetter
from ledger_cdc.batching.contexts import Contexts
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import Reducers, SessionContext, completion
from ledger_cdc.lsn import format_lsn
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Anomaly, ArchiveStart, Item, Quarantined, rejected_row

__all__ = ["Before", "GapReader", "ItemFolder", "Part"]

log = logging.getLogger(__name__)

# (session, first, last) → that session's rows at those positions, read from the ledger table
GapReader = Callable[[uuid.UUID, int, int], list[LedgerEvent | Rejected]]
# session → (event count, status) at the transaction's start: the snapshot rule's input
Before = dict[uuid.UUID, tuple[int, str]]


@dataclass
class Part:
    """What a batch (or a part of a big transaction) has folded so far."""

    batch: Batch
    # session → (context, commit LSN, hash of its last event as streamed)
    changed: dict[uuid.UUID, tuple[SessionContext, int, bytes | None]] = field(default_factory=dict)
    runs_before: dict[uuid.UUID, tuple[str, int] | None] = field(default_factory=dict)
    max_seq: int = 0
    used: int = 0  # estimated bytes held: the changes folded


class ItemFolder:
    """Folds one change at a time into a :class:`Part` (see the module docstring).

    ``folds`` False: a relay (consume --publish-only) that only hands the events on to the
    publishers, in commit order, quarantined ones included; fold workers build the projections
    from the stream. ``publish``: folded events are handed on too. ``on_anomaly`` is told of
    each UPDATE / DELETE / TRUNCATE met."""

    def __init__(
        self,
        contexts: Contexts,
        reducers: Reducers,
        *,
        folds: bool,
        publish: bool,
        fill_gap: GapReader | None,
        on_anomaly: Callable[[Anomaly], None] | None,
    ) -> None:
        self.contexts = contexts
        self.cache = contexts.cache
        self.reducers = reducers
        self.folds = folds
        self.publish = publish
        self.fill_gap = fill_gap
        self.on_anomaly = on_anomaly
        # sessions the loader rebuilt from the ledger (their stored projection unusable), with
        # the memo rows of every call they completed: the next batch that has one of their
        # events writes them (even an event already folded), and those rows (agent_memo keeps
        # the ones it has)
        self.rebuilt: dict[uuid.UUID, list[tuple[uuid.UUID, int, Any]]] = {}

    def fold(self, f: Part, it: Item, txn: Transaction[Item], before: Before | None) -> None:
        """One change into the batch. ``before`` collects what each session was at the
        transaction's start (the snapshot rule); None in a chunked transaction, whose chunks
        record it instead."""
        match it:
            case LedgerEvent():
                self._event(f, it, txn.commit_lsn, txn, before)
            case Quarantined():
                self._quarantined(f, it, txn, before)
            case Anomaly():
                self._anomaly(f, it)
            case ArchiveStart():
                if self.folds:  # (a relay's fold workers have the bootstrap's events)
                    ctx: SessionContext = it.ctx
                    self.cache.put(ctx.session_id, ctx, 0)
                    f.changed[ctx.session_id] = (ctx, txn.commit_lsn, None)

    def _anomaly(self, f: Part, it: Anomaly) -> None:
        if self.on_anomaly is not None:
            self.on_anomaly(it)
        log.error(
            "ledger %s seen at %s (seq %s): the append-only guard was bypassed; not folded",
            it.kind.upper(),
            format_lsn(it.lsn),
            it.seq,
        )
        why = f"{it.kind.upper()} on the append-only ledger"
        f.batch.dead_letters.append(DeadLetter(it.seq, it.session_id, it.lsn, it.kind, why, it.row))

    def _quarantined(
        self, f: Part, it: Quarantined, txn: Transaction[Item], before: Before | None
    ) -> None:
        r = it.rejected
        if r.incomplete and not r.unplaced and self.fill_gap is not None:
            # the stream lacked some of its columns: the row, whole, from the ledger table
            # (a relay publishes it whole too)
            whole = self.fill_gap(r.session_id, r.position, r.position)
            if len(whole) == 1 and whole[0].position == r.position:
                ev = whole[0]
                if isinstance(ev, LedgerEvent):
                    self._event(f, ev, txn.commit_lsn, txn, before)
                    return
                r = ev
        if self.folds and r.unplaced:
            # its session or position could not be read: in no session's history, so no
            # projection is touched (nor a nil session's made); dead-lettered, each one
            sid = r.session_id if r.session_id.int else None
            dead = DeadLetter(r.seq, sid, it.lsn, "quarantined", r.reason, rejected_row(r))
            f.batch.dead_letters.append(dead)
            return
        self._event(f, r, it.lsn, txn, before)

    def _event(
        self,
        f: Part,
        ev: LedgerEvent | Rejected,
        lsn: int,
        txn: Transaction[Item],
        before: Before | None,
    ) -> None:
        """An event folded into its session (a Rejected row quarantined there); ``lsn`` is its
        insert's, for a dead letter: a quarantined row's own, else its commit's."""
        if not self.folds:
            f.batch.events += 1
            if ev.seq > f.max_seq:
                f.max_seq = ev.seq
            f.batch.published.append((ev, txn.commit_lsn if txn.xid else 0))
            return
        sid = ev.session_id
        ctx = self.cache.get(sid)
        if ctx is None:
            ctx = self.contexts.get(sid)
        changed = f.changed
        if ev.position <= ctx.last_position:  # already folded (a projection ahead of a lost
            if sid in self.rebuilt:  # checkpoint, or one rebuilt from the ledger: written)
                self._touch(f, sid, ctx, before)
                prev = changed.get(sid)
                head = ev.hash if ev.position == ctx.last_position else None
                changed[sid] = (ctx, txn.commit_lsn, head or (prev[2] if prev else None))
            return
        if ev.position > ctx.last_position + 1 and not self._fill(f, txn, ctx, ev, before):
            self._gap(f, lsn, ctx, ev)
        self._touch(f, sid, ctx, before)
        reason = self.reducers.fold_one(ctx, ev)
        changed[sid] = (ctx, txn.commit_lsn, ev.hash)
        if ev.seq > f.max_seq:
            f.max_seq = ev.seq
        if reason is not None:
            row = rejected_row(ev) if isinstance(ev, Rejected) else {"seq": ev.seq}
            f.batch.dead_letters.append(DeadLetter(ev.seq, sid, lsn, "quarantined", reason, row))
            return
        assert isinstance(ev, LedgerEvent)  # (a Rejected row is always quarantined)
        done = completion(ctx, ev)
        if done is not None:
            f.batch.memo.append((sid, ev.position, done))
        f.batch.events += 1
        if self.publish:
            # a bootstrap (xid 0) folds rows read from the table, not a streamed commit: their
            # LSN is unknown (0), so the fan-out looks up what the stream already holds of them
            f.batch.published.append((ev, txn.commit_lsn if txn.xid else 0))

    def _fill(
        self,
        f: Part,
        txn: Transaction[Item],
        ctx: SessionContext,
        ev: LedgerEvent | Rejected,
        before: Before | None,
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
            self.fold(
                f, Quarantined(txn.commit_lsn, r) if isinstance(r, Rejected) else r, txn, before
            )
        return True

    @staticmethod
    def _gap(f: Part, lsn: int, ctx: SessionContext, ev: LedgerEvent | Rejected) -> None:
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
        f.batch.dead_letters.append(
            DeadLetter(ev.seq, ev.session_id, lsn, "gap", why, {"seq": ev.seq})
        )

    @staticmethod
    def _touch(f: Part, sid: uuid.UUID, ctx: SessionContext, before: Before | None) -> None:
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
