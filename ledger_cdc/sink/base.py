"""What the consumer needs of a sink: the :class:`Sink` protocol.

Two implement it: :class:`~ledger_cdc.sink.postgres.PgSink` (the projections in PostgreSQL) and
:class:`~ledger_cdc.sink.memory.MemorySink` (the same rules in a process's memory, which lets the
whole consumer loop run in tests without a server). Every write is all or nothing, and the
checkpoint commits with the projections it covers, fenced against a checkpoint another consumer
moved (:class:`~ledger_cdc.errors.FencedError`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ledger_cdc.batching import Batch, Tail
from ledger_cdc.fold import SessionContext

__all__ = ["BOOTSTRAPPING", "Sink"]

BOOTSTRAPPING = -1
"""The checkpoint's epoch while a slot is being (re)built from the table: a consumer that finds
it starts the bootstrap over (the projections may hold part of one)."""


class Sink(Protocol):
    checkpoint: int | None  # the stored LSN, as last read or written
    epoch: int | None
    publishers: list[Any]  # fan-out sinks given each batch before it commits
    # whether what it stores may reference ledger events instead of copying them (the sink
    # reads them back: its database holds the ledger, or it keeps them itself)
    by_reference: bool

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
