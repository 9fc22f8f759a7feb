"""What the consumer needs of a sink: the :class:`Sink` protocol.

Two implement it: :class:`~ledger_cdc.sink.postgres.PgSink` (the projections in PostgreSQL) and
:class:`~ledger_cdc.sink.memory.MemorySink` (the same rules in a process's memory, which lets the
whole consumer loop run in tests without a server). Every write is all or nothing, and the
checkpoint commits with the projections it covers, fenced against a checkpoint another consumer
moved (:class:`~ledger_cdc.errors.FencedError`).
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ledger_cdc.batching import Batch, Tail
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import SessionContext

__all__ = ["BOOTSTRAPPING", "Connecting", "Publisher", "Publishing", "Sink"]

BOOTSTRAPPING = -1
"""The checkpoint's epoch while a slot is being (re)built from the table: a consumer that finds
it starts the bootstrap over (the projections may hold part of one)."""


Connecting = concurrent.futures.Future[None]
"""A publisher's connection under way (:meth:`Publisher.start_connect`)."""


class Publishing(Protocol):
    """One batch being published: waited for before the sink commits, cancelled if it gives
    the batch up."""

    def wait(self) -> None: ...

    def cancel(self) -> None: ...


class Publisher(Protocol):
    """A fan-out sink (:class:`~ledger_cdc.sink.jetstream.JetStreamPublisher`) a sink gives
    each batch to before it commits."""

    def start_connect(self) -> Connecting:
        """Begin connecting on the publisher's own thread."""
        ...

    def connect(self, timeout: float = 30, started: Connecting | None = None) -> None:
        """Connected (and its stream made or checked), or RetryableError."""
        ...

    def begin(
        self,
        events: Sequence[tuple[LedgerEvent | Rejected, int]],
        sessions: Sequence[tuple[uuid.UUID, int, bytes, int]],
    ) -> Publishing:
        """Start publishing the batch's events (each with its commit LSN) and changed
        projections (session, last position, context JSON, commit LSN); return at once."""
        ...

    def stopping(self) -> None:
        """The process is stopping: give up soon on what a server does not answer."""
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    checkpoint: int | None  # the stored LSN, as last read or written
    epoch: int | None
    publishers: list[Publisher]  # fan-out sinks given each batch before it commits
    # whether what it stores may reference ledger events instead of copying them (the sink
    # reads them back: its database holds the ledger, or it keeps them itself)
    by_reference: bool
    # sessions whose stored projection :meth:`load_contexts_sized` could not use, with why
    # (left out of what it returned; the consumer rebuilds them from the ledger and pops them)
    unusable: dict[uuid.UUID, str]

    def load_checkpoint(self) -> int | None:
        """Read the stored checkpoint (and epoch); None when the slot has none."""
        ...

    def mark_bootstrap(self) -> None: ...

    def unmark_bootstrap(self) -> None: ...

    def positions(self) -> dict[uuid.UUID, int]:
        """How far each session's projection has folded (its last position)."""
        ...

    def load_contexts_sized(
        self, session_ids: Iterable[uuid.UUID]
    ) -> dict[uuid.UUID, tuple[SessionContext, int]]: ...

    def commit(self, batch: Batch) -> None:
        """Write the batch and its checkpoint at once, or nothing (FencedError if the stored
        checkpoint is no longer the one this sink read)."""
        ...

    def commit_chunked(self, chunks: Iterable[Batch], finish: Callable[[Tail], Batch]) -> None:
        """One transaction written in parts, then ``finish``'s batch and the checkpoint: all or
        nothing."""
        ...

    def write_part(self, batch: Batch) -> None:
        """Inside :meth:`commit_chunked`: write a part now, in the commit under way."""
        ...

    def durable(self) -> int:
        """The highest end LSN of a committed batch known to be durable: the most the slot may
        be confirmed to (a sink that commits without waiting for its disk learns it later)."""
        ...

    @property
    def pending(self) -> bool:
        """Whether a committed batch is not known durable yet (:meth:`probe` may tell)."""
        ...

    def probe(self) -> None:
        """Learn, without waiting, what became durable since the last commit."""
        ...

    def flush(self) -> None:
        """Wait until every committed batch is durable (before a stop)."""
        ...

    def close(self) -> None:
        """Forget the connection (after a failure); the next call opens another."""
        ...

    def shutdown(self) -> None: ...
