"""The pgoutput logical replication protocol (versions 1–4): grammar, typed messages, decoder,
value loading. Knows nothing about agents or the ledger."""

from ledger_cdc.pgoutput.decode import Decoder
from ledger_cdc.pgoutput.messages import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Binary,
    Column,
    ColumnFlag,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    MessageType,
    OldTupleKind,
    Origin,
    Prepare,
    Relation,
    ReplicaIdentity,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TruncateOption,
    TupleKind,
    Type,
    UnchangedToast,
    Update,
)

__all__ = [
    "UNCHANGED",
    "Begin",
    "BeginPrepare",
    "Binary",
    "Column",
    "ColumnFlag",
    "Commit",
    "CommitPrepared",
    "Decoder",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Message",
    "MessageType",
    "OldTupleKind",
    "Origin",
    "Prepare",
    "Relation",
    "ReplicaIdentity",
    "RollbackPrepared",
    "StreamAbort",
    "StreamCommit",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TruncateOption",
    "TupleKind",
    "Type",
    "UnchangedToast",
    "Update",
]


def __getattr__(name: str) -> object:
    # RowLoader loads values with psycopg, so it lives in ``stream.values``; this layer imports no
    # I/O library. Kept reachable here for code written against the flat layout.
    if name == "RowLoader":
        import importlib

        return importlib.import_module("ledger_cdc.stream.values").RowLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
