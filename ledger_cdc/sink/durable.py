"""Which committed batches are durable, when the sink commits without waiting for its WAL flush.

With ``synchronous_commit = off`` a sink transaction is visible at once and flushed to disk by
the server's WAL writer a moment later (within ``3 × wal_writer_delay``, sooner when any other
transaction flushes). The slot must not be confirmed past a batch before that: a server crash in
between would lose the batch and its checkpoint while the slot had moved on, a gap no restart
fills. So the sink reads the server's WAL insert and flush positions inside each later
transaction (and when idle, by themselves): an insert position read after a batch's commit
returned lies past its commit record, and once the flush position reaches it, the batch is on
disk. Pure: the positions are given, nothing is read here.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DurableTracker"]


class DurableTracker:
    """The highest end LSN of a batch known durable (:attr:`durable`), from the batches
    committed (:meth:`committed`) and the server's WAL positions observed after them
    (:meth:`observed`)."""

    def __init__(self) -> None:
        self.durable = 0
        self._unbounded = 0  # end LSN of the last batch committed since the last observation
        # (insert position read after these commits, the highest batch end LSN they cover)
        self._bounded: deque[tuple[int, int]] = deque()

    @property
    def pending(self) -> bool:
        """Whether a committed batch is not known durable yet."""
        return bool(self._unbounded or self._bounded)

    def committed(self, end_lsn: int) -> None:
        """A batch covering up to ``end_lsn`` committed (visible; perhaps not on disk yet)."""
        if end_lsn > self.durable:
            self._unbounded = max(self._unbounded, end_lsn)

    def observed(self, insert_lsn: int, flush_lsn: int) -> None:
        """The server's WAL insert and flush positions, read after every batch passed to
        :meth:`committed` so far had committed."""
        if self._unbounded:
            self._bounded.append((insert_lsn, self._unbounded))
            self._unbounded = 0
        bounded = self._bounded
        while bounded and bounded[0][0] <= flush_lsn:
            self.durable = max(self.durable, bounded.popleft()[1])

    def flushed(self) -> None:
        """Everything committed so far is on disk (a synchronous commit came after it)."""
        ends = [end for _, end in self._bounded]
        self.durable = max(self.durable, self._unbounded, *ends)
        self._unbounded = 0
        self._bounded.clear()

    def forget(self) -> None:
        """The connection is gone: what was not known durable may be lost (the next start reads
        the checkpoint back and makes it durable first)."""
        self._unbounded = 0
        self._bounded.clear()
