"""What one sink transaction writes (:class:`Batch`) and the rows it carries: projections,
snapshots (:class:`SnapshotRow`, due by :class:`SnapshotPolicy`), dead letters
(:class:`DeadLetter`). Plain values: the builder fills them, every sink reads them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from ledger_cdc.fold import CompletedModel, CompletedTool, SessionContext, SessionStatus
from ledger_cdc.names import RUNS_CHANNEL

__all__ = ["Batch", "DeadLetter", "SnapshotPolicy", "SnapshotRow", "Tail", "frozen"]

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
