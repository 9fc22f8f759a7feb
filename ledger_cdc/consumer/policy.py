"""When the consumer hands its batch to the sink (pure: the clock is injected).

A batch goes when it is **full** (``batch_size`` events, or its byte budget passed: the loop
then waits for the sink if it is still writing the previous one), or when it is **overdue**
(older than ``max_delay`` and the sink is free: a quiet stream still commits within
``max_delay``, and a busy sink is never queued behind). Snapshots are the batch builder's
:class:`~ledger_cdc.sink.batch.SnapshotPolicy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FlushPolicy"]

IDLE_WAIT = 0.1  # seconds to wait on the socket with nothing in hand
INLINE_TRANSACTIONS = 4  # a batch of at most this many …
INLINE_BYTES = 64 * 1024  # … and this many bytes of projections is committed by the loop itself


@dataclass
class FlushPolicy:
    batch_size: int
    budget: int  # bytes of transactions in hand
    max_delay: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    events: int = 0
    size: int = 0
    since: float | None = None  # when the oldest transaction in hand arrived

    def add(self, events: int, size: int) -> None:
        """A committed transaction is in hand."""
        self.events += events
        self.size += size
        if self.since is None:
            self.since = self.clock()

    @property
    def full(self) -> bool:
        return self.events >= self.batch_size or self.size > self.budget

    def overdue(self, sink_busy: bool) -> bool:
        return (
            self.since is not None and not sink_busy and self.clock() - self.since > self.max_delay
        )

    def reset(self, events: int = 0, size: int = 0) -> None:
        """A batch went to the sink; ``events`` and ``size`` are what is left in hand."""
        self.events, self.size = events, size
        self.since = self.clock() if events or size else None

    @staticmethod
    def inline(transactions: int, size: int) -> bool:
        """Whether the loop commits a batch itself instead of handing it to the sink's thread:
        a trickle of small transactions (an idle or lightly loaded system) pays for the
        hand-over (two thread wake-ups and a pipe) more than it gains from the overlap, which
        only a batch that takes a while to write has."""
        return transactions <= INLINE_TRANSACTIONS and size <= INLINE_BYTES

    def wait_timeout(self) -> float:
        """How long the loop may wait on the socket before looking again."""
        return self.max_delay if self.since is not None else IDLE_WAIT
