"""Where folded batches go: the PostgreSQL projections (``postgres``), JetStream (``jetstream``),
an in-memory sink for tests (``memory``). What each of them commits, a
:class:`~ledger_cdc.batching.Batch`, is built by ``ledger_cdc.batching``."""

from ledger_cdc.batching import Batch, DeadLetter, SnapshotRow
from ledger_cdc.errors import FencedError
from ledger_cdc.names import SESSIONS_CHANNEL
from ledger_cdc.sink.base import BOOTSTRAPPING, Sink
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from ledger_cdc.sink.postgres import SNAPSHOT_CONFLICT, ChunkedTail, PgSink

__all__ = [
    "BOOTSTRAPPING",
    "SESSIONS_CHANNEL",
    "SNAPSHOT_CONFLICT",
    "Batch",
    "ChunkedTail",
    "DeadLetter",
    "FencedError",
    "MemorySink",
    "MemoryStore",
    "PgSink",
    "Sink",
    "SnapshotRow",
]
