"""A sink in a process's memory, with the PostgreSQL sink's rules and rows.

It stores the rows the PostgreSQL sink writes, built by the same functions (``sink.shape``), and
what those rows reference of the ledger's events. Every commit is all or nothing (the new state is
built aside, then swapped in), the checkpoint is fenced exactly like ``ledger_checkpoints`` (a
commit succeeds only if the stored LSN is still the one this sink read), snapshots at the same
point are replaced only by another format or reducer version, memo rows are never overwritten.
Several :class:`MemorySink` objects can share one :class:`MemoryStore`, as several consumers
share one database: that is how a test crashes a consumer mid-batch and starts another on the
same state. ``fail_next`` makes the next commit fail (before anything is applied), as a dropped
connection would.
"""

from __future__ import annotations

import operator
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ledger_cdc.batching import Batch, DeadLetter, SnapshotPolicy, context_size
from ledger_cdc.errors import FencedError
from ledger_cdc.events import Message
from ledger_cdc.fold import (
    RUN_PENDING,
    CompletedModel,
    CompletedTool,
    SessionContext,
    attach,
    decode_context,
    references,
)
from ledger_cdc.lsn import format_lsn
from ledger_cdc.names import SESSIONS_CHANNEL
from ledger_cdc.sink.base import BOOTSTRAPPING, Publisher
from ledger_cdc.sink.shape import (
    MEMO,
    AgentMemoRow,
    AgentSessionRow,
    AgentSnapshotRow,
    memo_row,
    session_row,
    snapshot_row,
)

__all__ = ["MemorySink", "MemoryStore", "Projection"]


class Projection(AgentSessionRow):
    """A row of ``agent_sessions``, as the PostgreSQL sink writes it."""

    __slots__ = ()

    @property
    def data(self) -> bytes:
        """The stored context's JSON (the ``context`` column)."""
        return self.context

    @property
    def leases(self) -> int | None:
        """Its run's leases, read from the stored context as SQL reads them."""
        run = decode_context(self.context).run
        return None if run is None else run.leases


_memo_key = operator.attrgetter(*MEMO.key)
_tool_entry = msgspec.json.Decoder(CompletedTool)
_model_entry = msgspec.json.Decoder(CompletedModel)


@dataclass
class _Touched:
    count_before: int
    status_before: str
    run_before: str | None
    leases_before: int | None


@dataclass
class MemoryStore:
    """What a database would hold for one slot."""

    sessions: dict[uuid.UUID, Projection] = field(default_factory=dict)
    # by (session, upto_position): the same event as the table's key, (session, upto_seq)
    snapshots: dict[tuple[uuid.UUID, int], AgentSnapshotRow] = field(default_factory=dict)
    memo: dict[tuple[uuid.UUID, str, str, int], AgentMemoRow] = field(default_factory=dict)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    notifications: list[tuple[str, str]] = field(default_factory=list)
    checkpoint: int | None = None
    epoch: int | None = None
    folded_seq: int = 0
    commits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # what stored contexts reference, as agent_events holds it: the messages of context windows
    # and the strings messages were taken from, by (session, event position)
    windows: dict[tuple[uuid.UUID, int], tuple[Message, ...]] = field(default_factory=dict)
    strings: dict[tuple[uuid.UUID, int], str] = field(default_factory=dict)
    # and the result (content) of each completing event, which its memo row's entry may leave
    # in it (fold.encode_memo_entry)
    results: dict[tuple[uuid.UUID, int], Any] = field(default_factory=dict)

    def stored(self, session_id: uuid.UUID) -> SessionContext | None:
        """The projection as stored, its window attached (no completed calls: see memo)."""
        row = self.sessions.get(session_id)
        if row is None:
            return None
        ctx = decode_context(row.data)
        self.attach(ctx)
        return ctx

    def attach(self, ctx: SessionContext) -> None:
        sid = ctx.session_id
        at, positions = references(ctx)
        attach(
            ctx,
            None if at is None else self.windows.get((sid, at)),
            [self.strings.get((sid, p)) for p in positions],
        )

    def context(self, session_id: uuid.UUID) -> SessionContext | None:
        """The whole context the projection stands for: its window attached and its completed
        calls read from the memo, the latest row of each call up to the projection's position
        (what ``ledger_session_context`` gives in SQL)."""
        ctx = self.stored(session_id)
        if ctx is None or not ctx.memo_position:
            return ctx
        latest: dict[tuple[str, str], AgentMemoRow] = {}
        for row in self.memo.values():
            if row.session_id != session_id or row.completed_position > ctx.memo_position:
                continue
            prev = latest.get((row.kind, row.call_id))
            if prev is None or prev.completed_position < row.completed_position:
                latest[(row.kind, row.call_id)] = row
        for row in sorted(latest.values(), key=operator.attrgetter("completed_position")):
            done = self.memo_entry(row)
            if isinstance(done, CompletedTool):
                ctx.completed_tools[done.call_id] = done
            else:
                ctx.completed_models[done.request_id] = done
        ctx.memo_position = 0
        return ctx

    def memo_entry(self, row: AgentMemoRow) -> CompletedTool | CompletedModel:
        """The call a memo row stands for, what its entry leaves in the completing event put
        back (as ``ledger_memo_entry`` does in SQL)."""
        entry = msgspec.json.decode(row.entry)
        left, decoder = ("result", _tool_entry) if row.kind == "tool" else ("content", _model_entry)
        if left not in entry:
            entry[left] = self.results.get((row.session_id, row.completed_position))
        done: CompletedTool | CompletedModel = decoder.decode(msgspec.json.encode(entry))
        return done

    def _copy(self) -> MemoryStore:
        return MemoryStore(
            dict(self.sessions),
            dict(self.snapshots),
            dict(self.memo),
            list(self.dead_letters),
            list(self.notifications),
            self.checkpoint,
            self.epoch,
            self.folded_seq,
            self.commits,
            self.lock,
            dict(self.windows),
            dict(self.strings),
            dict(self.results),
        )

    def _swap(self, new: MemoryStore) -> None:
        for name in (
            "sessions",
            "snapshots",
            "memo",
            "dead_letters",
            "notifications",
            "checkpoint",
            "epoch",
            "folded_seq",
            "commits",
            "windows",
            "strings",
            "results",
        ):
            setattr(self, name, getattr(new, name))


