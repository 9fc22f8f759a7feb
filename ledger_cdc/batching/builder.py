"""Committed transactions → the batches a sink writes (:class:`BatchBuilder`), and one
transaction too big for a batch folded in parts (:meth:`BatchBuilder.big`). See the package
docstring for what it does and what I/O it does.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Container, Generator, Iterable, Iterator

from ledger_cdc.batching.batch import Batch, SnapshotPolicy, SnapshotRow, Tail
from ledger_cdc.batching.contexts import LOAD_AT_ONCE, Contexts, Loader, SessionCache, context_size
from ledger_cdc.batching.items import Before, GapReader, ItemFolder, Part
from ledger_cdc.batching.spill import by_session
from ledger_cdc.fold import RUN_PENDING, Reducers, SessionContext, decode_context, encode_stored
from ledger_cdc.names import RUNS_CHANNEL
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Anomaly, Item

__all__ = ["BatchBuilder", "BigRun"]


class BigRun:
    """One big transaction folded in parts: what its parts counted, once committed."""

    def __init__(self, txn: Transaction[Item], epoch: int | None) -> None:
        self.txn = txn
        self.epoch = epoch
        self.events = 0
        self.dead = 0
        self.max_seq = 0
        self.last = self.part()

    def part(self) -> Part:
        return Part(Batch(end_lsn=self.txn.end_lsn))

    def count(self, chunk: Batch) -> None:
        self.events += chunk.events
        self.dead += len(chunk.dead_letters)
        self.max_seq = max(self.max_seq, chunk.max_seq or 0)


class BatchBuilder:
    """Folds committed transactions into batches (see the package docstring).

    ``load(session_ids)`` gives the projected context (and its estimated size) of each session
    that has one, ``load_at_once`` sessions at most; ``fill_gap`` reads the positions the
    stream skipped from the ledger table (None: recorded as a gap only); ``on_anomaly`` is told
    of each UPDATE / DELETE / TRUNCATE met; ``by_reference``: stored contexts reference the
    ledger's events instead of copying them (the sink reads them back: see
    ``fold.encode_stored``); ``folds`` and ``publish``: see :class:`ItemFolder`."""

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
        load_at_once: int = LOAD_AT_ONCE,
    ) -> None:
        self.contexts = Contexts(load, cache, load_at_once)
        self.items = ItemFolder(
            self.contexts,
            reducers,
            folds=folds,
            publish=publish,
            fill_gap=fill_gap,
            on_anomaly=on_anomaly,
        )
        self.folds = folds
        self.by_reference = by_reference
        self.cache = cache
        self.budget = max(1, budget)
        self.version = reducers.version
        self.snapshots = snapshots
        self.channel = channel
        self.notify_sessions = notify_sessions
        self.spill_dir = spill_dir
        self._ahead: Part | None = None  # the next batch, folded ahead of time (fold_ahead)
        # sessions rebuilt from the ledger, with the memo rows of every call they completed
        # (see ItemFolder.rebuilt)
        self.rebuilt = self.items.rebuilt

    # -- a batch of whole transactions -----------------------------------------------------------

    def fold(self, txns: list[Transaction[Item]]) -> tuple[Batch, list[Transaction[Item]]]:
        """Fold committed transactions into one batch, as many as fit its byte budget (at least
        one), after those :meth:`fold_ahead` folded into it already: the batch, and the
        transactions left for the next."""
        f, self._ahead = self._ahead, None
        if f is None:
            f = Part(Batch(end_lsn=0))
        rest: list[Transaction[Item]] = []
        loaded_upto = 0
        for i, txn in enumerate(txns):
            if f.batch.transactions and f.used > self.budget:
                rest = txns[i:]
                break
            if i >= loaded_upto and self.folds:
                loaded_upto = self.contexts.load_for(txns, i)
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
            if self.folds and any(self.contexts.uncached(items)):
                return done
            if f is None:
                f = self._ahead = Part(Batch(end_lsn=0))
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

    def _fold_transaction(self, f: Part, txn: Transaction[Item]) -> None:
        before: Before = {}
        items = txn.items
        assert isinstance(items, list)
        f.used += self.contexts.take_loaded()
        fold = self.items.fold
        for it in items:
            fold(f, it, txn, before)
        self._cut_snapshots(f, before)
        batch = f.batch
        batch.transactions += 1
        batch.end_lsn = txn.end_lsn
        batch.commit_times.append(txn.commit_ts)
        batch.last_commit_ts = txn.commit_ts
        f.used += txn.size

    def _cut_snapshots(self, f: Part, before: Before) -> None:
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

    def seal(self, f: Part, *, notices: bool = True) -> Batch:
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
            if notices and _became_ready(ctx, f.runs_before.get(sid)):
                batch.notify.append(sid)
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
        projected: Container[uuid.UUID] | None = None,
    ) -> tuple[BigRun, Iterator[Batch], Callable[[Tail], Batch]]:
        """A transaction too big for one batch (spilled, over the batch budget, or a bootstrap),
        folded as its changes are read — from the spill file, or the table. Gives the run (what
        it counted), the parts to write, and ``finish``, which writes the last part (with
        ``write_part``, in the sink's transaction), the snapshots that came due and the
        notifications, and returns the batch that commits it with its checkpoint.

        Sessions are independent of one another and a session's changes keep their order, so
        unless they come ``grouped`` by session already (a bootstrap reads them so), the changes
        are first sorted into files by session: each session's context is then loaded once,
        not once per part, however many sessions the transaction touches. ``projected``: the
        sessions that may have a projection (a bootstrap knows them), the others started
        without a query (:class:`Contexts`)."""
        run = BigRun(txn, epoch)
        at_once = self.contexts.at_once

        def chunks() -> Iterator[Batch]:
            f = run.part()
            ahead: list[tuple[Item, int]] = []
            held = 0  # bytes of the changes in ahead
            self.contexts.expect(projected)
            try:
                for pair in sized if grouped else by_session(sized, self.spill_dir, self.budget):
                    ahead.append(pair)
                    held += pair[1]
                    if len(ahead) >= at_once or held > self.budget:
                        f = yield from self._fold_ahead(run, f, ahead)
                        ahead, held = [], 0
                run.last = yield from self._fold_ahead(run, f, ahead)
            finally:
                self.contexts.expect(None)

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
        self, run: BigRun, f: Part, ahead: list[tuple[Item, int]]
    ) -> Generator[Batch, None, Part]:
        """Fold a run of a big transaction's changes (the contexts they lack loaded in one
        query); each time the part in hand passes the batch budget, hand it over as a chunk and
        go on with a new part. Returns the part in hand."""
        self._load_missing(ahead)
        fold = self.items.fold
        for i, (it, size) in enumerate(ahead):
            fold(f, it, run.txn, None)
            f.used += size + self.contexts.take_loaded()  # the changes, and the contexts they pin
            if f.used > self.budget:
                chunk = self.seal(f, notices=False)
                run.count(chunk)
                yield chunk
                f = run.part()  # what was written is in the projections (same transaction)
                self._load_missing(ahead[i + 1 :])  # what the seal evicted, read back at once
        return f

    def _load_missing(self, ahead: list[tuple[Item, int]]) -> None:
        if self.folds:
            self.contexts.load_missing(it for it, _ in ahead)


def _became_ready(ctx: SessionContext, was: tuple[str, int] | None) -> bool:
    """Whether the session's run became ready to lease in this batch (``was``: its run's
    status and leases before the batch)."""
    run = ctx.run
    return run is not None and run.status == RUN_PENDING and was != (RUN_PENDING, run.leases)
