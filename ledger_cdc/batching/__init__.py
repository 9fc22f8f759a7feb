"""The batching stage: committed transactions → the batches a sink writes.

:class:`BatchBuilder` folds transactions into the sessions' contexts with the reducers it is
given, in commit order, and shapes what one sink transaction writes (:class:`Batch`): the changed
projections, the memo rows of the calls completed, the snapshots that came due
(:class:`SnapshotPolicy`, always between two transactions, never inside one), the dead letters,
the runs that became ready to lease and the change notices. Contexts come from a bounded
:class:`SessionCache`; those it lacks are asked of the sink through the ``load`` callable.

It reads no clock. Its I/O is that of the callables and objects it is handed, and its own spill
files and log records:

- ``load`` (the sink's query for the contexts the cache lacks, ``contexts``) and ``fill_gap``
  (positions the stream skipped, read from the ledger table, ``items``);
- a big transaction's ``write_part`` and :class:`Tail` (due snapshots read and notifications
  sent inside the sink's transaction, ``builder``);
- temporary files in the spill directory, where a big transaction's changes are pickled to be
  grouped by session (``spill``);
- log records of anomalies and of positions the stream skipped (``items``).

Memory is bounded by the consumer's limit M: the session cache takes 15 % of M (least recently
used contexts evicted, by their estimated size), a batch 15 % (a batch ends at the transaction
where it would pass it). A single transaction over it is folded in parts
(:meth:`BatchBuilder.big`): the sink writes each part inside one database transaction that ends
with the checkpoint.

Below the sinks (which import its :class:`Batch` and the rows it carries), above ``stream`` and
``fold``.
"""

from ledger_cdc.batching.batch import Batch, DeadLetter, SnapshotPolicy, SnapshotRow, Tail, frozen
from ledger_cdc.batching.builder import BatchBuilder, BigRun
from ledger_cdc.batching.contexts import LOAD_AT_ONCE, SessionCache, context_size
from ledger_cdc.batching.spill import by_session

__all__ = [
    "LOAD_AT_ONCE",
    "Batch",
    "BatchBuilder",
    "BigRun",
    "DeadLetter",
    "SessionCache",
    "SnapshotPolicy",
    "SnapshotRow",
    "Tail",
    "by_session",
    "context_size",
    "frozen",
]