class _Tail:
    def __init__(self, state: MemoryStore, touched: dict[uuid.UUID, _Touched]) -> None:
        self.state = state
        self.touched = touched

    def due_snapshots(
        self, every: int, size: int = 200
    ) -> Iterator[list[tuple[uuid.UUID, str, bytes | None]]]:
        rows: list[tuple[uuid.UUID, str, bytes | None]] = []
        policy = SnapshotPolicy(every)
        for sid, t in self.touched.items():
            p = self.state.sessions.get(sid)
            if p is None:
                continue
            if policy.crossed(t.count_before, t.status_before, p.event_count, p.status):
                rows.append((sid, p.context.decode(), p.last_hash))
                if len(rows) >= size:
                    yield rows
                    rows = []
        if rows:
            yield rows

    def notify(self, channel: str, sessions: bool) -> None:
        for sid, t in self.touched.items():
            p = self.state.sessions.get(sid)
            if p is None:
                continue
            if p.run_status == RUN_PENDING and not (
                t.run_before == RUN_PENDING and t.leases_before == p.leases
            ):
                self.state.notifications.append((channel, str(sid)))
            if sessions:
                self.state.notifications.append((SESSIONS_CHANNEL, f"{sid}:{p.last_position}"))


class MemorySink:
    """A :class:`~ledger_cdc.sink.base.Sink` over a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store if store is not None else MemoryStore()
        self.checkpoint: int | None = None
        self.epoch: int | None = None
        self.publishers: list[Publisher] = []
        self.by_reference = True  # the store keeps what stored contexts reference
        self.unusable: dict[uuid.UUID, str] = {}  # (it stores contexts as objects: none is)
        self.fail_next: BaseException | None = None
        self.before_commit: Callable[[Batch], None] | None = None  # a hook for fault tests
        self._open: MemoryStore | None = None  # inside commit_chunked: the state being built
        self._touched: dict[uuid.UUID, _Touched] = {}

    # -- reads ---------------------------------------------------------------------------------

    def load_checkpoint(self) -> int | None:
        with self.store.lock:
            self.checkpoint, self.epoch = self.store.checkpoint, self.store.epoch
        return self.checkpoint

    def positions(self) -> dict[uuid.UUID, int]:
        with self.store.lock:
            return {sid: p.last_position for sid, p in self.store.sessions.items()}

    def load_contexts_sized(
        self, session_ids: Iterable[uuid.UUID]
    ) -> dict[uuid.UUID, tuple[SessionContext, int]]:
        state = self._open if self._open is not None else self.store
        out = {}
        for sid in session_ids:
            p = state.sessions.get(sid)
            if p is not None:
                ctx = decode_context(p.context)
                state.attach(ctx)
                out[sid] = (ctx, context_size(ctx, p.context))
        return out

    # -- durability: every commit is durable at once ---------------------------------------------

    def durable(self) -> int:
        return self.checkpoint or 0

    @property
    def pending(self) -> bool:
        return False

    def probe(self) -> None:
        pass

    def flush(self) -> None:
        pass

    # -- writes --------------------------------------------------------------------------------

    def mark_bootstrap(self) -> None:
        self.commit(Batch(end_lsn=0, epoch=BOOTSTRAPPING))
        self.epoch = BOOTSTRAPPING

    def unmark_bootstrap(self) -> None:
        with self.store.lock:
            if self.store.epoch == BOOTSTRAPPING:
                self.store.epoch = 0
        self.epoch = 0

    def commit(self, batch: Batch) -> None:
        publishing = self._publish(batch)
        try:
            self._check_failure(batch)
            for p in publishing:  # every publisher holds the batch before it commits
                p.wait()
            with self.store.lock:
                new = self.store._copy()
                _apply(new, batch, {}, self.by_reference)
                _notices(new, batch)
                self._checkpoint(new, batch)
                self.store._swap(new)
        except BaseException:
            for p in publishing:  # the batch is given up
                p.cancel()
            raise
        self._committed(batch)

    def commit_chunked(self, chunks: Iterable[Batch], finish: Callable[[Any], Batch]) -> None:
        with self.store.lock:
            new = self.store._copy()
        self._open, self._touched = new, {}
        try:
            for chunk in chunks:
                self.write_part(chunk)
            final = finish(_Tail(new, self._touched))
            self.write_part(final)
            _notices(new, final)
            with self.store.lock:
                self._checkpoint(new, final)
                self.store._swap(new)
        finally:
            self._open, self._touched = None, {}
        self._committed(final)

    def write_part(self, batch: Batch) -> None:
        assert self._open is not None, "write_part outside commit_chunked"
        self._check_failure(batch)
        for p in self._publish(batch):
            p.wait()
        _apply(self._open, batch, self._touched, self.by_reference)

    def close(self) -> None:
        """Nothing to close; what a failed chunked commit built is already dropped."""

    def shutdown(self) -> None:
        for pub in self.publishers:
            pub.close()

    # -- the parts of a commit ----------------------------------------------------------------

    def _publish(self, batch: Batch) -> list[Any]:
        """Start publishing the batch to every publisher, as the PostgreSQL sink does: its
        events, and each changed projection with the latest commit LSN of its events here."""
        if not self.publishers:
            return []
        latest: dict[uuid.UUID, int] = {}
        for ev, at in batch.published:
            latest[ev.session_id] = max(at, latest.get(ev.session_id, 0))
        changed = [
            (sid, ctx.last_position, data, latest.get(sid, 0))
            for sid, (ctx, data, _, _) in batch.sessions.items()
        ]
        return [pub.begin(batch.published, changed) for pub in self.publishers]

    def _check_failure(self, batch: Batch) -> None:
        if self.before_commit is not None:
            self.before_commit(batch)
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err

    def _checkpoint(self, new: MemoryStore, batch: Batch) -> None:
        if self.store.checkpoint != self.checkpoint:  # as ledger_checkpoints' WHERE clause
            prev = None if self.checkpoint is None else format_lsn(self.checkpoint)
            raise FencedError(
                f"checkpoint of this slot is no longer {prev}: another consumer advanced it; "
                "this batch is dropped unwritten and this consumer stands by"
            )
        new.checkpoint = batch.end_lsn
        if batch.epoch is not None:
            new.epoch = batch.epoch
        elif new.epoch is None:
            new.epoch = 0
        new.folded_seq = max(new.folded_seq, batch.max_seq or 0)
        new.commits += 1

    def _committed(self, batch: Batch) -> None:
        self.checkpoint = batch.end_lsn
        if batch.epoch is not None:
            self.epoch = batch.epoch


def _apply(
    state: MemoryStore, batch: Batch, touched: dict[uuid.UUID, _Touched], by_reference: bool
) -> None:
    for sid, count, status, run_status, leases in batch.touched:
        touched.setdefault(sid, _Touched(count, status, run_status, leases))
    for sid, (ctx, data, commit_lsn, head) in batch.sessions.items():
        w = ctx.window
        if w is not None and not w.omitted:
            state.windows.setdefault((sid, w.position), tuple(ctx.messages[: w.length]))
        for src in ctx.sources:  # the events' strings (what a reload reads back)
            if not src.omitted and src.index < len(ctx.messages):
                state.strings.setdefault((sid, src.position), ctx.messages[src.index].content)
        state.sessions[sid] = Projection(*session_row(sid, ctx, bytes(data), commit_lsn, head))
    for sid, position, done in batch.memo:
        row = memo_row(sid, position, done, by_reference)
        state.memo.setdefault(_memo_key(row), row)  # ON CONFLICT DO NOTHING
        result = done.result if isinstance(done, CompletedTool) else done.content
        state.results.setdefault((sid, position), result)
    for snap in batch.snapshots:
        new = snapshot_row(snap)
        at = (new.session_id, new.upto_position)
        old = state.snapshots.get(at)
        # as SNAPSHOT_CONFLICT: a row this version cannot use is replaced, a usable one kept
        if old is None or (old.format_version, old.reducer_version) != (
            new.format_version,
            new.reducer_version,
        ):
            state.snapshots[at] = new
    if batch.dead_letters:
        # as ledger_dead_letters_once: a row quarantined again (a replay, a rebuild) is one
        # letter, whatever the reason given the second time
        seen = set(map(_dead_key, state.dead_letters))
        for dead in batch.dead_letters:
            key = _dead_key(dead)
            if key not in seen:
                seen.add(key)
                state.dead_letters.append(dead)


def _dead_key(dead: DeadLetter) -> tuple[int, str, int]:
    return (dead.lsn, dead.kind, -1 if dead.seq is None else dead.seq)


def _notices(state: MemoryStore, batch: Batch) -> None:
    state.notifications.extend((batch.channel, str(s)) for s in batch.notify)
    state.notifications.extend((SESSIONS_CHANNEL, n) for n in batch.session_notices)
