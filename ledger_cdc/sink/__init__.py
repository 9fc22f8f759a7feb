"""Where folded batches go: the PostgreSQL projections (``postgres``), JetStream (``jetstream``),
an in-memory sink for tests (``memory``); ``batch`` builds what each of them commits."""

from ledger_cdc.errors import FencedError
from ledger_cdc.names import SESSIONS_CHANNEL
from ledger_cdc.sink.base import BOOTSTRAPPING, Sink
from ledger_cdc.sink.batch import Batch, BatchBuilder, DeadLetter, SnapshotPolicy, SnapshotRow
from ledger_cdc.sink.memory import MemorySink, MemoryStore
from ledger_cdc.sink.postgres import SNAPSHOT_CONFLICT, ChunkedTail, PgSink

__all__ = [
    "BOOTSTRAPPING",
    "SESSIONS_CHANNEL",
    "SNAPSHOT_CONFLICT",
    "Batch",
    "BatchBuilder",
    "ChunkedTail",
    "DeadLetter",
    "FencedError",
    "MemorySink",
    "MemoryStore",
    "PgSink",
    "Sink",
    "SnapshotPolicy",
    "SnapshotRow",
]
