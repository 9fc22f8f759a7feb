"""Default names, one place each: the slot, publication and table, the NOTIFY channels, the
heartbeat's message prefix, and the columns the publication streams; and the connect timeout."""

from __future__ import annotations

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_PUBLICATION",
    "DEFAULT_SLOT",
    "HEARTBEAT_PREFIX",
    "LEDGER_TABLE",
    "RUNS_CHANNEL",
    "SESSIONS_CHANNEL",
    "STREAMED_COLUMNS",
    "shard_names",
]

CONNECT_TIMEOUT = 10
"""Seconds a connection attempt may take, unless its DSN gives its own ``connect_timeout``: a
server that accepts but never answers fails the attempt (retried where the caller retries)."""
DEFAULT_SLOT = "agent_slot"
DEFAULT_PUBLICATION = "agent_pub"
LEDGER_TABLE = "agent_events"
RUNS_CHANNEL = "ledger_runs"
"""NOTIFY channel of runs that became ready to lease (payload: the session id)."""
SESSIONS_CHANNEL = "ledger_sessions"
"""NOTIFY channel of projection changes (payload ``<session_id>:<last_position>``)."""
HEARTBEAT_PREFIX = "ledger-cdc.heartbeat"
"""Prefix of the consumer's heartbeat messages (pg_logical_emit_message)."""

# The columns the consumer folds, and the event's hash: the consumer keeps the hash it streamed
# in each projection and snapshot, a record of the chain of its own that ``verify`` holds
# against the table (an edit that recomputes the table's hashes still differs from it).
# prev_hash stays out of the stream: it is the previous event's hash, already streamed.
STREAMED_COLUMNS = (
    "seq",
    "session_id",
    "position",
    "agent_id",
    "event_type",
    "payload",
    "idempotency_key",
    "created_at",
    "hash",
)


def shard_names(
    shard: int, publication: str = DEFAULT_PUBLICATION, slot: str = DEFAULT_SLOT
) -> tuple[str, str]:
    """(publication, slot) of a shard: ``agent_pub_s2``, ``agent_slot_s2``."""
    return f"{publication}_s{shard}", f"{slot}_s{shard}"
