"""When the consumer hands its batch to the sink (pure: the clock is injected).

A batch goes when it is **full** (``batch_size`` events, or its byte budget passed: the loop
then waits for the sink if it is still writing the previous one), or when it is **overdue**
(older than ``max_delay`` and the sink is free: a quiet stream still commits within
``max_delay``, and a busy sink is never queued behind).

While the stream **catches up** (the server sent the transaction last taken more than
``CATCH_UP_LAG`` seconds after it committed, both by the server's clock), an overdue batch
waits until it is ``CATCH_UP_DELAY`` old instead, or full: every batch rewrites the projection
of each session it touches, and in a backlog a few large batches rewrite them less often than
many small ones, while the delay adds nothing to a lag already that large. A consumer that also
publishes to JetStream does not wait (``catch_up_delay`` 0): publishing costs its sink per
event, not per session, so the sink is what a drain waits for, and a batch held back only
leaves it idle.

When the slot may be confirmed past what the consumer applied, while it is idle, is
:func:`idle_confirm`. Snapshots are the batch builder's
:class:`~ledger_cdc.batching.SnapshotPolicy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FlushPolicy", "Idle", "idle_confirm"]

IDLE_WAIT = 0.1  # seconds to wait on the socket with nothing in hand
INLINE_TRANSACTIONS = 4  # a batch of at most this many …
INLINE_BYTES = 64 * 1024  # … and this many bytes of projections is committed by the loop itself
CATCH_UP_LAG = 1.0  # seconds from commit to send that make the stream a backlog
CATCH_UP_DELAY = 0.5  # seconds a batch may wait for more while the stream catches up


@dataclass
class FlushPolicy:
    batch_size: int
    budget: int  # bytes of transactions in hand
    max_delay: float
    catch_up_delay: float = CATCH_UP_DELAY
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    events: int = 0
    size: int = 0
    since: float | None = None  # when the oldest transaction in hand arrived
    catching_up: bool = False  # the transaction last taken was sent long after its commit

    def add(self, events: int, size: int, lag: float = 0.0) -> None:
        """A committed transaction is in hand; the server sent it ``lag`` seconds after it
        committed."""
        self.events += events
        self.size += size
        self.catching_up = lag > CATCH_UP_LAG
        if self.since is None:
            self.since = self.clock()

    @property
    def full(self) -> bool:
        return self.events >= self.batch_size or self.size > self.budget

    def overdue(self, sink_busy: bool) -> bool:
        if self.since is None or sink_busy:
            return False
        delay = max(self.max_delay, self.catch_up_delay) if self.catching_up else self.max_delay
        return self.clock() - self.since > delay

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


@dataclass(frozen=True)
class Idle:
    """What the loop knows when nothing is ready to read (see :func:`idle_confirm`)."""

    sink_busy: bool  # a batch is being written
    submitted: int  # end LSN of the last batch handed to the sink
    confirmed: int  # what the slot was last confirmed to
    unsettled: bool  # committed batches not yet known durable (or not yet settled)
    in_flight: bool  # a transaction begun in the stream and not yet committed
    in_hand: bool  # transactions taken, not yet handed to the sink
    wal_end: int  # the server's WAL end, as its keepalives say


def idle_confirm(s: Idle) -> int | None:
    """The position to confirm while idle, or None. Confirming the WAL end lets an idle slot
    advance (its WAL is freed) even though no change of ours is in it; it is allowed only when
    every batch handed to the sink has been settled as committed and is known durable, and
    nothing is begun or in hand: the WAL end must never pass a batch whose commit failed, is
    still unknown or may yet be lost, nor a transaction not yet applied."""
    if (
        s.sink_busy
        or s.submitted > s.confirmed
        or s.unsettled
        or s.in_flight
        or s.in_hand
        or s.wal_end <= s.confirmed
    ):
        return None
    return s.wal_end
